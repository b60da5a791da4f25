// What AccumulateKernel's threads and blocks see of a head: per-thread
// statistics in registers, the 16-bit unit shortcut, the block reduction's
// operand, and the flush of a block's result into the head's global state.
#ifndef KVCAL_KERNELS_CUDA_DEVICE_BLOCK_STATISTICS_CUH_
#define KVCAL_KERNELS_CUDA_DEVICE_BLOCK_STATISTICS_CUH_

#include "kernels/cuda/device/element_math.cuh"

namespace kvcal::cuda {

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

}  // namespace kvcal::cuda

#endif  // KVCAL_KERNELS_CUDA_DEVICE_BLOCK_STATISTICS_CUH_
