// Evaluation results (kvcal.torch.evaluate's to_json output, or the
// worker's evaluation in the same form) read into rows the recommendation
// and the page use.
#ifndef KVCAL_CLIENT_REPORT_EVALUATION_H_
#define KVCAL_CLIENT_REPORT_EVALUATION_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/report/report.h"
#include "kernels/statistics.h"

namespace kvcal::report {

struct EvaluationRow {
  std::string name;
  std::string label;
  std::string observer;
  std::string granularity;
  bool kv_only = false;
  bool q_per_kv_group = true;
  // The K/V cache format the evaluation emulated: "fp8", "nvfp4" or
  // "nvfp4_4over6" (an evaluation without the field is FP8).
  std::string kv_format = "fp8";
  double delta_nll = 0.0;       // calibrated - reference
  double delta_nll_ones = 0.0;  // scale 1.0 - reference
  double perplexity = 0.0;
  double reference_perplexity = 0.0;
  double attention_mean = 0.0, attention_worst = 0.0;
  double attention_ones_mean = 0.0;
  // Per layer: the mean attention error over the layer's query heads.
  std::vector<double> layer_attention;
  double saturated = 0.0, saturated_ones = 0.0;  // max over layers x heads
  double subnormal = 0.0;                        // mean
  // Per role [layer][head]: evaluation absmax and the applied scale.
  std::vector<std::vector<double>> absmax[3];
  std::vector<std::vector<double>> scale[3];
};

// One evaluation result as a row; InvalidArgument naming the file and the
// field when a field is missing or of the wrong type.
absl::StatusOr<EvaluationRow> ParseEvaluation(const EvaluationInput& in);

// Every evaluation result, each checked against the session's geometry
// when there is one.
absl::StatusOr<std::vector<EvaluationRow>> ParseEvaluations(
    const std::vector<EvaluationInput>& inputs,
    const std::optional<SessionStatistics>& statistics);

}  // namespace kvcal::report

#endif  // KVCAL_CLIENT_REPORT_EVALUATION_H_
