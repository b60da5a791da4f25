// AVX2 + F16C + FMA inner loops. This file alone is compiled with
// -mavx2 -mf16c -mfma; Avx2RunFn checks the CPU at run time before handing
// these out, so the binary still runs on CPUs without AVX2.
#include "kernels/cpu/run_kernels.h"

#if defined(__x86_64__) && defined(__AVX2__) && defined(__F16C__) && \
    defined(__FMA__)
#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

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
__attribute__((always_inline)) inline __m256i Bins8(__m256i abs_bits,
                                                    uint32_t log2_bins,
                                                    __m256i overflow_bin) {
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

// The histogram of one call is counted in kSubHistograms interleaved uint32
// sub-histograms, lane l of each 8-value vector into sub-histogram l: repeated
// bins (the common case: activations crowd into a few octaves) then form
// eight independent store-to-load chains instead of one. The sub-histograms
// are per thread, kept all zero between calls, and flushed into the uint64
// histogram (only the bin range that was touched) at the end of each call and
// before any counter could reach 2^32. Counts are exact, so results are
// bitwise those of the scalar path.
constexpr int kSubHistograms = 8;
constexpr size_t kFlushEvery = size_t{1} << 31;  // values per flush, < 2^32
// Prefetch this many runs ahead when the runs of a head are strided.
constexpr size_t kPrefetchRuns = 16;
constexpr size_t kMaxPrefetchBytes = 4096;

uint32_t* SubHistograms(uint32_t bins) {
  thread_local std::vector<uint32_t> scratch;
  const size_t need = static_cast<size_t>(bins) * kSubHistograms;
  if (scratch.size() < need) scratch.resize(need, 0);
  return scratch.data();
}

void FlushSubHistograms(uint32_t* sub, uint32_t bins, uint32_t lo, uint32_t hi,
                        uint64_t* histogram) {
  for (uint32_t bin = lo; bin <= hi && bin < bins; ++bin) {
    uint64_t total = 0;
    for (int k = 0; k < kSubHistograms; ++k) {
      total += sub[static_cast<size_t>(k) * bins + bin];
      sub[static_cast<size_t>(k) * bins + bin] = 0;
    }
    histogram[bin] += total;
  }
}

uint32_t HorizontalMinU32(__m256i v) {
  alignas(32) uint32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), v);
  uint32_t m = lanes[0];
  for (uint32_t x : lanes) m = std::min(m, x);
  return m;
}
uint32_t HorizontalMaxU32(__m256i v) {
  alignas(32) uint32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), v);
  uint32_t m = lanes[0];
  for (uint32_t x : lanes) m = std::max(m, x);
  return m;
}

