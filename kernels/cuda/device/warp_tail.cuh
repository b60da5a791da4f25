// Each warp of AccumulateKernel keeps its exact top-kTailCapacity |x| in a
// shared buffer: candidates are appended behind the kept ones and the buffer
// is sorted and cut back when the next round might not fit.
#ifndef KVCAL_KERNELS_CUDA_DEVICE_WARP_TAIL_CUH_
#define KVCAL_KERNELS_CUDA_DEVICE_WARP_TAIL_CUH_

#include <cub/warp/warp_scan.cuh>

#include "kernels/cuda/device/bitonic_sort.cuh"
#include "kernels/cuda/device/element_math.cuh"

namespace kvcal::cuda {

// Keeps the kTailCapacity largest of buf[0, count) in buf[0, kTailCapacity),
// sorted descending. kTailCapacity < count <= kWarpTailBuffer.
__device__ __forceinline__ void CompactWarpTail(float* buf, uint32_t count,
                                                uint32_t lane) {
  const uint32_t n =
      count <= 512u ? 512u : static_cast<uint32_t>(kWarpTailBuffer);
  for (uint32_t i = count + lane; i < n; i += 32)
    buf[i] = -1.0f;  // below any |x|
  __syncwarp();
  BitonicSortDescending<32>(buf, n, lane, [] { __syncwarp(); });
}

// Keeps the warp's kTailCapacity largest candidates when it holds more, and
// raises the warp's floor to the smallest of them (plus one ulp). Called by
// all 32 lanes with the same tail_count.
__device__ __forceinline__ void CompactWarpTailIfOver(float* tail_buffer,
                                                      uint32_t& tail_count,
                                                      uint32_t& floor_bits,
                                                      uint32_t lane) {
  if (tail_count <= kTailCapacity) return;
  CompactWarpTail(tail_buffer, tail_count, lane);
  tail_count = kTailCapacity;
  floor_bits = FloatBits(tail_buffer[kTailCapacity - 1]) + 1u;
}

// Appends this round's tail candidates of every lane (bit v of `candidates`:
// magnitudes[v] enters) behind the warp's kept ones. The buffer is compacted
// only when the next round's candidates might not fit, not whenever it holds
// more than kTailCapacity: while the tails are empty (a session's first
// chunk), every value is a candidate, and sorting after each round made that
// chunk 17x slower than the next ones on an H200 (54 against 926 GB/s).
// Called by all 32 lanes (the caller's condition is warp-uniform).
template <int kPerRound>
__device__ __forceinline__ void AppendWarpCandidates(
    const float (&magnitudes)[kPerRound], uint32_t candidates,
    float* tail_buffer, uint32_t& tail_count, uint32_t& floor_bits,
    uint32_t lane, typename cub::WarpScan<uint32_t>::TempStorage& scan) {
  // The exclusive prefix sum of the lanes' counts (0 for lane 0) gives each
  // lane its offset, the warp aggregate how many were added.
  uint32_t below = 0;
  uint32_t added = 0;
  cub::WarpScan<uint32_t>(scan).ExclusiveSum(
      static_cast<uint32_t>(__popc(candidates)), below, added);
  uint32_t position = tail_count + below;
#pragma unroll
  for (int v = 0; v < kPerRound; ++v) {
    if ((candidates >> v) & 1u) tail_buffer[position++] = magnitudes[v];
  }
  tail_count += added;  // <= kWarpTailBuffer
  __syncwarp();
  if (tail_count > kWarpTailBuffer - 32 * kPerRound) {
    CompactWarpTailIfOver(tail_buffer, tail_count, floor_bits, lane);
  }
}

}  // namespace kvcal::cuda

#endif  // KVCAL_KERNELS_CUDA_DEVICE_WARP_TAIL_CUH_
