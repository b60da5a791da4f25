// Test helpers for the statistics engine: encoders for every input dtype, a
// chunk builder with guard bytes around the data, seeded generators (normal,
// Student-t, Cauchy-like) and a plain scalar reference of what a backend must
// accumulate.
//
// The reference deliberately uses no engine code: it decodes f16 and bf16 with
// its own arithmetic, finds histogram bins with frexp instead of bit fields,
// and keeps the tail by sorting every value. So a bug shared by the engine's
// element_math.h and the backends cannot hide behind the reference.
//
//   kvcal::testing::ChunkBuilder chunk(kvcal::DType::kBf16,
//                                      kvcal::Layout::kTokensHeadsDim,
//                                      {33, 4, 128});
//   chunk.Fill([&](const ElementIndex& at) { return rng.Normal(); });
//   kvcal::testing::Reference ref(geometry);
//   ref.Add(chunk.view(/*layer=*/0, kvcal::Role::kK));
//   ExpectStatisticsMatch(ref, *backend->Snapshot());
#ifndef KVCAL_TESTS_KERNELS_TEST_UTIL_H_
#define KVCAL_TESTS_KERNELS_TEST_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/statistics.h"
#include "kernels/types.h"

namespace kvcal::testing {

// ---------------------------------------------------------------------------
// Status matchers (the Abseil in Debian 12 has none).
// ---------------------------------------------------------------------------

inline const absl::Status& GetStatus(const absl::Status& status) {
  return status;
}
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& status_or) {
  return status_or.status();
}

MATCHER(IsOk, "is OK") {
  const absl::Status& status = GetStatus(arg);
  *result_listener << "status is " << status;
  return status.ok();
}

MATCHER_P2(StatusIs, code, message_matcher,
           "has code " + ::testing::PrintToString(code) + " and a message " +
               ::testing::DescribeMatcher<std::string>(message_matcher)) {
  const absl::Status& status = GetStatus(arg);
  *result_listener << "status is " << status;
  return status.code() == code &&
         ::testing::Matches(message_matcher)(std::string(status.message()));
}

// ---------------------------------------------------------------------------
// Encoding and decoding, independent of kernels/element_math.h.
// ---------------------------------------------------------------------------

inline uint32_t Bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}
inline float FromBits(uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

// binary16 -> float by arithmetic: (1024 + m) * 2^(e - 25), m * 2^-24.
inline float RefDecodeF16(uint16_t h) {
  const bool negative = (h & 0x8000u) != 0;
  const int e = (h >> 10) & 0x1f;
  const int m = h & 0x3ff;
  double v;
  if (e == 0x1f) {
    v = m == 0 ? std::numeric_limits<double>::infinity()
               : std::numeric_limits<double>::quiet_NaN();
  } else if (e == 0) {
    v = std::ldexp(static_cast<double>(m), -24);
  } else {
    v = std::ldexp(static_cast<double>(1024 + m), e - 25);
  }
  return static_cast<float>(negative ? -v : v);
}

inline float RefDecodeBf16(uint16_t b) {
  return FromBits(static_cast<uint32_t>(b) << 16);
}

// float -> binary16, round to nearest even; NaN stays NaN, overflow to Inf.
inline uint16_t EncodeF16(float x) {
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  if (std::isnan(x)) return 0x7e00;
  const double a = std::fabs(static_cast<double>(x));
  if (std::isinf(a)) return sign | 0x7c00;
  if (a < std::ldexp(1.0, -14)) {  // subnormal range: multiples of 2^-24
    const double m = std::nearbyint(std::ldexp(a, 24));  // 1024 = min normal
    return sign | static_cast<uint16_t>(m);
  }
  int exponent;
  std::frexp(a, &exponent);  // a = f * 2^exponent, f in [0.5, 1)
  --exponent;                // a = 1.m * 2^exponent
  double m = std::nearbyint((std::ldexp(a, -exponent) - 1.0) * 1024.0);
  if (m == 1024.0) {
    m = 0.0;
    ++exponent;
  }
  if (exponent + 15 >= 31) return sign | 0x7c00;
  return sign |
         static_cast<uint16_t>(((exponent + 15) << 10) | static_cast<int>(m));
}

// float -> bfloat16, round to nearest even; NaN stays NaN.
inline uint16_t EncodeBf16(float x) {
  const uint32_t b = Bits(x);
  if (std::isnan(x)) return static_cast<uint16_t>((b >> 16) | 0x40);
  const uint32_t rounded = b + 0x7fffu + ((b >> 16) & 1u);
  return static_cast<uint16_t>(rounded >> 16);
}

// The value `x` becomes after a round trip through `dtype`.
inline float RoundTrip(float x, DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return x;
    case DType::kF16:
      return RefDecodeF16(EncodeF16(x));
    case DType::kBf16:
      return RefDecodeBf16(EncodeBf16(x));
  }
  return x;
}

