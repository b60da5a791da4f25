// AVX2 + F16C + FMA inner loops. This file alone is compiled with
// -mavx2 -mf16c -mfma; Avx2Loops checks the CPU at run time before handing
// these out, so the binary still runs on CPUs without AVX2.
//
// The walk follows memory order (run_kernels.h): each head's vector state
// (min, max and double sums, two interleaved sets) lives in a small per-head
// record that is loaded into registers for one run of that head and stored
// back after it, so a TOKENS_HEADS_DIM chunk is read as one sequential
// stream instead of one strided stream per head.
//
// Non-finite values are rare, so the vector loop does not look for them:
// a run is processed in blocks, and a NaN or Inf in a block shows up as a
// non-finite double sum at the block's end (finite floats cannot make a
// double sum overflow). Such a block is then done again from the head's
// state before it, lane by lane masked; its histogram increments for the
// non-finite lanes (which land in the overflow bin) are taken back, and the
// tail never sees them (its rare insertion path checks finiteness).
//
// Why this file is over 600 lines: every AVX2 loop of the engine is here
// because this is the only file compiled with -mavx2 -mf16c -mfma; a loop
// moved elsewhere would be compiled without them.

#include "kernels/cpu/run_kernels.h"

#if defined(__x86_64__) && defined(__AVX2__) && defined(__F16C__) && \
    defined(__FMA__)
#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <vector>

#include "kernels/cpu/run_kernels_internal.h"
#include "kernels/element_math.h"

namespace kvcal::cpu {
namespace {

// Pairs of 8-value vectors per block: the unit that is redone when it holds
// a non-finite value.
constexpr size_t kBlockPairs = 128;
// The loops prefetch this far ahead of their loads. The hardware prefetcher
// alone left the bf16 loop stalled on its loads at half the read pass's
// bandwidth (kvcal_bench_cpu); 2 KiB ahead doubled it. Prefetches past the
// end of a buffer are harmless (they never fault).
constexpr size_t kPrefetchBytes = 2048;
// Sub-histogram counters are uint32 and get at most one count per vector, so
// a head is flushed before it sees 2^31 vectors.
constexpr uint64_t kFlushEveryVectors = uint64_t{1} << 31;
// The sub-histograms of the heads walked together stay within this many
// bytes (more heads are walked as several groups, one after the other).
constexpr size_t kSubHistogramBudget = size_t{1} << 20;

// Loads 16 values as two vectors of 8 floats. The order of lanes does not
// matter to any statistic, so bf16 uses two in-lane unpacks of one 32-byte
// load.
template <DType kDType>
__attribute__((always_inline)) inline void Load16(const unsigned char* p,
                                                  __m256& a, __m256& b) {
  if constexpr (kDType == DType::kF32) {
    a = _mm256_loadu_ps(reinterpret_cast<const float*>(p));
    b = _mm256_loadu_ps(reinterpret_cast<const float*>(p + 32));
  } else if constexpr (kDType == DType::kF16) {
    a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    b = _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  } else {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i z = _mm256_setzero_si256();
    a = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v));
    b = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v));
  }
}

