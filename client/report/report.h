// The scale-quality report `kvcal report` writes: one self-contained HTML
// page (inline SVG and CSS, no script, nothing fetched) from a session's
// statistics and/or a scales file, plus optional evaluation results
// (kvcal.torch.evaluate's JSON).
//
//   kvcal::ReportInputs in;
//   in.statistics = std::move(stats);  // SessionStatistics from ExportState
//   in.evaluations.push_back({"static-head.json", json});
//   KVCAL_ASSIGN_OR_RETURN(kvcal::Report report, kvcal::BuildReport(in));
//   // report.html: the page; report.summary: the recommendation as JSON.
//
// With statistics the engine computes every observer's scales
// (ComputeScales) and estimates each one's quantization error, saturation
// and subnormal shares from the histograms (EstimateQuantization). With
// evaluation results the measured figures decide the recommendation.
//
// The parts (client/report/): svg.* draws the figures, evaluation.* reads
// evaluation results, estimates.* computes the per-observer estimates,
// recommendation.* holds the policy, page.cc lays the page out.
#ifndef KVCAL_CLIENT_REPORT_REPORT_H_
#define KVCAL_CLIENT_REPORT_REPORT_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/checkpoint/scales_file.h"
#include "kernels/scale_math.h"
#include "kernels/statistics.h"
#include "nlohmann/json.hpp"

namespace kvcal {

struct EvaluationInput {
  std::string name;  // shown in the page (the file name)
  nlohmann::json result;
};

struct ReportInputs {
  std::string title = "kvcal scale report";
  std::string source;  // e.g. "session s1 on 127.0.0.1:50051"
  std::optional<SessionStatistics> statistics;
  std::optional<CalibratedScales> scales;
  std::vector<EvaluationInput> evaluations;
  // kvcal-calibrate's decision (client/report/decision.h): the page
  // renders it as the recommendation instead of applying its own rule.
  std::optional<nlohmann::json> decision;
  Format format = Format::kFp8E4m3fn;
};

struct Report {
  std::string html;
  // {"recommendation": {observer, granularity, quantize, margin, reason,
  // basis}, "estimates": [...], "figures": [ids of the page's SVGs]}
  nlohmann::ordered_json summary;
};

// InvalidArgument when there is neither statistics nor a scales file, or an
// evaluation result lacks a field or has the wrong geometry (naming the file
// and the field).
absl::StatusOr<Report> BuildReport(const ReportInputs& inputs);

}  // namespace kvcal

#endif  // KVCAL_CLIENT_REPORT_REPORT_H_
