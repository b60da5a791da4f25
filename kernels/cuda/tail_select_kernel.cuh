// TailSelectKernel: one block per head of the chunk. Merges the head's tail
// with its warps' candidates (AccumulateKernel's TailScratch) and keeps the
// kTailCapacity largest exactly (radix select on the float bits when there
// are more), sorted descending.
//
// Why exact: top-k of a union equals top-k of the union of each part's top-k
// (as multisets), and a value equal to a full set's smallest member does not
// change that set's multiset, so dropping it is harmless.
#ifndef KVCAL_KERNELS_CUDA_TAIL_SELECT_KERNEL_CUH_
#define KVCAL_KERNELS_CUDA_TAIL_SELECT_KERNEL_CUH_

#include "kernels/cuda/device/bitonic_sort.cuh"
#include "kernels/cuda/device/element_math.cuh"

namespace kvcal::cuda {

// The kTailCapacity-th largest of the inputs `for_each_input` visits (all
// >= 0, so their bits order like the values), by radix select: eight bits
// per pass, most significant first; `prefix` holds the digits chosen so far
// and `need` how many values with that prefix are still to be kept. Returns
// the value's bits; `need` ends as how many copies of it complete the set
// (kTailCapacity - need inputs are strictly greater). Every thread of the
// block calls it.
template <typename ForEachInput>
__device__ __forceinline__ uint32_t
RadixSelectKthLargest(ForEachInput&& for_each_input,
                      uint32_t* digit_counts,  // [256], shared
                      uint32_t& chosen_digit, uint32_t& still_needed,  // shared
                      uint32_t& need) {
  const uint32_t tid = threadIdx.x;
  uint32_t prefix = 0;
  uint32_t prefix_mask = 0;
  need = kTailCapacity;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (uint32_t d = tid; d < 256; d += blockDim.x) digit_counts[d] = 0;
    __syncthreads();
    for_each_input([&](float v) {
      const uint32_t bits = FloatBits(v);
      if ((bits & prefix_mask) == prefix) {
        atomicAdd(&digit_counts[(bits >> shift) & 0xffu], 1u);
      }
    });
    __syncthreads();
    if (tid == 0) {
      uint32_t above = 0;
      uint32_t digit = 255;
      for (; digit > 0; --digit) {
        if (above + digit_counts[digit] >= need) break;
        above += digit_counts[digit];
      }
      chosen_digit = digit;
      still_needed = need - above;
    }
    __syncthreads();
    prefix |= chosen_digit << shift;
    prefix_mask |= 0xffu << shift;
    need = still_needed;
    __syncthreads();  // digit_counts and chosen_digit are reused next pass
  }
  return prefix;
}

// How many tail candidates the warps of this block's head left (summed
// over the block in `fresh_total`); clears `kept_cursor`. Every thread of the
// block calls it and gets the same number.
__device__ __forceinline__ uint32_t
CountCandidates(const uint32_t* counts,  // [warps_per_head]
                uint32_t warps_per_head, uint32_t& fresh_total,
                uint32_t& kept_cursor) {  // shared
  const uint32_t tid = threadIdx.x;
  if (tid == 0) {
    fresh_total = 0;
    kept_cursor = 0;
  }
  __syncthreads();
  uint32_t local = 0;
  for (uint32_t w = tid; w < warps_per_head; w += blockDim.x)
    local += counts[w];
  if (local != 0) atomicAdd(&fresh_total, local);
  __syncthreads();
  return fresh_total;
}

// One block of kTailSelectThreads per head of the chunk (blockIdx.x = chunk
// head); warps_per_head = blocks_per_head * kAccumulateWarps of the
// AccumulateKernel launch it follows. scratch.candidate_counts: [heads of the
// chunk][warps_per_head]; scratch.candidates: [heads of the chunk]
// [warps_per_head][kTailCapacity]; state.tail: [heads][kTailCapacity].
__global__ void __launch_bounds__(kTailSelectThreads)
    TailSelectKernel(DeviceState state, TailScratch scratch, uint32_t head_base,
                     uint32_t warps_per_head) {
  static_assert(kTailSelectThreads == kTailCapacity,
                "the final bitonic sort gives each thread one element");
  __shared__ float kept[kTailCapacity];
  __shared__ uint32_t digit_counts[256];
  __shared__ uint32_t fresh_total;
  __shared__ uint32_t kept_cursor;
  __shared__ uint32_t chosen_digit;
  __shared__ uint32_t still_needed;

  const uint32_t tid = threadIdx.x;
  const uint32_t head = head_base + blockIdx.x;
  const uint32_t* counts = scratch.candidate_counts +
                           static_cast<size_t>(blockIdx.x) * warps_per_head;
  const float* candidates =
      scratch.candidates +
      static_cast<size_t>(blockIdx.x) * warps_per_head * kTailCapacity;
  float* tail = state.tail + static_cast<size_t>(head) * kTailCapacity;

  // 1. How many candidates the warps left; none: the tail stays as it is.
  const uint32_t fresh =
      CountCandidates(counts, warps_per_head, fresh_total, kept_cursor);
  if (fresh == 0) return;  // block-uniform: nothing can change the tail
  const uint32_t old_size = state.tail_size[head];
  const uint32_t n = old_size + fresh;

  // Calls fn on every input value: the head's current tail, then each warp's
  // candidates; the block's threads share the work.
  auto for_each_input = [&](auto&& fn) {
    for (uint32_t i = tid; i < old_size; i += blockDim.x) fn(tail[i]);
    for (uint32_t w = 0; w < warps_per_head; ++w) {
      const uint32_t c = counts[w];
      const float* values = candidates + static_cast<size_t>(w) * kTailCapacity;
      for (uint32_t i = tid; i < c; i += blockDim.x) fn(values[i]);
    }
  };

  // 2. Gather what is kept: everything, or the kTailCapacity largest.
  uint32_t kept_count = 0;
  if (n <= kTailCapacity) {
    for_each_input([&](float v) { kept[atomicAdd(&kept_cursor, 1u)] = v; });
    kept_count = n;
  } else {
    uint32_t need = 0;
    const uint32_t kth = RadixSelectKthLargest(
        for_each_input, digit_counts, chosen_digit, still_needed, need);
    const uint32_t greater = kTailCapacity - need;
    for_each_input([&](float v) {
      if (FloatBits(v) > kth) kept[atomicAdd(&kept_cursor, 1u)] = v;
    });
    for (uint32_t i = greater + tid; i < kTailCapacity; i += blockDim.x) {
      kept[i] = BitsToFloat(kth);
    }
    kept_count = kTailCapacity;
  }
  __syncthreads();

  // 3. Sort descending, padding last.
  for (uint32_t i = kept_count + tid; i < kTailCapacity; i += blockDim.x) {
    kept[i] = -1.0f;  // padding sorts last
  }
  __syncthreads();
  BitonicSortDescending<kTailSelectThreads>(kept, kTailCapacity, tid,
                                            [] { __syncthreads(); });

  // 4. The new tail, its size and its floor (one ulp above its smallest when
  // full: only larger values can enter).
  for (uint32_t i = tid; i < kept_count; i += blockDim.x) tail[i] = kept[i];
  if (tid == 0) {
    state.tail_size[head] = kept_count;
    state.tail_floor_bits[head] = kept_count == kTailCapacity
                                      ? FloatBits(kept[kTailCapacity - 1]) + 1u
                                      : 0u;
  }
}

}  // namespace kvcal::cuda

#endif  // KVCAL_KERNELS_CUDA_TAIL_SELECT_KERNEL_CUH_
