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
# Layout: BUNDLE_DIR/bin/* (stripped of debug info), BUNDLE_DIR/lib/ (empty
# unless a dependency had no static archive).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bundle="${1:-${root}/.gpu-bundle}"
build="${KVCAL_BUNDLE_BUILD_DIR:-${root}/build-gpu-bundle}"
jobs="${KVCAL_BUNDLE_JOBS:-${KVCAL_JOBS:-$(nproc)}}"
max_glibc="2.35"

cmake -S "${root}" -B "${build}" -G Ninja -DKVCAL_CUDA=ON \
  -DCMAKE_BUILD_TYPE=Release -DKVCAL_STATIC_RUNTIME=ON >/dev/null
targets=(kvcal_bench_gpu kvcal_backend_cuda_test kvcal_cuda_status_test)
binaries=("${build}/bench/gpu/kvcal_bench_gpu"
          "${build}/tests/kernels/kvcal_backend_cuda_test"
          "${build}/tests/kernels/kvcal_cuda_status_test")
# The cuDNN FP8 attention test exists when the configure found cuDNN and the
# cudnn-frontend headers (./run gpu-bundle installs them).
if ninja -C "${build}" -t targets all | grep -q '^kvcal_fp8_attention_cuda_test:'; then
  targets+=(kvcal_fp8_attention_cuda_test)
  binaries+=("${build}/tests/kernels/kvcal_fp8_attention_cuda_test")
fi
ninja -C "${build}" -j "${jobs}" "${targets[@]}"

rm -rf "${bundle}"
mkdir -p "${bundle}/bin" "${bundle}/lib"
# Keep the bundle out of git without touching the repository's .gitignore.
printf '*\n' >"${bundle}/.gitignore"

# The C runtime, the dynamic loader and the driver come from the GPU machine;
# anything else still linked dynamically is bundled (and checked below).
system_lib='^(linux-vdso|ld-linux|libc\.so|libm\.so|libpthread\.so|libdl\.so|librt\.so|libresolv\.so|libutil\.so|libcuda\.so|libnvidia)'
for binary in "${binaries[@]}"; do
  cp "${binary}" "${bundle}/bin/"
  strip --strip-debug "${bundle}/bin/$(basename "${binary}")"
  ldd "${binary}" | awk '/=> \// {print $1, $3}' | while read -r name path; do
    if [[ ! "${name}" =~ ${system_lib} ]]; then
      cp -L -n "${path}" "${bundle}/lib/${name}"
    fi
  done
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

# Every binary and library must load with glibc <= max_glibc, and nothing may
# be missing.
status=0
newest="2.0"
for file in "${bundle}"/bin/* "${bundle}"/lib/*; do
  [[ -f "${file}" ]] || continue
  need=$(objdump -T "${file}" | grep -o 'GLIBC_2\.[0-9]*' | sed 's/GLIBC_//' |
         sort -t. -k2 -n -u | tail -n 1)
  need="${need:-2.0}"
  if [[ "$(printf '%s\n%s\n' "${need}" "${newest}" | sort -V | tail -n 1)" == "${need}" ]]; then
    newest="${need}"
  fi
  if [[ "$(printf '%s\n%s\n' "${need}" "${max_glibc}" | sort -V | tail -n 1)" != "${max_glibc}" ]]; then
    echo "make_gpu_bundle: $(basename "${file}") needs glibc ${need} (> ${max_glibc})" >&2
    status=1
  fi
done
for binary in "${bundle}"/bin/*; do
  if LD_LIBRARY_PATH="${bundle}/lib" ldd "${binary}" | grep -q 'not found'; then
    echo "make_gpu_bundle: $(basename "${binary}") has unresolved libraries:" >&2
    LD_LIBRARY_PATH="${bundle}/lib" ldd "${binary}" | grep 'not found' >&2
    status=1
  fi
done

echo "bundle ${bundle}: $(ls "${bundle}/bin" | tr '\n' ' ')"
echo "  $(ls "${bundle}/lib" | wc -l) bundled libraries, $(du -sh "${bundle}" | cut -f1), needs glibc >= ${newest}"
exit ${status}
