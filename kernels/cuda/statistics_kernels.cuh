// Device code of the CUDA statistics backend. See statistics_kernels.h for
// the state layout and the launch interface; statistics_kernels.cu
// instantiates and launches these. CUB (CCCL, shipped with the toolkit)
// provides the block reduction of the per-thread statistics
// (cub::BlockReduce over BlockStatistics) and the warp prefix sum that
// places tail candidates (cub::WarpScan); the top-256 selection is still
// hand-written (bitonic sort per warp, radix select per head).
//
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
// the 256th; once more at the end. Then: cub::BlockReduce, one
// set of global atomics per block, the shared histogram added to the global
// one, and each warp's <= kTailCapacity candidates written to TailScratch.
//
// TailSelectKernel: one block per head of the chunk. Merges the head's tail
// with its warps' candidates and keeps the kTailCapacity largest exactly
// (radix select on the float bits when there are more), sorted descending.
//
// Why exact: top-k of a union equals top-k of the union of each part's top-k
// (as multisets), and a value equal to a full set's smallest member does not
// change that set's multiset, so dropping it is harmless.
#ifndef KVCAL_KERNELS_CUDA_STATISTICS_KERNELS_CUH_
#define KVCAL_KERNELS_CUDA_STATISTICS_KERNELS_CUH_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cub/block/block_reduce.cuh>
#include <cub/warp/warp_scan.cuh>

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

// What one thread, then the whole block, saw of its head: the operand of the
// block reduction (cub::BlockReduce). min/max never see a NaN (non-finite
// values are only counted) and ±0 arrive canonical (CanonicalZero), so the
// combination order does not change them; counts are exact in any order;
// the double sums round differently per order, as the CPU backend's thread
// split does (the tests compare them with a tolerance).
struct BlockStatistics {
  float min;
  float max;
  unsigned long long finite;
  unsigned long long nan;
  unsigned long long inf;
  double sum;
  double sum_squares;
};

struct MergeBlockStatistics {
  __device__ __forceinline__ BlockStatistics
  operator()(const BlockStatistics& a, const BlockStatistics& b) const {
    return BlockStatistics{fminf(a.min, b.min),
                           fmaxf(a.max, b.max),
                           a.finite + b.finite,
                           a.nan + b.nan,
                           a.inf + b.inf,
                           a.sum + b.sum,
                           a.sum_squares + b.sum_squares};
  }
};

template <ElementType kType>
__device__ __forceinline__ float Decode16(uint32_t bits) {
  if constexpr (kType == ElementType::kF16) {
    return DecodeF16(static_cast<uint16_t>(bits));
  } else {
    return DecodeBf16(static_cast<uint16_t>(bits));
  }
}

// How a kernel variant loads its data: Raw is one load unit of kValues
// values; a thread issues kUnroll loads per round before using any.
// kUnroll * kValues is 16 values with histograms (so that a warp adds at most
// 512 tail candidates per round) and 32 without.
template <ElementType kType, bool kVectorized, bool kHistograms>
struct Loader;

template <bool kHistograms>
struct Loader<ElementType::kF32, true, kHistograms> {
  using Raw = float4;
  static constexpr int kValues = 4;
  static constexpr int kUnroll = kHistograms ? 4 : 8;
  __device__ __forceinline__ static Raw Load(const void* data, uint64_t unit) {
    return __ldcs(static_cast<const float4*>(data) + unit);
  }
  __device__ __forceinline__ static void Decode(const Raw& raw, float* out) {
    out[0] = raw.x;
    out[1] = raw.y;
    out[2] = raw.z;
    out[3] = raw.w;
  }
};

template <bool kHistograms>
struct Loader<ElementType::kF32, false, kHistograms> {
  using Raw = float;
  static constexpr int kValues = 1;
  static constexpr int kUnroll = 8;
  __device__ __forceinline__ static Raw Load(const void* data, uint64_t unit) {
    return __ldcs(static_cast<const float*>(data) + unit);
  }
  __device__ __forceinline__ static void Decode(const Raw& raw, float* out) {
    out[0] = raw;
  }
};

template <ElementType kType, bool kHistograms>
struct Loader16Vector {
  using Raw = uint4;
  static constexpr int kValues = 8;
  static constexpr int kUnroll = kHistograms ? 2 : 4;
  __device__ __forceinline__ static Raw Load(const void* data, uint64_t unit) {
    return __ldcs(static_cast<const uint4*>(data) + unit);
  }
  // Little-endian: element 2w is the low half of word w.
  __device__ __forceinline__ static void Decode(const Raw& raw, float* out) {
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      out[2 * w] = Decode16<kType>(words[w] & 0xffffu);
      out[2 * w + 1] = Decode16<kType>(words[w] >> 16);
    }
  }
};

