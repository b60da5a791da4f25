#!/usr/bin/env bash
# GPU check for a machine with an NVIDIA GPU: runs the CUDA backend's typed
# tests and the GPU throughput benchmark from a prebuilt bundle
# (bench/make_gpu_bundle.sh), in well under 8 minutes. Needs nothing but the
# driver: no Debian libraries, no network.
#
#   bench/gpu_check.sh [BUNDLE_DIR [BENCH_ARGS...]]   (default .gpu-bundle/)
#
# Exit status: 0 when every test passed and the benchmark ran (the benchmark
# reports its throughput goals but a missed goal is not a failure: timings
# are never assertions).
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bundle="${1:-${root}/.gpu-bundle}"
[[ $# -gt 0 ]] && shift
if [[ ! -d "${bundle}/bin" ]]; then
  echo "gpu_check: no bundle at ${bundle} (build one with bench/make_gpu_bundle.sh)" >&2
  exit 2
fi
export LD_LIBRARY_PATH="${bundle}/lib${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

status=0
shopt -s nullglob
tests=("${bundle}"/bin/*cuda*)
if [[ ${#tests[@]} -eq 0 ]]; then
  echo "gpu_check: no CUDA test binary in ${bundle}/bin" >&2
  status=1
fi
for test_binary in "${tests[@]}"; do
  echo "=== $(basename "${test_binary}")"
  # A skipped test (no device) would hide a broken set-up: make it visible.
  timeout 240 "${test_binary}" --gtest_brief=1 2>&1 | tee /tmp/gpu_check_test.log | tail -n 40
  rc=${PIPESTATUS[0]}
  if grep -q "SKIPPED" /tmp/gpu_check_test.log; then
    echo "gpu_check: some tests were SKIPPED (no device visible?)"
  fi
  if [[ ${rc} -ne 0 ]]; then
    [[ ${rc} -eq 124 ]] && echo "gpu_check: $(basename "${test_binary}") timed out"
    echo "gpu_check: $(basename "${test_binary}") FAILED (exit ${rc})"
    status=1
  fi
done

echo "=== kvcal_bench_gpu"
timeout 180 "${bundle}/bin/kvcal_bench_gpu" "$@" 2>&1
rc=$?
if [[ ${rc} -ne 0 ]]; then
  echo "gpu_check: kvcal_bench_gpu FAILED (exit ${rc})"
  status=1
fi

echo "=== gpu_check: $([[ ${status} -eq 0 ]] && echo PASSED || echo FAILED)"
exit ${status}
