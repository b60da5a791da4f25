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
#
# Environment:
#   GPU_CHECK_LOG_DIR=DIR     keep every test's and the benchmark's full log
#                             in DIR (default: a temporary directory, removed)
#   GPU_CHECK_SANITIZE=1      afterwards, run the CUDA backend tests under
#                             compute-sanitizer memcheck and racecheck
#                             (GPU_CHECK_SANITIZE_FILTER, default all, and
#                             GPU_CHECK_RACECHECK_FILTER for racecheck, which
#                             is far slower;
#                             GPU_CHECK_SANITIZE_TIMEOUT seconds each,
#                             default 150); a reported error or a time-out
#                             fails the check
#
# cuDNN and NVRTC do not travel in the bundle (bench/make_gpu_bundle.sh): when
# the loader does not know them, the check looks for them in the CUDA
# toolkit and in Python's nvidia-* wheels on this machine.
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bundle="${1:-${root}/.gpu-bundle}"
[[ $# -gt 0 ]] && shift
if [[ ! -d "${bundle}/bin" ]]; then
  echo "gpu_check: FAILED: no bundle at ${bundle} (build one with bench/make_gpu_bundle.sh)" >&2
  exit 2
fi
# library_dir NAME: prints the directory of NAME when the loader would not
# find it by itself; nothing when it would, or when it is nowhere here.
library_dir() {
  local name="$1" found
  ldconfig -p 2>/dev/null | grep -q "^[[:space:]]*${name} " && return 0
  found=$(find /usr/local/cuda*/ /usr/lib /opt -name "${name}" \
            \( -type f -o -type l \) -print -quit 2>/dev/null)
  [[ -n "${found}" ]] && dirname "${found}"
}
extra_dirs=""
for name in libcudnn.so.9 libnvrtc.so.13; do
  dir="$(library_dir "${name}")"
  if [[ -n "${dir}" ]]; then
    echo "gpu_check: ${name} from ${dir}"
    extra_dirs="${extra_dirs}:${dir}"
  fi
done
base_library_path="${LD_LIBRARY_PATH:-}"
export LD_LIBRARY_PATH="${bundle}/lib${extra_dirs}${base_library_path:+:${base_library_path}}"
if [[ -n "${GPU_CHECK_LOG_DIR:-}" ]]; then
  log_dir="${GPU_CHECK_LOG_DIR}"
  mkdir -p "${log_dir}"
else
  log_dir="$(mktemp -d)"
  trap 'rm -rf "${log_dir}"' EXIT
fi

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
if [[ ! -x "${bundle}/bin/kvcal_fp8_attention_cuda_test" ]]; then
  echo "gpu_check: note: no kvcal_fp8_attention_cuda_test in the bundle (built without cuDNN or cudnn-frontend)"
fi
# The worker side: a real kvcal-worker --backend cuda fed through CUDA IPC.
if [[ -x "${bundle}/service/bin/kvcal_shared_memory_cuda_test" ]]; then
  LD_LIBRARY_PATH="${bundle}/service/lib${base_library_path:+:${base_library_path}}" \
  KVCAL_WORKER_PATH="${bundle}/service/bin/kvcal-worker" \
    run_tests kvcal_shared_memory_cuda_test \
      "${bundle}/service/bin/kvcal_shared_memory_cuda_test"
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

sanitize_timeout="${GPU_CHECK_SANITIZE_TIMEOUT:-150}"
# sanitize TOOL: the CUDA backend tests under compute-sanitizer TOOL.
sanitize() {
  local tool="$1" sanitizer log="${log_dir}/sanitizer-$1.log"
  local filter="${GPU_CHECK_SANITIZE_FILTER:-*}"
  if [[ "${tool}" == racecheck && -n "${GPU_CHECK_RACECHECK_FILTER:-}" ]]; then
    filter="${GPU_CHECK_RACECHECK_FILTER}"
  fi
  # gtest filters: POSITIVE[-NEGATIVE], one '-' at most.
  if [[ "${filter}" == *-* ]]; then
    filter="${filter}:${two_gpu_test}"
  else
    filter="${filter}-${two_gpu_test}"
  fi
  sanitizer="$(command -v compute-sanitizer)"
  if [[ -z "${sanitizer}" ]]; then
    for candidate in /usr/local/cuda*/bin/compute-sanitizer \
                     /usr/local/cuda*/compute-sanitizer/compute-sanitizer; do
      if [[ -x "${candidate}" ]]; then
        sanitizer="${candidate}"
        break
      fi
    done
  fi
  echo "=== compute-sanitizer --tool ${tool}"
  if [[ -z "${sanitizer}" ]]; then
    failures+=("compute-sanitizer not found")
    return
  fi
  # API errors are not memory errors: the out-of-memory tests make
  # cudaMalloc fail on purpose.
  timeout "${sanitize_timeout}" "${sanitizer}" --tool "${tool}" \
    --report-api-errors no --error-exitcode 99 \
    "${bundle}/bin/kvcal_backend_cuda_test" --gtest_brief=1 \
    --gtest_filter="${filter}" \
    >"${log}" 2>&1
  local rc=$?
  grep -v '^Running main\|Skipped$' "${log}" | tail -n 15
  case ${rc} in
    0) ;;
    99) failures+=("compute-sanitizer ${tool}: errors reported (see its log)") ;;
    124) failures+=("compute-sanitizer ${tool}: timed out after ${sanitize_timeout} s") ;;
    *) failures+=("compute-sanitizer ${tool}: exit ${rc}") ;;
  esac
}
if [[ "${GPU_CHECK_SANITIZE:-0}" == 1 ]]; then
  sanitize memcheck
  sanitize racecheck
fi

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