// Loads 8 values as one vector.
template <DType kDType>
__attribute__((always_inline)) inline __m256 Load8(const unsigned char* p) {
  if constexpr (kDType == DType::kF32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  } else if constexpr (kDType == DType::kF16) {
    return _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    const __m256i wide = _mm256_cvtepu16_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
}

// Histogram bins of 8 |x| (element_math.h's HistogramBin, lane-wise): the
// bits shifted right by 23 - log2(B) are exponent * B + top mantissa bits,
// so the bin is that minus a constant, clamped to [underflow, overflow]
// (non-finite lanes get the overflow bin), and zero where |x| is +0 (the
// only case where |x|'s bits are below the clamped bin). Checked against
// HistogramBin for every 31-bit |x| at every resolution.
__attribute__((always_inline)) inline __m256i Bins8(__m256i abs_bits,
                                                    __m128i mantissa_shift,
                                                    __m256i bin_offset,
                                                    __m256i overflow_bin) {
  __m256i bin =
      _mm256_sub_epi32(_mm256_srl_epi32(abs_bits, mantissa_shift), bin_offset);
  bin = _mm256_max_epi32(bin, _mm256_set1_epi32(kUnderflowBin));
  bin = _mm256_min_epi32(bin, overflow_bin);
  return _mm256_min_epu32(bin, abs_bits);
}

// One set of vector accumulators.
struct Lanes {
  __m256 vmin;
  __m256 vmax;
  __m256d sum0, sum1, sq0, sq1;
};

// Adds the 8 values x, widened to double, to the sums and sums of squares
// of l.
__attribute__((always_inline)) inline void AddSums(__m256 x, Lanes& l) {
  const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
  const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
  l.sum0 = _mm256_add_pd(l.sum0, lo);
  l.sum1 = _mm256_add_pd(l.sum1, hi);
  l.sq0 = _mm256_fmadd_pd(lo, lo, l.sq0);
  l.sq1 = _mm256_fmadd_pd(hi, hi, l.sq1);
}

Lanes EmptyLanes() {
  return Lanes{_mm256_set1_ps(std::numeric_limits<float>::infinity()),
               _mm256_set1_ps(-std::numeric_limits<float>::infinity()),
               _mm256_setzero_pd(),
               _mm256_setzero_pd(),
               _mm256_setzero_pd(),
               _mm256_setzero_pd()};
}

// A head's state while the rows are walked: two sets of accumulators (so
// that the latency of the double additions does not bound the loop) and the
// counts of the vector code.
struct HeadState {
  Lanes even;
  Lanes odd;
  uint64_t vector_values = 0;  // values seen by the vector code
  uint64_t nonfinite = 0;      // of those, NaN or Inf
  uint64_t nan = 0;
  uint64_t since_flush = 0;  // vectors since the sub-histograms were flushed
};

// The histogram is counted in per-head uint32 sub-histograms with the eight
// lanes of a vector interleaved (counter bin * 8 + lane): repeated bins (the
// common case: activations crowd into a few octaves) then form eight
// independent store-to-load chains instead of one. The sub-histograms are
// per thread, kept all zero between calls, and flushed into the uint64
// histogram at the end of each call and before a counter could reach 2^32.
// Counts are exact, so results are bitwise those of the scalar path.
uint32_t* SubHistograms(size_t counters) {
  thread_local std::vector<uint32_t> scratch;
  if (scratch.size() < counters) scratch.resize(counters, 0);
  return scratch.data();
}

HeadState* HeadStates(size_t heads) {
  thread_local std::vector<HeadState> scratch;
  if (scratch.size() < heads) scratch.resize(heads);
  for (size_t h = 0; h < heads; ++h) {
    scratch[h] = HeadState{EmptyLanes(), EmptyLanes()};
  }
  return scratch.data();
}

// The eight lanes of v folded with `op`.
template <typename Op>
float Horizontal(__m256 v, Op op) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  float m = lanes[0];
  for (float x : lanes) m = op(m, x);
  return m;
}
float HorizontalMin(__m256 v) {
  return Horizontal(v, [](float a, float b) { return std::min(a, b); });
}
float HorizontalMax(__m256 v) {
  return Horizontal(v, [](float a, float b) { return std::max(a, b); });
}
double HorizontalSum(__m256d a, __m256d b) {
  alignas(32) double d[4];
  _mm256_store_pd(d, _mm256_add_pd(a, b));
  return (d[0] + d[1]) + (d[2] + d[3]);
}

