// AVX2 + F16C + FMA inner loops. This file alone is compiled with
// -mavx2 -mf16c -mfma; Avx2RunFn checks the CPU at run time before handing
// these out, so the binary still runs on CPUs without AVX2.
#include "kernels/cpu/run_kernels.h"

#if defined(__x86_64__) && defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "kernels/cpu/run_kernels.h"
#include "kernels/element_math.h"

namespace kvcal::cpu {
namespace {

template <DType kDType>
__m256 Load8(const unsigned char* p) {
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

// Histogram bins of 8 finite values (element_math.h's HistogramBin, lane-wise).
__m256i Bins8(__m256i abs_bits, uint32_t log2_bins, __m256i overflow_bin) {
  const __m256i exponent = _mm256_srli_epi32(abs_bits, 23);
  const __m256i mantissa =
      _mm256_and_si256(abs_bits, _mm256_set1_epi32(0x7fffff));
  const __m128i shift = _mm_cvtsi32_si128(static_cast<int>(23u - log2_bins));
  const __m128i octave_shift = _mm_cvtsi32_si128(static_cast<int>(log2_bins));
  const __m256i lowest = _mm256_set1_epi32(127 + kHistogramMinExponent);
  __m256i bin = _mm256_add_epi32(
      _mm256_add_epi32(
          _mm256_set1_epi32(kFirstOctaveBin),
          _mm256_sll_epi32(_mm256_sub_epi32(exponent, lowest), octave_shift)),
      _mm256_srl_epi32(mantissa, shift));
  const __m256i under = _mm256_cmpgt_epi32(lowest, exponent);
  const __m256i over = _mm256_cmpgt_epi32(
      exponent, _mm256_set1_epi32(127 + kHistogramMaxExponent - 1));
  const __m256i zero = _mm256_cmpeq_epi32(abs_bits, _mm256_setzero_si256());
  bin = _mm256_blendv_epi8(bin, _mm256_set1_epi32(kUnderflowBin), under);
  bin = _mm256_blendv_epi8(bin, overflow_bin, over);
  bin = _mm256_blendv_epi8(bin, _mm256_set1_epi32(kZeroBin), zero);
  return bin;
}

template <DType kDType, bool kHistogram, bool kTail>
void Avx2Run(const void* data, size_t n, RunAccumulator& acc) {
  constexpr size_t kSize = kDType == DType::kF32 ? 4 : 2;
  const auto* p = static_cast<const unsigned char*>(data);
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256i max_finite = _mm256_set1_epi32(0x7f7fffff);
  const __m256i inf_bits = _mm256_set1_epi32(0x7f800000);
  const __m256 pos_inf = _mm256_castsi256_ps(inf_bits);
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256 zero = _mm256_setzero_ps();
  const uint32_t log2_bins = acc.log2_bins_per_octave;
  const __m256i overflow_bin =
      _mm256_set1_epi32(static_cast<int>(HistogramBinCount(log2_bins) - 1));
  uint64_t* const histogram = acc.histogram;
  TailKeeper* const tail = acc.tail;

  __m256 vmin = _mm256_set1_ps(acc.min);
  __m256 vmax = _mm256_set1_ps(acc.max);
  __m256d sum0 = _mm256_setzero_pd(), sum1 = _mm256_setzero_pd();
  __m256d sq0 = _mm256_setzero_pd(), sq1 = _mm256_setzero_pd();
  uint64_t nonfinite = 0, nan = 0;
  __m256 threshold = _mm256_set1_ps(kTail ? tail->threshold() : 0.0f);

  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    // x + 0 turns -0.0 into +0.0 (element_math.h CanonicalZero).
    const __m256 x = _mm256_add_ps(Load8<kDType>(p + i * kSize), zero);
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i abs_bits = _mm256_and_si256(bits, abs_mask);
    const __m256i bad = _mm256_cmpgt_epi32(abs_bits, max_finite);
    const int bad_mask = _mm256_movemask_ps(_mm256_castsi256_ps(bad));
    __m256 xf = x;  // x with non-finite lanes zeroed
    if (bad_mask != 0) [[unlikely]] {
      const __m256i is_nan = _mm256_cmpgt_epi32(abs_bits, inf_bits);
      nonfinite += static_cast<uint64_t>(__builtin_popcount(bad_mask));
      nan += static_cast<uint64_t>(__builtin_popcount(
          _mm256_movemask_ps(_mm256_castsi256_ps(is_nan))));
      const __m256 bad_ps = _mm256_castsi256_ps(bad);
      vmin = _mm256_min_ps(vmin, _mm256_blendv_ps(x, pos_inf, bad_ps));
      vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(x, neg_inf, bad_ps));
      xf = _mm256_blendv_ps(x, zero, bad_ps);
    } else {
      vmin = _mm256_min_ps(vmin, x);
      vmax = _mm256_max_ps(vmax, x);
    }
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(xf));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(xf, 1));
    sum0 = _mm256_add_pd(sum0, lo);
    sum1 = _mm256_add_pd(sum1, hi);
    sq0 = _mm256_fmadd_pd(lo, lo, sq0);
    sq1 = _mm256_fmadd_pd(hi, hi, sq1);
    if constexpr (kHistogram) {
      alignas(32) uint32_t bins[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(bins),
                         Bins8(abs_bits, log2_bins, overflow_bin));
      if (bad_mask == 0) [[likely]] {
        for (int lane = 0; lane < 8; ++lane) ++histogram[bins[lane]];
      } else {
        for (int lane = 0; lane < 8; ++lane) {
          if (((bad_mask >> lane) & 1) == 0) ++histogram[bins[lane]];
        }
      }
    }
    if constexpr (kTail) {
      const __m256 abs_x = _mm256_castsi256_ps(abs_bits);
      // Ordered compare: NaN lanes are false; Inf lanes are masked out.
      int enter = _mm256_movemask_ps(_mm256_cmp_ps(abs_x, threshold, _CMP_GT_OQ));
      enter &= ~bad_mask;
      if (enter != 0) [[unlikely]] {
        alignas(32) float values[8];
        _mm256_store_ps(values, abs_x);
        for (int lane = 0; lane < 8; ++lane) {
          if ((enter >> lane) & 1) {
            if (values[lane] > tail->threshold()) tail->Offer(values[lane]);
          }
        }
        threshold = _mm256_set1_ps(tail->threshold());
      }
    }
  }

  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmin);
  float mn = lanes[0];
  for (float v : lanes) mn = std::min(mn, v);
  _mm256_store_ps(lanes, vmax);
  float mx = lanes[0];
  for (float v : lanes) mx = std::max(mx, v);
  alignas(32) double d[4];
  _mm256_store_pd(d, _mm256_add_pd(sum0, sum1));
  const double sum = (d[0] + d[1]) + (d[2] + d[3]);
  _mm256_store_pd(d, _mm256_add_pd(sq0, sq1));
  const double sum_squares = (d[0] + d[1]) + (d[2] + d[3]);

  acc.min = mn;
  acc.max = mx;
  acc.finite += i - nonfinite;
  acc.nan += nan;
  acc.inf += nonfinite - nan;
  acc.sum += sum;
  acc.sum_squares += sum_squares;
  if (i < n) ScalarRunFn(kDType)(p + i * kSize, n - i, acc);
}

