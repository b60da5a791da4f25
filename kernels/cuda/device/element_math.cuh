// The engine's element math (kernels/element_math.h) and launch interface
// (statistics_kernels.h) for device code, plus the two constants every
// kernel of the statistics backend shares.
#ifndef KVCAL_KERNELS_CUDA_DEVICE_ELEMENT_MATH_CUH_
#define KVCAL_KERNELS_CUDA_DEVICE_ELEMENT_MATH_CUH_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

// element_math.h computes unsigned bin offsets from the signed exponent
// constants (127u + kHistogramMinExponent); the arithmetic is intended and
// exact, but nvcc warns (#68) and warnings are errors for our code.
#pragma nv_diagnostic push
#pragma nv_diag_suppress 68
#include "kernels/element_math.h"
#pragma nv_diagnostic pop
#include "kernels/cuda/statistics_kernels.h"

namespace kvcal::cuda {

inline constexpr unsigned kFullWarpMask = 0xffffffffu;

// Bytes of the shared histogram (32-bit counters), rounded up to 16 so the
// warp tail buffers behind it stay aligned.
KVCAL_HOST_DEVICE constexpr size_t SharedHistogramBytes(uint32_t bins) {
  return (static_cast<size_t>(bins) * sizeof(uint32_t) + 15u) &
         ~static_cast<size_t>(15u);
}

}  // namespace kvcal::cuda

#endif  // KVCAL_KERNELS_CUDA_DEVICE_ELEMENT_MATH_CUH_
