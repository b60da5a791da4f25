// Launch interface of the CUDA statistics kernels (statistics_kernels.cu).
// The host code in cuda_backend.cc owns the memory described here, sizes the
// grid and calls these functions; the kernels themselves live in
// accumulate_kernel.cuh and tail_select_kernel.cuh. No Abseil here: this
// header is compiled by nvcc.
//
// Device state, per flat head index (SessionStatistics::Index order), all
// zero after Reset so that one cudaMemsetAsync initialises everything:
//   min_key_inverted[h]   ~OrderedKey(min)   (0: no finite value yet)
//   max_key[h]            OrderedKey(max)    (0: no finite value yet)
//   counts[3h + {0,1,2}]  finite, NaN, Inf
//   sums[2h + {0,1}]      sum, sum of squares
//   histogram[h * bins + bin]
//   tail[h * kTailCapacity + i], i < tail_size[h]: the largest |x|, sorted
//     descending
//   tail_floor_bits[h]    0 while the tail is not full, else
//                         FloatBits(tail[h][255]) + 1: an |x| enters only
//                         when its bits are >= this
//   batch_*[slot * heads_total + h]  min/max of batch slot `slot`, encoded
//                         like min_key_inverted / max_key.
//
// One chunk is one AccumulateKernel launch (grid: blocks_per_head x heads,
// kAccumulateThreads threads), followed, with histograms, by one
// TailSelectKernel launch (one block per head) that merges the per-warp tail
// candidates into the head's tail.
#ifndef KVCAL_KERNELS_CUDA_STATISTICS_KERNELS_H_
#define KVCAL_KERNELS_CUDA_STATISTICS_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/element_math.h"

namespace kvcal::cuda {

inline constexpr int kAccumulateThreads = 256;
inline constexpr int kAccumulateWarps = kAccumulateThreads / 32;
// Per-warp tail buffer in shared memory: the kept kTailCapacity values plus
// at most 512 new candidates of one round, rounded up to a power of two for
// the bitonic sort.
inline constexpr int kWarpTailBuffer = 1024;
inline constexpr int kTailSelectThreads = 256;

enum class ElementType : uint32_t { kF32, kF16, kBf16 };

// Values one 16-byte load carries (vectorized kernels need inner % this == 0
// and 16-byte aligned data).
KVCAL_HOST_DEVICE constexpr uint32_t ValuesPerVector(ElementType type) {
  return type == ElementType::kF32 ? 4u : 8u;
}

struct DeviceState {
  uint32_t* min_key_inverted = nullptr;
  uint32_t* max_key = nullptr;
  unsigned long long* counts = nullptr;
  double* sums = nullptr;
  unsigned long long* histogram = nullptr;  // null without histograms
  float* tail = nullptr;                    // null without histograms
  uint32_t* tail_size = nullptr;
  uint32_t* tail_floor_bits = nullptr;
  uint32_t* batch_min_key_inverted = nullptr;
  uint32_t* batch_max_key = nullptr;
  uint32_t heads_total = 0;
  uint32_t bins = 0;  // per head; 0 without histograms
  uint32_t log2_bins_per_octave = 0;
};

// Per-warp tail candidates of the last AccumulateKernel launch.
struct TailScratch {
  float* candidates = nullptr;           // [warps][kTailCapacity]
  uint32_t* candidate_counts = nullptr;  // [warps]
  size_t warps = 0;                      // capacity
};

// One chunk (or piece of a chunk) in canonical form (types.h ChunkExtent):
// element (o, h, i) at index (o * heads + h) * inner + i of `data`, in
// device memory.
struct ChunkLaunch {
  const void* data = nullptr;
  ElementType type = ElementType::kF32;
  uint64_t outer = 0;
  uint32_t heads = 0;
  uint64_t inner = 0;
  uint32_t head_base = 0;   // flat index of the chunk's head 0
  uint32_t batch_slot = 0;  // row of the batch table
  uint32_t blocks_per_head = 1;
  // 16-byte loads: data 16-byte aligned and inner % ValuesPerVector == 0.
  bool vectorized = false;
  // Outer x inner values per head must stay below 2^31 (per-thread and
  // per-block counters are 32-bit).
};

// Dynamic shared memory of one AccumulateKernel block.
size_t AccumulateSharedBytes(bool histograms, uint32_t bins);

// Resident blocks per SM of the AccumulateKernel variant (for grid sizing).
cudaError_t AccumulateBlocksPerSm(ElementType type, bool vectorized,
                                  bool histograms, uint32_t bins,
                                  int* blocks_per_sm);

// Enqueues the kernels for one chunk on `stream`: AccumulateKernel, and with
// histograms TailSelectKernel. The caller guarantees scratch.warps >=
// heads * blocks_per_head * kAccumulateWarps. Returns launch errors.
cudaError_t EnqueueChunk(const DeviceState& state, const TailScratch& scratch,
                         const ChunkLaunch& chunk, cudaStream_t stream);

// Order-preserving map of a float to uint32: a < b  <=>  key(a) < key(b) for
// non-NaN values. Never 0 and never 0xffffffff for finite values.
KVCAL_HOST_DEVICE constexpr uint32_t OrderedKeyFromBits(uint32_t bits) {
  return (bits & 0x80000000u) != 0 ? ~bits : (bits | 0x80000000u);
}
KVCAL_HOST_DEVICE constexpr uint32_t BitsFromOrderedKey(uint32_t key) {
  return (key & 0x80000000u) != 0 ? (key & 0x7fffffffu) : ~key;
}

}  // namespace kvcal::cuda

#endif  // KVCAL_KERNELS_CUDA_STATISTICS_KERNELS_H_
