#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

#include "kernels/cpu/run_kernels.h"
#include "kernels/cpu/run_kernels_internal.h"
#include "kernels/element_math.h"

namespace kvcal::cpu {

TailKeeper::TailKeeper(const std::vector<float>& sorted_descending) {
  values_.reserve(kBufferCapacity);
  values_.assign(sorted_descending.begin(), sorted_descending.end());
  if (values_.size() > kTailCapacity) Select();
  if (values_.size() >= kTailCapacity) threshold_ = values_[kTailCapacity - 1];
}

void TailKeeper::Select() {
  std::nth_element(values_.begin(), values_.begin() + (kTailCapacity - 1),
                   values_.end(), std::greater<float>());
  values_.resize(kTailCapacity);
  threshold_ = values_[kTailCapacity - 1];
}

void TailKeeper::StoreSortedDescending(std::vector<float>* out) {
  if (changed_) {
    if (values_.size() > kTailCapacity) Select();
    std::sort(values_.begin(), values_.end(), std::greater<float>());
    changed_ = false;
  }
  out->assign(values_.begin(), values_.end());
}

namespace {

template <DType kDType>
float LoadValue(const unsigned char* p, size_t i) {
  if constexpr (kDType == DType::kF32) {
    float x;
    std::memcpy(&x, p + 4 * i, 4);
    return x;
  } else {
    uint16_t bits;
    std::memcpy(&bits, p + 2 * i, 2);
    return kDType == DType::kF16 ? DecodeF16(bits) : DecodeBf16(bits);
  }
}

// Adds finite x to acc's histogram and (with offer_tail) tail.
inline void BinAndOffer(float x, RunAccumulator& acc, bool offer_tail = true) {
  if (acc.histogram != nullptr) {
    ++acc.histogram[HistogramBin(x, acc.log2_bins_per_octave)];
  }
  if (offer_tail && acc.tail != nullptr) {
    const float a = std::fabs(x);
    if (a > acc.tail->threshold()) acc.tail->Offer(a);
  }
}

// Counts x (its zero canonical) in acc: NaN and Inf in their counts
// (returns false: nothing more to add), else finite, min and max.
inline bool CountFinite(float x, RunAccumulator& acc) {
  if (CountIfNonFinite(x, acc.nan, acc.inf)) return false;
  ++acc.finite;
  acc.min = std::min(acc.min, x);
  acc.max = std::max(acc.max, x);
  return true;
}

template <DType kDType>
void ScalarRun(const void* data, size_t n, RunAccumulator& acc) {
  const auto* p = static_cast<const unsigned char*>(data);
  float mn = acc.min, mx = acc.max;
  uint64_t finite = 0, nan = 0, inf = 0;
  double sum = 0.0, sum_squares = 0.0;
  for (size_t i = 0; i < n; ++i) {
    const float x = CanonicalZero(LoadValue<kDType>(p, i));
    if (CountIfNonFinite(x, nan, inf)) continue;
    ++finite;
    mn = std::min(mn, x);
    mx = std::max(mx, x);
    sum += x;
    sum_squares += static_cast<double>(x) * x;
    BinAndOffer(x, acc);
  }
  acc.min = mn;
  acc.max = mx;
  acc.finite += finite;
  acc.nan += nan;
  acc.inf += inf;
  acc.sum += sum;
  acc.sum_squares += sum_squares;
}

template <DType kDType>
void ScalarRows(const void* data, size_t rows, size_t stride, size_t heads,
                size_t length, RunAccumulator* accs) {
  const auto* p = static_cast<const unsigned char*>(data);
  constexpr size_t kSize = kDType == DType::kF32 ? 4 : 2;
  for (size_t r = 0; r < rows; ++r) {
    for (size_t h = 0; h < heads; ++h) {
      ScalarRun<kDType>(p + (r * stride + h * length) * kSize, length, accs[h]);
    }
  }
}

template <DType kDType>
void CarefulBlock(const unsigned char* p, size_t n, size_t tail_from,
                  RunAccumulator& acc, internal::DoubleLanes& lanes);

// 16-bit values in the canonical order (run_kernels_internal.h).
template <DType kDType>
void Scalar16Spans(const RowSpan* spans, size_t count, size_t heads,
                   RunAccumulator* accs) {
  using internal::kBlockValues;
  using internal::kGroupValues;
  using internal::kLanes;
  std::vector<internal::DoubleLanes> lanes(heads, internal::DoubleLanes{});
  for (const RowSpan* span = spans; span != spans + count; ++span) {
    const auto* base = static_cast<const unsigned char*>(span->data);
    const size_t length = span->length;
    for (size_t r = 0; r < span->rows; ++r) {
      for (size_t j = 0; j < span->heads; ++j) {
        const size_t h = span->head + j;
        const unsigned char* run = base + (r * span->stride + j * length) * 2;
        for (size_t b = 0; b < length; b += kBlockValues) {
          const unsigned char* p = run + b * 2;
          const size_t n = std::min(kBlockValues, length - b);
          float s[2 * kLanes] = {}, q[2 * kLanes] = {};
          for (size_t i = 0; i < n; ++i) {
            const float x = LoadValue<kDType>(p, i);
            const size_t lane = internal::Lane16(kDType, i % kGroupValues);
            s[lane] += x;
            q[lane] += x * x;  // exact for 16-bit x: no contraction question
          }
          // The lane sums A + B the double lanes would get: all finite
          // (no NaN or Inf input, no float overflow, also not in A + B).
          float s_ab[kLanes], q_ab[kLanes];
          bool finite = true, tiny = true;
          for (size_t k = 0; k < kLanes; ++k) {
            s_ab[k] = s[k] + s[kLanes + k];
            q_ab[k] = q[k] + q[kLanes + k];
            finite &= !internal::NonFiniteBits(FloatBits(s_ab[k])) &&
                      !internal::NonFiniteBits(FloatBits(q_ab[k]));
          }
          for (size_t k = 0; k < 2 * kLanes; ++k) {
            tiny &= q[k] < internal::kTinySquares;
          }
          if (finite && !tiny) {
            for (size_t k = 0; k < kLanes; ++k) {
              lanes[h].sum[k] += static_cast<double>(s_ab[k]);
              lanes[h].sum_squares[k] += static_cast<double>(q_ab[k]);
            }
            internal::ExactStats16(kDType, p, n, accs[h]);
          } else {
            CarefulBlock<kDType>(p, n, 0, accs[h], lanes[h]);
          }
        }
      }
    }
  }
  for (size_t h = 0; h < heads; ++h) {
    accs[h].sum += internal::FoldLanes(lanes[h].sum);
    accs[h].sum_squares += internal::FoldLanes(lanes[h].sum_squares);
  }
}

template <DType kDType>
void Scalar16Rows(const void* data, size_t rows, size_t stride, size_t heads,
                  size_t length, RunAccumulator* accs) {
  const RowSpan span{data, rows, stride, 0, heads, length};
  Scalar16Spans<kDType>(&span, 1, heads, accs);
}

// f32 values in the AVX2 kernel's order (run_kernels_internal.h).
double FoldF32Lanes(const double* l) {
  double d[4];
  for (size_t k = 0; k < 4; ++k) {
    d[k] = (l[k] + l[8 + k]) + (l[4 + k] + l[12 + k]);
  }
  return (d[0] + d[1]) + (d[2] + d[3]);
}

template <bool kHistogram>
void ScalarF32Rows(const void* data, size_t rows, size_t stride, size_t heads,
                   size_t length, RunAccumulator* accs) {
  if (length < 8) {
    return ScalarRows<DType::kF32>(data, rows, stride, heads, length, accs);
  }
  const auto* base = static_cast<const unsigned char*>(data);
  const size_t vector_values = 16 * (length / 16) + 8 * ((length / 8) % 2);
  const size_t rest = length % 8;
  std::vector<internal::DoubleLanes> lanes(heads, internal::DoubleLanes{});
  for (size_t r = 0; r < rows; ++r) {
    for (size_t h = 0; h < heads; ++h) {
      const unsigned char* p = base + (r * stride + h * length) * 4;
      RunAccumulator& acc = accs[h];
      internal::DoubleLanes& l = lanes[h];
      for (size_t i = 0; i < vector_values; ++i) {
        const float x = CanonicalZero(LoadValue<DType::kF32>(p, i));
        if (!CountFinite(x, acc)) continue;
        const size_t lane = kHistogram ? i % 8 : i % 16;
        l.sum[lane] += x;
        l.sum_squares[lane] += static_cast<double>(x) * x;
        BinAndOffer(x, acc);
      }
      if (rest != 0) {
        ScalarRun<DType::kF32>(p + (length - rest) * 4, rest, acc);
      }
    }
  }
  for (size_t h = 0; h < heads; ++h) {
    accs[h].sum += FoldF32Lanes(lanes[h].sum);
    accs[h].sum_squares += FoldF32Lanes(lanes[h].sum_squares);
  }
}

void ScalarF32Dispatch(const void* data, size_t rows, size_t stride,
                       size_t heads, size_t length, RunAccumulator* accs) {
  if (rows == 0 || heads == 0 || length == 0) return;
  if (accs[0].histogram != nullptr) {
    return ScalarF32Rows<true>(data, rows, stride, heads, length, accs);
  }
  return ScalarF32Rows<false>(data, rows, stride, heads, length, accs);
}

// Values [begin, end) of a block: exact statistics, and (when `lanes`) the
// double redo of the sums, value i going to its canonical lane.
template <DType kDType>
void AddExact16(const unsigned char* p, size_t begin, size_t end,
                bool offer_tail, RunAccumulator& acc,
                internal::DoubleLanes* lanes) {
  for (size_t i = begin; i < end; ++i) {
    const float x = CanonicalZero(LoadValue<kDType>(p, i));
    if (!CountFinite(x, acc)) continue;
    if (lanes != nullptr) {
      const size_t lane = internal::Lane16(kDType, i % internal::kGroupValues) %
                          internal::kLanes;
      lanes->sum[lane] += static_cast<double>(x);
      lanes->sum_squares[lane] += static_cast<double>(x) * x;
    }
    BinAndOffer(x, acc, offer_tail);
  }
}

template <DType kDType>
void CarefulBlock(const unsigned char* p, size_t n, size_t tail_from,
                  RunAccumulator& acc, internal::DoubleLanes& lanes) {
  const size_t from = std::min(tail_from, n);
  AddExact16<kDType>(p, 0, from, false, acc, &lanes);
  AddExact16<kDType>(p, from, n, true, acc, &lanes);
}

}  // namespace

namespace internal {

double FoldLanes(const double* lanes) {
  double t[kLanes];
  std::copy(lanes, lanes + kLanes, t);
  for (size_t width = kLanes / 2; width >= 1; width /= 2) {
    for (size_t k = 0; k < width; ++k) t[k] += t[k + width];
  }
  return t[0];
}

void CarefulBlock16(DType dtype, const unsigned char* p, size_t n,
                    size_t tail_from, RunAccumulator& acc, DoubleLanes& lanes) {
  if (dtype == DType::kBf16) {
    CarefulBlock<DType::kBf16>(p, n, tail_from, acc, lanes);
  } else {
    CarefulBlock<DType::kF16>(p, n, tail_from, acc, lanes);
  }
}

void ExactStats16(DType dtype, const unsigned char* p, size_t n,
                  RunAccumulator& acc) {
  if (dtype == DType::kBf16) {
    AddExact16<DType::kBf16>(p, 0, n, true, acc, nullptr);
  } else {
    AddExact16<DType::kF16>(p, 0, n, true, acc, nullptr);
  }
}

}  // namespace internal

Loops ScalarLoops(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return {&ScalarF32Dispatch, &internal::SpansByRows<&ScalarF32Dispatch>};
    case DType::kF16:
      return {&Scalar16Rows<DType::kF16>, &Scalar16Spans<DType::kF16>};
    case DType::kBf16:
      return {&Scalar16Rows<DType::kBf16>, &Scalar16Spans<DType::kBf16>};
  }
  return {};
}

}  // namespace kvcal::cpu
