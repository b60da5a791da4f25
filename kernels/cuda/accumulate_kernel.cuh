// AccumulateKernel: grid (blocks_per_head, heads). The blocks of one head
// walk that head's rows (o, h, 0..inner) with a grid-stride loop over load
// units (16-byte vectors, or single values when the chunk is not aligned for
// vectors). Every value goes through the element_math.h functions shared with
// the CPU backend. Per thread: min/max/counts/sums in registers; per block:
// the histogram in shared memory (32-bit counters). Each warp keeps its own
// exact top-kTailCapacity |x| in a shared buffer: values at or below the
// head's current 256th largest (tail_floor_bits) never enter, and when the
// buffer could not take another round's candidates (more than 512 held) the
// warp sorts it (bitonic), keeps its 256 largest and raises its own floor to
// the 256th; once more at the end. Then: cub::BlockReduce, one set of global
// atomics per block, the shared histogram added to the global one, and each
// warp's <= kTailCapacity candidates written to TailScratch, which
// TailSelectKernel (tail_select_kernel.cuh) merges into the head's tail.
#ifndef KVCAL_KERNELS_CUDA_ACCUMULATE_KERNEL_CUH_
#define KVCAL_KERNELS_CUDA_ACCUMULATE_KERNEL_CUH_

#include <cub/block/block_reduce.cuh>
#include <cub/warp/warp_scan.cuh>

#include "kernels/cuda/device/block_statistics.cuh"
#include "kernels/cuda/device/element_math.cuh"
#include "kernels/cuda/device/head_walk.cuh"
#include "kernels/cuda/device/loaders.cuh"
#include "kernels/cuda/device/warp_tail.cuh"

