// Finalize with a judgement: the scales' FP8 attention error on the
// session's held-out batches (`evaluate`), and the `auto` observer that
// finalizes every observer (and allowed granularity), evaluates each and
// keeps the scales with the lowest error.
//
//   EvaluatedFinalizeOptions options;
//   options.scale = scale_options;        // layers, format, parameters, ...
//   options.evaluate = true;              // or options.auto_observer = true
//   KVCAL_ASSIGN_OR_RETURN(EvaluatedFinalize result,
//       FinalizeAndEvaluate(stats, session->holdout(), options));
//
// `auto`: candidates are every observer the statistics allow (MSE and
// percentile need histograms) for each granularity of `auto_granularities`
// (empty = scale.granularity); the parameters of `scale` apply to all. Per
// layer (default) each layer takes the observer with the lowest error under
// one granularity, the granularity whose per-layer choices give the lowest
// error over all layers; with `auto_per_session` the single candidate with
// the lowest error over all layers wins. Ties go to the earlier candidate
// (observers in wire order: static min-max first).
#ifndef KVCAL_SERVICE_FINALIZE_EVALUATION_H_
#define KVCAL_SERVICE_FINALIZE_EVALUATION_H_

#include <vector>

#include "absl/status/statusor.h"
#include "kernels/scale_math.h"
#include "kernels/statistics.h"
#include "service/holdout_store.h"

namespace kvcal::service {

struct EvaluatedFinalizeOptions {
  ScaleOptions scale;
  bool evaluate = false;
  bool kv_only = false;
  bool auto_observer = false;
  bool auto_per_session = false;
  std::vector<Granularity> auto_granularities;
};

// One set of scales judged on the held-out batches.
struct Evaluation {
  Observer observer = Observer::kStaticMinMax;
  Granularity granularity = Granularity::kPerTensor;
  bool kv_only = false;
  // Per evaluated layer; with `auto`, each layer's observer and granularity
  // in layer_observers / layer_granularities (same order).
  std::vector<LayerEvaluation> layers;
  std::vector<Observer> layer_observers;
  std::vector<Granularity> layer_granularities;
  double error = 0.0, error_ones = 0.0;  // over all layers
  uint64_t sequences = 0, tokens = 0;    // per layer
};

struct EvaluatedFinalize {
  ScaleResult scales;
  // Set with `evaluate` or `auto`.
  std::optional<Evaluation> evaluation;
  // `auto`: every candidate, in the order tried.
  std::vector<Evaluation> candidates;
  // The selected layers' heads with NaN or Inf values (Session::Finalize
  // fills it; kMaxNonFiniteHeadsListed at most).
  NonFiniteHeads nonfinite_heads;
};

// FailedPrecondition when evaluation is asked of a session without held-out
// batches (saying how to send them) or a requested layer without any;
// InvalidArgument for a format other than FP8 e4m3fn; plus ComputeScales'
// errors.
absl::StatusOr<EvaluatedFinalize> FinalizeAndEvaluate(
    const SessionStatistics& stats, const HoldoutStore& holdout,
    const EvaluatedFinalizeOptions& options);

}  // namespace kvcal::service

#endif  // KVCAL_SERVICE_FINALIZE_EVALUATION_H_
