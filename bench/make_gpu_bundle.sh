#!/usr/bin/env bash
# Builds the CUDA test binaries and kvcal_bench_gpu (in build/ with CUDA on,
# or in $KVCAL_BUNDLE_BUILD_DIR) and copies them, with every shared library
# they need that is not part of the C runtime, into a self-contained bundle
# for a GPU machine that has no Debian libraries and no network. Run
# bench/gpu_check.sh there.
#
#   bench/make_gpu_bundle.sh [BUNDLE_DIR]     (default .gpu-bundle/)
#
# Layout: BUNDLE_DIR/bin/* (stripped of debug info), BUNDLE_DIR/lib/*.so*.
# The CUDA runtime is linked statically; the driver (libcuda) comes from the
# GPU machine and is never bundled.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bundle="${1:-${root}/.gpu-bundle}"
build="${KVCAL_BUNDLE_BUILD_DIR:-${root}/build}"
jobs="${KVCAL_BUNDLE_JOBS:-$(nproc)}"

cmake -S "${root}" -B "${build}" -G Ninja -DKVCAL_CUDA=ON >/dev/null
# Only what the bundle needs: the benchmark and the kernels tests (the CUDA
# test executables live there).
ninja -C "${build}" -j "${jobs}" kvcal_bench_gpu tests/kernels/all

binaries=("${build}/bench/gpu/kvcal_bench_gpu")
while IFS= read -r -d '' test_binary; do
  binaries+=("${test_binary}")
done < <(find "${build}/tests/kernels" -maxdepth 1 -type f -executable \
              -name '*cuda*' -print0)
if [[ ${#binaries[@]} -lt 2 ]]; then
  echo "make_gpu_bundle: no CUDA test binary (*cuda*) under ${build}/tests/kernels" >&2
  exit 1
fi

rm -rf "${bundle}"
mkdir -p "${bundle}/bin" "${bundle}/lib"
# Keep the bundle out of git without touching the repository's .gitignore.
printf '*\n' >"${bundle}/.gitignore"

# The C runtime and the dynamic loader must come from the GPU machine; the
# driver too. libstdc++ and libgcc_s are bundled: their versions may differ.
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

echo "bundle ${bundle}: $(ls "${bundle}/bin" | tr '\n' ' ')"
echo "  $(ls "${bundle}/lib" | wc -l) libraries, $(du -sh "${bundle}" | cut -f1)"
