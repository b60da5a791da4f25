#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, ASan+UBSan) in build-fuzz/ and runs
# each for N seconds (default 60) on its seed corpus, KVCAL_FUZZ_JOBS of them
# at a time (default: one per core; each target is one process on one core,
# so running them side by side gives each the same time as one after the
# other). Fails on any crash, leak, sanitizer report or broken invariant,
# after the targets already started have finished.
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

# run_target TARGET: one fuzzer run; its output goes to its log.
run_target() {
  local target="$1"
  local seeds="$ROOT/tests/fuzz/corpus/$target"
  local work="$BUILD/corpus/$target"
  local artifacts="$BUILD/artifacts/$target"
  mkdir -p "$work" "$artifacts"
  "$BUILD/tests/fuzz/$target" "$work" "$seeds" \
    -max_total_time="$SECONDS_PER_TARGET" -max_len=16384 -rss_limit_mb=2048 \
    -timeout=20 -print_final_stats=1 -artifact_prefix="$artifacts/" \
    >"$BUILD/logs/$target.log" 2>&1
}

# report TARGET STATUS: its summary, or its log's end and where the inputs are.
report() {
  local target="$1" status="$2"
  if [ "$status" -eq 0 ]; then
    grep -E '^#[0-9]+.*DONE|^stat::number_of_executed_units' "$BUILD/logs/$target.log" |
      tail -2 | sed "s/^/[fuzz] $target: /" >&2 || true
  else
    tail -60 "$BUILD/logs/$target.log" >&2
    log "$target FAILED (log: $BUILD/logs/$target.log, inputs: $BUILD/artifacts/$target/)"
  fi
}

max_jobs="${KVCAL_FUZZ_JOBS:-$(nproc)}"
[ "$max_jobs" -ge 1 ] 2>/dev/null || max_jobs=1
status=0
batch=()
# run_batch: the targets in `batch` side by side; waits for all of them.
run_batch() {
  local pids=() i rc
  for target in "${batch[@]}"; do
    log "$target: ${SECONDS_PER_TARGET}s"
    run_target "$target" &
    pids+=($!)
  done
  for i in "${!batch[@]}"; do
    rc=0
    wait "${pids[$i]}" || rc=$?
    report "${batch[$i]}" "$rc"
    [ "$rc" -eq 0 ] || status=1
  done
  batch=()
}
for target in "${TARGETS[@]}"; do
  batch+=("$target")
  if [ "${#batch[@]}" -ge "$max_jobs" ]; then
    run_batch
    [ "$status" -eq 0 ] || break
  fi
done
if [ "$status" -eq 0 ] && [ "${#batch[@]}" -gt 0 ]; then
  run_batch
fi
exit $status
