// Scale math: FP8/INT8 rounding against known values, every observer against
// hand-computed results on small inputs, granularity, q_per_kv_group, margin,
// missing heads, option validation, and MSE against a brute-force
// llm-compressor-style grid search over the raw values.
#include "kernels/scale_math.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/statistics.h"
#include "tests/kernels/test_util.h"

namespace kvcal {
namespace {

using ::kvcal::testing::IsOk;
using ::kvcal::testing::Rng;
using ::kvcal::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;

constexpr float kInf = std::numeric_limits<float>::infinity();

// Each observer's range function, through the registry (observers/).
float RangeOf(Observer observer, HeadSpan heads,
              const ObserverParameters& parameters, uint32_t log2_bins) {
  const ObserverDefinition* d = FindObserver(observer);
  EXPECT_NE(d, nullptr);
  return d == nullptr ? 0.0f : d->range(heads, parameters, log2_bins);
}
float MinMaxRange(HeadSpan heads, Observer observer, float c) {
  ObserverParameters p;
  p.averaging_constant = c;
  return RangeOf(observer, heads, p, 0);
}
float PercentileRange(HeadSpan heads, double percentile, uint32_t log2_bins) {
  ObserverParameters p;
  p.percentile = percentile;
  return RangeOf(Observer::kPercentile, heads, p, log2_bins);
}
float MseRange(HeadSpan heads, const ScaleOptions& options,
               uint32_t log2_bins) {
  return RangeOf(Observer::kMse, heads, options, log2_bins);
}
constexpr float kNan = std::numeric_limits<float>::quiet_NaN();

Geometry MakeGeometry(uint32_t layers, uint32_t q_heads, uint32_t kv_heads,
                      uint32_t bins_per_octave, uint32_t role_mask = 0b111) {
  Geometry g;
  g.num_layers = layers;
  g.num_attention_heads = q_heads;
  g.num_key_value_heads = kv_heads;
  g.head_dim = 1;
  g.bins_per_octave = bins_per_octave;
  g.role_mask = role_mask;
  return g;
}

void AddValues(SessionStatistics& stats, uint32_t layer, Role role,
               uint32_t head, uint64_t batch,
               const std::vector<float>& values) {
  const uint32_t log2 = stats.geometry().log2_bins_per_octave();
  for (float v : values) stats.head(layer, role, head).Add(v, batch, log2);
}

// Every (layer, role, head) gets one value so that nothing is missing.
void FillAll(SessionStatistics& stats, float value = 1.0f) {
  const Geometry& g = stats.geometry();
  for (uint32_t layer = 0; layer < g.num_layers; ++layer) {
    for (Role role : g.roles()) {
      for (uint32_t h = 0; h < g.heads(role); ++h) {
        AddValues(stats, layer, role, h, 0, {value});
      }
    }
  }
}

const RoleScales& Role0(const ScaleResult& result, Role role,
                        uint32_t slot = 0) {
  return *result.layers.at(slot).role(role);
}

ScaleOptions Options(Observer observer, Granularity granularity) {
  ScaleOptions options;
  options.observer = observer;
  options.granularity = granularity;
  return options;
}

// ---------------------------------------------------------------------------
// Formats and rounding.
// ---------------------------------------------------------------------------

TEST(FormatTest, Maxima) {
  EXPECT_EQ(FormatMax(Format::kFp8E4m3fn), 448.0f);
  EXPECT_EQ(FormatMax(Format::kFp8E4m3fnuz), 240.0f);
  EXPECT_EQ(FormatMax(Format::kFp8E5m2), 57344.0f);
  EXPECT_EQ(FormatMax(Format::kInt8), 127.0f);
}

struct RoundCase {
  Format format;
  float in;
  float out;
};

TEST(FormatTest, RoundToFormatKnownValues) {
  const float s9 = std::ldexp(1.0f, -9);    // e4m3fn smallest subnormal
  const float s10 = std::ldexp(1.0f, -10);  // e4m3fnuz smallest subnormal
  const float s16 = std::ldexp(1.0f, -16);  // e5m2 smallest subnormal
  const RoundCase cases[] = {
      // e4m3fn: 3 mantissa bits, min normal 2^-6, max 448.
      {Format::kFp8E4m3fn, 1.0f, 1.0f},
      {Format::kFp8E4m3fn, 1.0625f, 1.0f},   // tie -> even (1.000)
      {Format::kFp8E4m3fn, 1.1875f, 1.25f},  // tie -> even (1.010)
      {Format::kFp8E4m3fn, 1.07f, 1.125f},   // nearest
      {Format::kFp8E4m3fn, 448.0f, 448.0f},
      {Format::kFp8E4m3fn, 432.0f, 448.0f},  // tie 416/448 -> 448 (even)
      {Format::kFp8E4m3fn, 424.0f, 416.0f},
      {Format::kFp8E4m3fn, -3.3f, -3.25f},
      {Format::kFp8E4m3fn, s9, s9},
      {Format::kFp8E4m3fn, 0.5f * s9, 0.0f},  // tie 0/s -> 0
      {Format::kFp8E4m3fn, 0.75f * s9, s9},
      {Format::kFp8E4m3fn, 1.5f * s9, 2.0f * s9},  // tie -> even
      {Format::kFp8E4m3fn, 2.5f * s9, 2.0f * s9},  // tie -> even
      {Format::kFp8E4m3fn, 7.0f * s9, 7.0f * s9},  // largest subnormal
      {Format::kFp8E4m3fn, 7.5f * s9, 8.0f * s9},  // -> min normal 2^-6
      {Format::kFp8E4m3fn, std::ldexp(1.0f, -6), std::ldexp(1.0f, -6)},
      {Format::kFp8E4m3fn, 0.0f, 0.0f},
      // e4m3fnuz: min normal 2^-7, subnormal step 2^-10, max 240.
      {Format::kFp8E4m3fnuz, 240.0f, 240.0f},
      {Format::kFp8E4m3fnuz, 232.0f, 224.0f},  // tie 224/240 -> 224 (even)
      {Format::kFp8E4m3fnuz, 239.0f, 240.0f},
      {Format::kFp8E4m3fnuz, s10, s10},
      {Format::kFp8E4m3fnuz, 0.5f * s10, 0.0f},
      {Format::kFp8E4m3fnuz, 3.0f * 0.5f * s10, 2.0f * s10},
      {Format::kFp8E4m3fnuz, std::ldexp(1.0f, -7), std::ldexp(1.0f, -7)},
      {Format::kFp8E4m3fnuz, -1.0625f, -1.0f},
      // e5m2: 2 mantissa bits, min normal 2^-14, max 57344.
      {Format::kFp8E5m2, 57344.0f, 57344.0f},
      {Format::kFp8E5m2, 53248.0f, 49152.0f},  // tie 49152/57344 -> even
      {Format::kFp8E5m2, 55000.0f, 57344.0f},
      {Format::kFp8E5m2, 1.125f, 1.0f},  // tie -> even (1.00)
      {Format::kFp8E5m2, 1.375f, 1.5f},  // tie -> even (1.10)
      {Format::kFp8E5m2, 1.2f, 1.25f},
      {Format::kFp8E5m2, s16, s16},
      {Format::kFp8E5m2, 0.5f * s16, 0.0f},
      {Format::kFp8E5m2, 3.0f * s16, 3.0f * s16},
      {Format::kFp8E5m2, 3.5f * s16, 4.0f * s16},
      // int8: round half to even, as torch.round does.
      {Format::kInt8, 2.5f, 2.0f},
      {Format::kInt8, 3.5f, 4.0f},
      {Format::kInt8, -2.5f, -2.0f},
      {Format::kInt8, 126.6f, 127.0f},
      {Format::kInt8, 0.49f, 0.0f},
  };
  for (const RoundCase& c : cases) {
    EXPECT_EQ(RoundToFormat(c.in, c.format), c.out)
        << static_cast<int>(c.format) << " " << c.in;
    EXPECT_EQ(RoundToFormat(-c.in, c.format), -c.out)
        << static_cast<int>(c.format) << " " << -c.in;
  }
}

TEST(FormatTest, RoundingIsIdempotentOnEveryE4m3fnValue) {
  // All 127 positive finite e4m3fn values: exponent field 0..15, mantissa 0..7
  // except S.1111.111 (NaN).
  for (int e = 0; e < 16; ++e) {
    for (int m = 0; m < 8; ++m) {
      if (e == 15 && m == 7) continue;
      const float v = e == 0 ? std::ldexp(static_cast<float>(m), -9)
                             : std::ldexp(1.0f + m / 8.0f, e - 7);
      EXPECT_EQ(RoundToFormat(v, Format::kFp8E4m3fn), v) << v;
    }
  }
}

TEST(FormatTest, FakeQuantizeClampsRoundsAndRescales) {
  EXPECT_EQ(FakeQuantize(1000.0f, 1.0f, Format::kFp8E4m3fn), 448.0f);
  EXPECT_EQ(FakeQuantize(-1000.0f, 1.0f, Format::kFp8E4m3fn), -448.0f);
  EXPECT_EQ(FakeQuantize(1000.0f, 2.0f, Format::kFp8E4m3fnuz), 480.0f);
  EXPECT_EQ(FakeQuantize(1e9f, 1.0f, Format::kFp8E5m2), 57344.0f);
  EXPECT_EQ(FakeQuantize(300.0f, 1.0f, Format::kInt8), 127.0f);
  // 0.3 / 0.5 = 0.6 -> 0.625 (step 1/16 in [0.5, 1)) -> 0.3125.
  EXPECT_EQ(FakeQuantize(0.3f, 0.5f, Format::kFp8E4m3fn), 0.3125f);
  EXPECT_EQ(FakeQuantize(0.0f, 0.5f, Format::kFp8E4m3fn), 0.0f);
  // x / scale in float32 first, as torch does: 1/3 rounds before quantizing.
  const float scale = 1.0f / 3.0f;
  EXPECT_EQ(FakeQuantize(1.0f, scale, Format::kInt8),
            std::nearbyint(1.0f / scale) * scale);
}

TEST(FormatTest, ScaleFromRange) {
  EXPECT_EQ(ScaleFromRange(448.0f, 1.0f, Format::kFp8E4m3fn), 1.0f);
  EXPECT_EQ(ScaleFromRange(240.0f, 1.0f, Format::kFp8E4m3fnuz), 1.0f);
  EXPECT_EQ(ScaleFromRange(57344.0f, 0.5f, Format::kFp8E5m2), 0.5f);
  EXPECT_EQ(ScaleFromRange(127.0f, 2.0f, Format::kInt8), 2.0f);
  EXPECT_EQ(ScaleFromRange(3.0f, 1.05f, Format::kFp8E4m3fn),
            (3.0f * 1.05f) / 448.0f);
  EXPECT_EQ(ScaleFromRange(0.0f, 1.0f, Format::kFp8E4m3fn), FLT_EPSILON);
  // Overflow to Inf never escapes.
  const float huge = ScaleFromRange(FLT_MAX, 1000.0f, Format::kInt8);
  EXPECT_TRUE(std::isfinite(huge));
  EXPECT_GT(huge, 0.0f);
  // Underflow to 0 becomes FLT_EPSILON.
  EXPECT_EQ(ScaleFromRange(1e-44f, 1.0f, Format::kFp8E5m2), FLT_EPSILON);
}

// ---------------------------------------------------------------------------
// Min-max observers.
// ---------------------------------------------------------------------------

// Two K heads:
//   head 0: batch 1 {-1, 2}, batch 2 {-3, 4}, batch 3 {0.5, 1},
//           batch 5 only NaN/Inf (not a batch with finite values)
//   head 1: batch 1 {5, 6},  batch 2 {-7, 2}
SessionStatistics ObserverState(uint32_t bins = 0) {
  SessionStatistics stats(MakeGeometry(1, 2, 2, bins, 0b010));
  AddValues(stats, 0, Role::kK, 0, 1, {-1.0f, 2.0f});
  AddValues(stats, 0, Role::kK, 0, 2, {-3.0f, 4.0f});
  AddValues(stats, 0, Role::kK, 0, 3, {0.5f, 1.0f});
  AddValues(stats, 0, Role::kK, 0, 5, {kNan, kInf, -kInf});
  AddValues(stats, 0, Role::kK, 1, 1, {5.0f, 6.0f});
  AddValues(stats, 0, Role::kK, 1, 2, {-7.0f, 2.0f});
  return stats;
}

TEST(MinMaxObserverTest, StaticPerTensorAndPerHead) {
  const SessionStatistics stats = ObserverState();
  auto t = ComputeScales(
      stats, Options(Observer::kStaticMinMax, Granularity::kPerTensor));
  ASSERT_THAT(t, IsOk());
  ASSERT_EQ(t->layers.size(), 1u);
  EXPECT_FALSE(t->layers[0].role(Role::kQ).has_value());
  EXPECT_FALSE(t->layers[0].role(Role::kV).has_value());
  EXPECT_THAT(Role0(*t, Role::kK).scale, ElementsAre(7.0f / 448.0f));
  EXPECT_THAT(Role0(*t, Role::kK).absmax, ElementsAre(7.0f));
  EXPECT_EQ(Role0(*t, Role::kK).count, 10u);
  EXPECT_EQ(Role0(*t, Role::kK).nonfinite, 3u);
  auto h = ComputeScales(
      stats, Options(Observer::kStaticMinMax, Granularity::kPerHead));
  ASSERT_THAT(h, IsOk());
  EXPECT_THAT(Role0(*h, Role::kK).scale,
              ElementsAre(4.0f / 448.0f, 7.0f / 448.0f));
  EXPECT_THAT(Role0(*h, Role::kK).absmax, ElementsAre(4.0f, 7.0f));
}

TEST(MinMaxObserverTest, RangeIsClampedToIncludeZero) {
  SessionStatistics stats(MakeGeometry(1, 2, 1, 0, 0b001));
  AddValues(stats, 0, Role::kQ, 0, 0, {2.0f, 3.0f});    // all positive
  AddValues(stats, 0, Role::kQ, 1, 0, {-4.0f, -1.0f});  // all negative
  auto h = ComputeScales(
      stats, Options(Observer::kStaticMinMax, Granularity::kPerHead));
  ASSERT_THAT(h, IsOk());
  EXPECT_THAT(Role0(*h, Role::kQ).scale,
              ElementsAre(3.0f / 448.0f, 4.0f / 448.0f));
}

TEST(MinMaxObserverTest, EmaWithAveragingConstant) {
  const SessionStatistics stats = ObserverState();
  ScaleOptions options = Options(Observer::kMinMaxEma, Granularity::kPerHead);
  options.averaging_constant = 0.5f;
  auto h = ComputeScales(stats, options);
  ASSERT_THAT(h, IsOk());
  // head 0: min -1 -> -2 -> -0.75, max 2 -> 3 -> 2: range 2.
  // head 1: min 5 -> -1, max 6 -> 4: range 4.
  EXPECT_THAT(Role0(*h, Role::kK).scale,
              ElementsAre(2.0f / 448.0f, 4.0f / 448.0f));
  // absmax stays the static absmax.
  EXPECT_THAT(Role0(*h, Role::kK).absmax, ElementsAre(4.0f, 7.0f));
  // Per tensor: batches reduced over heads first: {-1, 6}, {-7, 4},
  // {0.5, 1}: min -1 -> -4 -> -1.75, max 6 -> 5 -> 3: range 3.
  options.granularity = Granularity::kPerTensor;
  auto t = ComputeScales(stats, options);
  ASSERT_THAT(t, IsOk());
  EXPECT_THAT(Role0(*t, Role::kK).scale, ElementsAre(3.0f / 448.0f));
}

TEST(MinMaxObserverTest, EmaDefaultConstantInFloat32) {
  const SessionStatistics stats = ObserverState();
  auto h = ComputeScales(stats,
                         Options(Observer::kMinMaxEma, Granularity::kPerHead));
  ASSERT_THAT(h, IsOk());
  // llm-compressor's lerp: state * (1 - c) + batch * c in float32.
  const float c = 0.01f;
  const float keep = static_cast<float>(1.0 - double{c});
  float mn = -1.0f, mx = 2.0f;
  mn = mn * keep + -3.0f * c;
  mx = mx * keep + 4.0f * c;
  mn = mn * keep + 0.5f * c;
  mx = mx * keep + 1.0f * c;
  const float range0 = std::max(std::fabs(std::min(mn, 0.0f)), mx);
  EXPECT_EQ(Role0(*h, Role::kK).scale[0], range0 / 448.0f);
  EXPECT_NEAR(range0, 2.0098f, 1e-6);
}

TEST(MinMaxObserverTest, EmaIsLlmCompressorsFormToTheBitOverManyBatches) {
  // 64 batches of one value each: the state after each is
  // state * (1 - c) + batch * c with both products rounded to float
  // (torch's float32 tensor arithmetic), not state + c * (batch - state),
  // which drifts by several ulp over tens of batches.
  SessionStatistics stats(MakeGeometry(1, 1, 1, 0, 0b100));
  Rng rng(5);
  const float c = 0.01f;
  const float keep = static_cast<float>(1.0 - double{c});
  float mx = 0.0f, other = 0.0f;
  for (uint64_t b = 0; b < 64; ++b) {
    const float x = static_cast<float>(rng.Uniform(1.0, 21.0));
    AddValues(stats, 0, Role::kV, 0, b, {x});
    if (b == 0) {
      mx = other = x;
      continue;
    }
    const volatile float kept = mx * keep;  // no fused multiply-add
    const volatile float added = x * c;
    mx = kept + added;
    other = other + c * (x - other);
  }
  auto t = ComputeScales(
      stats, Options(Observer::kMinMaxEma, Granularity::kPerTensor));
  ASSERT_THAT(t, IsOk());
  EXPECT_EQ(Role0(*t, Role::kV).scale[0], mx / 448.0f);
  EXPECT_NE(mx, other) << "the two forms happen to agree on this data";
}

TEST(MinMaxObserverTest, EmaClampsOnceAtTheEnd) {
  // Batch 1 all negative {-12, -10}; batch 2 {-1, 20}; c = 0.5.
  // Raw EMA: min -12 -> -6.5, max -10 -> 5: range 6.5. (Clamping each batch
  // first would give max 0 -> 10.)
  SessionStatistics stats(MakeGeometry(1, 1, 1, 0, 0b100));
  AddValues(stats, 0, Role::kV, 0, 1, {-12.0f, -10.0f});
  AddValues(stats, 0, Role::kV, 0, 2, {-1.0f, 20.0f});
  ScaleOptions options = Options(Observer::kMinMaxEma, Granularity::kPerTensor);
  options.averaging_constant = 0.5f;
  auto t = ComputeScales(stats, options);
  ASSERT_THAT(t, IsOk());
  EXPECT_THAT(Role0(*t, Role::kV).scale, ElementsAre(6.5f / 448.0f));
  // c = 1 is the last batch.
  options.averaging_constant = 1.0f;
  t = ComputeScales(stats, options);
  ASSERT_THAT(t, IsOk());
  EXPECT_THAT(Role0(*t, Role::kV).scale, ElementsAre(20.0f / 448.0f));
}

TEST(MinMaxObserverTest, MemorylessUsesTheLastBatchWithFiniteValues) {
  const SessionStatistics stats = ObserverState();
  // Per head: head 0's last batch with finite values is 3 ({0.5, 1}: range
  // 1; batch 5 had only NaN/Inf), head 1's is 2 ({-7, 2}: range 7).
  auto h = ComputeScales(
      stats, Options(Observer::kMemorylessMinMax, Granularity::kPerHead));
  ASSERT_THAT(h, IsOk());
  EXPECT_THAT(Role0(*h, Role::kK).scale,
              ElementsAre(1.0f / 448.0f, 7.0f / 448.0f));
  // Per tensor: the highest such batch over the heads is 3, seen by head 0
  // only.
  auto t = ComputeScales(
      stats, Options(Observer::kMemorylessMinMax, Granularity::kPerTensor));
  ASSERT_THAT(t, IsOk());
  EXPECT_THAT(Role0(*t, Role::kK).scale, ElementsAre(1.0f / 448.0f));
}

TEST(MinMaxObserverTest, MinMaxRangeBuildingBlock) {
  const SessionStatistics stats = ObserverState();
  const HeadStatistics* heads[] = {&stats.head(0, Role::kK, 0),
                                   &stats.head(0, Role::kK, 1)};
  EXPECT_EQ(MinMaxRange(heads, Observer::kStaticMinMax, 0.01f), 7.0f);
  EXPECT_EQ(MinMaxRange(heads, Observer::kMemorylessMinMax, 0.01f), 1.0f);
  EXPECT_EQ(MinMaxRange(heads, Observer::kMinMaxEma, 0.5f), 3.0f);
}

// ---------------------------------------------------------------------------
// Percentile.
// ---------------------------------------------------------------------------

std::vector<float> Range(int from, int to) {  // inclusive
  std::vector<float> out;
  for (int i = from; i <= to; ++i) out.push_back(static_cast<float>(i));
  return out;
}

float PercentileOf(const SessionStatistics& stats,
                   std::vector<const HeadStatistics*> heads, double p) {
  return PercentileRange(heads, p, stats.geometry().log2_bins_per_octave());
}

TEST(PercentileObserverTest, ExactWhenEveryValueIsKept) {
  SessionStatistics stats(MakeGeometry(1, 1, 1, 16, 0b001));
  std::vector<float> values = Range(1, 100);
  for (float& v : values) v = -v;  // |x| is what counts
  AddValues(stats, 0, Role::kQ, 0, 0, values);
  const HeadStatistics* h = &stats.head(0, Role::kQ, 0);
  EXPECT_EQ(PercentileOf(stats, {h}, 50.0), 50.0f);
  EXPECT_EQ(PercentileOf(stats, {h}, 99.99), 100.0f);  // k = ceil(99.99)
  EXPECT_EQ(PercentileOf(stats, {h}, 100.0), 100.0f);
  EXPECT_EQ(PercentileOf(stats, {h}, 1.0), 1.0f);
  EXPECT_EQ(PercentileOf(stats, {h}, 0.5), 1.0f);    // k = ceil(0.5) = 1
  EXPECT_EQ(PercentileOf(stats, {h}, 37.5), 38.0f);  // k = ceil(37.5)
  EXPECT_EQ(PercentileOf(stats, {h}, 37.0), 37.0f);
  // Through ComputeScales, with the margin.
  ScaleOptions options =
      Options(Observer::kPercentile, Granularity::kPerTensor);
  options.percentile = 90.0;
  options.margin = 1.05f;
  auto t = ComputeScales(stats, options);
  ASSERT_THAT(t, IsOk());
  EXPECT_THAT(Role0(*t, Role::kQ).scale, ElementsAre((90.0f * 1.05f) / 448.0f));
  EXPECT_THAT(Role0(*t, Role::kQ).absmax, ElementsAre(100.0f));
}

TEST(PercentileObserverTest, HistogramUpperEdgeBelowTheKeptValues) {
  // 744 x 1.0 and 256 x 100.0; 16 bins per octave: 1.0 lies in [1, 1.0625).
  SessionStatistics stats(MakeGeometry(1, 1, 1, 16, 0b001));
  AddValues(stats, 0, Role::kQ, 0, 0, std::vector<float>(744, 1.0f));
  AddValues(stats, 0, Role::kQ, 0, 1, std::vector<float>(256, 100.0f));
  const HeadStatistics* h = &stats.head(0, Role::kQ, 0);
  EXPECT_EQ(PercentileOf(stats, {h}, 50.0), 1.0625f);  // k = 500: histogram
  EXPECT_EQ(PercentileOf(stats, {h}, 74.4), 1.0625f);  // k = 744
  EXPECT_EQ(PercentileOf(stats, {h}, 74.5), 100.0f);   // k = 745: kept value
  EXPECT_EQ(PercentileOf(stats, {h}, 80.0), 100.0f);
}

TEST(PercentileObserverTest, HistogramEdgeIsCappedAtTheAbsmax) {
  // 1000 x 3.0: the tail holds 256 of them, the rank falls in the histogram,
  // whose bin [3, 3.125) would overshoot the true absmax.
  SessionStatistics stats(MakeGeometry(1, 1, 1, 16, 0b001));
  AddValues(stats, 0, Role::kQ, 0, 0, std::vector<float>(1000, -3.0f));
  const HeadStatistics* h = &stats.head(0, Role::kQ, 0);
  EXPECT_EQ(PercentileOf(stats, {h}, 50.0), 3.0f);
}

TEST(PercentileObserverTest, ZeroBinGivesEpsilonScale) {
  SessionStatistics stats(MakeGeometry(1, 1, 1, 16, 0b001));
  AddValues(stats, 0, Role::kQ, 0, 0, std::vector<float>(1000, 0.0f));
  AddValues(stats, 0, Role::kQ, 0, 0, std::vector<float>(10, 5.0f));
  const HeadStatistics* h = &stats.head(0, Role::kQ, 0);
  EXPECT_EQ(PercentileOf(stats, {h}, 50.0), 0.0f);
  ScaleOptions options = Options(Observer::kPercentile, Granularity::kPerHead);
  options.percentile = 50.0;
  auto r = ComputeScales(stats, options);
  ASSERT_THAT(r, IsOk());
  EXPECT_THAT(Role0(*r, Role::kQ).scale, ElementsAre(FLT_EPSILON));
  EXPECT_THAT(Role0(*r, Role::kQ).absmax, ElementsAre(5.0f));
}

TEST(PercentileObserverTest, ExactRanksPerTensorAndPerHead) {
  // head 0: 1..300, head 1: 1001..1300. Each keeps its 256 largest:
  // head 0 down to 45, head 1 down to 1045. Per tensor, the values known
  // exactly are those at or above 1045 (the largest 256th-largest value).
  SessionStatistics stats(MakeGeometry(1, 2, 1, 16, 0b001));
  AddValues(stats, 0, Role::kQ, 0, 0, Range(1, 300));
  AddValues(stats, 0, Role::kQ, 1, 0, Range(1001, 1300));
  const HeadStatistics* h0 = &stats.head(0, Role::kQ, 0);
  const HeadStatistics* h1 = &stats.head(0, Role::kQ, 1);
  // n = 600: p = 99 -> k = 594 -> 7th largest.
  EXPECT_EQ(PercentileOf(stats, {h0, h1}, 99.0), 1294.0f);
  // k = 345 -> the 256th largest, 1045, the threshold value itself.
  EXPECT_EQ(PercentileOf(stats, {h0, h1}, 57.5), 1045.0f);
  // k = 300 -> 300 is not known exactly: its bin [288, 304) gives 304.
  EXPECT_EQ(PercentileOf(stats, {h0, h1}, 50.0), 304.0f);
  // Per head, all 256 kept values are exact: k = 45 of 300 is the 256th
  // largest of head 1.
  EXPECT_EQ(PercentileOf(stats, {h1}, 15.0), 1045.0f);
  EXPECT_EQ(PercentileOf(stats, {h0}, 15.0), 45.0f);
  // k = 44 is below the kept values: 1044 in [1024, 1088) gives 1088.
  EXPECT_EQ(PercentileOf(stats, {h1}, 14.5), 1088.0f);
}

// ---------------------------------------------------------------------------
// MSE.
// ---------------------------------------------------------------------------

// Sum of |fq(x) - x|^norm over raw values, in double.
double RawError(const std::vector<float>& values, float range, Format format,
                double norm) {
  const float scale = ScaleFromRange(range, 1.0f, format);
  double error = 0.0;
  for (float x : values) {
    const double diff =
        std::fabs(static_cast<double>(FakeQuantize(x, scale, format) - x));
    error += std::pow(diff, norm);
  }
  return error;
}

// llm-compressor's MSE observer (symmetric), run on raw values: shrink the
// static range by p = 1 - i / grid, keep the best, stop after `patience`
// steps without improvement.
float BruteForceMseRange(const std::vector<float>& values,
                         const ScaleOptions& options, bool early_stop = true) {
  float mn = 0.0f, mx = 0.0f;
  for (float x : values) {
    mn = std::min(mn, x);
    mx = std::max(mx, x);
  }
  const float absmax = std::max(-mn, mx);
  const int steps = static_cast<int>(std::floor(
      static_cast<double>(options.mse_max_shrink) * options.mse_grid));
  float best_range = absmax;
  double best = std::numeric_limits<double>::infinity();
  uint32_t no_improve = 0;
  for (int i = 0; i < steps; ++i) {
    const float p = static_cast<float>(1.0 - double(i) / options.mse_grid);
    const float range = p * absmax;
    const double error =
        RawError(values, range, options.format, options.mse_norm);
    if (error < best) {
      best = error;
      best_range = range;
      no_improve = 0;
    } else if (++no_improve >= options.mse_patience && early_stop) {
      break;
    }
  }
  return best_range;
}

TEST(MseObserverTest, HandComputedRanges) {
  // A single value at the format max has zero error unshrunk: range stays.
  SessionStatistics stats(MakeGeometry(1, 1, 1, 16, 0b001));
  AddValues(stats, 0, Role::kQ, 0, 0, {448.0f, -448.0f, 0.0f});
  const HeadStatistics* h = &stats.head(0, Role::kQ, 0);
  ScaleOptions options = Options(Observer::kMse, Granularity::kPerTensor);
  EXPECT_EQ(MseRange({&h, 1}, options, 4), 448.0f);
  // No steps (floor(0.2 * 4) = 0): the static range.
  options.mse_grid = 4;
  EXPECT_EQ(MseRange({&h, 1}, options, 4), 448.0f);
  // One value 1.0 with range 1.0 shrunk to p: every candidate with
  // fq(1.0) == 1.0 has zero error; the first (p = 1) wins.
  SessionStatistics one(MakeGeometry(1, 1, 1, 16, 0b001));
  AddValues(one, 0, Role::kQ, 0, 0, {1.0f});
  const HeadStatistics* o = &one.head(0, Role::kQ, 0);
  options = Options(Observer::kMse, Granularity::kPerTensor);
  EXPECT_EQ(MseRange({&o, 1}, options, 4), 1.0f);
  // Margin multiplies the searched range.
  options.margin = 2.0f;
  auto r = ComputeScales(one, options);
  ASSERT_THAT(r, IsOk());
  EXPECT_THAT(Role0(*r, Role::kQ).scale, ElementsAre(2.0f / 448.0f));
}

// With every value kept exactly (<= 256 per head), kvcal's MSE sees the raw
// data and must choose a range as good as the brute force's.
TEST(MseObserverTest, MatchesBruteForceWhenAllValuesAreKept) {
  Rng rng(21);
  for (Format format : {Format::kFp8E4m3fn, Format::kFp8E5m2, Format::kInt8}) {
    for (int trial = 0; trial < 30; ++trial) {
      SessionStatistics stats(MakeGeometry(1, 1, 1, 64, 0b001));
      std::vector<float> values;
      for (int i = 0; i < 256; ++i) {
        values.push_back(static_cast<float>(rng.StudentT(2.0)));
      }
      AddValues(stats, 0, Role::kQ, 0, 0, values);
      ScaleOptions options = Options(Observer::kMse, Granularity::kPerHead);
      options.format = format;
      const HeadStatistics* h = &stats.head(0, Role::kQ, 0);
      const float ours = MseRange({&h, 1}, options, 6);
      const float brute = BruteForceMseRange(values, options);
      const double norm = options.mse_norm;
      EXPECT_LE(RawError(values, ours, format, norm),
                RawError(values, brute, format, norm) * (1 + 1e-9))
          << static_cast<int>(format) << " trial " << trial << " ours " << ours
          << " brute " << brute;
      // kvcal searches the whole grid: with every value exact, it finds
      // the raw minimum over the grid itself.
      EXPECT_EQ(ours, BruteForceMseRange(values, options, false))
          << static_cast<int>(format) << " trial " << trial;
    }
  }
}

// docs/observers.md "The MSE goal": on heavy-tailed per-head data at 64 bins
// per octave, the chosen scale's raw error is within 1.02x of llm-compressor's
// grid search on the same raw values for >= 99% of scales, 1.05x for all.
TEST(MseObserverTest, HeavyTailedDataWithinContractTolerance) {
  constexpr uint32_t kHeads = 96;
  constexpr int kValues = 3000;
  Rng rng(22);
  SessionStatistics stats(MakeGeometry(1, kHeads, kHeads, 64, 0b001));
  std::vector<std::vector<float>> raw(kHeads);
  for (uint32_t h = 0; h < kHeads; ++h) {
    const double dof = 1.0 + static_cast<double>(h % 6);     // 1 = Cauchy
    const double scale = h % 16 == 7 ? 300.0 : 1.0 + h % 5;  // outlier heads
    for (int i = 0; i < kValues; ++i) {
      raw[h].push_back(static_cast<float>(rng.StudentT(dof) * scale));
    }
    AddValues(stats, 0, Role::kQ, h, static_cast<uint64_t>(h % 3), raw[h]);
  }
  const ScaleOptions options = Options(Observer::kMse, Granularity::kPerHead);
  int within_102 = 0;
  double worst = 0.0;
  for (uint32_t h = 0; h < kHeads; ++h) {
    const HeadStatistics* head = &stats.head(0, Role::kQ, h);
    const float ours = MseRange({&head, 1}, options, 6);
    const float brute = BruteForceMseRange(raw[h], options);
    const double ratio = RawError(raw[h], ours, options.format, 2.4) /
                         RawError(raw[h], brute, options.format, 2.4);
    worst = std::max(worst, ratio);
    within_102 += ratio <= 1.02;
  }
  EXPECT_GE(within_102, static_cast<int>(std::ceil(0.99 * kHeads)))
      << "worst ratio " << worst;
  EXPECT_LE(worst, 1.05);
}

// EstimateQuantization: the relative RMS error, saturation and subnormal
// shares the statistics give for a scale, against the same figures computed
// on the raw values. Heavy-tailed values far beyond the 256 kept per head,
// so the histogram part carries most of the error.
TEST(EstimateQuantizationTest, MatchesRawValues) {
  Rng rng(31);
  SessionStatistics stats(MakeGeometry(1, 1, 1, 64, 0b001));
  std::vector<float> values;
  for (int i = 0; i < 20000; ++i) {
    values.push_back(static_cast<float>(rng.StudentT(3.0) * 0.05));
  }
  AddValues(stats, 0, Role::kQ, 0, 0, values);
  const HeadStatistics* h = &stats.head(0, Role::kQ, 0);
  const float absmax = h->absmax();
  // A scale that clips (0.5 x absmax), the static one, and one so large
  // that many values fall into e4m3's subnormals.
  for (float range : {0.5f * absmax, absmax, 512.0f * absmax}) {
    const float scale = ScaleFromRange(range, 1.0f, Format::kFp8E4m3fn);
    double error = 0.0, energy = 0.0, saturated = 0.0, subnormal = 0.0;
    for (float v : values) {
      const double d = FakeQuantize(v, scale, Format::kFp8E4m3fn) - v;
      error += d * d;
      energy += static_cast<double>(v) * v;
      const double q = std::fabs(v / scale);
      saturated += q > 448.0 * (1.0 + 0x1p-20);
      subnormal += q > 0.0 && q < 0x1p-6;
    }
    const double n = static_cast<double>(values.size());
    const QuantizationEstimate e =
        EstimateQuantization({&h, 1}, scale, Format::kFp8E4m3fn, 6);
    SCOPED_TRACE(::testing::Message() << "range " << range);
    EXPECT_NEAR(e.relative_rms_error, std::sqrt(error / energy),
                0.03 * std::sqrt(error / energy));
    // Saturation is decided among the kept values here: exact.
    EXPECT_DOUBLE_EQ(e.saturated_share, saturated / n);
    EXPECT_NEAR(e.subnormal_share, subnormal / n, 0.002);
  }
  // The static scale saturates nothing; half the range does.
  EXPECT_EQ(EstimateQuantization(
                {&h, 1}, ScaleFromRange(absmax, 1.0f, Format::kFp8E4m3fn),
                Format::kFp8E4m3fn, 6)
                .saturated_share,
            0.0);
  // No histograms: nothing to estimate from.
  SessionStatistics plain(MakeGeometry(1, 1, 1, 0, 0b001));
  AddValues(plain, 0, Role::kQ, 0, 0, values);
  const HeadStatistics* p = &plain.head(0, Role::kQ, 0);
  EXPECT_EQ(EstimateQuantization({&p, 1}, 1.0f, Format::kFp8E4m3fn, 0)
                .relative_rms_error,
            0.0);
}

TEST(MseObserverTest, NeedsHistograms) {
  SessionStatistics stats(MakeGeometry(1, 1, 1, 0));
  FillAll(stats);
  for (Observer observer : {Observer::kMse, Observer::kPercentile}) {
    EXPECT_THAT(ComputeScales(stats, Options(observer, Granularity::kPerHead)),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         HasSubstr("observer needs histograms")));
  }
}

// ---------------------------------------------------------------------------
// Granularity, groups, margin, zero range, missing heads.
// ---------------------------------------------------------------------------

TEST(ComputeScalesTest, QPerKvGroupTakesTheGroupMaximumForQOnly) {
  SessionStatistics stats(MakeGeometry(1, 4, 2, 0, 0b011));
  AddValues(stats, 0, Role::kQ, 0, 0, {1.0f});
  AddValues(stats, 0, Role::kQ, 1, 0, {-3.0f});
  AddValues(stats, 0, Role::kQ, 2, 0, {8.0f});
  AddValues(stats, 0, Role::kQ, 3, 0, {2.0f});
  AddValues(stats, 0, Role::kK, 0, 0, {5.0f});
  AddValues(stats, 0, Role::kK, 1, 0, {6.0f});
  ScaleOptions options =
      Options(Observer::kStaticMinMax, Granularity::kPerHead);
  options.q_per_kv_group = true;
  auto r = ComputeScales(stats, options);
  ASSERT_THAT(r, IsOk());
  EXPECT_THAT(Role0(*r, Role::kQ).scale,
              ElementsAre(3.0f / 448.0f, 8.0f / 448.0f));
  EXPECT_THAT(Role0(*r, Role::kQ).absmax, ElementsAre(3.0f, 8.0f));
  EXPECT_THAT(Role0(*r, Role::kK).scale,
              ElementsAre(5.0f / 448.0f, 6.0f / 448.0f));
  // Per tensor it changes nothing.
  options.granularity = Granularity::kPerTensor;
  r = ComputeScales(stats, options);
  ASSERT_THAT(r, IsOk());
  EXPECT_THAT(Role0(*r, Role::kQ).scale, ElementsAre(8.0f / 448.0f));
}

TEST(ComputeScalesTest, MarginMultipliesEveryObserver) {
  const SessionStatistics stats = ObserverState(/*bins=*/16);
  for (Observer observer :
       {Observer::kStaticMinMax, Observer::kMinMaxEma,
        Observer::kMemorylessMinMax, Observer::kMse, Observer::kPercentile}) {
    SCOPED_TRACE(static_cast<int>(observer));
    ScaleOptions plain = Options(observer, Granularity::kPerHead);
    ScaleOptions margin = plain;
    margin.margin = 1.25f;
    auto a = ComputeScales(stats, plain);
    auto b = ComputeScales(stats, margin);
    ASSERT_THAT(a, IsOk());
    ASSERT_THAT(b, IsOk());
    for (size_t h = 0; h < 2; ++h) {
      EXPECT_FLOAT_EQ(Role0(*b, Role::kK).scale[h],
                      Role0(*a, Role::kK).scale[h] * 1.25f);
    }
  }
}

TEST(ComputeScalesTest, FormatsDivideByTheirMaximum) {
  const SessionStatistics stats = ObserverState();
  for (Format format : {Format::kFp8E4m3fn, Format::kFp8E4m3fnuz,
                        Format::kFp8E5m2, Format::kInt8}) {
    ScaleOptions options =
        Options(Observer::kStaticMinMax, Granularity::kPerTensor);
    options.format = format;
    auto r = ComputeScales(stats, options);
    ASSERT_THAT(r, IsOk());
    EXPECT_THAT(Role0(*r, Role::kK).scale,
                ElementsAre(7.0f / FormatMax(format)));
  }
}

TEST(ComputeScalesTest, ZeroRangeGivesEpsilon) {
  SessionStatistics stats(MakeGeometry(1, 2, 1, 16, 0b001));
  AddValues(stats, 0, Role::kQ, 0, 0, {0.0f, -0.0f});
  AddValues(stats, 0, Role::kQ, 1, 0, {-0.0f});
  for (Observer observer :
       {Observer::kStaticMinMax, Observer::kMinMaxEma,
        Observer::kMemorylessMinMax, Observer::kMse, Observer::kPercentile}) {
    for (Granularity granularity :
         {Granularity::kPerTensor, Granularity::kPerHead}) {
      auto r = ComputeScales(stats, Options(observer, granularity));
      ASSERT_THAT(r, IsOk()) << static_cast<int>(observer);
      for (float s : Role0(*r, Role::kQ).scale) {
        EXPECT_EQ(s, FLT_EPSILON) << static_cast<int>(observer);
      }
      for (float a : Role0(*r, Role::kQ).absmax) EXPECT_EQ(a, 0.0f);
    }
  }
}

TEST(ComputeScalesTest, MissingHeadsAreListed) {
  SessionStatistics stats(MakeGeometry(2, 4, 2, 0));
  FillAll(stats);
  stats.head(1, Role::kK, 1) =
      SessionStatistics(stats.geometry()).head(0, Role::kK, 1);
  AddValues(stats, 1, Role::kK, 1, 0, {kNan});  // no finite value: missing
  // The message says that the head saw values, all non-finite (not "no
  // data" alone, which would send the user looking for a lost chunk).
  EXPECT_THAT(
      ComputeScales(stats, ScaleOptions()),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               AllOf(HasSubstr("1 (layer, role, head)"), HasSubstr("(1, K, 1)"),
                     HasSubstr("1 of them saw only non-finite values "
                               "(first (1, K, 1): 1 NaN, 0 Inf)"))));
  ScaleOptions options =
      Options(Observer::kStaticMinMax, Granularity::kPerHead);
  options.allow_missing = true;
  auto r = ComputeScales(stats, options);
  ASSERT_THAT(r, IsOk());
  ASSERT_EQ(r->layers.size(), 2u);
  EXPECT_EQ(r->layers[1].layer, 1u);
  EXPECT_THAT(Role0(*r, Role::kK, 1).scale, IsEmpty());
  EXPECT_THAT(Role0(*r, Role::kK, 1).absmax, IsEmpty());
  EXPECT_EQ(Role0(*r, Role::kK, 1).count, 1u);
  EXPECT_EQ(Role0(*r, Role::kK, 1).nonfinite, 1u);
  EXPECT_THAT(Role0(*r, Role::kV, 1).scale, Not(IsEmpty()));
  EXPECT_EQ(Role0(*r, Role::kK, 0).scale.size(), 2u);
  EXPECT_EQ(Role0(*r, Role::kQ, 1).scale.size(), 4u);
}

