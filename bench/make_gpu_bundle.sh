#!/usr/bin/env bash
# Builds the CUDA test binaries and kvcal_bench_gpu and copies them into a
# self-contained bundle for a GPU machine that has no Debian libraries and no
# network. Run bench/gpu_check.sh there.
#
#   bench/make_gpu_bundle.sh [BUNDLE_DIR]     (default .gpu-bundle/)
#
# The build (in build-gpu-bundle/, or $KVCAL_BUNDLE_BUILD_DIR) links
# libstdc++, libgcc and Abseil statically (KVCAL_STATIC_RUNTIME) and the CUDA
# runtime statically, so the binaries need only the C library (glibc <= 2.35:
# Ubuntu 22.04 and later, Debian 12) and the driver (libcuda, never bundled).
# The script checks both and fails when a binary would need more.
#
# The bundle also holds kvcal-worker and the CUDA IPC shared-memory test that
# drives it (tests/service/shared_memory_cuda_test.cc), built apart (in
# BUILD_DIR-service) and linked the ordinary way: gRPC, protobuf, OpenSSL,
# Abseil and libstdc++ travel as Debian's shared libraries, which need glibc
# <= 2.36 (Debian 12, Ubuntu 24.04).
#
# cuDNN (500+ MB) and NVRTC (100+ MB) do not travel: the FP8 attention test
# loads them from the GPU machine, where the CUDA toolkit or PyTorch's
# nvidia-cudnn-cu13 / nvidia-cuda-nvrtc wheels provide them (gpu_check.sh
# finds them). KVCAL_BUNDLE_CUDNN=1 bundles them anyway.
#
# Layout: BUNDLE_DIR/bin/* (stripped of debug info) and BUNDLE_DIR/lib/ (the
# dynamic libraries other than glibc, the driver, cuDNN and NVRTC);
# BUNDLE_DIR/service/{bin,lib}: the worker side, apart so that its Debian
# libstdc++ never reaches the CUDA tests or the GPU machine's cuDNN.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bundle="${1:-${root}/.gpu-bundle}"
build="${KVCAL_BUNDLE_BUILD_DIR:-${root}/build-gpu-bundle}"
jobs="${KVCAL_BUNDLE_JOBS:-${KVCAL_JOBS:-$(nproc)}}"
max_glibc="2.35"          # CUDA tests and benchmark: Ubuntu 22.04 and later
max_glibc_service="2.36"  # kvcal-worker and its gRPC libraries: Debian 12's
bundle_cudnn="${KVCAL_BUNDLE_CUDNN:-0}"

cmake -S "${root}" -B "${build}" -G Ninja -DKVCAL_CUDA=ON \
  -DCMAKE_BUILD_TYPE=Release -DKVCAL_STATIC_RUNTIME=ON >/dev/null
targets=(kvcal_bench_gpu kvcal_backend_cuda_test kvcal_cuda_status_test)
binaries=("${build}/bench/gpu/kvcal_bench_gpu"
          "${build}/tests/kernels/kvcal_backend_cuda_test"
          "${build}/tests/kernels/kvcal_cuda_status_test")
# The cuDNN FP8 attention test exists when the configure found cuDNN and the
# cudnn-frontend headers (./run gpu-bundle installs them).
# (grep without -q: with pipefail, grep -q leaving early would fail ninja
# with SIGPIPE, and the test would silently drop out of the bundle.)
if ninja -C "${build}" -t targets all |
   grep '^kvcal_fp8_attention_cuda_test:' >/dev/null; then
  targets+=(kvcal_fp8_attention_cuda_test)
  binaries+=("${build}/tests/kernels/kvcal_fp8_attention_cuda_test")
fi
ninja -C "${build}" -j "${jobs}" "${targets[@]}"

# The worker with --backend cuda and the CUDA IPC test that starts it, from a
# build linked the ordinary way (shared gRPC, protobuf, Abseil, libstdc++):
# Debian has no static gRPC, and one static and one shared Abseil in the same
# process would be two copies of its globals.
service_build="${build}-service"
cmake -S "${root}" -B "${service_build}" -G Ninja -DKVCAL_CUDA=ON \
  -DCMAKE_BUILD_TYPE=Release -DKVCAL_STATIC_RUNTIME=OFF >/dev/null
ninja -C "${service_build}" -j "${jobs}" kvcal-worker kvcal_shared_memory_cuda_test
service_binaries=("${service_build}/service/kvcal-worker"
                  "${service_build}/tests/service/kvcal_shared_memory_cuda_test")

rm -rf "${bundle}"
mkdir -p "${bundle}/bin" "${bundle}/lib" "${bundle}/service/bin" "${bundle}/service/lib"
# Keep the bundle out of git without touching the repository's .gitignore.
printf '*\n' >"${bundle}/.gitignore"