// Adds the counters [0, last_bin] of one head's sub-histograms to
// `histogram` and zeroes them. Every counted bin is at most the bin of the
// head's largest finite |x| (non-finite lanes were taken back).
void FlushSubHistograms(uint32_t* sub, uint32_t last_bin, uint64_t* histogram) {
  for (uint32_t bin = 0; bin <= last_bin; ++bin) {
    uint32_t* counters = sub + static_cast<size_t>(bin) * 8;
    const __m256i c =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(counters));
    if (_mm256_testz_si256(c, c)) continue;
    const __m256i wide =
        _mm256_add_epi64(_mm256_cvtepu32_epi64(_mm256_castsi256_si128(c)),
                         _mm256_cvtepu32_epi64(_mm256_extracti128_si256(c, 1)));
    alignas(32) uint64_t parts[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(parts), wide);
    histogram[bin] += (parts[0] + parts[1]) + (parts[2] + parts[3]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(counters),
                        _mm256_setzero_si256());
  }
}

// True when one of the sums is NaN or +-Inf.
__attribute__((always_inline)) inline bool SumsNonFinite(const Lanes& a,
                                                         const Lanes& b) {
  const __m256d t = _mm256_add_pd(_mm256_add_pd(a.sum0, a.sum1),
                                  _mm256_add_pd(b.sum0, b.sum1));
  const __m256d d = _mm256_sub_pd(t, t);  // 0 when finite, else NaN
  return _mm256_movemask_pd(_mm256_cmp_pd(d, d, _CMP_UNORD_Q)) != 0;
}

// The careful path, for a block that holds a non-finite value: adds the
// finite values of `pairs` pairs of vectors at p (then one more vector when
// `single`) to the head's state, counts the others, and takes back the
// overflow counts that the fast path gave them (sub: the head's
// sub-histograms, or null). Kept out of line so that the fast path keeps its
// registers.
template <DType kDType, bool kHistogram>
__attribute__((noinline)) void RedoBlockCarefully(const unsigned char* p,
                                                  size_t pairs, bool single,
                                                  HeadState& s, uint32_t* sub,
                                                  uint32_t overflow) {
  constexpr size_t kSize = kDType == DType::kF32 ? 4 : 2;
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256i max_finite = _mm256_set1_epi32(0x7f7fffff);
  const __m256i inf_bits = _mm256_set1_epi32(0x7f800000);
  const __m256 pos_inf = _mm256_castsi256_ps(inf_bits);
  const __m256 neg_inf =
      _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256 zero = _mm256_setzero_ps();
  auto add = [&](__m256 x, Lanes& l) {
    const __m256i abs_bits = _mm256_and_si256(_mm256_castps_si256(x), abs_mask);
    const __m256i bad = _mm256_cmpgt_epi32(abs_bits, max_finite);
    const int bad_mask = _mm256_movemask_ps(_mm256_castsi256_ps(bad));
    const __m256 bad_ps = _mm256_castsi256_ps(bad);
    if (bad_mask != 0) {
      const __m256i is_nan = _mm256_cmpgt_epi32(abs_bits, inf_bits);
      s.nonfinite += static_cast<uint64_t>(__builtin_popcount(bad_mask));
      s.nan += static_cast<uint64_t>(
          __builtin_popcount(_mm256_movemask_ps(_mm256_castsi256_ps(is_nan))));
      if (sub != nullptr) {
        for (int lane = 0; lane < 8; ++lane) {
          if ((bad_mask >> lane) & 1) {
            --sub[static_cast<size_t>(overflow) * 8 +
                  static_cast<size_t>(lane)];
          }
        }
      }
    }
    l.vmin = _mm256_min_ps(l.vmin, _mm256_blendv_ps(x, pos_inf, bad_ps));
    l.vmax = _mm256_max_ps(l.vmax, _mm256_blendv_ps(x, neg_inf, bad_ps));
    AddSums(_mm256_blendv_ps(x, zero, bad_ps), l);
  };
  for (size_t k = 0; k < pairs; ++k, p += 16 * kSize) {
    __m256 a, b;
    Load16<kDType>(p, a, b);
    add(a, s.even);
    // The fast path's lanes: with histograms b goes to the even set too.
    add(b, kHistogram ? s.even : s.odd);
  }
  if (single) add(Load8<kDType>(p), s.even);
}