// Histogram bin of finite x by the layout documented in element_math.h, found
// with frexp and double arithmetic rather than bit fields.
inline uint32_t RefHistogramBin(float x, uint32_t bins_per_octave) {
  const double a = std::fabs(static_cast<double>(x));
  const uint32_t octaves = 48;
  if (a == 0.0) return 0;
  if (a < std::ldexp(1.0, -24)) return 1;
  if (a >= std::ldexp(1.0, 24)) return 2 + octaves * bins_per_octave;
  int exponent;
  const double f = std::frexp(a, &exponent);  // a = f * 2^exponent
  const int octave = exponent - 1 + 24;       // 0 for [2^-24, 2^-23)
  const double within = 2.0 * f - 1.0;        // [0, 1)
  const auto sub = static_cast<uint32_t>(std::floor(within * bins_per_octave));
  return 2 + static_cast<uint32_t>(octave) * bins_per_octave + sub;
}

// ---------------------------------------------------------------------------
// Seeded generators.
// ---------------------------------------------------------------------------

class Rng {
 public:
  explicit Rng(uint64_t seed) : engine_(seed) {}
  double Uniform(double lo, double hi) {
    return std::uniform_real_distribution<double>(lo, hi)(engine_);
  }
  uint64_t UniformInt(uint64_t lo, uint64_t hi) {  // inclusive
    return std::uniform_int_distribution<uint64_t>(lo, hi)(engine_);
  }
  double Normal() { return std::normal_distribution<double>()(engine_); }
  // Student-t with `dof` degrees of freedom (dof = 1 is Cauchy).
  double StudentT(double dof) {
    return std::student_t_distribution<double>(dof)(engine_);
  }
  std::mt19937_64& engine() { return engine_; }

 private:
  std::mt19937_64 engine_;
};

// ---------------------------------------------------------------------------
// Chunks with guard bytes.
// ---------------------------------------------------------------------------

// Where an element sits: its flat index and the chunk-local head it belongs to.
struct ElementIndex {
  uint64_t flat = 0;
  uint32_t head = 0;
};

// Owns the bytes of one chunk: [kGuard bytes | data | kGuard bytes]. The guard
// is 0xff, a NaN in every dtype, so a backend that reads outside the data
// counts NaNs the reference does not. The data starts at an offset that is not
// a multiple of 4, so loads must not assume alignment.
class ChunkBuilder {
 public:
  static constexpr size_t kGuard = 70;

  ChunkBuilder(DType dtype, Layout layout, std::vector<uint64_t> shape,
               uint32_t head_offset = 0, uint64_t batch = 0)
      : dtype_(dtype),
        layout_(layout),
        shape_(std::move(shape)),
        head_offset_(head_offset),
        batch_(batch) {
    elements_ = 1;
    for (uint64_t d : shape_) elements_ *= d;
    bytes_.assign(2 * kGuard + elements_ * DTypeSize(dtype_), std::byte{0xff});
  }

