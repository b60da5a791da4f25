#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, ASan+UBSan) in build-fuzz/ and runs
# each for N seconds (default 60) on its seed corpus, one after the other.
# Fails on the first crash, leak, sanitizer report or broken invariant.
#
#   tests/fuzz/run_fuzz.sh [seconds]
#
# New inputs libFuzzer finds go to build-fuzz/corpus/<target>/ (the seeds in
# tests/fuzz/corpus/ stay as they are); a crash leaves
# build-fuzz/artifacts/<target>/crash-* and the log in build-fuzz/logs/.
# KVCAL_FUZZ_TARGETS="a b" runs only those; KVCAL_JOBS limits the build.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
SECONDS_PER_TARGET="${1:-60}"
BUILD="$ROOT/build-fuzz"
TARGETS=(${KVCAL_FUZZ_TARGETS:-fuzz_chunk_accumulate fuzz_state fuzz_safetensors fuzz_model_config fuzz_checkpoint_index})
SAN_FLAGS="-fsanitize=address,undefined,fuzzer-no-link -fno-sanitize-recover=all -fno-omit-frame-pointer"

log() { printf '[fuzz] %s\n' "$*" >&2; }

command -v clang++ >/dev/null || { log "clang++ not found (apt-get install clang)"; exit 1; }
if [ ! -f "$BUILD/build.ninja" ]; then
  log "configuring build-fuzz"
  CC=clang CXX=clang++ cmake -S "$ROOT" -B "$BUILD" -G Ninja \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVCAL_FUZZ=ON -DKVCAL_CUDA=OFF \
    -DKVCAL_BUILD_BENCHMARKS=OFF -DKVCAL_BUILD_TESTS=OFF -DKVCAL_WERROR=OFF \
    -DCMAKE_CXX_FLAGS="$SAN_FLAGS" >"$BUILD.configure.log" 2>&1 ||
    { cat "$BUILD.configure.log" >&2; exit 1; }
fi
log "building ${TARGETS[*]}"
if ! cmake --build "$BUILD" -j "${KVCAL_JOBS:-$(nproc)}" --target "${TARGETS[@]}" \
    >"$BUILD.build.log" 2>&1; then
  grep -E "error|FAILED" -A5 "$BUILD.build.log" | head -60 >&2 || true
  log "build failed (full log: $BUILD.build.log)"
  exit 1
fi

export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:allocator_may_return_null=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
mkdir -p "$BUILD/logs"
status=0
for target in "${TARGETS[@]}"; do
  seeds="$ROOT/tests/fuzz/corpus/$target"
  work="$BUILD/corpus/$target"
  artifacts="$BUILD/artifacts/$target"
  mkdir -p "$work" "$artifacts"
  log "$target: ${SECONDS_PER_TARGET}s"
  if "$BUILD/tests/fuzz/$target" "$work" "$seeds" \
      -max_total_time="$SECONDS_PER_TARGET" -max_len=16384 -rss_limit_mb=2048 \
      -timeout=20 -print_final_stats=1 -artifact_prefix="$artifacts/" \
      >"$BUILD/logs/$target.log" 2>&1; then
    grep -E '^#[0-9]+.*DONE|^stat::number_of_executed_units' "$BUILD/logs/$target.log" |
      tail -2 | sed "s/^/[fuzz] $target: /" >&2
  else
    tail -60 "$BUILD/logs/$target.log" >&2
    log "$target FAILED (log: $BUILD/logs/$target.log, inputs: $artifacts/)"
    status=1
    break
  fi
done
exit $status
