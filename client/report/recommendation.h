// What the report recommends (observer, granularity, whether Q is
// quantized, the scale margin) and why: from measured evaluations when there
// are any, else from the engine's estimates, else nothing. The policy is
// here alone so that its rules can be tested without rendering a page
// (tests/client/report_recommendation_test.cc).
#ifndef KVCAL_CLIENT_REPORT_RECOMMENDATION_H_
#define KVCAL_CLIENT_REPORT_RECOMMENDATION_H_

#include <optional>
#include <string>
#include <vector>

#include "client/checkpoint/scales_file.h"
#include "client/checkpoint/skip_layers.h"
#include "client/report/common.h"
#include "client/report/estimates.h"
#include "client/report/evaluation.h"

namespace kvcal::report {

// The smallest loss difference (nats per predicted token) the
// recommendation acts on: quantize Q too when it costs at most this much over
// K/V only; leave static min-max per tensor only for a row better by more.
// Smaller differences on a few thousand evaluation tokens are noise (on
// SmolLM2, 1020 tokens: scale 1.0 and static min-max per tensor differ by
// 0.013 nats/token with K/V attention errors 5.9% vs 6.1%).
constexpr double kSignificantNats = 0.01;

// What the page recommends, why, and the evaluation row it rests on.
struct Recommendation {
  OrderedJson json;
  std::string reason;
  const EvaluationRow* row = nullptr;
};

// How far the evaluation's maxima pass the clip points of `best`'s scales
// (largest ratio over the quantized roles, layers and heads; 0 when none).
double ClipOvershoot(const EvaluationRow& best, bool kv_only, Format format);

// Of the rows of one kind (K/V only or Q/K/V): the simplest (static
// min-max per tensor, when evaluated), replaced by the lowest-loss row only
// when its loss is lower by more than kSignificantNats and its mean
// attention error is not larger. Null when no row is of that kind.
const EvaluationRow* SimplestOrBest(
    const std::vector<EvaluationRow>& evaluations, bool kv_only);

// The scale margin `best` needs so that the evaluation's maxima do not
// saturate (1.0 when they stay within the clip points; otherwise the
// overshoot rounded up to a multiple of 0.05), and why.
double MarginFor(const EvaluationRow& best, bool kv_only, Format format,
                 std::string& why);

// From measured evaluations (at least one FP8 row; rows of other cache
// formats are not scale candidates): quantize Q too unless it costs more than
// kSignificantNats over K/V only.
Recommendation RecommendFromEvaluations(
    const std::vector<EvaluationRow>& evaluations, Format format);

// Layers to keep out of the quantized KV cache: the outliers of the row's
// per-layer attention errors by checkpoint/skip_layers.h's rule (candidates:
// the report has no model to re-score with).
struct SkipCandidates {
  std::vector<int> layers;  // ascending
  double median = 0.0;      // the median layer's mean attention error
  std::string argument;     // "--kv-cache-dtype-skip-layers 3 17", or ""
  // The KV cache bytes per token with `layers` in 16 bits over those with
  // every layer quantized in `row`'s format.
  double cache_ratio = 1.0;
};
SkipCandidates SkipLayerCandidates(const EvaluationRow& row);

// Bytes per cached K or V value in vLLM 0.34's cache formats: fp8 1,
// nvfp4 and nvfp4_4over6 9/16 (4-bit values and one E4M3 scale per 16);
// the model's 16-bit dtype 2.
double CacheValueBytes(const std::string& kv_format);

// The held-out loss (nats per token) a recommended cache format may add;
// kvcal-calibrate's --tolerance default.
constexpr double kFormatToleranceNats = 0.02;

// Which KV cache format keeps the model within `tolerance`: of each
// format's lowest-loss row, the one with the fewest cache bytes whose
// Δ nats/token is at most `tolerance` (ties: the lower Δ); none (keep the
// cache in 16 bits) when no format is within it.
struct FormatChoice {
  std::vector<const EvaluationRow*> best;      // one per format present
  const EvaluationRow* recommended = nullptr;  // null: none is within
  OrderedJson json;
  std::string reason;
};
FormatChoice RecommendFormat(const std::vector<EvaluationRow>& evaluations,
                             double tolerance = kFormatToleranceNats);

// From the statistics alone (at least one estimate): the lowest estimated
// K/V error, per tensor when it is within 2% of the best per head.
Recommendation RecommendFromEstimates(const std::vector<Estimate>& estimates);

// Neither evaluations nor histograms: the scales file's observer and
// granularity (static min-max per tensor without one), basis "none".
Recommendation NoRecommendation(const std::optional<CalibratedScales>& scales);

}  // namespace kvcal::report

#endif  // KVCAL_CLIENT_REPORT_RECOMMENDATION_H_