template <ElementType kType>
struct Loader16Scalar {
  using Raw = unsigned short;
  static constexpr int kValues = 1;
  static constexpr int kUnroll = 8;
  __device__ __forceinline__ static Raw Load(const void* data, uint64_t unit) {
    return __ldcs(static_cast<const unsigned short*>(data) + unit);
  }
  __device__ __forceinline__ static void Decode(const Raw& raw, float* out) {
    out[0] = Decode16<kType>(raw);
  }
};

template <bool kHistograms>
struct Loader<ElementType::kF16, true, kHistograms>
    : Loader16Vector<ElementType::kF16, kHistograms> {};
template <bool kHistograms>
struct Loader<ElementType::kBf16, true, kHistograms>
    : Loader16Vector<ElementType::kBf16, kHistograms> {};
template <bool kHistograms>
struct Loader<ElementType::kF16, false, kHistograms>
    : Loader16Scalar<ElementType::kF16> {};
template <bool kHistograms>
struct Loader<ElementType::kBf16, false, kHistograms>
    : Loader16Scalar<ElementType::kBf16> {};

// Sorts buf[0, n) descending; n a power of two; called by all 32 lanes of a
// warp. In each step the pairs (i, i ^ j) are disjoint and each is handled by
// the lane owning the lower index.
__device__ __forceinline__ void WarpSortDescending(float* buf, uint32_t n,
                                                   uint32_t lane) {
  for (uint32_t k = 2; k <= n; k <<= 1) {
    for (uint32_t j = k >> 1; j > 0; j >>= 1) {
      for (uint32_t i = lane; i < n; i += 32) {
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
      __syncwarp();
    }
  }
}

// Keeps the kTailCapacity largest of buf[0, count) in buf[0, kTailCapacity),
// sorted descending. kTailCapacity < count <= kWarpTailBuffer.
__device__ __forceinline__ void CompactWarpTail(float* buf, uint32_t count,
                                                uint32_t lane) {
  const uint32_t n =
      count <= 512u ? 512u : static_cast<uint32_t>(kWarpTailBuffer);
  for (uint32_t i = count + lane; i < n; i += 32)
    buf[i] = -1.0f;  // below any |x|
  __syncwarp();
  WarpSortDescending(buf, n, lane);
}

// What one thread saw of its head, in registers: the operand of the block
// reduction once the walk is done.
struct ThreadStatistics {
  float min_value;
  float max_value;
  uint32_t finite;
  uint32_t nan;
  uint32_t inf;
  double sum;
  double sum_squares;

  __device__ __forceinline__ static ThreadStatistics Empty() {
    return ThreadStatistics{BitsToFloat(0x7f800000u),  // +Inf
                            BitsToFloat(0xff800000u),  // -Inf
                            0u,
                            0u,
                            0u,
                            0.0,
                            0.0};
  }
  // Counts x and takes it into min/max; false when it is not finite (then
  // it is only counted). The sums are the caller's (AddSums).
  __device__ __forceinline__ bool AddExtrema(float x) {
    if (CountIfNonFinite(x, nan, inf)) return false;
    ++finite;
    min_value = fminf(min_value, x);
    max_value = fmaxf(max_value, x);
    return true;
  }
  __device__ __forceinline__ void AddSums(float x) {
    sum += x;
    sum_squares += static_cast<double>(x) * x;
  }
  // Adds a load unit's statistics (UnitStatistics16::AllFinite): n finite
  // values. min/max are made canonical here, which gives what canonical
  // values would (CanonicalZero only maps -0 to +0).
  __device__ __forceinline__ void AddUnit(float lo, float hi, float unit_sum,
                                          float unit_squares, uint32_t n) {
    finite += n;
    min_value = fminf(min_value, CanonicalZero(lo));
    max_value = fmaxf(max_value, CanonicalZero(hi));
    sum += unit_sum;
    sum_squares += unit_squares;
  }
  __device__ __forceinline__ BlockStatistics ToBlock() const {
    return BlockStatistics{min_value, max_value, finite,     nan,
                           inf,       sum,       sum_squares};
  }
};

// Min, max and moments of one load unit of 16-bit values, computed as if
// every value were finite: about five instructions a value, where checking
// each value first cost eighteen and held bf16 at 0.62 of HBM bandwidth on
// an H200 (0.90 with this). The sums are float: 16-bit values and their
// squares are exact in float, and eight of them summed stay within
// 8 * 2^-24 of sum |x|, the CPU backend's bound for 16-bit inputs. AllFinite
// says whether the unit may be taken as it is; otherwise (a NaN or Inf, a
// float overflow, or squares all below 2^-100, where float loses the small
// ones) the caller goes value by value. (f32 goes value by value always: in
// double, the same scheme spilled registers and measured slower.)
template <int kValues>
struct UnitStatistics16 {
  float lo;
  float hi;
  float sum;
  float squares;

  __device__ __forceinline__ explicit UnitStatistics16(
      const float (&x)[kValues]) {
    lo = x[0];
    hi = x[0];
    sum = x[0];
    squares = x[0] * x[0];
#pragma unroll
    for (int v = 1; v < kValues; ++v) {
      lo = fminf(lo, x[v]);
      hi = fmaxf(hi, x[v]);
      sum += x[v];
      squares = fmaf(x[v], x[v], squares);
    }
  }
  // An Inf or NaN makes `squares` Inf or NaN, which fails every comparison
  // below. A unit of zeros passes; one whose squares underflowed to 0 does
  // not (its lo or hi is not 0).
  __device__ __forceinline__ bool AllFinite() const {
    if (squares == 0.0f) return lo == 0.0f && hi == 0.0f;
    return squares <= 3.402823466e38f && squares >= 0x1p-100f;
  }
};

// The load units of head h that one thread visits: flat indices j = t,
// t + stride, ... below total over the head's outer x units_per_row units.
// Unit u of row o sits at (o * heads + h) * units_per_row + u; the walk tracks
// (row, unit-in-row) and the absolute unit index incrementally.
struct HeadWalk {
  uint64_t total;
  uint64_t units_per_row;
  uint64_t stride;
  uint64_t stride_units;  // stride % units_per_row
  uint64_t step;          // absolute advance of one stride, before the carry
  uint64_t carry_step;    // extra advance when the unit-in-row wraps
  uint64_t j;
  uint64_t in_row;
  uint64_t unit;

  __device__ __forceinline__ HeadWalk(const ChunkLaunch& chunk, uint32_t h,
                                      uint32_t values_per_unit) {
    units_per_row = chunk.inner / values_per_unit;
    total = chunk.outer * units_per_row;
    const uint64_t row_step =
        static_cast<uint64_t>(chunk.heads) * units_per_row;
    stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
    const uint64_t stride_rows = stride / units_per_row;
    stride_units = stride - stride_rows * units_per_row;
    step = stride_rows * row_step + stride_units;
    carry_step = row_step - units_per_row;
    j = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    in_row = j % units_per_row;
    unit = (j / units_per_row) * row_step +
           static_cast<uint64_t>(h) * units_per_row + in_row;
  }
  __device__ __forceinline__ bool Valid() const { return j < total; }
  __device__ __forceinline__ void Advance() {
    j += stride;
    in_row += stride_units;
    unit += step;
    if (in_row >= units_per_row) {  // stride_units < units_per_row: one carry
      in_row -= units_per_row;
      unit += carry_step;
    }
  }
};

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

// Adds the block's result to the head's global state: the shared histogram
// (every thread), then, from thread 0, counts, sums and extrema (`block` is
// valid in thread 0 only). After a __syncthreads.
__device__ __forceinline__ void FlushBlock(const DeviceState& state,
                                           const ChunkLaunch& chunk,
                                           uint32_t head,
                                           const BlockStatistics& block,
                                           const uint32_t* histogram) {
  if (histogram != nullptr) {
    unsigned long long* global_histogram =
        state.histogram + static_cast<size_t>(head) * state.bins;
    for (uint32_t b = threadIdx.x; b < state.bins; b += blockDim.x) {
      const uint32_t count = histogram[b];
      if (count != 0) {
        atomicAdd(global_histogram + b, static_cast<unsigned long long>(count));
      }
    }
  }
  if (threadIdx.x != 0) return;
  const size_t counts = 3 * static_cast<size_t>(head);
  const size_t sums = 2 * static_cast<size_t>(head);
  if (block.finite != 0) {
    atomicAdd(&state.counts[counts], block.finite);
    atomicAdd(&state.sums[sums], block.sum);
    atomicAdd(&state.sums[sums + 1], block.sum_squares);
    const uint32_t min_key = OrderedKeyFromBits(FloatBits(block.min));
    const uint32_t max_key = OrderedKeyFromBits(FloatBits(block.max));
    atomicMax(&state.min_key_inverted[head], ~min_key);
    atomicMax(&state.max_key[head], max_key);
    const size_t batch_index =
        static_cast<size_t>(chunk.batch_slot) * state.heads_total + head;
    atomicMax(&state.batch_min_key_inverted[batch_index], ~min_key);
    atomicMax(&state.batch_max_key[batch_index], max_key);
  }
  if (block.nan != 0) atomicAdd(&state.counts[counts + 1], block.nan);
  if (block.inf != 0) atomicAdd(&state.counts[counts + 2], block.inf);
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
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  __shared__ typename BlockReduceStatistics::TempStorage reduce_storage;
  __shared__ typename cub::WarpScan<uint32_t>::TempStorage
      scan_storage[kAccumulateWarps];

  const uint32_t lane = threadIdx.x & 31u;
  const uint32_t warp = threadIdx.x >> 5;
  const uint32_t head = chunk.head_base + blockIdx.y;

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
    typename L::Raw raw[kUnroll];
    bool valid[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      valid[u] = walk.Valid();
      raw[u] = typename L::Raw{};
      if (valid[u]) raw[u] = L::Load(chunk.data, walk.unit);
      walk.Advance();
    }

    [[maybe_unused]] float magnitudes[kHistograms ? kPerRound : 1];
    [[maybe_unused]] uint32_t candidates = 0;  // bit v: magnitudes[v] enters
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
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
          atomicAdd(&histogram[HistogramBin(x, state.log2_bins_per_octave)],
                    1u);
          const uint32_t magnitude_bits = FloatBits(x) & 0x7fffffffu;
          magnitudes[u * kValues + v] = BitsToFloat(magnitude_bits);
          if (magnitude_bits >= floor_bits)
            candidates |= 1u << (u * kValues + v);
        }
      }
    }

    if constexpr (kHistograms) {
      if (__any_sync(kFullWarpMask, candidates != 0)) {
        AppendWarpCandidates(magnitudes, candidates, tail_buffer, tail_count,
                             floor_bits, lane, scan_storage[warp]);
      }
    }
  }

  if constexpr (kHistograms) {
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

  // Every thread of the block gets here (no early exit above).
  const BlockStatistics block =
      BlockReduceStatistics(reduce_storage)
          .Reduce(mine.ToBlock(), MergeBlockStatistics());  // thread 0's
  __syncthreads();  // every thread's histogram atomics are done
  FlushBlock(state, chunk, head, block, kHistograms ? histogram : nullptr);
}