  uint64_t elements() const { return elements_; }
  DType dtype() const { return dtype_; }
  Layout layout() const { return layout_; }
  const std::vector<uint64_t>& shape() const { return shape_; }
  uint32_t head_offset() const { return head_offset_; }
  uint64_t batch() const { return batch_; }

  // Heads in the chunk and the chunk-local head of flat element i.
  uint32_t heads() const {
    return static_cast<uint32_t>(layout_ == Layout::kHeadsTokensDim
                                     ? shape_[1]
                                     : shape_[shape_.size() - 2]);
  }
  uint32_t HeadOf(uint64_t i) const {
    if (layout_ == Layout::kHeadsTokensDim) {
      return static_cast<uint32_t>((i / (shape_[2] * shape_[3])) % shape_[1]);
    }
    const uint64_t dim = shape_.back();
    return static_cast<uint32_t>((i / dim) % shape_[shape_.size() - 2]);
  }

  // Sets every element to value(at), rounded into the dtype.
  void Fill(const std::function<float(const ElementIndex&)>& value) {
    for (uint64_t i = 0; i < elements_; ++i) {
      SetValue(i, value(ElementIndex{i, HeadOf(i)}));
    }
  }
  void SetValue(uint64_t i, float x) {
    switch (dtype_) {
      case DType::kF32:
        SetRaw(i, Bits(x));
        break;
      case DType::kF16:
        SetRaw(i, EncodeF16(x));
        break;
      case DType::kBf16:
        SetRaw(i, EncodeBf16(x));
        break;
    }
  }
  // Stores the low DTypeSize bytes of `bits` as element i.
  void SetRaw(uint64_t i, uint32_t bits) {
    const size_t size = DTypeSize(dtype_);
    std::memcpy(bytes_.data() + kGuard + i * size, &bits, size);
  }
  uint32_t Raw(uint64_t i) const {
    uint32_t bits = 0;
    const size_t size = DTypeSize(dtype_);
    std::memcpy(&bits, bytes_.data() + kGuard + i * size, size);
    return bits;
  }
  // Element i decoded by the reference decoders.
  float Value(uint64_t i) const {
    const uint32_t raw = Raw(i);
    switch (dtype_) {
      case DType::kF32:
        return FromBits(raw);
      case DType::kF16:
        return RefDecodeF16(static_cast<uint16_t>(raw));
      case DType::kBf16:
        return RefDecodeBf16(static_cast<uint16_t>(raw));
    }
    return 0.0f;
  }

  absl::Span<const std::byte> data() const {
    return absl::Span<const std::byte>(bytes_.data() + kGuard,
                                       elements_ * DTypeSize(dtype_));
  }
  ChunkView view(uint32_t layer, Role role) const {
    ChunkView chunk;
    chunk.layer = layer;
    chunk.role = role;
    chunk.dtype = dtype_;
    chunk.layout = layout_;
    chunk.shape = shape_;
    chunk.head_offset = head_offset_;
    chunk.batch = batch_;
    chunk.data = data();
    return chunk;
  }
  // True when the guard bytes are still 0xff (nobody wrote past the data).
  bool GuardsIntact() const {
    for (size_t i = 0; i < kGuard; ++i) {
      if (bytes_[i] != std::byte{0xff}) return false;
      if (bytes_[bytes_.size() - 1 - i] != std::byte{0xff}) return false;
    }
    return true;
  }

 private:
  DType dtype_;
  Layout layout_;
  std::vector<uint64_t> shape_;
  uint32_t head_offset_;
  uint64_t batch_;
  uint64_t elements_ = 0;
  std::vector<std::byte> bytes_;
};

// ---------------------------------------------------------------------------
// The scalar reference.
// ---------------------------------------------------------------------------

