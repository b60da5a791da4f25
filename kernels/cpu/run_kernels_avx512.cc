// AVX-512 (F, BW, VL, DQ) inner loops for 16-bit values; f32 uses the AVX2
// loop (its double sums have one order on both). The functions of this file
// carry the target through `#pragma GCC target` (clang: an attribute pushed
// over the file) after every header is included, so nothing outside them is
// compiled for AVX-512 and the binary still runs on CPUs without it;
// Avx512Loops checks the CPU at run time before handing these out.
#include "kernels/cpu/run_kernels.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
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

#if defined(__clang__)
#pragma clang attribute push(                                            \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma," \
                          "f16c"))),                                     \
    apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
// GCC 12 warns about the deliberately undefined pass-through operand of its
// own AVX-512 intrinsics (_mm512_undefined_*): a false positive.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace kvcal::cpu {
namespace {

// 16 float lanes in one register.
struct V {
  static constexpr size_t kInterleave = 8;
  using F = __m512;
  using I = __m512i;  // the integer register of MakeBins

  static __m512i SetI(int x) { return _mm512_set1_epi32(x); }
  // Lane k of a register holds k % kInterleave.
  static __m512i LaneIds() {
    return _mm512_and_si512(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(kInterleave - 1));
  }
  static __attribute__((always_inline)) F ZeroF() {
    return _mm512_setzero_ps();
  }
  static __attribute__((always_inline)) F SetF(float x) {
    return _mm512_set1_ps(x);
  }
  template <DType kDType>
  static __attribute__((always_inline)) void LoadGroup(const unsigned char* p,
                                                       F& a, F& b) {
    if constexpr (kDType == DType::kBf16) {
      const __m512i v = _mm512_loadu_si512(p);
      a = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      b = _mm512_castsi512_ps(_mm512_and_si512(
          v, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
    } else {
      a = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      b = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
    }
  }
  // How many bf16 values of the group at p have 0 < |bits| < limit.
  static __attribute__((always_inline)) uint32_t TinyCountBf16(
      const unsigned char* p, uint32_t limit) {
    const __m512i abs =
        _mm512_and_si512(_mm512_loadu_si512(p), _mm512_set1_epi16(0x7fff));
    const __mmask32 tiny =
        _mm512_test_epi16_mask(abs, abs) &
        _mm512_cmplt_epu16_mask(abs,
                                _mm512_set1_epi16(static_cast<short>(limit)));
    return tiny == 0 ? 0u : static_cast<uint32_t>(std::popcount(tiny));
  }
  // The counter indices of the 32 bf16 values at p (CountKeysBf16):
  // (|bits| >> shift) * 2 + j % 2 for value j.
  static __attribute__((always_inline)) void KeysBf16(const unsigned char* p,
                                                      __m128i shift,
                                                      uint16_t* out) {
    __m512i v =
        _mm512_and_si512(_mm512_loadu_si512(p), _mm512_set1_epi16(0x7fff));
    v = _mm512_srl_epi16(v, shift);
    v = _mm512_or_si512(_mm512_add_epi16(v, v), _mm512_set1_epi32(0x10000));
    _mm512_store_si512(out, v);
  }
  static __attribute__((always_inline)) F Add(F a, F b) {
    return _mm512_add_ps(a, b);
  }
  // acc + x * x as a product then a sum (never fused: the files of the
  // vector loops are compiled with -ffp-contract=off).
  static __attribute__((always_inline)) F SquareAdd(F x, F acc) {
    return _mm512_add_ps(acc, _mm512_mul_ps(x, x));
  }
  static __attribute__((always_inline)) F Min(F a, F b) {
    return _mm512_min_ps(a, b);
  }
  static __attribute__((always_inline)) F Max(F a, F b) {
    return _mm512_max_ps(a, b);
  }
  static __attribute__((always_inline)) F Abs(F x) {
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x),
                                                _mm512_set1_epi32(0x7fffffff)));
  }
  static __attribute__((always_inline)) uint32_t GreaterMask(F a, F t) {
    return _mm512_cmp_ps_mask(a, t, _CMP_GT_OQ);
  }
  static __attribute__((always_inline)) void StoreF(F x, float* out) {
    _mm512_store_ps(out, x);
  }
  static __attribute__((always_inline)) bool AnyNonFinite(F a, F b, F c, F d) {
    return (NonFiniteMask(a) | NonFiniteMask(b) | NonFiniteMask(c) |
            NonFiniteMask(d)) != 0;
  }
  // True when every lane of a and b is below t (NaN lanes count as not).
  static __attribute__((always_inline)) bool AllBelow(F a, F b, float t) {
    const F tv = _mm512_set1_ps(t);
    return (_mm512_cmp_ps_mask(a, tv, _CMP_LT_OQ) &
            _mm512_cmp_ps_mask(b, tv, _CMP_LT_OQ)) == 0xffff;
  }
  static __attribute__((always_inline)) __mmask16 NonFiniteMask(F x) {
    const __m512i e = _mm512_set1_epi32(0x7f800000);
    return _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(x), e),
                                   e);
  }
  static __attribute__((always_inline)) void AddToDoubleLanes(F x, double* d) {
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d hi = _mm512_cvtps_pd(
        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    _mm512_storeu_pd(d, _mm512_add_pd(_mm512_loadu_pd(d), lo));
    _mm512_storeu_pd(d + 8, _mm512_add_pd(_mm512_loadu_pd(d + 8), hi));
  }
  static float MinLane(F x) { return _mm512_reduce_min_ps(x); }
  static float MaxLane(F x) { return _mm512_reduce_max_ps(x); }
  // Counts 16 values into the sub-histograms (element_math.h HistogramBin,
  // lane-wise, as in run_kernels_avx2.cc Bins8). The counter indices leave
  // the register through 64-bit extracts: read back from memory, a vector
  // store feeds scalar loads slowly, and the loads of the indices then wait
  // on the counters' stores.
  template <int kDelta, typename Bins>
  static __attribute__((always_inline)) void Count(F x, const Bins& b,
                                                   uint32_t* sub) {
    const __m512i abs_bits =
        _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff));
    __m512i bin =
        _mm512_sub_epi32(_mm512_srl_epi32(abs_bits, b.shift), b.offset);
    bin = _mm512_max_epi32(bin, _mm512_set1_epi32(kUnderflowBin));
    bin = _mm512_min_epi32(bin, b.overflow);
    bin = _mm512_min_epu32(bin, abs_bits);
    const __m512i slot = _mm512_or_si512(
        _mm512_slli_epi32(bin, __builtin_ctz(kInterleave)), b.lane);
    internal::AddToSlots4<kDelta>(_mm512_castsi512_si128(slot), sub);
    internal::AddToSlots4<kDelta>(_mm512_extracti32x4_epi32(slot, 1), sub);
    internal::AddToSlots4<kDelta>(_mm512_extracti32x4_epi32(slot, 2), sub);
    internal::AddToSlots4<kDelta>(_mm512_extracti32x4_epi32(slot, 3), sub);
  }
};

#include "kernels/cpu/run_kernels_16bit.inc"

bool CpuHasAvx512() {
  static const bool has = __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512dq") &&
                          Avx2Loops(DType::kF32).rows != nullptr;
  return has;
}

}  // namespace

Loops Avx512Loops(DType dtype) {
  if (!CpuHasAvx512()) return {};
  if (dtype == DType::kF32) return Avx2Loops(dtype);
  return Loops16(dtype);
}

}  // namespace kvcal::cpu

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

#else  // not x86-64

namespace kvcal::cpu {
Loops Avx512Loops(DType) { return {}; }
}  // namespace kvcal::cpu

#endif
