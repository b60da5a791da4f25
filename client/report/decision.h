// kvcal-calibrate's decision as the report shows it (`kvcal report
// --decision FILE`). The decision is kvcal-calibrate's one answer (the
// chosen scales, the cache format to serve with and its skip layers, the
// `vllm serve` line, every candidate scored and the noise of the held-out
// set; python/kvcal/calibrate/decision.py): the page renders it as its
// recommendation and applies no rule of its own, so the summary, `--json`
// and the page cannot disagree.
#ifndef KVCAL_CLIENT_REPORT_DECISION_H_
#define KVCAL_CLIENT_REPORT_DECISION_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/report/common.h"
#include "client/report/evaluation.h"
#include "client/report/recommendation.h"

namespace kvcal::report {

// The recommendation of a decision: json {basis "kvcal-calibrate", label,
// observer, granularity, quantize, margin 1, kv_cache_dtype, skip_layers,
// serve}, its why, and the FP8 evaluation row of the written scales when
// one was given. InvalidArgument naming the missing or mistyped field.
absl::StatusOr<Recommendation> RecommendFromDecision(
    const Json& decision, const std::vector<EvaluationRow>& evaluations);

// The page's sections for a decision: what to serve (scales, cache dtype,
// the serve line, the FP8 alternative, the noise), every candidate scored
// with the chosen one marked, and the cache formats with their skip layers.
// Each section is complete HTML (<section>...</section>).
std::string DecisionServeSection(const Json& decision);
std::string DecisionCandidatesSection(const Json& decision);
std::string DecisionFormatsSection(const Json& decision);

}  // namespace kvcal::report

#endif  // KVCAL_CLIENT_REPORT_DECISION_H_