struct RefHead {
  float min = std::numeric_limits<float>::infinity();
  float max = -std::numeric_limits<float>::infinity();
  uint64_t finite = 0;
  uint64_t nan = 0;
  uint64_t inf = 0;
  double sum = 0.0;
  double sum_squares = 0.0;
  double abs_sum = 0.0;  // for the tolerance on sum
  std::vector<uint64_t> histogram;
  std::vector<float> abs_values;  // every finite |x|, for the tail
  std::map<uint64_t, std::pair<float, float>> batches;
};

class Reference {
 public:
  explicit Reference(const Geometry& geometry) : geometry_(geometry) {
    for (uint32_t layer = 0; layer < geometry.num_layers; ++layer) {
      for (Role role : kAllRoles) {
        if (!geometry.collects(role)) continue;
        for (uint32_t h = 0; h < geometry.heads(role); ++h) {
          RefHead& head = heads_[Key(layer, role, h)];
          if (geometry.bins_per_octave != 0) {
            head.histogram.assign(2 + 48 * geometry.bins_per_octave + 1, 0);
          }
        }
      }
    }
  }

  const Geometry& geometry() const { return geometry_; }

  // How far the backends' double sums may be from this reference's, relative
  // to the sum of |x| (resp. x^2). 16-bit inputs: the CPU backend adds at
  // most 8 values per float lane before it goes to double
  // (kernels/cpu/run_kernels_internal.h), each partial within 8 * 2^-24 of
  // its |x| sum.
  double sum_tolerance() const { return sum_tolerance_; }

  void Add(const ChunkBuilder& chunk, uint32_t layer, Role role) {
    if (chunk.dtype() != DType::kF32) {
      sum_tolerance_ = std::max(sum_tolerance_, 8.0 / 16777216.0);
    }
    for (uint64_t i = 0; i < chunk.elements(); ++i) {
      AddValue(layer, role, chunk.head_offset() + chunk.HeadOf(i),
               chunk.batch(), chunk.Value(i));
    }
  }

  void AddValue(uint32_t layer, Role role, uint32_t head, uint64_t batch,
                float x) {
    RefHead& h = heads_.at(Key(layer, role, head));
    if (std::isnan(x)) {
      ++h.nan;
      return;
    }
    if (std::isinf(x)) {
      ++h.inf;
      return;
    }
    if (x == 0.0f) x = 0.0f;  // documented: min/max see -0.0 as +0.0
    h.min = std::min(h.min, x);
    h.max = std::max(h.max, x);
    ++h.finite;
    h.sum += x;
    h.sum_squares += static_cast<double>(x) * x;
    h.abs_sum += std::fabs(static_cast<double>(x));
    auto [it, inserted] = h.batches.try_emplace(batch, x, x);
    if (!inserted) {
      it->second.first = std::min(it->second.first, x);
      it->second.second = std::max(it->second.second, x);
    }
    if (geometry_.bins_per_octave != 0) {
      ++h.histogram[RefHistogramBin(x, geometry_.bins_per_octave)];
      h.abs_values.push_back(std::fabs(x));
    }
  }

  const RefHead& head(uint32_t layer, Role role, uint32_t h) const {
    return heads_.at(Key(layer, role, h));
  }

  static uint64_t Key(uint32_t layer, Role role, uint32_t head) {
    return (static_cast<uint64_t>(layer) << 16) |
           (static_cast<uint64_t>(RoleIndex(role)) << 12) | head;
  }

 private:
  double sum_tolerance_ = 1e-9;
  Geometry geometry_;
  std::map<uint64_t, RefHead> heads_;
};

inline std::vector<float> RefTail(const RefHead& head) {
  std::vector<float> tail = head.abs_values;
  std::sort(tail.begin(), tail.end(), std::greater<float>());
  if (tail.size() > 256) tail.resize(256);
  return tail;
}

inline std::vector<uint32_t> BitsOf(const std::vector<float>& values) {
  std::vector<uint32_t> out;
  out.reserve(values.size());
  for (float v : values) out.push_back(Bits(v));
  return out;
}

