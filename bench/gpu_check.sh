#!/usr/bin/env bash
# GPU check for a machine with an NVIDIA GPU: runs the CUDA backend's tests
# and the GPU benchmark from a prebuilt bundle (bench/make_gpu_bundle.sh) in
# under 8 minutes. Needs nothing but the driver: no Debian libraries, no
# network.
#
#   bench/gpu_check.sh [BUNDLE_DIR [BENCH_ARGS...]]   (default .gpu-bundle/)
#
# It cannot pass by skipping: it FAILS when
#   - no CUDA device is visible (then every GPU test skips: "no GPU test ran"),
#   - any test fails or skips, except the two-GPU test on a one-GPU machine,
#   - a test binary runs no test at all, or times out,
#   - the benchmark fails, finds no device, or measures nothing.
# The benchmark's throughput goals are reported, not enforced (timings are
# never assertions). Time limits: 150 s per test run, 120 s for the
# benchmark, so the whole check ends within 8 minutes.
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bundle="${1:-${root}/.gpu-bundle}"
[[ $# -gt 0 ]] && shift
if [[ ! -d "${bundle}/bin" ]]; then
  echo "gpu_check: FAILED: no bundle at ${bundle} (build one with bench/make_gpu_bundle.sh)" >&2
  exit 2
fi
export LD_LIBRARY_PATH="${bundle}/lib${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"
log_dir="$(mktemp -d)"
trap 'rm -rf "${log_dir}"' EXIT

if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
else
  echo "gpu_check: nvidia-smi not found"
fi

failures=()
gpu_passed=0  # tests of the CUDA backend that ran on a device and passed
# The only test allowed to skip: it needs two GPUs, and device 0 untouched
# by its process, so it also runs alone below.
two_gpu_test='*DeviceOneOnFreshThreadsNeverTouchesDeviceZero*'

# run_tests NAME BINARY [GTEST_ARGS...]: runs one test binary, prints its
# tail, and records failures, skips and how many tests passed.
run_tests() {
  local name="$1" binary="$2"
  shift 2
  local log="${log_dir}/${name}.log"
  echo "=== ${name}"
  timeout 150 "${binary}" --gtest_brief=1 "$@" >"${log}" 2>&1
  local rc=$?
  grep -v '^Running main\|Skipped$\|skipping the CUDA backend tests$' "${log}" | tail -n 25
  if [[ ${rc} -eq 124 ]]; then
    failures+=("${name}: timed out after 150 s")
  elif [[ ${rc} -ne 0 ]]; then
    failures+=("${name}: exit ${rc}")
  fi
  local passed skipped
  passed=$(sed -n 's/^\[  PASSED  \] \([0-9]*\) tests\{0,1\}\..*/\1/p' "${log}" | tail -n 1)
  skipped=$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) tests\{0,1\}[.,].*/\1/p' "${log}" | tail -n 1)
  passed="${passed:-0}"
  skipped="${skipped:-0}"
  if [[ "${name}" == kvcal_backend_cuda_test* ]]; then
    gpu_passed=$((gpu_passed + passed))
  fi
  if [[ ${skipped} -ne 0 && "${name}" == *two-gpu* ]] &&
     grep -q "needs two CUDA devices" "${log}"; then
    echo "gpu_check: ${name}: skipped, this machine has one GPU (allowed)"
    return
  fi
  if [[ ${passed} -eq 0 ]]; then
    failures+=("${name}: no test passed (${skipped} skipped)")
  fi
  if [[ ${skipped} -ne 0 ]]; then
    failures+=("${name}: ${skipped} test(s) SKIPPED: $(grep -m1 -A1 'Skipped' "${log}" | tail -n 1)")
  fi
}

shopt -s nullglob
for test_binary in "${bundle}"/bin/*cuda*test*; do
  name="$(basename "${test_binary}")"
  if [[ "${name}" == kvcal_backend_cuda_test ]]; then
    run_tests "${name}" "${test_binary}" --gtest_filter="-${two_gpu_test}"
    run_tests "${name}-two-gpu" "${test_binary}" --gtest_filter="${two_gpu_test}"
  else
    run_tests "${name}" "${test_binary}"
  fi
done
if [[ ! -x "${bundle}/bin/kvcal_backend_cuda_test" ]]; then
  failures+=("no kvcal_backend_cuda_test in ${bundle}/bin")
fi

echo "=== kvcal_bench_gpu"
timeout 120 "${bundle}/bin/kvcal_bench_gpu" "$@" 2>&1 | tee "${log_dir}/bench.log"
rc=${PIPESTATUS[0]}
case ${rc} in
  0)
    if ! grep -q "HBM ratio" "${log_dir}/bench.log" ||
       ! grep -q "H2D ratio" "${log_dir}/bench.log"; then
      failures+=("kvcal_bench_gpu: exited 0 but printed no HBM/H2D ratio")
    fi
    ;;
  3) failures+=("kvcal_bench_gpu: no CUDA device, nothing measured") ;;
  124) failures+=("kvcal_bench_gpu: timed out after 120 s") ;;
  *) failures+=("kvcal_bench_gpu: exit ${rc}") ;;
esac

echo "=== summary"
grep -h "HBM ratio\|H2D ratio\|HBM peak" "${log_dir}/bench.log" 2>/dev/null
if [[ ${gpu_passed} -eq 0 ]]; then
  failures=("no GPU test ran: every CUDA backend test skipped or none was found (is a GPU visible?)" "${failures[@]}")
fi
if [[ ${#failures[@]} -eq 0 ]]; then
  echo "=== gpu_check: PASSED (${gpu_passed} CUDA backend tests passed, benchmark measured)"
  exit 0
fi
for failure in "${failures[@]}"; do echo "gpu_check: ${failure}"; done
echo "=== gpu_check: FAILED"
exit 1
