// What the scalar, AVX2 and AVX-512 inner loops share so that they agree bit
// for bit: the canonical order of the double sums, and the careful (slow)
// path that every ISA uses for a block that holds a non-finite value.
//
// 16-bit values (bf16, f16), per head and per RowsFn call:
//   - A run (one head's `length` values of one row) is cut, from its start,
//     into blocks of kBlockValues values (the last one shorter).
//   - Within a block, value j of each group of kGroupValues goes to float
//     lane Lane16(dtype, j % kGroupValues): two sets A and B of kLanes
//     lanes. Each lane keeps s += x and q += x * x in float, in value order
//     (x * x is exact in float for 16-bit inputs, so mul+add and FMA agree).
//   - At the end of the block, when every float sum A_s[k] + B_s[k] and
//     A_q[k] + B_q[k] is finite and some q lane is at least kTinySquares,
//     lane k adds double(A_s[k] + B_s[k]) to the head's double lane k (and
//     the same for q). Otherwise (a NaN or Inf input, a float overflow,
//     also one in A + B alone, or a block of values so small that their
//     squares would underflow float) the block is redone in double: each finite
//     value, in order, adds double(x) and double(x)^2 to its double lane (k as
//     above).
//   - At the end of the call, FoldLanes adds the kLanes double lanes in a
//     fixed pairwise order to RunAccumulator::sum (and sum_squares).
// Min, max, counts, histograms and tails are exact, so any order gives the
// same bits.
//
// f32 values keep the AVX2 kernel's order (run_kernels_avx2.cc), which the
// scalar path replays: per head, values at run offset i < 16 * (length / 16)
// go to double lane i % 16 (i % 8 with histograms), the odd vector of 8 at
// the end of a run to lanes 0..7, the last length % 8 values to a fresh
// double added to the accumulator after each run; FoldF32Lanes at the end.
#ifndef KVCAL_KERNELS_CPU_RUN_KERNELS_INTERNAL_H_
#define KVCAL_KERNELS_CPU_RUN_KERNELS_INTERNAL_H_

#include <cstddef>
#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "kernels/cpu/run_kernels.h"
#include "kernels/element_math.h"
#include "kernels/types.h"

namespace kvcal::cpu::internal {

inline constexpr size_t kLanes = 16;
inline constexpr size_t kGroupValues = 2 * kLanes;
// Each float lane adds at most kBlockValues / kGroupValues = 8 values before
// it goes into double: relative error of a block's float sum <= 8 * 2^-24.
inline constexpr size_t kBlockValues = 256;
// 2^-100: a block whose every q lane is below this is redone in double (its
// squares may have lost bits to float underflow); above, what underflow
// loses is below 2^-40 of the block's sum of squares.
inline constexpr float kTinySquares = 0x1p-100f;

// Where value j (0 <= j < kGroupValues) of a group goes: lane k of set A
// (returns k) or of set B (returns kLanes + k). bf16 puts the even values in
// A and the odd ones in B (a 32-bit word's low and high halves); f16 puts
// the first 16 in A and the next 16 in B (the order of vcvtph2ps).
constexpr size_t Lane16(DType dtype, size_t j) {
  return dtype == DType::kBf16 ? (j % 2) * kLanes + j / 2 : j;
}

// The double lanes of one head.
struct DoubleLanes {
  double sum[kLanes];
  double sum_squares[kLanes];
};

// sum of lanes[0..kLanes) in the canonical pairwise order.
double FoldLanes(const double* lanes);

// The careful path of one block of n 16-bit values: counts, min/max
// (through CanonicalZero), the histogram (when acc.histogram) and the double
// redo of the sums into `lanes`, value by value; values at index >= tail_from
// are offered to the tail (the fast path offered the ones before).
void CarefulBlock16(DType dtype, const unsigned char* p, size_t n,
                    size_t tail_from, RunAccumulator& acc, DoubleLanes& lanes);

// Counts, min/max, histogram and tail of n 16-bit values (no sums): the
// values of a block after its whole groups, once the block is known finite.
void ExactStats16(DType dtype, const unsigned char* p, size_t n,
                  RunAccumulator& acc);

// The histogram bin of a finite float's bits as the vector loops compute it
// lane-wise (element_math.h HistogramBin): (|bits| >> shift) - offset,
// clamped to [kUnderflowBin, overflow], and kZeroBin for |bits| == 0.
struct BinConstants {
  int shift;     // 23 - log2 bins per octave
  int offset;    // (the first exactly binned exponent << log2) - first bin
  int overflow;  // the overflow bin
};
inline BinConstants BinConstantsFor(uint32_t log2_bins) {
  return {static_cast<int>(23u - log2_bins),
          static_cast<int>(((127 + kHistogramMinExponent) << log2_bins) -
                           kFirstOctaveBin),
          static_cast<int>(HistogramBinCount(log2_bins) - 1)};
}

#if defined(__x86_64__)
// Adds kDelta to the four counters whose indices are the 32-bit lanes of
// `slots` (the vector loops' histogram counting). The indices leave the
// register through 64-bit extracts: stored and read back as 4-byte loads
// they defeat store-to-load forwarding.
template <int kDelta>
__attribute__((always_inline, target("sse4.1"))) inline void AddToSlots4(
    __m128i slots, uint32_t* sub) {
  const auto p0 = static_cast<uint64_t>(_mm_cvtsi128_si64(slots));
  const auto p1 = static_cast<uint64_t>(_mm_extract_epi64(slots, 1));
  sub[static_cast<uint32_t>(p0)] += kDelta;
  sub[p0 >> 32] += kDelta;
  sub[static_cast<uint32_t>(p1)] += kDelta;
  sub[p1 >> 32] += kDelta;
}
#endif

// True when the float is NaN or +-Inf.
inline bool NonFiniteBits(uint32_t bits) {
  return (bits & 0x7f800000u) == 0x7f800000u;
}

// The instantiation of a loop templated on <kHistogram, kTail> that the
// accumulators ask for (they all agree: run_kernels.h), chosen once per call:
// Loop<L>::Get<true, false>() must return L<..., true, false>.
template <typename Loop>
auto ChooseLoop(const RunAccumulator& acc) {
  if (acc.histogram != nullptr) {
    return acc.tail != nullptr ? Loop::template Get<true, true>()
                               : Loop::template Get<true, false>();
  }
  return acc.tail != nullptr ? Loop::template Get<false, true>()
                             : Loop::template Get<false, false>();
}

// A SpansFn that calls `kRows` once per span.
template <RowsFn kRows>
void SpansByRows(const RowSpan* spans, size_t count, size_t /*heads*/,
                 RunAccumulator* accs) {
  for (size_t i = 0; i < count; ++i) {
    const RowSpan& s = spans[i];
    kRows(s.data, s.rows, s.stride, s.heads, s.length, accs + s.head);
  }
}

}  // namespace kvcal::cpu::internal

#endif  // KVCAL_KERNELS_CPU_RUN_KERNELS_INTERNAL_H_
