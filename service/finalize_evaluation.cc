#include "service/finalize_evaluation.h"

#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "proto/names.h"
#include "proto/wire_enums.h"
#include "util/status_macros.h"

namespace kvcal::service {
namespace {

double Ratio(double error_sq, double reference_sq) {
  if (reference_sq <= 0.0) return error_sq > 0.0 ? INFINITY : 0.0;
  return std::sqrt(error_sq / reference_sq);
}

// Totals over the layers.
void Summarize(Evaluation& e) {
  double err = 0.0, err_ones = 0.0, ref = 0.0;
  for (const LayerEvaluation& l : e.layers) {
    err += l.error_sq;
    err_ones += l.error_sq_ones;
    ref += l.reference_sq;
  }
  e.error = Ratio(err, ref);
  e.error_ones = Ratio(err_ones, ref);
  if (!e.layers.empty()) {
    e.sequences = e.layers[0].sequences;
    e.tokens = e.layers[0].tokens;
  }
}

absl::StatusOr<Evaluation> EvaluateScales(const SessionStatistics& stats,
                                          const HoldoutStore& holdout,
                                          const ScaleResult& scales,
                                          const ScaleOptions& scale_options,
                                          bool kv_only) {
  Evaluation e;
  e.observer = scale_options.observer;
  e.granularity = scale_options.granularity;
  e.kv_only = kv_only;
  EvaluationOptions options;
  options.kv_only = kv_only;
  for (const LayerScales& layer : scales.layers) {
    KVCAL_ASSIGN_OR_RETURN(
        LayerEvaluation l,
        holdout.EvaluateLayer(stats.geometry(), layer, options));
    e.layers.push_back(std::move(l));
    e.layer_observers.push_back(e.observer);
    e.layer_granularities.push_back(e.granularity);
  }
  Summarize(e);
  return e;
}

// Why `options` cannot evaluate on this session (OK when it can).
absl::Status CheckEvaluable(const SessionStatistics& stats,
                            const HoldoutStore& holdout,
                            const EvaluatedFinalizeOptions& options) {
  KVCAL_RETURN_IF_ERROR(options.scale.Validate());
  const char* what = options.auto_observer ? "observer auto" : "evaluate";
  if (options.scale.format != Format::kFp8E4m3fn) {
    return absl::InvalidArgumentError(absl::StrCat(
        what,
        " measures FP8 attention in float8_e4m3fn (vLLM's FP8 "
        "attention format); format ",
        CanonicalName(static_cast<kvcal::v1::Format>(options.scale.format)),
        " is not supported"));
  }
  if (holdout.chunks() == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        what,
        " needs held-out batches and this session has none: send some "
        "chunks with IngestRequest.holdout = true (`kvcal push "
        "--holdout-batches N`, or `producer.holdout = True` in Python) "
        "before finalizing"));
  }
  for (Role role : kAllRoles) {
    if (!stats.geometry().collects(role)) {
      return absl::FailedPreconditionError(absl::StrCat(
          what, " needs Q, K and V; this session does not collect ",
          RoleName(role)));
    }
  }
  return absl::OkStatus();
}

// Every observer (those the session's histograms allow) at every
// granularity, evaluated: out.candidates, and their scales in `results`.
absl::Status EvaluateCandidates(const SessionStatistics& stats,
                                const HoldoutStore& holdout,
                                const EvaluatedFinalizeOptions& options,
                                const std::vector<Granularity>& granularities,
                                EvaluatedFinalize& out,
                                std::vector<ScaleResult>& results) {
  for (Granularity granularity : granularities) {
    // Every observer of the proto's table (proto/names.h), simplest first.
    for (const ObserverRow& row : ObserverTable()) {
      if (!stats.geometry().has_histograms() && row.needs_histograms) continue;
      ScaleOptions candidate = options.scale;
      candidate.observer = FromWire(row.value);
      candidate.granularity = granularity;
      KVCAL_ASSIGN_OR_RETURN(ScaleResult scales,
                             ComputeScales(stats, candidate));
      KVCAL_ASSIGN_OR_RETURN(
          Evaluation e,
          EvaluateScales(stats, holdout, scales, candidate, options.kv_only));
      out.candidates.push_back(std::move(e));
      results.push_back(std::move(scales));
    }
  }
  return absl::OkStatus();
}

// Per layer the candidate of least error within each granularity; then the
// granularity whose combination has the least error.
void ChooseBestPerLayer(const EvaluatedFinalizeOptions& options,
                        const std::vector<Granularity>& granularities,
                        const std::vector<ScaleResult>& results,
                        EvaluatedFinalize& out) {
  std::optional<Evaluation> best_combined;
  std::optional<ScaleResult> best_scales;
  for (Granularity granularity : granularities) {
    Evaluation combined;
    combined.granularity = granularity;
    combined.observer = Observer::kStaticMinMax;
    combined.kv_only = options.kv_only;
    ScaleResult scales;
    std::vector<size_t> of_granularity;
    for (size_t i = 0; i < out.candidates.size(); ++i) {
      if (out.candidates[i].granularity == granularity) {
        of_granularity.push_back(i);
      }
    }
    const size_t layers = out.candidates[of_granularity[0]].layers.size();
    for (size_t l = 0; l < layers; ++l) {
      size_t best = of_granularity[0];
      for (size_t i : of_granularity) {
        if (out.candidates[i].layers[l].error <
            out.candidates[best].layers[l].error) {
          best = i;
        }
      }
      combined.layers.push_back(out.candidates[best].layers[l]);
      combined.layer_observers.push_back(out.candidates[best].observer);
      combined.layer_granularities.push_back(granularity);
      scales.layers.push_back(results[best].layers[l]);
    }
    Summarize(combined);
    if (!best_combined.has_value() || combined.error < best_combined->error) {
      best_combined = std::move(combined);
      best_scales = std::move(scales);
    }
  }
  out.scales = std::move(*best_scales);
  out.evaluation = std::move(*best_combined);
}

}  // namespace

absl::StatusOr<EvaluatedFinalize> FinalizeAndEvaluate(
    const SessionStatistics& stats, const HoldoutStore& holdout,
    const EvaluatedFinalizeOptions& options) {
  EvaluatedFinalize out;
  if (!options.evaluate && !options.auto_observer) {
    KVCAL_ASSIGN_OR_RETURN(out.scales, ComputeScales(stats, options.scale));
    return out;
  }
  KVCAL_RETURN_IF_ERROR(CheckEvaluable(stats, holdout, options));
  if (!options.auto_observer) {
    KVCAL_ASSIGN_OR_RETURN(out.scales, ComputeScales(stats, options.scale));
    KVCAL_ASSIGN_OR_RETURN(
        Evaluation e, EvaluateScales(stats, holdout, out.scales, options.scale,
                                     options.kv_only));
    out.evaluation = std::move(e);
    return out;
  }

  std::vector<Granularity> granularities = options.auto_granularities;
  if (granularities.empty()) granularities.push_back(options.scale.granularity);
  std::vector<ScaleResult> results;  // results[i]: out.candidates[i]'s scales
  KVCAL_RETURN_IF_ERROR(
      EvaluateCandidates(stats, holdout, options, granularities, out, results));
  if (options.auto_per_session) {
    size_t best = 0;
    for (size_t i = 1; i < out.candidates.size(); ++i) {
      if (out.candidates[i].error < out.candidates[best].error) best = i;
    }
    out.scales = results[best];
    out.evaluation = out.candidates[best];
    return out;
  }
  ChooseBestPerLayer(options, granularities, results, out);
  return out;
}

}  // namespace kvcal::service