TEST(ComputeScalesTest, ManyMissingHeadsListTheFirstTwenty) {
  SessionStatistics stats(MakeGeometry(1, 32, 1, 0, 0b001));
  AddValues(stats, 0, Role::kQ, 0, 0, {1.0f});
  auto r = ComputeScales(stats, ScaleOptions());
  EXPECT_THAT(
      r, StatusIs(
             absl::StatusCode::kFailedPrecondition,
             AllOf(HasSubstr("31 (layer, role, head)"), HasSubstr("(0, Q, 1)"),
                   HasSubstr("(0, Q, 20)"), Not(HasSubstr("(0, Q, 21)")),
                   Not(HasSubstr("non-finite")), HasSubstr("allow_missing"))));
}

TEST(ComputeScalesTest, NoFiniteValueAtAllFailsEvenWithAllowMissing) {
  SessionStatistics stats(MakeGeometry(1, 1, 1, 16));
  AddValues(stats, 0, Role::kK, 0, 0, {kNan, kInf});
  ScaleOptions options;
  for (bool allow : {false, true}) {
    options.allow_missing = allow;
    EXPECT_THAT(ComputeScales(stats, options),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         HasSubstr("no finite values: nothing to calibrate "
                                   "(it saw only 2 NaN or Inf values)")));
  }
  EXPECT_THAT(
      ComputeScales(SessionStatistics(MakeGeometry(1, 1, 1, 0)), options),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               HasSubstr("no finite values")));
}