// One block of kTailSelectThreads per head of the chunk (blockIdx.x = chunk
// head); warps_per_head = blocks_per_head * kAccumulateWarps of the
// AccumulateKernel launch it follows.
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
  const uint32_t fresh = fresh_total;
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

  uint32_t kept_count = 0;
  if (n <= kTailCapacity) {
    for_each_input([&](float v) { kept[atomicAdd(&kept_cursor, 1u)] = v; });
    kept_count = n;
  } else {
    // Radix select of the kTailCapacity-th largest: inputs are >= 0, so their
    // bits order like the values. Eight bits per pass, most significant
    // first; `prefix` holds the digits chosen so far and `need` how many
    // values with that prefix are still to be kept.
    uint32_t prefix = 0;
    uint32_t prefix_mask = 0;
    uint32_t need = kTailCapacity;
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
    // `prefix` is now the kTailCapacity-th largest value; kTailCapacity -
    // need values are strictly greater, and `need` copies of it complete the
    // set.
    const uint32_t greater = kTailCapacity - need;
    for_each_input([&](float v) {
      if (FloatBits(v) > prefix) kept[atomicAdd(&kept_cursor, 1u)] = v;
    });
    for (uint32_t i = greater + tid; i < kTailCapacity; i += blockDim.x) {
      kept[i] = BitsToFloat(prefix);
    }
    kept_count = kTailCapacity;
  }
  __syncthreads();
  for (uint32_t i = kept_count + tid; i < kTailCapacity; i += blockDim.x) {
    kept[i] = -1.0f;  // padding sorts last
  }
  __syncthreads();

  for (uint32_t k = 2; k <= kTailCapacity; k <<= 1) {
    for (uint32_t j = k >> 1; j > 0; j >>= 1) {
      const uint32_t partner = tid ^ j;
      if (partner > tid) {
        const float a = kept[tid];
        const float b = kept[partner];
        const bool descending = (tid & k) == 0;
        if (descending ? (a < b) : (a > b)) {
          kept[tid] = b;
          kept[partner] = a;
        }
      }
      __syncthreads();
    }
  }

  for (uint32_t i = tid; i < kept_count; i += blockDim.x) tail[i] = kept[i];
  if (tid == 0) {
    state.tail_size[head] = kept_count;
    state.tail_floor_bits[head] = kept_count == kTailCapacity
                                      ? FloatBits(kept[kTailCapacity - 1]) + 1u
                                      : 0u;
  }
}

}  // namespace kvcal::cuda

#endif  // KVCAL_KERNELS_CUDA_STATISTICS_KERNELS_CUH_
