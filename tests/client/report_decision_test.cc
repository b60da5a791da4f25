// kvcal report --decision (client/report/decision.h): the page renders
// kvcal-calibrate's decision as its recommendation, with no rule of its own
// (a decision that names scale 1.0 stays scale 1.0, whatever the report's
// own rule would pick), every candidate in the table with the chosen one
// marked, the serve line verbatim, and a clear error for a decision that
// lacks a field. The end-to-end agreement with the summary and --json is
// tests/python/test_calibrate_decision.py.
#include <string>
#include <vector>

#include "client/report/decision.h"
#include "client/report/report.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcal::report {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

Json Decision() {
  return Json::parse(R"({
    "decision": {"chosen": "scale 1.0, K, V", "scales": "scale 1.0, K, V",
                 "observer": null, "granularity": "one", "kv_only": true,
                 "why": "it is within the noise",
                 "kv_cache_dtype": "bfloat16", "skip_layers": [],
                 "serve": {"command": "vllm serve /m --dtype bfloat16 --kv-cache-dtype bfloat16",
                           "notes": ["a <note>"],
                           "fp8_alternative": {"command": "vllm serve /m --kv-cache-dtype fp8",
                                               "cost": "held-out +0.0300"}},
                 "noise": {"resolved": false,
                           "lines": ["held-out: 3 windows", "too few held-out tokens to decide"]}},
    "candidates": [
      {"label": "scale 1.0, K, V", "delta_nll": 0.03, "delta_nll_se": 0.01,
       "attention_error_mean": 0.05, "chosen": true, "best": false, "same_as": null, "note": null},
      {"label": "static min-max per tensor, K, V", "delta_nll": 0.02, "delta_nll_se": 0.01,
       "attention_error_mean": 0.04, "chosen": false, "best": true, "same_as": null, "note": null}],
    "cache_formats": {"tolerance_nats_per_token": 0.02, "recommended": "auto",
                      "formats": [{"kv_format": "fp8", "scales": "scale 1.0, K, V",
                                   "best_delta_nll": 0.03, "best_delta_nll_se": 0.01,
                                   "skip_layers": [], "cache_bytes_ratio": 0.5,
                                   "within_tolerance": false}]},
    "reference_nll": 2.5, "holdout_tokens": 765})");
}

TEST(ReportDecisionTest, TheRecommendationIsTheDecisionNotARuleOfItsOwn) {
  EvaluationRow calibrated;
  calibrated.label = "static min-max per tensor, K, V";
  calibrated.kv_only = true;
  auto rec = RecommendFromDecision(Decision(), {calibrated});
  ASSERT_TRUE(rec.ok()) << rec.status();
  EXPECT_EQ(rec->json["basis"], "kvcal-calibrate");
  EXPECT_EQ(rec->json["label"], "scale 1.0, K, V");
  EXPECT_EQ(rec->json["observer"], "scale_one");
  EXPECT_EQ(rec->json["quantize"], "k_v");
  EXPECT_EQ(rec->json["kv_cache_dtype"], "bfloat16");
  EXPECT_EQ(rec->row, nullptr);  // the calibrated row is not the decision's
  EXPECT_EQ(rec->reason, "it is within the noise");
}

TEST(ReportDecisionTest, SectionsShowTheServeLineCandidatesAndFormats) {
  const Json d = Decision();
  const std::string serve = DecisionServeSection(d);
  EXPECT_THAT(serve,
              HasSubstr("<code id=\"serve-command\">vllm serve /m --dtype "
                        "bfloat16 --kv-cache-dtype bfloat16</code>"));
  EXPECT_THAT(serve, HasSubstr("<code id=\"fp8-command\">vllm serve /m "
                               "--kv-cache-dtype fp8</code>"));
  EXPECT_THAT(serve, HasSubstr("KV cache: <b>bfloat16</b>"));
  EXPECT_THAT(serve, HasSubstr("a &lt;note&gt;"));
  EXPECT_THAT(serve, HasSubstr("too few held-out tokens to decide"));
  const std::string table = DecisionCandidatesSection(d);
  EXPECT_THAT(table,
              HasSubstr("<tr class=\"chosen\"><td>scale 1.0, K, V</td>"));
  EXPECT_THAT(table, HasSubstr("<td>static min-max per tensor, K, V</td>"));
  EXPECT_THAT(table, HasSubstr("765 tokens"));
  const std::string formats = DecisionFormatsSection(d);
  EXPECT_THAT(formats, HasSubstr("here <b>bfloat16</b>"));
  EXPECT_THAT(formats,
              Not(HasSubstr("class=\"chosen\"")));  // fp8 is not served
}

TEST(ReportDecisionTest, AMissingFieldIsNamed) {
  Json d = Decision();
  d["decision"].erase("kv_cache_dtype");
  auto rec = RecommendFromDecision(d, {});
  ASSERT_FALSE(rec.ok());
  EXPECT_THAT(std::string(rec.status().message()),
              HasSubstr("decision.kv_cache_dtype"));
  d = Decision();
  d["candidates"] = Json::array();
  rec = RecommendFromDecision(d, {});
  ASSERT_FALSE(rec.ok());
  EXPECT_THAT(std::string(rec.status().message()), HasSubstr("candidates"));
  EXPECT_FALSE(RecommendFromDecision(Json::array(), {}).ok());
}

TEST(ReportDecisionTest, BuildReportWithADecisionRendersIt) {
  ReportInputs in;
  in.scales = CalibratedScales{};
  in.decision = Decision();
  auto report = BuildReport(in);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_THAT(report->html, HasSubstr("id=\"serve-command\""));
  EXPECT_THAT(report->html, HasSubstr("id=\"candidates-table\""));
  EXPECT_EQ(report->summary["recommendation"]["basis"], "kvcal-calibrate");
  EXPECT_EQ(report->summary["decision"]["kv_cache_dtype"], "bfloat16");
}

}  // namespace
}  // namespace kvcal::report