namespace kvcal::cuda {

// Phase 1 of a round: kUnroll loads of the thread's next load units, issued
// before any is used. valid[u]: unit u is inside the head.
template <typename L>
__device__ __forceinline__ void LoadRound(
    const ChunkLaunch& chunk, HeadWalk& walk,
    typename L::Raw (&raw)[L::kUnroll],  // [kUnroll] load units
    bool (&valid)[L::kUnroll]) {
#pragma unroll
  for (int u = 0; u < L::kUnroll; ++u) {
    valid[u] = walk.Valid();
    raw[u] = typename L::Raw{};
    if (valid[u]) raw[u] = L::Load(chunk.data, walk.unit);
    walk.Advance();
  }
}

// Phase 2 of a round: decodes the loaded units into the thread's statistics
// and, with histograms, into the block's shared histogram, noting each
// value's |x| in magnitudes[u * kValues + v] and setting bit u * kValues + v
// of `candidates` when it enters the warp's tail (bits >= floor_bits).
template <typename L, ElementType kType, bool kHistograms, int kMagnitudes>
__device__ __forceinline__ void TakeRound(
    const typename L::Raw (&raw)[L::kUnroll],  // [kUnroll] load units
    const bool (&valid)[L::kUnroll], uint32_t log2_bins_per_octave,
    uint32_t floor_bits, ThreadStatistics& mine,
    uint32_t* histogram,               // [bins], shared
    float (&magnitudes)[kMagnitudes],  // [kValues * kUnroll] with histograms
    uint32_t& candidates) {
  constexpr int kValues = L::kValues;
#pragma unroll
  for (int u = 0; u < L::kUnroll; ++u) {
    float decoded[kValues];
    L::Decode(raw[u], decoded);
    if (!valid[u]) continue;
    bool all_finite = false;
    if constexpr (kType != ElementType::kF32) {
      const UnitStatistics16<kValues> unit(decoded);
      all_finite = unit.AllFinite();
      if (all_finite) {
        mine.AddUnit(unit.lo, unit.hi, unit.sum, unit.squares, kValues);
      }
    }
    if (!all_finite) {
#pragma unroll
      for (int v = 0; v < kValues; ++v) {
        const float x = CanonicalZero(decoded[v]);
        if (mine.AddExtrema(x)) mine.AddSums(x);
      }
    }
    if constexpr (kHistograms) {
#pragma unroll
      for (int v = 0; v < kValues; ++v) {
        const float x = CanonicalZero(decoded[v]);
        if (!all_finite && IsNonFinite(x)) continue;
        atomicAdd(&histogram[HistogramBin(x, log2_bins_per_octave)], 1u);
        const uint32_t magnitude_bits = FloatBits(x) & 0x7fffffffu;
        magnitudes[u * kValues + v] = BitsToFloat(magnitude_bits);
        if (magnitude_bits >= floor_bits) candidates |= 1u << (u * kValues + v);
      }
    }
  }
}

// Phase 4: the warp's last compaction and its <= kTailCapacity candidates
// into TailScratch (slot: the warp's index over the grid). All 32 lanes.
__device__ __forceinline__ void WriteWarpCandidates(
    const TailScratch& scratch,
    float* tail_buffer,  // [kWarpTailBuffer], this warp's, shared
    uint32_t tail_count, uint32_t floor_bits, uint32_t lane, uint32_t warp) {
  CompactWarpTailIfOver(tail_buffer, tail_count, floor_bits, lane);
  const size_t global_warp =
      (static_cast<size_t>(blockIdx.y) * gridDim.x + blockIdx.x) *
          kAccumulateWarps +
      warp;
  float* out = scratch.candidates + global_warp * kTailCapacity;
  __syncwarp();
  for (uint32_t i = lane; i < tail_count; i += 32) out[i] = tail_buffer[i];
  if (lane == 0) scratch.candidate_counts[global_warp] = tail_count;
}

template <ElementType kType, bool kVectorized, bool kHistograms>
__global__ void __launch_bounds__(kAccumulateThreads, 4)
    AccumulateKernel(DeviceState state, TailScratch scratch,
                     ChunkLaunch chunk) {
  using L = Loader<kType, kVectorized, kHistograms>;
  constexpr int kValues = L::kValues;
  constexpr int kUnroll = L::kUnroll;
  constexpr int kPerRound = kValues * kUnroll;
  static_assert(!kHistograms || kPerRound <= 16,
                "candidate mask and warp tail buffer hold 16 values per lane");
  static_assert(kTailCapacity + 32 * 16 <= kWarpTailBuffer);
  static_assert(
      !kHistograms || kWarpTailBuffer - 32 * kPerRound >= kTailCapacity,
      "a round's candidates fit behind a compacted tail");

  using BlockReduceStatistics =
      cub::BlockReduce<BlockStatistics, kAccumulateThreads>;
  // Dynamic shared memory: the histogram ([bins] 32-bit counters), then one
  // tail buffer ([kWarpTailBuffer] floats) per warp.
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  __shared__ typename BlockReduceStatistics::TempStorage reduce_storage;
  __shared__ typename cub::WarpScan<uint32_t>::TempStorage
      scan_storage[kAccumulateWarps];

  const uint32_t lane = threadIdx.x & 31u;
  const uint32_t warp = threadIdx.x >> 5;
  const uint32_t head = chunk.head_base + blockIdx.y;

  // 0. Clear the shared histogram; take the head's tail floor.
  uint32_t* histogram = reinterpret_cast<uint32_t*>(shared_bytes);
  float* tail_buffer = reinterpret_cast<float*>(
                           shared_bytes + SharedHistogramBytes(state.bins)) +
                       static_cast<size_t>(warp) * kWarpTailBuffer;
  uint32_t floor_bits = 0;  // an |x| is a tail candidate when its bits >= this
  uint32_t tail_count = 0;  // warp-uniform
  if constexpr (kHistograms) {
    for (uint32_t b = threadIdx.x; b < state.bins; b += blockDim.x) {
      histogram[b] = 0;
    }
    floor_bits = state.tail_floor_bits[head];
    __syncthreads();
  }

  HeadWalk walk(chunk, blockIdx.y, kValues);
  ThreadStatistics mine = ThreadStatistics::Empty();
  // Rounds are uniform over the grid (the loop bound does not depend on the
  // thread), so warp-collective tail code below sees all 32 lanes.
  const uint64_t round_step = walk.stride * kUnroll;
  for (uint64_t round = 0; round < walk.total; round += round_step) {
    // 1. Load; 2. take into the statistics; 3. append the tail candidates.
    typename L::Raw raw[kUnroll];
    bool valid[kUnroll];
    LoadRound<L>(chunk, walk, raw, valid);

    [[maybe_unused]] float magnitudes[kHistograms ? kPerRound : 1];
    [[maybe_unused]] uint32_t candidates = 0;  // bit v: magnitudes[v] enters
    TakeRound<L, kType, kHistograms>(raw, valid, state.log2_bins_per_octave,
                                     floor_bits, mine, histogram, magnitudes,
                                     candidates);

    if constexpr (kHistograms) {
      if (__any_sync(kFullWarpMask, candidates != 0)) {
        AppendWarpCandidates(magnitudes, candidates, tail_buffer, tail_count,
                             floor_bits, lane, scan_storage[warp]);
      }
    }
  }

  // 4. The warps' candidates to TailScratch.
  if constexpr (kHistograms) {
    WriteWarpCandidates(scratch, tail_buffer, tail_count, floor_bits, lane,
                        warp);
  }

  // 5. Reduce the block (every thread gets here: no early exit above) and
  // flush it into the head's global state.
  const BlockStatistics block =
      BlockReduceStatistics(reduce_storage)
          .Reduce(mine.ToBlock(), MergeBlockStatistics());  // thread 0's
  __syncthreads();  // every thread's histogram atomics are done
  FlushBlock(state, chunk, head, block, kHistograms ? histogram : nullptr);
}

}  // namespace kvcal::cuda

#endif  // KVCAL_KERNELS_CUDA_ACCUMULATE_KERNEL_CUH_