template <DType kDType>
void Avx2Dispatch(const void* data, size_t n, RunAccumulator& acc) {
  if (acc.histogram != nullptr) {
    if (acc.tail != nullptr) return Avx2Run<kDType, true, true>(data, n, acc);
    return Avx2Run<kDType, true, false>(data, n, acc);
  }
  if (acc.tail != nullptr) return Avx2Run<kDType, false, true>(data, n, acc);
  return Avx2Run<kDType, false, false>(data, n, acc);
}

bool CpuHasAvx2() {
  static const bool has = __builtin_cpu_supports("avx2") &&
                          __builtin_cpu_supports("f16c") &&
                          __builtin_cpu_supports("fma");
  return has;
}

}  // namespace

RunFn Avx2RunFn(DType dtype) {
  if (!CpuHasAvx2()) return nullptr;
  switch (dtype) {
    case DType::kF32:
      return &Avx2Dispatch<DType::kF32>;
    case DType::kF16:
      return &Avx2Dispatch<DType::kF16>;
    case DType::kBf16:
      return &Avx2Dispatch<DType::kBf16>;
  }
  return nullptr;
}

}  // namespace kvcal::cpu

#else  // no AVX2 in this build

namespace kvcal::cpu {
RunFn Avx2RunFn(DType) { return nullptr; }
}  // namespace kvcal::cpu

#endif