// flatten: the per-vector lambdas below must be inlined into the loop.
template <DType kDType, bool kHistogram, bool kTail>
__attribute__((flatten)) void Avx2Runs(const void* data, size_t runs,
                                       size_t length, size_t stride,
                                       RunAccumulator& acc) {
  constexpr size_t kSize = kDType == DType::kF32 ? 4 : 2;
  const auto* base = static_cast<const unsigned char*>(data);
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256i max_finite = _mm256_set1_epi32(0x7f7fffff);
  const __m256i inf_bits = _mm256_set1_epi32(0x7f800000);
  const __m256 pos_inf = _mm256_castsi256_ps(inf_bits);
  const __m256 neg_inf =
      _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256 zero = _mm256_setzero_ps();
  const uint32_t log2_bins = acc.log2_bins_per_octave;
  const uint32_t bin_count = HistogramBinCount(log2_bins);
  const __m256i overflow_bin =
      _mm256_set1_epi32(static_cast<int>(bin_count - 1));
  TailKeeper* const tail = acc.tail;
  uint32_t* const sub = kHistogram ? SubHistograms(bin_count) : nullptr;
  const __m256i lane_offset =
      _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                         _mm256_set1_epi32(static_cast<int>(bin_count)));
  __m256i bin_lo = _mm256_set1_epi32(-1);  // as unsigned: UINT32_MAX
  __m256i bin_hi = _mm256_setzero_si256();
  size_t since_flush = 0;
  auto flush = [&] {
    if constexpr (kHistogram) {
      if (since_flush == 0) return;
      FlushSubHistograms(sub, bin_count, HorizontalMinU32(bin_lo),
                         HorizontalMaxU32(bin_hi), acc.histogram);
      bin_lo = _mm256_set1_epi32(-1);
      bin_hi = _mm256_setzero_si256();
      since_flush = 0;
    }
  };

  // Two independent sets of vector accumulators, so that the latency of
  // the double additions does not bound the loop.
  struct Lanes {
    __m256 vmin = _mm256_set1_ps(std::numeric_limits<float>::infinity());
    __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    __m256d sum0 = _mm256_setzero_pd(), sum1 = _mm256_setzero_pd();
    __m256d sq0 = _mm256_setzero_pd(), sq1 = _mm256_setzero_pd();
  };
  Lanes even, odd;
  uint64_t vector_values = 0, nonfinite = 0, nan = 0;
  __m256 threshold = _mm256_set1_ps(kTail ? tail->threshold() : 0.0f);

  // Adds the 8 values at p into the accumulator set l.
  auto add_vector = [&](const unsigned char* p, Lanes& l) {
    {
      // x + 0 turns -0.0 into +0.0 (element_math.h CanonicalZero).
      const __m256 x = _mm256_add_ps(Load8<kDType>(p), zero);
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
        l.vmin = _mm256_min_ps(l.vmin, _mm256_blendv_ps(x, pos_inf, bad_ps));
        l.vmax = _mm256_max_ps(l.vmax, _mm256_blendv_ps(x, neg_inf, bad_ps));
        xf = _mm256_blendv_ps(x, zero, bad_ps);
      } else {
        l.vmin = _mm256_min_ps(l.vmin, x);
        l.vmax = _mm256_max_ps(l.vmax, x);
      }
      const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(xf));
      const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(xf, 1));
      l.sum0 = _mm256_add_pd(l.sum0, lo);
      l.sum1 = _mm256_add_pd(l.sum1, hi);
      l.sq0 = _mm256_fmadd_pd(lo, lo, l.sq0);
      l.sq1 = _mm256_fmadd_pd(hi, hi, l.sq1);
      if constexpr (kHistogram) {
        const __m256i bin = Bins8(abs_bits, log2_bins, overflow_bin);
        bin_lo = _mm256_min_epu32(bin_lo, bin);
        bin_hi = _mm256_max_epu32(bin_hi, bin);
        // Lane indices leave the vector through 64-bit extracts: a 32-byte
        // store read back as 4-byte loads defeats store-to-load forwarding.
        const __m256i slot = _mm256_add_epi32(bin, lane_offset);
        const __m128i slot_lo = _mm256_castsi256_si128(slot);
        const __m128i slot_hi = _mm256_extracti128_si256(slot, 1);
        const uint64_t pairs[4] = {
            static_cast<uint64_t>(_mm_cvtsi128_si64(slot_lo)),
            static_cast<uint64_t>(_mm_extract_epi64(slot_lo, 1)),
            static_cast<uint64_t>(_mm_cvtsi128_si64(slot_hi)),
            static_cast<uint64_t>(_mm_extract_epi64(slot_hi, 1))};
        if (bad_mask == 0) [[likely]] {
          for (int k = 0; k < 4; ++k) {
            ++sub[static_cast<uint32_t>(pairs[k])];
            ++sub[pairs[k] >> 32];
          }
        } else {
          for (int lane = 0; lane < 8; ++lane) {
            if (((bad_mask >> lane) & 1) == 0) {
              ++sub[static_cast<uint32_t>(pairs[lane / 2] >>
                                          (32 * (lane % 2)))];
            }
          }
        }
      }
      if constexpr (kTail) {
        const __m256 abs_x = _mm256_castsi256_ps(abs_bits);
        // Ordered compare: NaN lanes are false; Inf lanes are masked out.
        int enter =
            _mm256_movemask_ps(_mm256_cmp_ps(abs_x, threshold, _CMP_GT_OQ));
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
  };
  // Adds the values [p, p + 8 * vectors) with the vector code.
  auto add_vectors = [&](const unsigned char* p, size_t vectors) {
    size_t v = 0;
    for (; v + 2 <= vectors; v += 2, p += 16 * kSize) {
      add_vector(p, even);
      add_vector(p + 8 * kSize, odd);
    }
    if (v < vectors) add_vector(p, even);
  };

  const size_t vectors_per_run = length / 8;
  const size_t rest = length - 8 * vectors_per_run;
  const size_t stride_bytes = stride * kSize;
  const size_t run_bytes = length * kSize;
  // Strided runs (TOKENS_HEADS_DIM: one head's head_dim values per token)
  // defeat the hardware prefetcher; fetch kPrefetchRuns runs ahead. Measured
  // on [2048, 8, 128] bf16: 1.6x without histograms, 1.6x with.
  const bool prefetch = stride != length && run_bytes <= kMaxPrefetchBytes;
  constexpr size_t kSegmentVectors = size_t{1} << 24;
  for (size_t r = 0; r < runs; ++r) {
    const unsigned char* p = base + r * stride_bytes;
    if (prefetch && r + kPrefetchRuns < runs) {
      const unsigned char* ahead = p + kPrefetchRuns * stride_bytes;
      for (size_t off = 0; off < run_bytes; off += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(ahead + off), _MM_HINT_T0);
      }
    }
    for (size_t done = 0; done < vectors_per_run;) {
      const size_t n = std::min(vectors_per_run - done, kSegmentVectors);
      if constexpr (kHistogram) {
        if (since_flush + 8 * n > kFlushEvery) flush();
        since_flush += 8 * n;
      }
      add_vectors(p + done * 8 * kSize, n);
      done += n;
    }
    vector_values += 8 * vectors_per_run;
    if (rest != 0) {
      ScalarRunFn(kDType)(p + 8 * vectors_per_run * kSize, 1, rest, rest, acc);
    }
  }
  flush();

  const __m256 vmin = _mm256_min_ps(even.vmin, odd.vmin);
  const __m256 vmax = _mm256_max_ps(even.vmax, odd.vmax);
  const __m256d sum0 = _mm256_add_pd(even.sum0, odd.sum0);
  const __m256d sum1 = _mm256_add_pd(even.sum1, odd.sum1);
  const __m256d sq0 = _mm256_add_pd(even.sq0, odd.sq0);
  const __m256d sq1 = _mm256_add_pd(even.sq1, odd.sq1);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmin);
  float mn = acc.min;
  for (float v : lanes) mn = std::min(mn, v);
  _mm256_store_ps(lanes, vmax);
  float mx = acc.max;
  for (float v : lanes) mx = std::max(mx, v);
  alignas(32) double d[4];
  _mm256_store_pd(d, _mm256_add_pd(sum0, sum1));
  const double sum = (d[0] + d[1]) + (d[2] + d[3]);
  _mm256_store_pd(d, _mm256_add_pd(sq0, sq1));
  const double sum_squares = (d[0] + d[1]) + (d[2] + d[3]);

  acc.min = mn;
  acc.max = mx;
  acc.finite += vector_values - nonfinite;
  acc.nan += nan;
  acc.inf += nonfinite - nan;
  acc.sum += sum;
  acc.sum_squares += sum_squares;
}  // namespace kvcal::cpu

template <DType kDType>
void Avx2Dispatch(const void* data, size_t runs, size_t length, size_t stride,
                  RunAccumulator& acc) {
  if (acc.histogram != nullptr) {
    if (acc.tail != nullptr) {
      return Avx2Runs<kDType, true, true>(data, runs, length, stride, acc);
    }
    return Avx2Runs<kDType, true, false>(data, runs, length, stride, acc);
  }
  if (acc.tail != nullptr) {
    return Avx2Runs<kDType, false, true>(data, runs, length, stride, acc);
  }
  return Avx2Runs<kDType, false, false>(data, runs, length, stride, acc);
}

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
