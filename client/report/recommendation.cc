#include "client/report/recommendation.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/report/svg.h"

namespace kvcal::report {

double ClipOvershoot(const EvaluationRow& best, bool kv_only, Format format) {
  double over = 0.0;
  for (int r = kv_only ? 1 : 0; r < 3; ++r) {
    for (size_t l = 0; l < best.scale[r].size() && l < best.absmax[r].size();
         ++l) {
      for (size_t h = 0;
           h < best.scale[r][l].size() && h < best.absmax[r][l].size(); ++h) {
        const double clip = best.scale[r][l][h] * FormatMax(format);
        if (clip > 0) over = std::max(over, best.absmax[r][l][h] / clip);
      }
    }
  }
  return over;
}

const EvaluationRow* SimplestOrBest(
    const std::vector<EvaluationRow>& evaluations, bool kv_only) {
  const EvaluationRow* base = nullptr;
  const EvaluationRow* best = nullptr;
  for (const EvaluationRow& r : evaluations) {
    if (r.kv_only != kv_only || r.kv_format != "fp8") continue;
    if (!best || r.delta_nll < best->delta_nll) best = &r;
    if (!base && r.observer == "static_minmax" && r.granularity == "tensor") {
      base = &r;
    }
  }
  if (!base || !best) return best;
  // A lower loss with a larger attention error is not trusted: on this
  // few tokens the loss moves by chance, the attention error does not.
  return best->delta_nll < base->delta_nll - kSignificantNats &&
                 best->attention_mean <= base->attention_mean
             ? best
             : base;
}

// Why `best` (the chosen row) over static min-max per tensor and over
// scale 1.0.
namespace {

std::string ChoiceReason(const EvaluationRow& best) {
  std::string why =
      best.observer == "static_minmax" && best.granularity == "tensor"
          ? absl::StrFormat(
                "no observer or granularity lowers the loss by more than "
                "%.3f nats/token against static min-max per tensor, the "
                "simplest (it cannot saturate on its calibration data and "
                "loads in every vLLM attention backend)",
                kSignificantNats)
          : absl::StrFormat(
                "it lowers the loss by more than %.3f nats/token against "
                "static min-max per tensor, at no larger attention error",
                kSignificantNats);
  if (best.delta_nll_ones > best.delta_nll + kSignificantNats) {
    absl::StrAppendFormat(&why, "; scale 1.0 costs %+.4f nats/token more",
                          best.delta_nll_ones - best.delta_nll);
  } else {
    absl::StrAppendFormat(
        &why,
        "; scale 1.0 is not measurably worse here (%+.4f vs %+.4f "
        "nats/token, attention error %s vs %s, saturating %s): calibrated "
        "scales still guard against values beyond 448",
        best.delta_nll_ones, best.delta_nll, Percent(best.attention_ones_mean),
        Percent(best.attention_mean), Percent(best.saturated_ones, 4));
  }
  return why;
}

}  // namespace

double MarginFor(const EvaluationRow& best, bool kv_only, Format format,
                 std::string& why) {
  const double over = ClipOvershoot(best, kv_only, format);
  if (best.saturated > 0 && over > 1.0) {
    why = absl::StrFormat(
        "the evaluation's maxima pass the clip points by up to %.3fx "
        "(%s of values saturate)",
        over, Percent(best.saturated, 4));
    return std::ceil(over * 20.0) / 20.0;
  }
  why = absl::StrFormat(
      "the evaluation's maxima stay within the clip points (at most %.3f "
      "of them)",
      over);
  return 1.0;
}

Recommendation RecommendFromEvaluations(
    const std::vector<EvaluationRow>& evaluations, Format format) {
  Recommendation out;
  const EvaluationRow* best_kv = SimplestOrBest(evaluations, true);
  const EvaluationRow* best_qkv = SimplestOrBest(evaluations, false);
  bool kv_only;
  std::string quantize_why;
  if (best_kv && best_qkv) {
    const double extra = best_qkv->delta_nll - best_kv->delta_nll;
    kv_only = extra > kSignificantNats;
    quantize_why = absl::StrFormat(
        "quantizing Q as well costs %+.4f nats/token over K/V only (%s "
        "%.3f) and raises the mean attention error from %s to %s%s",
        extra, kv_only ? "more than" : "at most", kSignificantNats,
        Percent(best_kv->attention_mean), Percent(best_qkv->attention_mean),
        kv_only ? "" : "; take it where FP8 attention is faster");
  } else {
    kv_only = best_kv != nullptr;
    quantize_why = kv_only ? "only K/V-only evaluations were given"
                           : "only Q/K/V evaluations were given";
  }
  const EvaluationRow* best = kv_only ? best_kv : best_qkv;
  out.row = best;
  std::string margin_why;
  const double margin = MarginFor(*best, kv_only, format, margin_why);
  out.json = {{"observer", best->observer},
              {"label", best->label},
              {"granularity", best->granularity},
              {"quantize", kv_only ? "k_v" : "q_k_v"},
              {"q_per_kv_group", best->q_per_kv_group},
              {"margin", margin},
              {"basis", "evaluation"},
              {"delta_nll", best->delta_nll},
              {"delta_nll_scale_one", best->delta_nll_ones}};
  out.reason = absl::StrFormat(
      "Measured on the evaluation data: %s per %s costs %+.4f nats/token "
      "against the unquantized model (perplexity %.3f vs %.3f); scale 1.0 "
      "costs %+.4f. Choice: %s. Q: %s. Margin %.2f: %s.",
      best->label, best->granularity, best->delta_nll, best->perplexity,
      best->reference_perplexity, best->delta_nll_ones, ChoiceReason(*best),
      quantize_why, margin, margin_why);
  return out;
}

SkipCandidates SkipLayerCandidates(const EvaluationRow& row) {
  SkipCandidates out;
  SkipLayerOutliers found = FindSkipLayerOutliers(row.layer_attention);
  out.layers = std::move(found.layers);
  out.median = found.median;
  out.argument = SkipLayersArgument(out.layers);
  if (!out.layers.empty()) {
    const double n = static_cast<double>(row.layer_attention.size());
    const double b = CacheValueBytes(row.kv_format);
    const double s = static_cast<double>(out.layers.size());
    out.cache_ratio = ((n - s) * b + s * 2.0) / (n * b);
  }
  return out;
}

double CacheValueBytes(const std::string& kv_format) {
  if (kv_format == "fp8") return 1.0;
  if (kv_format == "nvfp4" || kv_format == "nvfp4_4over6") return 0.5625;
  return 2.0;
}

FormatChoice RecommendFormat(const std::vector<EvaluationRow>& evaluations,
                             double tolerance) {
  FormatChoice out;
  for (const char* format : {"fp8", "nvfp4", "nvfp4_4over6"}) {
    const EvaluationRow* best = nullptr;
    for (const EvaluationRow& r : evaluations) {
      if (r.kv_format == format && (!best || r.delta_nll < best->delta_nll)) {
        best = &r;
      }
    }
    if (best) out.best.push_back(best);
  }
  OrderedJson formats = OrderedJson::array();
  std::string listed;
  for (const EvaluationRow* r : out.best) {
    const bool within = r->delta_nll <= tolerance;
    if (within && (!out.recommended ||
                   CacheValueBytes(r->kv_format) <
                       CacheValueBytes(out.recommended->kv_format) ||
                   (CacheValueBytes(r->kv_format) ==
                        CacheValueBytes(out.recommended->kv_format) &&
                    r->delta_nll < out.recommended->delta_nll))) {
      out.recommended = r;
    }
    formats.push_back(
        {{"kv_format", r->kv_format},
         {"row", r->name},
         {"delta_nll", r->delta_nll},
         {"attention_error_mean", r->attention_mean},
         {"cache_bytes_ratio", CacheValueBytes(r->kv_format) / 2.0},
         {"within_tolerance", within}});
    absl::StrAppendFormat(&listed, "%s%s %+.4f nats/token (%s, %s)",
                          listed.empty() ? "" : "; ", r->kv_format,
                          r->delta_nll, r->label, Percent(r->attention_mean));
  }
  const std::string chosen =
      out.recommended ? out.recommended->kv_format : "auto";
  out.json = {{"tolerance_nats_per_token", tolerance},
              {"formats", formats},
              {"recommended", chosen}};
  out.reason =
      out.recommended
          ? absl::StrFormat(
                "--kv-cache-dtype %s: the fewest cache bytes among the "
                "formats within %.3f nats/token (%s)",
                chosen, tolerance, listed)
          : absl::StrFormat(
                "no evaluated cache format is within %.3f nats/token (%s): "
                "keep the KV cache in the model's dtype "
                "(--kv-cache-dtype auto)",
                tolerance, listed);
  return out;
}

Recommendation RecommendFromEstimates(const std::vector<Estimate>& estimates) {
  Recommendation out;
  const Estimate* best = nullptr;
  const Estimate* best_tensor = nullptr;
  for (const Estimate& e : estimates) {
    if (e.variant->q_per_kv_group) continue;  // q is not judged here
    if (!best || e.kv_error < best->kv_error) best = &e;
    if (e.variant->granularity == Granularity::kPerTensor &&
        (!best_tensor || e.kv_error < best_tensor->kv_error)) {
      best_tensor = &e;
    }
  }
  std::string granularity_why = "the lowest estimated error";
  if (best_tensor && best != best_tensor &&
      best_tensor->kv_error <= best->kv_error * 1.02) {
    granularity_why = absl::StrFormat(
        "per tensor is within 2%% of the best per-head estimate (%s vs %s) "
        "and loads in every vLLM attention backend",
        Percent(best_tensor->kv_error), Percent(best->kv_error));
    best = best_tensor;
  }
  const bool head = best->variant->granularity == Granularity::kPerHead;
  out.json = {{"observer", ObserverName(best->observer->observer)},
              {"label", best->observer->label},
              {"granularity", head ? "head" : "tensor"},
              {"quantize", "k_v"},
              {"q_per_kv_group", false},
              {"margin", 1.0},
              {"basis", "statistics"},
              {"estimated_kv_error", best->kv_error}};
  out.reason = absl::StrFormat(
      "Estimated from the calibration statistics (no evaluation given): %s "
      "per %s has the lowest mean relative RMS error on K and V (%s; "
      "saturating %s of K and %s of V). Granularity: %s. K/V only: whether "
      "Q can be quantized too needs a measurement (kvcal.torch.evaluate, "
      "then kvcal report --eval). Margin 1.0: no evaluation maxima to "
      "compare with.",
      best->observer->label, head ? "head" : "tensor", Percent(best->kv_error),
      Percent(best->roles[1].saturated, 4),
      Percent(best->roles[2].saturated, 4), granularity_why);
  return out;
}

Recommendation NoRecommendation(const std::optional<CalibratedScales>& scales) {
  Recommendation out;
  out.json = {
      {"observer", scales ? scales->observer : "static_minmax"},
      {"granularity",
       scales ? std::string(GranularityName(scales->granularity)) : "tensor"},
      {"quantize", "k_v"},
      {"margin", 1.0},
      {"basis", "none"}};
  out.reason =
      "No basis for a recommendation: without histograms in the session "
      "or evaluation results, the page shows the scales only. Calibrate "
      "with histograms (the default) and pass --eval results to compare "
      "observers.";
  return out;
}

}  // namespace kvcal::report