// The vector constants of the fast path (for `log2_bins` bins per octave).
struct FastConstants {
  explicit FastConstants(uint32_t log2_bins)
      : bins(internal::BinConstantsFor(log2_bins)),
        abs_mask(_mm256_set1_epi32(0x7fffffff)),
        overflow_bin(_mm256_set1_epi32(bins.overflow)),
        bin_offset(_mm256_set1_epi32(bins.offset)),
        lane_index(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
        mantissa_shift(_mm_cvtsi32_si128(bins.shift)) {}
  internal::BinConstants bins;
  __m256i abs_mask;
  __m256i overflow_bin;
  __m256i bin_offset;
  __m256i lane_index;
  __m128i mantissa_shift;
};

// Adds kDelta to the 8 counters whose indices are the lanes of `slot`
// (internal::AddToSlots4 per half).
template <int kDelta>
__attribute__((always_inline)) inline void AddToSlots(__m256i slot,
                                                      uint32_t* sub) {
  internal::AddToSlots4<kDelta>(_mm256_castsi256_si128(slot), sub);
  internal::AddToSlots4<kDelta>(_mm256_extracti128_si256(slot, 1), sub);
}

// Counts the 8 lanes of `abs_bits` (|x| as bits; non-finite ones into the
// overflow bin) in the lane-private counters `sub` (bin * 8 + lane).
__attribute__((always_inline)) inline void CountLanes(__m256i abs_bits,
                                                      uint32_t* sub,
                                                      const FastConstants& c) {
  const __m256i bin =
      Bins8(abs_bits, c.mantissa_shift, c.bin_offset, c.overflow_bin);
  AddToSlots<1>(_mm256_or_si256(_mm256_slli_epi32(bin, 3), c.lane_index), sub);
}

// Offers the finite lanes of |x| above `threshold` to the tail, and moves
// `threshold` to the tail's new one.
__attribute__((always_inline)) inline void OfferToTail(__m256 abs_x,
                                                       TailKeeper* tail,
                                                       __m256& threshold) {
  // Ordered compare: NaN lanes are false; Inf lanes are dropped below.
  const int enter =
      _mm256_movemask_ps(_mm256_cmp_ps(abs_x, threshold, _CMP_GT_OQ));
  if (enter == 0) [[likely]] {
    return;
  }
  alignas(32) float values[8];
  _mm256_store_ps(values, abs_x);
  for (int lane = 0; lane < 8; ++lane) {
    const float a = values[lane];
    if (((enter >> lane) & 1) && a <= std::numeric_limits<float>::max() &&
        a > tail->threshold()) {
      tail->Offer(a);
    }
  }
  threshold = _mm256_set1_ps(tail->threshold());
}

// The fast path: adds the 8 values x to l, counts every lane (non-finite
// ones into the overflow bin) and offers finite |x| above the threshold to
// the tail.
template <bool kHistogram, bool kTail>
__attribute__((always_inline)) inline void AddFast(__m256 x, Lanes& l,
                                                   uint32_t* sub,
                                                   TailKeeper* tail,
                                                   __m256& threshold,
                                                   const FastConstants& c) {
  l.vmin = _mm256_min_ps(l.vmin, x);
  l.vmax = _mm256_max_ps(l.vmax, x);
  AddSums(x, l);
  if constexpr (kHistogram || kTail) {
    const __m256i abs_bits =
        _mm256_and_si256(_mm256_castps_si256(x), c.abs_mask);
    if constexpr (kHistogram) CountLanes(abs_bits, sub, c);
    if constexpr (kTail) {
      OfferToTail(_mm256_castsi256_ps(abs_bits), tail, threshold);
    }
  }
}

// Adds a head's sub-histograms (`sub`) to its histogram, up to the bin of
// its largest finite |x| so far.
void FlushHead(HeadState& s, uint32_t* sub, uint32_t log2_bins,
               RunAccumulator& acc) {
  if (s.since_flush == 0) return;
  const float absmax =
      std::max(-HorizontalMin(_mm256_min_ps(s.even.vmin, s.odd.vmin)),
               HorizontalMax(_mm256_max_ps(s.even.vmax, s.odd.vmax)));
  // No finite value yet: every counter was taken back.
  if (absmax >= 0.0f) {
    FlushSubHistograms(sub, HistogramBin(absmax, log2_bins), acc.histogram);
  }
  s.since_flush = 0;
}

// Adds a head's lanes to its accumulator.
void FinishHead(const HeadState& s, RunAccumulator& acc) {
  // min and max see -0.0 as +0.0 (element_math.h CanonicalZero).
  const float mn =
      CanonicalZero(HorizontalMin(_mm256_min_ps(s.even.vmin, s.odd.vmin)));
  const float mx =
      CanonicalZero(HorizontalMax(_mm256_max_ps(s.even.vmax, s.odd.vmax)));
  acc.min = std::min(acc.min, mn);
  acc.max = std::max(acc.max, mx);
  acc.finite += s.vector_values - s.nonfinite;
  acc.nan += s.nan;
  acc.inf += s.nonfinite - s.nan;
  acc.sum += HorizontalSum(_mm256_add_pd(s.even.sum0, s.odd.sum0),
                           _mm256_add_pd(s.even.sum1, s.odd.sum1));
  acc.sum_squares += HorizontalSum(_mm256_add_pd(s.even.sq0, s.odd.sq0),
                                   _mm256_add_pd(s.even.sq1, s.odd.sq1));
}

// One block of one head: `pairs` pairs of vectors at p, then one more vector
// when `single`, into the head's state `s`, its sub-histogram `sub` (null
// without histograms) and its accumulator's tail.
template <DType kDType, bool kHistogram, bool kTail>
inline void Avx2Block(const unsigned char* p, size_t pairs, bool single,
                      HeadState& s, uint32_t* sub, RunAccumulator& acc,
                      uint32_t log2_bins, const FastConstants& c) {
  constexpr size_t kSize = kDType == DType::kF32 ? 4 : 2;
  TailKeeper* const tail = acc.tail;
  const uint64_t vectors = 2 * pairs + (single ? 1 : 0);
  if constexpr (kHistogram) {
    if (s.since_flush + vectors > kFlushEveryVectors) {
      FlushHead(s, sub, log2_bins, acc);
    }
    s.since_flush += vectors;
  }
  __m256 threshold = _mm256_set1_ps(kTail ? tail->threshold() : 0.0f);
  Lanes even = s.even, odd = s.odd;
  const unsigned char* q = p;
  for (size_t k = 0; k < pairs; ++k, q += 16 * kSize) {
    _mm_prefetch(reinterpret_cast<const char*>(q) + kPrefetchBytes,
                 _MM_HINT_T0);
    __m256 a, b;
    Load16<kDType>(q, a, b);
    AddFast<kHistogram, kTail>(a, even, sub, tail, threshold, c);
    // With histograms the counting, not the latency of the sums, bounds
    // the loop: one set of accumulators leaves registers to the rest.
    AddFast<kHistogram, kTail>(b, kHistogram ? even : odd, sub, tail, threshold,
                               c);
  }
  if (single) {
    AddFast<kHistogram, kTail>(Load8<kDType>(q), even, sub, tail, threshold, c);
  }
  if (SumsNonFinite(even, odd)) [[unlikely]] {
    RedoBlockCarefully<kDType, kHistogram>(p, pairs, single, s, sub,
                                           c.bins.overflow);
  } else {
    s.even = even;
    s.odd = odd;
  }
  s.vector_values += 8 * vectors;
}

// flatten: the per-vector functions above must be inlined into the loops.
template <DType kDType, bool kHistogram, bool kTail>
__attribute__((flatten)) void Avx2RowsGroup(const unsigned char* base,
                                            size_t rows, size_t stride_bytes,
                                            size_t heads, size_t length,
                                            RunAccumulator* accs) {
  constexpr size_t kSize = kDType == DType::kF32 ? 4 : 2;
  const uint32_t log2_bins = accs[0].log2_bins_per_octave;
  const FastConstants c(log2_bins);
  const size_t head_counters =
      static_cast<size_t>(HistogramBinCount(log2_bins)) * 8;
  uint32_t* const subs =
      kHistogram ? SubHistograms(heads * head_counters) : nullptr;
  HeadState* const states = HeadStates(heads);

  const size_t pairs_per_run = length / 16;
  const bool single = (length / 8) % 2 != 0;
  const size_t rest = length % 8;
  const RowsFn scalar = ScalarLoops(kDType).rows;
  for (size_t r = 0; r < rows; ++r) {
    const unsigned char* row = base + r * stride_bytes;
    for (size_t h = 0; h < heads; ++h) {
      const unsigned char* p = row + h * length * kSize;
      size_t done = 0;
      do {
        const size_t n = std::min(pairs_per_run - done, kBlockPairs);
        const bool last = done + n == pairs_per_run;
        Avx2Block<kDType, kHistogram, kTail>(
            p + done * 16 * kSize, n, last && single, states[h],
            kHistogram ? subs + h * head_counters : nullptr, accs[h], log2_bins,
            c);
        done += n;
      } while (done < pairs_per_run);
      if (rest != 0) {
        scalar(p + (length - rest) * kSize, 1, rest, 1, rest, &accs[h]);
      }
    }
  }

  for (size_t h = 0; h < heads; ++h) {
    if constexpr (kHistogram) {
      FlushHead(states[h], subs + h * head_counters, log2_bins, accs[h]);
    }
    FinishHead(states[h], accs[h]);
  }
}

template <DType kDType, bool kHistogram, bool kTail>
void Avx2Rows(const void* data, size_t rows, size_t stride, size_t heads,
              size_t length, RunAccumulator* accs) {
  constexpr size_t kSize = kDType == DType::kF32 ? 4 : 2;
  if (length < 8) {
    return ScalarLoops(kDType).rows(data, rows, stride, heads, length, accs);
  }
  size_t group = heads;
  if constexpr (kHistogram) {
    const size_t head_bytes =
        static_cast<size_t>(HistogramBinCount(accs[0].log2_bins_per_octave)) *
        8 * sizeof(uint32_t);
    group = std::max<size_t>(1, kSubHistogramBudget / head_bytes);
  }
  const auto* base = static_cast<const unsigned char*>(data);
  for (size_t h = 0; h < heads; h += group) {
    Avx2RowsGroup<kDType, kHistogram, kTail>(
        base + h * length * kSize, rows, stride * kSize,
        std::min(group, heads - h), length, accs + h);
  }
}

template <DType kDType>
struct Avx2Loop {
  template <bool kHistogram, bool kTail>
  static RowsFn Get() {
    return &Avx2Rows<kDType, kHistogram, kTail>;
  }
};

template <DType kDType>
void Avx2Dispatch(const void* data, size_t rows, size_t stride, size_t heads,
                  size_t length, RunAccumulator* accs) {
  if (rows == 0 || heads == 0 || length == 0) return;
  internal::ChooseLoop<Avx2Loop<kDType>>(accs[0])(data, rows, stride, heads,
                                                  length, accs);
}

// The 16-bit loop (run_kernels_16bit.inc) on 16 float lanes held as two
// AVX2 registers: lanes 0..7 in lo, 8..15 in hi.
struct V {
  static constexpr size_t kInterleave = 8;
  struct F {
    __m256 lo;
    __m256 hi;
  };
  using I = __m256i;  // the integer register of MakeBins