TEST(ComputeScalesTest, LayerSelection) {
  SessionStatistics stats(MakeGeometry(3, 1, 1, 0, 0b001));
  AddValues(stats, 0, Role::kQ, 0, 0, {1.0f});
  AddValues(stats, 2, Role::kQ, 0, 0, {4.0f});  // layer 1 missing
  ScaleOptions options;
  options.layers = {2, 0, 2};
  auto r = ComputeScales(stats, options);
  ASSERT_THAT(r, IsOk());
  ASSERT_EQ(r->layers.size(), 2u);
  EXPECT_EQ(r->layers[0].layer, 0u);
  EXPECT_EQ(r->layers[1].layer, 2u);
  EXPECT_THAT(Role0(*r, Role::kQ, 1).scale, ElementsAre(4.0f / 448.0f));
  options.layers = {3};
  EXPECT_THAT(ComputeScales(stats, options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("layer 3 is out of range")));
}

// ---------------------------------------------------------------------------
// Option validation (docs/wire-contract.md "Finalize").
// ---------------------------------------------------------------------------

TEST(ScaleOptionsTest, RangesAreValidatedEvenForUnusedParameters) {
  SessionStatistics stats(MakeGeometry(1, 1, 1, 16));
  FillAll(stats);
  struct Case {
    std::function<void(ScaleOptions&)> mutate;
    std::string message;
  };
  const std::vector<Case> bad = {
      {[](ScaleOptions& o) { o.averaging_constant = 0.0f; },
       "averaging_constant"},
      {[](ScaleOptions& o) { o.averaging_constant = 1.01f; },
       "averaging_constant"},
      {[](ScaleOptions& o) { o.averaging_constant = -0.5f; },
       "averaging_constant"},
      {[](ScaleOptions& o) { o.averaging_constant = kNan; },
       "averaging_constant"},
      {[](ScaleOptions& o) { o.percentile = 0.0; }, "percentile"},
      {[](ScaleOptions& o) { o.percentile = 100.001; }, "percentile"},
      {[](ScaleOptions& o) { o.percentile = -1.0; }, "percentile"},
      {[](ScaleOptions& o) { o.percentile = kNan; }, "percentile"},
      {[](ScaleOptions& o) { o.margin = 0.0f; }, "margin"},
      {[](ScaleOptions& o) { o.margin = -1.0f; }, "margin"},
      {[](ScaleOptions& o) { o.margin = kInf; }, "margin"},
      {[](ScaleOptions& o) { o.margin = kNan; }, "margin"},
      {[](ScaleOptions& o) { o.mse_max_shrink = 0.0f; }, "mse_max_shrink"},
      {[](ScaleOptions& o) { o.mse_max_shrink = 1.0f; }, "mse_max_shrink"},
      {[](ScaleOptions& o) { o.mse_max_shrink = kNan; }, "mse_max_shrink"},
      {[](ScaleOptions& o) { o.mse_norm = 0.0f; }, "mse_norm"},
      {[](ScaleOptions& o) { o.mse_norm = -2.0f; }, "mse_norm"},
      {[](ScaleOptions& o) { o.mse_norm = kNan; }, "mse_norm"},
      {[](ScaleOptions& o) { o.observer = static_cast<Observer>(0); },
       "observer"},
      {[](ScaleOptions& o) { o.observer = static_cast<Observer>(6); },
       "observer"},
      {[](ScaleOptions& o) { o.granularity = static_cast<Granularity>(0); },
       "granularity"},
      {[](ScaleOptions& o) { o.granularity = static_cast<Granularity>(3); },
       "granularity"},
      {[](ScaleOptions& o) { o.format = static_cast<Format>(0); }, "format"},
      {[](ScaleOptions& o) { o.format = static_cast<Format>(5); }, "format"},
  };
  for (const Case& c : bad) {
    // The static observer uses none of the parameters; they are checked anyway.
    ScaleOptions options;
    c.mutate(options);
    EXPECT_THAT(options.Validate(), StatusIs(absl::StatusCode::kInvalidArgument,
                                             HasSubstr(c.message)));
    EXPECT_THAT(
        ComputeScales(stats, options),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.message)));
  }
  const std::vector<std::function<void(ScaleOptions&)>> good = {
      [](ScaleOptions& o) { o.averaging_constant = 1.0f; },
      [](ScaleOptions& o) { o.averaging_constant = 1e-6f; },
      [](ScaleOptions& o) { o.percentile = 100.0; },
      [](ScaleOptions& o) { o.percentile = 1e-9; },
      [](ScaleOptions& o) { o.margin = 1e-3f; },
      [](ScaleOptions& o) { o.mse_max_shrink = 0.999f; },
      [](ScaleOptions& o) { o.mse_norm = 0.5f; },
  };
  for (const auto& mutate : good) {
    ScaleOptions options;
    mutate(options);
    EXPECT_THAT(options.Validate(), IsOk());
    EXPECT_THAT(ComputeScales(stats, options), IsOk());
  }
}

}  // namespace
}  // namespace kvcal