# The C runtime, the dynamic loader and the driver come from the GPU machine;
# anything else still linked dynamically is bundled (and checked below).
system_lib='^(linux-vdso|ld-linux|libc\.so|libm\.so|libpthread\.so|libdl\.so|librt\.so|libresolv\.so|libutil\.so|libcuda\.so|libnvidia)'
if [[ "${bundle_cudnn}" != 1 ]]; then
  system_lib="${system_lib%)}|libcudnn|libnvrtc)"
fi
# The CUDA tests and the benchmark link the C++ runtime statically; a shared
# libstdc++ or libgcc_s in their ldd comes from the machine's own cuDNN and
# NVRTC, which bring their own.
static_runtime_lib="${system_lib%)}|libstdc\+\+\.so|libgcc_s\.so)"

# copy_binary BINARY DIR SKIP: BINARY into DIR/bin, the libraries it needs
# into DIR/lib, except those whose names match the regular expression SKIP.
copy_binary() {
  local binary="$1" dir="$2" skip="$3"
  cp "${binary}" "${dir}/bin/"
  strip --strip-debug "${dir}/bin/$(basename "${binary}")"
  ldd "${binary}" | awk '/=> \// {print $1, $3}' | while read -r name path; do
    if [[ ! "${name}" =~ ${skip} ]]; then
      cp -L -n "${path}" "${dir}/lib/${name}"
    fi
  done
}
for binary in "${binaries[@]}"; do
  copy_binary "${binary}" "${bundle}" "${static_runtime_lib}"
done
for binary in "${service_binaries[@]}"; do
  copy_binary "${binary}" "${bundle}/service" "${system_lib}"
done
# cuDNN loads its engine libraries (libcudnn_graph, libcudnn_engines_*, ...)
# with dlopen: ldd does not list them; bundle all of cuDNN next to libcudnn.
if [[ -e "${bundle}/lib/libcudnn.so.9" ]]; then
  cudnn_dir="$(dirname "$(ldd "${build}/tests/kernels/kvcal_fp8_attention_cuda_test" |
                          awk '/libcudnn\.so/ {print $3}')")"
  cp -L -n "${cudnn_dir}"/libcudnn*.so.9 "${bundle}/lib/"
  # NVRTC loads its builtins the same way.
  cp -L -n "${cudnn_dir}"/libnvrtc-builtins.so.* "${bundle}/lib/" 2>/dev/null || true
fi

# Every CUDA test and the benchmark must load with glibc <= max_glibc, the
# worker side with glibc <= max_glibc_service; nothing may be missing but
# cuDNN and NVRTC, which the GPU machine provides.
status=0
newest="2.0"
# glibc_needed FILE: the newest GLIBC_2.N symbol version FILE needs.
glibc_needed() {
  local need
  need=$(objdump -T "$1" | grep -o 'GLIBC_2\.[0-9]*' | sed 's/GLIBC_//' |
         sort -t. -k2 -n -u | tail -n 1)
  echo "${need:-2.0}"
}
version_le() { [[ "$(printf '%s\n%s\n' "$1" "$2" | sort -V | tail -n 1)" == "$2" ]]; }
for binary in "${bundle}"/bin/* "${bundle}"/service/bin/*; do
  dir="$(dirname "$(dirname "${binary}")")"
  limit="${max_glibc}"
  [[ "${dir}" == "${bundle}/service" ]] && limit="${max_glibc_service}"
  loaded="$(LD_LIBRARY_PATH="${dir}/lib" ldd "${binary}")"
  if grep 'not found' <<<"${loaded}" | grep -v 'libcudnn\|libnvrtc' >/dev/null; then
    echo "make_gpu_bundle: $(basename "${binary}") has unresolved libraries:" >&2
    grep 'not found' <<<"${loaded}" >&2
    status=1
  fi
  # The binary and every bundled library it loads.
  files=("${binary}")
  while read -r path; do
    [[ "${path}" == "${dir}/lib/"* ]] && files+=("${path}")
  done < <(awk '/=> \// {print $3}' <<<"${loaded}")
  for file in "${files[@]}"; do
    need=$(glibc_needed "${file}")
    version_le "${need}" "${newest}" || newest="${need}"
    if ! version_le "${need}" "${limit}"; then
      echo "make_gpu_bundle: $(basename "${file}") (loaded by $(basename "${binary}")) needs glibc ${need} (> ${limit})" >&2
      status=1
    fi
  done
done

echo "bundle ${bundle}: $(ls "${bundle}/bin" "${bundle}/service/bin" | grep -v '^/\|^$' | tr '\n' ' ')"
echo "  $(ls "${bundle}/lib" "${bundle}/service/lib" | grep -c '\.so') bundled libraries, $(du -sh "${bundle}" | cut -f1), needs glibc >= ${newest}"
exit ${status}
