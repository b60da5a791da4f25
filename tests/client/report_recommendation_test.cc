// The report's recommendation policy (client/report/recommendation.h), on
// hand-made evaluation rows and estimates: which row wins, when Q is
// quantized too, the margin, and the fallbacks. The page around it is
// tested end to end in tests/python/test_report.py.
#include <string>
#include <vector>

#include "client/report/recommendation.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcal::report {
namespace {

using ::testing::HasSubstr;

EvaluationRow Row(const std::string& observer, const std::string& granularity,
                  bool kv_only, double delta_nll, double attention_mean) {
  EvaluationRow r;
  r.name = observer + "-" + granularity + (kv_only ? "-kv" : "-qkv");
  r.label = observer;
  r.observer = observer;
  r.granularity = granularity;
  r.kv_only = kv_only;
  r.delta_nll = delta_nll;
  r.delta_nll_ones = delta_nll + 0.1;
  r.attention_mean = attention_mean;
  return r;
}

TEST(SimplestOrBestTest, KeepsStaticMinMaxPerTensorWithinTheNoise) {
  const std::vector<EvaluationRow> rows = {
      Row("static_minmax", "tensor", true, 0.050, 0.060),
      Row("mse", "head", true, 0.050 - 0.9 * kSignificantNats, 0.050),
  };
  const EvaluationRow* chosen = SimplestOrBest(rows, true);
  ASSERT_NE(chosen, nullptr);
  EXPECT_EQ(chosen, &rows[0]);
}

TEST(SimplestOrBestTest, TakesAClearlyLowerLossAtNoLargerAttentionError) {
  const std::vector<EvaluationRow> rows = {
      Row("static_minmax", "tensor", true, 0.050, 0.060),
      Row("mse", "head", true, 0.050 - 2 * kSignificantNats, 0.060),
  };
  EXPECT_EQ(SimplestOrBest(rows, true), &rows[1]);
}

TEST(SimplestOrBestTest, DistrustsALowerLossWithALargerAttentionError) {
  const std::vector<EvaluationRow> rows = {
      Row("static_minmax", "tensor", true, 0.050, 0.060),
      Row("mse", "head", true, 0.050 - 2 * kSignificantNats, 0.061),
  };
  EXPECT_EQ(SimplestOrBest(rows, true), &rows[0]);
}

TEST(SimplestOrBestTest, WithoutTheSimplestRowTakesTheLowestLoss) {
  const std::vector<EvaluationRow> rows = {
      Row("mse", "head", true, 0.040, 0.060),
      Row("percentile", "tensor", true, 0.039, 0.070),
      Row("static_minmax", "tensor", false, 0.001, 0.010),  // other kind
  };
  EXPECT_EQ(SimplestOrBest(rows, true), &rows[1]);
  EXPECT_EQ(SimplestOrBest(rows, false), &rows[2]);
  EXPECT_EQ(SimplestOrBest({}, true), nullptr);
}

TEST(RecommendFromEvaluationsTest, QuantizesQOnlyWhenItCostsAtMostTheNoise) {
  const EvaluationRow kv = Row("static_minmax", "tensor", true, 0.020, 0.05);
  EvaluationRow qkv = Row("static_minmax", "tensor", false, 0.020, 0.06);

  // The recommendation points into the rows: they outlive it.
  qkv.delta_nll = kv.delta_nll + 0.5 * kSignificantNats;
  const std::vector<EvaluationRow> cheap_rows = {kv, qkv};
  Recommendation cheap =
      RecommendFromEvaluations(cheap_rows, Format::kFp8E4m3fn);
  EXPECT_EQ(cheap.json["quantize"], "q_k_v");
  EXPECT_EQ(cheap.json["basis"], "evaluation");
  EXPECT_EQ(cheap.json["observer"], "static_minmax");
  EXPECT_EQ(cheap.json["granularity"], "tensor");
  EXPECT_THAT(cheap.reason, HasSubstr("at most"));

  qkv.delta_nll = kv.delta_nll + 2 * kSignificantNats;
  const std::vector<EvaluationRow> costly_rows = {kv, qkv};
  Recommendation costly =
      RecommendFromEvaluations(costly_rows, Format::kFp8E4m3fn);
  EXPECT_EQ(costly.json["quantize"], "k_v");
  EXPECT_THAT(costly.reason, HasSubstr("more than"));
  ASSERT_NE(costly.row, nullptr);
  EXPECT_TRUE(costly.row->kv_only);
}

TEST(RecommendFromEvaluationsTest, OnlyOneKindGiven) {
  const std::vector<EvaluationRow> kv_rows = {
      Row("static_minmax", "tensor", true, 0.02, 0.05)};
  EXPECT_EQ(
      RecommendFromEvaluations(kv_rows, Format::kFp8E4m3fn).json["quantize"],
      "k_v");
  const std::vector<EvaluationRow> qkv_rows = {
      Row("static_minmax", "tensor", false, 0.02, 0.05)};
  EXPECT_EQ(
      RecommendFromEvaluations(qkv_rows, Format::kFp8E4m3fn).json["quantize"],
      "q_k_v");
}

TEST(MarginTest, OneWhenTheEvaluationStaysWithinTheClipPoints) {
  EvaluationRow r = Row("static_minmax", "tensor", true, 0.02, 0.05);
  for (int role = 0; role < 3; ++role) {
    r.scale[role] = {{1.0}};
    r.absmax[role] = {{400.0}};  // below 1.0 x 448
  }
  std::string why;
  EXPECT_EQ(MarginFor(r, true, Format::kFp8E4m3fn, why), 1.0);
  EXPECT_THAT(why, HasSubstr("stay within"));
  EXPECT_NEAR(ClipOvershoot(r, true, Format::kFp8E4m3fn), 400.0 / 448.0, 1e-12);
}

TEST(MarginTest, RoundsTheOvershootUpToAMultipleOfFiveHundredths) {
  EvaluationRow r = Row("static_minmax", "tensor", true, 0.02, 0.05);
  r.saturated = 1e-4;
  for (int role = 0; role < 3; ++role) {
    r.scale[role] = {{1.0, 2.0}};
    r.absmax[role] = {{100.0, 2.0 * 448.0 * 1.12}};
  }
  // Q (role 0) overshoots far more, but K/V only do not look at it.
  r.absmax[0] = {{448.0 * 3.0, 1.0}};
  std::string why;
  EXPECT_DOUBLE_EQ(MarginFor(r, true, Format::kFp8E4m3fn, why), 1.15);
  EXPECT_THAT(why, HasSubstr("1.120x"));
  EXPECT_DOUBLE_EQ(MarginFor(r, false, Format::kFp8E4m3fn, why), 3.0);
}

TEST(MarginTest, NoSaturationMeansNoMarginEvenPastTheClipPoint) {
  // The maxima pass the clip point but the row says nothing saturated
  // (e.g. every such value was non-finite): the margin stays 1.
  EvaluationRow r = Row("static_minmax", "tensor", true, 0.02, 0.05);
  for (int role = 0; role < 3; ++role) {
    r.scale[role] = {{1.0}};
    r.absmax[role] = {{500.0}};
  }
  std::string why;
  EXPECT_EQ(MarginFor(r, true, Format::kFp8E4m3fn, why), 1.0);
}

Estimate Est(const ObserverChoice* o, const Variant* v, double kv_error) {
  Estimate e{o, v, {}, {}, kv_error};
  return e;
}

TEST(RecommendFromEstimatesTest, PerTensorWithinTwoPercentOfPerHeadWins) {
  const ObserverChoice* minmax = &ReportObservers()[0];
  const ObserverChoice* mse = &ReportObservers()[3];
  ASSERT_EQ(mse->observer, Observer::kMse);
  const Variant* tensor = &kVariants[0];
  const Variant* head = &kVariants[1];
  const Variant* head_group = &kVariants[2];
  ASSERT_EQ(tensor->granularity, Granularity::kPerTensor);
  ASSERT_FALSE(head->q_per_kv_group);
  ASSERT_TRUE(head_group->q_per_kv_group);

  std::vector<Estimate> close = {Est(minmax, tensor, 0.0510),
                                 Est(mse, head, 0.0500),
                                 Est(mse, head_group, 0.0100)};
  Recommendation r = RecommendFromEstimates(close);
  EXPECT_EQ(r.json["granularity"], "tensor");
  EXPECT_EQ(r.json["observer"], ObserverName(Observer::kStaticMinMax));
  EXPECT_EQ(r.json["basis"], "statistics");
  EXPECT_EQ(r.json["quantize"], "k_v");
  EXPECT_THAT(r.reason, HasSubstr("within 2%"));

  std::vector<Estimate> far = {Est(minmax, tensor, 0.0520),
                               Est(mse, head, 0.0500)};
  Recommendation h = RecommendFromEstimates(far);
  EXPECT_EQ(h.json["granularity"], "head");
  EXPECT_EQ(h.json["observer"], ObserverName(Observer::kMse));
  EXPECT_DOUBLE_EQ(h.json["estimated_kv_error"].get<double>(), 0.05);
}

TEST(NoRecommendationTest, FallsBackToTheScalesFileOrStaticMinMax) {
  Recommendation none = NoRecommendation(std::nullopt);
  EXPECT_EQ(none.json["observer"], "static_minmax");
  EXPECT_EQ(none.json["granularity"], "tensor");
  EXPECT_EQ(none.json["basis"], "none");

  CalibratedScales scales;
  scales.observer = "mse";
  scales.granularity = Granularity::kPerHead;
  Recommendation from_file = NoRecommendation(scales);
  EXPECT_EQ(from_file.json["observer"], "mse");
  EXPECT_EQ(from_file.json["granularity"], "head");
}

TEST(SimplestOrBestTest, RowsOfAnotherCacheFormatAreNotScaleCandidates) {
  std::vector<EvaluationRow> rows = {
      Row("static_minmax", "tensor", true, 0.050, 0.060),
      Row("mse", "tensor", true, 0.050 - 5 * kSignificantNats, 0.010),
  };
  rows[1].kv_format = "nvfp4";
  EXPECT_EQ(SimplestOrBest(rows, true), &rows[0]);
  rows[0].kv_format = "nvfp4";
  EXPECT_EQ(SimplestOrBest(rows, true), nullptr);
}

EvaluationRow WithLayers(std::vector<double> layer_attention,
                         const std::string& kv_format = "fp8") {
  EvaluationRow r = Row("static_minmax", "tensor", true, 0.01, 0.05);
  r.layer_attention = std::move(layer_attention);
  r.kv_format = kv_format;
  return r;
}

TEST(SkipLayerCandidatesTest, OutliersAboveThreeTimesTheMedianWorstFirst) {
  // Median of 8 layers: (0.02 + 0.02) / 2; 0.061 and 0.3 exceed 3x it.
  const SkipCandidates s = SkipLayerCandidates(
      WithLayers({0.02, 0.3, 0.02, 0.02, 0.061, 0.02, 0.059, 0.02}));
  EXPECT_DOUBLE_EQ(s.median, 0.02);
  EXPECT_EQ(s.layers, (std::vector<int>{1, 4}));
  EXPECT_EQ(s.argument, "--kv-cache-dtype-skip-layers 1 4");
  // 6 layers at 1 byte, 2 at 2 bytes, over 8 at 1 byte.
  EXPECT_DOUBLE_EQ(s.cache_ratio, 10.0 / 8.0);
}

TEST(SkipLayerCandidatesTest, AtMostAQuarterOfTheLayersTheWorstKept) {
  const SkipCandidates s = SkipLayerCandidates(
      WithLayers({0.9, 0.01, 0.8, 0.01, 0.7, 0.01, 0.01, 0.01}, "nvfp4"));
  EXPECT_EQ(s.layers, (std::vector<int>{0, 2}));  // 0.7 is cut by the share
  EXPECT_DOUBLE_EQ(s.cache_ratio, (6 * 0.5625 + 2 * 2.0) / (8 * 0.5625));
}

TEST(SkipLayerCandidatesTest, NoneWhenNoLayerStandsOut) {
  const SkipCandidates s = SkipLayerCandidates(WithLayers({0.05, 0.1, 0.14}));
  EXPECT_TRUE(s.layers.empty());
  EXPECT_EQ(s.argument, "");
  EXPECT_DOUBLE_EQ(s.cache_ratio, 1.0);
  EXPECT_TRUE(SkipLayerCandidates(WithLayers({})).layers.empty());
}

TEST(RecommendFormatTest, CheapestFormatWithinTheTolerance) {
  std::vector<EvaluationRow> rows = {
      Row("static_minmax", "tensor", true, 0.004, 0.06),
      Row("mse", "tensor", true, 0.002, 0.06),
      Row("static_minmax", "tensor", true, 0.015, 0.19),
      Row("static_minmax", "tensor", true, 0.012, 0.18),
  };
  rows[2].kv_format = "nvfp4";
  rows[3].kv_format = "nvfp4_4over6";
  FormatChoice loose = RecommendFormat(rows, 0.02);
  ASSERT_EQ(loose.best.size(), 3u);
  EXPECT_EQ(loose.best[0], &rows[1]);      // FP8's lowest-loss row
  EXPECT_EQ(loose.recommended, &rows[3]);  // NVFP4 bytes, the lower loss
  EXPECT_EQ(loose.json["recommended"], "nvfp4_4over6");
  EXPECT_THAT(loose.reason, HasSubstr("--kv-cache-dtype nvfp4_4over6"));

  FormatChoice tight = RecommendFormat(rows, 0.01);
  EXPECT_EQ(tight.recommended, &rows[1]);
  EXPECT_EQ(tight.json["recommended"], "fp8");

  FormatChoice none = RecommendFormat(rows, 0.001);
  EXPECT_EQ(none.recommended, nullptr);
  EXPECT_EQ(none.json["recommended"], "auto");
  EXPECT_THAT(none.reason, HasSubstr("--kv-cache-dtype auto"));
  EXPECT_FALSE(none.json["formats"][0]["within_tolerance"].get<bool>());
}

}  // namespace
}  // namespace kvcal::report