  static __m256i SetI(int x) { return _mm256_set1_epi32(x); }
  // Lane k of a register holds k % kInterleave.
  static __m256i LaneIds() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
  static __attribute__((always_inline)) F ZeroF() {
    return F{_mm256_setzero_ps(), _mm256_setzero_ps()};
  }
  static __attribute__((always_inline)) F SetF(float x) {
    return F{_mm256_set1_ps(x), _mm256_set1_ps(x)};
  }
  template <DType kDType>
  static __attribute__((always_inline)) void LoadGroup(const unsigned char* p,
                                                       F& a, F& b) {
    if constexpr (kDType == DType::kBf16) {
      const __m256i v0 =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      const __m256i v1 =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
      const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
      a = F{_mm256_castsi256_ps(_mm256_slli_epi32(v0, 16)),
            _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16))};
      b = F{_mm256_castsi256_ps(_mm256_and_si256(v0, high)),
            _mm256_castsi256_ps(_mm256_and_si256(v1, high))};
    } else {
      auto half = [p](size_t offset) {
        return _mm256_cvtph_ps(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + offset)));
      };
      a = F{half(0), half(16)};
      b = F{half(32), half(48)};
    }
  }
  // The counter indices of the 32 bf16 values at p (CountKeysBf16):
  // (|bits| >> shift) * 2 + j % 2 for value j.
  static __attribute__((always_inline)) void KeysBf16(const unsigned char* p,
                                                      __m128i shift,
                                                      uint16_t* out) {
    const __m256i magnitude = _mm256_set1_epi16(0x7fff);
    const __m256i odd = _mm256_set1_epi32(0x10000);
    for (size_t half = 0; half < 2; ++half) {
      __m256i v = _mm256_and_si256(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * half)),
          magnitude);
      v = _mm256_srl_epi16(v, shift);
      v = _mm256_or_si256(_mm256_add_epi16(v, v), odd);
      _mm256_store_si256(reinterpret_cast<__m256i*>(out + 16 * half), v);
    }
  }
  // How many bf16 values of the group at p have 0 < |bits| < limit (at most
  // 128, so the signed 16-bit compare is exact).
  static __attribute__((always_inline)) uint32_t TinyCountBf16(
      const unsigned char* p, uint32_t limit) {
    const __m256i magnitude = _mm256_set1_epi16(0x7fff);
    const __m256i below = _mm256_set1_epi16(static_cast<short>(limit));
    auto tiny = [&](const unsigned char* q) {
      const __m256i abs = _mm256_and_si256(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)), magnitude);
      return static_cast<uint32_t>(_mm256_movemask_epi8(
          _mm256_andnot_si256(_mm256_cmpeq_epi16(abs, _mm256_setzero_si256()),
                              _mm256_cmpgt_epi16(below, abs))));
    };
    const uint64_t bytes = (uint64_t{tiny(p + 32)} << 32) | tiny(p);
    // Two mask bits per 16-bit value.
    return bytes == 0 ? 0u : static_cast<uint32_t>(std::popcount(bytes)) / 2;
  }
  static __attribute__((always_inline)) F Add(F a, F b) {
    return F{_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)};
  }
  // acc + x * x as a product then a sum (never fused: the files of the
  // vector loops are compiled with -ffp-contract=off).
  static __attribute__((always_inline)) F SquareAdd(F x, F acc) {
    return F{_mm256_add_ps(acc.lo, _mm256_mul_ps(x.lo, x.lo)),
             _mm256_add_ps(acc.hi, _mm256_mul_ps(x.hi, x.hi))};
  }
  static __attribute__((always_inline)) F Min(F a, F b) {
    return F{_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)};
  }
  static __attribute__((always_inline)) F Max(F a, F b) {
    return F{_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)};
  }
  static __attribute__((always_inline)) F Abs(F x) {
    const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    return F{_mm256_and_ps(x.lo, m), _mm256_and_ps(x.hi, m)};
  }
  static __attribute__((always_inline)) uint32_t GreaterMask(F a, F t) {
    return static_cast<uint32_t>(
               _mm256_movemask_ps(_mm256_cmp_ps(a.lo, t.lo, _CMP_GT_OQ))) |
           (static_cast<uint32_t>(
                _mm256_movemask_ps(_mm256_cmp_ps(a.hi, t.hi, _CMP_GT_OQ)))
            << 8);
  }
  static __attribute__((always_inline)) void StoreF(F x, float* out) {
    _mm256_store_ps(out, x.lo);
    _mm256_store_ps(out + 8, x.hi);
  }
  static __attribute__((always_inline)) __m256i NonFinite(__m256 x) {
    const __m256i e = _mm256_set1_epi32(0x7f800000);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(x), e), e);
  }
  static __attribute__((always_inline)) bool AnyNonFinite(F a, F b, F c, F d) {
    const __m256i bad = _mm256_or_si256(
        _mm256_or_si256(_mm256_or_si256(NonFinite(a.lo), NonFinite(a.hi)),
                        _mm256_or_si256(NonFinite(b.lo), NonFinite(b.hi))),
        _mm256_or_si256(_mm256_or_si256(NonFinite(c.lo), NonFinite(c.hi)),
                        _mm256_or_si256(NonFinite(d.lo), NonFinite(d.hi))));
    return !_mm256_testz_si256(bad, bad);
  }
  // True when every lane of a and b is below t (NaN lanes count as not).
  static __attribute__((always_inline)) bool AllBelow(F a, F b, float t) {
    const __m256 tv = _mm256_set1_ps(t);
    const __m256 below =
        _mm256_and_ps(_mm256_and_ps(_mm256_cmp_ps(a.lo, tv, _CMP_LT_OQ),
                                    _mm256_cmp_ps(a.hi, tv, _CMP_LT_OQ)),
                      _mm256_and_ps(_mm256_cmp_ps(b.lo, tv, _CMP_LT_OQ),
                                    _mm256_cmp_ps(b.hi, tv, _CMP_LT_OQ)));
    return _mm256_movemask_ps(below) == 0xff;
  }
  static __attribute__((always_inline)) void AddToDoubleLanes(F x, double* d) {
    const __m256d parts[4] = {_mm256_cvtps_pd(_mm256_castps256_ps128(x.lo)),
                              _mm256_cvtps_pd(_mm256_extractf128_ps(x.lo, 1)),
                              _mm256_cvtps_pd(_mm256_castps256_ps128(x.hi)),
                              _mm256_cvtps_pd(_mm256_extractf128_ps(x.hi, 1))};
    for (int i = 0; i < 4; ++i) {
      _mm256_storeu_pd(d + 4 * i,
                       _mm256_add_pd(_mm256_loadu_pd(d + 4 * i), parts[i]));
    }
  }
  static float MinLane(F x) { return HorizontalMin(_mm256_min_ps(x.lo, x.hi)); }
  static float MaxLane(F x) { return HorizontalMax(_mm256_max_ps(x.lo, x.hi)); }
  // Counts 16 values into the sub-histograms; the indices leave the
  // registers through 64-bit extracts (see Avx2RowsGroup).
  template <int kDelta, typename Bins>
  static __attribute__((always_inline)) void Count(F x, const Bins& b,
                                                   uint32_t* sub) {
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
    for (__m256 half : {x.lo, x.hi}) {
      const __m256i abs_bits =
          _mm256_and_si256(_mm256_castps_si256(half), abs_mask);
      const __m256i slot = _mm256_or_si256(
          _mm256_slli_epi32(Bins8(abs_bits, b.shift, b.offset, b.overflow), 3),
          b.lane);
      AddToSlots<kDelta>(slot, sub);
    }
  }
};

#include "kernels/cpu/run_kernels_16bit.inc"

// F16C is read from CPUID (leaf 1, ECX bit 29): clang's
// __builtin_cpu_supports does not know "f16c" (clang 14).
bool CpuHasF16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}

bool CpuHasAvx2() {
  static const bool has = __builtin_cpu_supports("avx2") && CpuHasF16c() &&
                          __builtin_cpu_supports("fma");
  return has;
}

}  // namespace

Loops Avx2Loops(DType dtype) {
  if (!CpuHasAvx2()) return {};
  if (dtype == DType::kF32) {
    return {&Avx2Dispatch<DType::kF32>,
            &internal::SpansByRows<&Avx2Dispatch<DType::kF32>>};
  }
  return Loops16(dtype);
}

}  // namespace kvcal::cpu

#else  // no AVX2 in this build

namespace kvcal::cpu {
Loops Avx2Loops(DType) { return {}; }
}  // namespace kvcal::cpu

#endif
