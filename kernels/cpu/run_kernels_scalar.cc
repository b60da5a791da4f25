#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>

#include "kernels/cpu/run_kernels.h"
#include "kernels/element_math.h"

namespace kvcal::cpu {

TailKeeper::TailKeeper(const std::vector<float>& sorted_descending)
    : heap_(sorted_descending) {
  std::make_heap(heap_.begin(), heap_.end(), std::greater<float>());
  if (heap_.size() >= kTailCapacity) threshold_ = heap_.front();
}

void TailKeeper::Offer(float abs_value) {
  if (heap_.size() < kTailCapacity) {
    heap_.push_back(abs_value);
    std::push_heap(heap_.begin(), heap_.end(), std::greater<float>());
    if (heap_.size() == kTailCapacity) threshold_ = heap_.front();
    return;
  }
  if (!(abs_value > heap_.front())) return;
  std::pop_heap(heap_.begin(), heap_.end(), std::greater<float>());
  heap_.back() = abs_value;
  std::push_heap(heap_.begin(), heap_.end(), std::greater<float>());
  threshold_ = heap_.front();
}

void TailKeeper::StoreSortedDescending(std::vector<float>* out) {
  out->assign(heap_.begin(), heap_.end());
  std::sort(out->begin(), out->end(), std::greater<float>());
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

template <DType kDType>
void ScalarRun(const void* data, size_t n, RunAccumulator& acc) {
  const auto* p = static_cast<const unsigned char*>(data);
  float mn = acc.min, mx = acc.max;
  uint64_t finite = 0, nan = 0, inf = 0;
  double sum = 0.0, sum_squares = 0.0;
  for (size_t i = 0; i < n; ++i) {
    const float x = CanonicalZero(LoadValue<kDType>(p, i));
    if (IsNonFinite(x)) {
      if (IsNan(x)) {
        ++nan;
      } else {
        ++inf;
      }
      continue;
    }
    ++finite;
    mn = std::min(mn, x);
    mx = std::max(mx, x);
    sum += x;
    sum_squares += static_cast<double>(x) * x;
    if (acc.histogram != nullptr) {
      ++acc.histogram[HistogramBin(x, acc.log2_bins_per_octave)];
    }
    if (acc.tail != nullptr) {
      const float a = std::fabs(x);
      if (a > acc.tail->threshold()) acc.tail->Offer(a);
    }
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

}  // namespace

RowsFn ScalarRowsFn(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return &ScalarRows<DType::kF32>;
    case DType::kF16:
      return &ScalarRows<DType::kF16>;
    case DType::kBf16:
      return &ScalarRows<DType::kBf16>;
  }
  return nullptr;
}

RowsFn BestRowsFn(DType dtype) {
  RowsFn fn = Avx2RowsFn(dtype);
  return fn != nullptr ? fn : ScalarRowsFn(dtype);
}

}  // namespace kvcal::cpu
