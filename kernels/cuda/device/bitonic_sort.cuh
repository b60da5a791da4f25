// The bitonic sort both statistics kernels use: a warp sorts its tail
// buffer (__syncwarp between steps), a block sorts the kept tail of a head
// (__syncthreads between steps).
#ifndef KVCAL_KERNELS_CUDA_DEVICE_BITONIC_SORT_CUH_
#define KVCAL_KERNELS_CUDA_DEVICE_BITONIC_SORT_CUH_

#include <cstdint>

namespace kvcal::cuda {

// Sorts buf[0, n) descending; n a power of two. Every thread
// of the group (kStride threads) calls it with its index `first` in the group;
// `sync()` (the group's barrier: __syncwarp or __syncthreads) runs after each
// step. In each step the pairs (i, i ^ j) are disjoint and each is handled by
// the thread owning the lower index.
template <uint32_t kStride, typename Sync>
__device__ __forceinline__ void BitonicSortDescending(float* buf, uint32_t n,
                                                      uint32_t first,
                                                      Sync sync) {
  __builtin_assume(first < kStride);  // a thread's index in its group
  for (uint32_t k = 2; k <= n; k <<= 1) {
    for (uint32_t j = k >> 1; j > 0; j >>= 1) {
      for (uint32_t i = first; i < n; i += kStride) {
        const uint32_t partner = i ^ j;
        if (partner > i) {
          const float a = buf[i];
          const float b = buf[partner];
          const bool descending = (i & k) == 0;
          if (descending ? (a < b) : (a > b)) {
            buf[i] = b;
            buf[partner] = a;
          }
        }
      }
      sync();
    }
  }
}

}  // namespace kvcal::cuda

#endif  // KVCAL_KERNELS_CUDA_DEVICE_BITONIC_SORT_CUH_