// Checks `actual` against the reference: bit for bit for min, max, counts,
// histograms, tails and batch extrema; sums within ref.sum_tolerance() of
// the sum of |x| (resp. x^2).
inline void ExpectMatchesReference(const Reference& ref,
                                   const SessionStatistics& actual,
                                   const std::string& context = "") {
  const Geometry& g = ref.geometry();
  ASSERT_EQ(actual.geometry(), g) << context;
  for (uint32_t layer = 0; layer < g.num_layers; ++layer) {
    for (Role role : g.roles()) {
      for (uint32_t hi = 0; hi < g.heads(role); ++hi) {
        SCOPED_TRACE(::testing::Message()
                     << context << " layer " << layer << " role "
                     << RoleName(role) << " head " << hi);
        const RefHead& e = ref.head(layer, role, hi);
        const HeadStatistics& a = actual.head(layer, role, hi);
        EXPECT_EQ(Bits(a.min), Bits(e.min)) << a.min << " vs " << e.min;
        EXPECT_EQ(Bits(a.max), Bits(e.max)) << a.max << " vs " << e.max;
        EXPECT_EQ(a.finite_count, e.finite);
        EXPECT_EQ(a.nan_count, e.nan);
        EXPECT_EQ(a.inf_count, e.inf);
        const double tol = ref.sum_tolerance();
        EXPECT_NEAR(a.sum, e.sum, tol * e.abs_sum + 1e-300);
        EXPECT_NEAR(a.sum_squares, e.sum_squares, tol * e.sum_squares + 1e-300);
        EXPECT_EQ(a.histogram, e.histogram);
        if (g.bins_per_octave != 0) {
          EXPECT_EQ(BitsOf(a.tail), BitsOf(RefTail(e)));
        } else {
          EXPECT_TRUE(a.tail.empty());
        }
        std::map<uint64_t, std::pair<uint32_t, uint32_t>> actual_batches,
            expected_batches;
        for (const auto& [batch, mm] : a.batches) {
          actual_batches[batch] = {Bits(mm.min), Bits(mm.max)};
        }
        for (const auto& [batch, mm] : e.batches) {
          expected_batches[batch] = {Bits(mm.first), Bits(mm.second)};
        }
        EXPECT_EQ(actual_batches, expected_batches);
        if (::testing::Test::HasFailure()) return;  // one head is enough
      }
    }
  }
}

// Exact equality of two states except the double sums (relative tolerance).
inline void ExpectStatesEqual(const SessionStatistics& expected,
                              const SessionStatistics& actual) {
  ASSERT_EQ(actual.geometry(), expected.geometry());
  ASSERT_EQ(actual.num_heads_total(), expected.num_heads_total());
  for (size_t i = 0; i < expected.num_heads_total(); ++i) {
    SCOPED_TRACE(::testing::Message() << "flat head " << i);
    const HeadStatistics& e = expected.heads()[i];
    const HeadStatistics& a = actual.heads()[i];
    EXPECT_EQ(Bits(a.min), Bits(e.min));
    EXPECT_EQ(Bits(a.max), Bits(e.max));
    EXPECT_EQ(a.finite_count, e.finite_count);
    EXPECT_EQ(a.nan_count, e.nan_count);
    EXPECT_EQ(a.inf_count, e.inf_count);
    EXPECT_NEAR(
        a.sum, e.sum,
        1e-9 * std::sqrt(e.sum_squares) * std::sqrt(double(e.finite_count)) +
            1e-300);
    EXPECT_NEAR(a.sum_squares, e.sum_squares, 1e-9 * e.sum_squares + 1e-300);
    EXPECT_EQ(a.histogram, e.histogram);
    EXPECT_EQ(BitsOf(a.tail), BitsOf(e.tail));
    EXPECT_EQ(a.batches, e.batches);
    if (::testing::Test::HasFailure()) return;
  }
}

}  // namespace kvcal::testing

#endif  // KVCAL_TESTS_KERNELS_TEST_UTIL_H_
