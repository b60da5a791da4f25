#include "kernels/scale_math.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/element_math.h"
#include "kernels/head_values.h"
#include "kernels/thread_pool.h"
#include "util/status_macros.h"

namespace kvcal {

absl::Status ScaleOptions::Validate() const {
  if (FindObserver(observer) == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown observer ", static_cast<uint32_t>(observer)));
  }
  const uint32_t g = static_cast<uint32_t>(granularity);
  if (g < 1 || g > 2) {
    return absl::InvalidArgumentError(absl::StrCat("unknown granularity ", g));
  }
  KVCAL_RETURN_IF_ERROR(ObserverParameters::Validate());
  if (!(std::isfinite(margin) && margin > 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("margin must be finite and > 0, got ", margin));
  }
  return absl::OkStatus();
}

QuantizationEstimate EstimateQuantization(
    std::span<const HeadStatistics* const> heads, float scale, Format format,
    uint32_t log2_bins_per_octave) {
  QuantizationEstimate out;
  uint64_t finite = 0;
  double sum_squares = 0.0;
  for (const HeadStatistics* h : heads) {
    finite += h->finite_count;
    sum_squares += h->sum_squares;
  }
  if (finite == 0 || heads[0]->histogram.empty()) return out;
  const ValueModel model(heads, log2_bins_per_octave);
  const double n = static_cast<double>(finite);
  const double error = model.Error(scale, format, 2.0);
  out.relative_rms_error =
      sum_squares > 0.0 ? std::sqrt(error / sum_squares) : 0.0;
  // A static scale's own absmax divides to a ulp above the format's max:
  // only beyond float32's rounding of the division counts (as evaluate()).
  const double clip =
      static_cast<double>(scale) * FormatMax(format) * (1.0 + 0x1p-20);
  out.saturated_share =
      model.CountBetween(clip, std::numeric_limits<double>::infinity()) / n;
  out.subnormal_share = model.CountBetween(0.0, static_cast<double>(scale) *
                                                    FormatMinNormal(format)) /
                        n;
  return out;
}

namespace {

std::string TripleName(uint32_t layer, Role role, uint32_t head) {
  return absl::StrCat("(", layer, ", ", RoleName(role), ", ", head, ")");
}

float ObserverRange(HeadSpan heads, const ScaleOptions& options,
                    uint32_t log2_bins) {
  return FindObserver(options.observer)->range(heads, options, log2_bins);
}

// options.layers sorted and deduplicated (every layer when empty); an
// error when one is out of range.
absl::StatusOr<std::vector<uint32_t>> SelectLayers(
    const Geometry& g, const std::vector<uint32_t>& layers) {
  std::vector<uint32_t> selected;
  if (layers.empty()) {
    for (uint32_t layer = 0; layer < g.num_layers; ++layer) {
      selected.push_back(layer);
    }
    return selected;
  }
  selected = layers;
  std::sort(selected.begin(), selected.end());
  selected.erase(std::unique(selected.begin(), selected.end()), selected.end());
  if (selected.back() >= g.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer ", selected.back(), " is out of range: the session has ",
        g.num_layers, " layers"));
  }
  return selected;
}

// FAILED_PRECONDITION naming the (layer, role, head) triples of `selected`
// without data, unless there are none or allow_missing.
absl::Status CheckMissing(const SessionStatistics& stats,
                          const std::vector<uint32_t>& selected,
                          bool allow_missing) {
  const Geometry& g = stats.geometry();
  std::vector<std::string> missing;
  uint64_t missing_count = 0;
  // Of those, the ones that saw values, all NaN or Inf.
  uint64_t nonfinite_only = 0;
  std::string first_nonfinite;
  for (uint32_t layer : selected) {
    for (Role role : g.roles()) {
      for (uint32_t head = 0; head < g.heads(role); ++head) {
        const HeadStatistics& h = stats.head(layer, role, head);
        if (h.finite_count != 0) continue;
        ++missing_count;
        if (missing.size() < 20)
          missing.push_back(TripleName(layer, role, head));
        if (h.nonfinite_count() != 0 && nonfinite_only++ == 0) {
          first_nonfinite =
              absl::StrCat(TripleName(layer, role, head), ": ", h.nan_count,
                           " NaN, ", h.inf_count, " Inf");
        }
      }
    }
  }
  if (missing_count == 0 || allow_missing) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      missing_count, " (layer, role, head) triples have no data: ",
      absl::StrJoin(missing, ", "),
      missing_count > missing.size() ? ", ..." : "",
      nonfinite_only == 0
          ? ""
          : absl::StrCat("; ", nonfinite_only,
                         " of them saw only non-finite values (first ",
                         first_nonfinite, ")"),
      " (set allow_missing to finalize the rest)"));
}

// The scales of one (layer, role): per tensor, per head, or per head then
// the largest of each KV group's query heads; empty when a head has no data.
RoleScales ScalesOfRole(const SessionStatistics& stats,
                        const ScaleOptions& options, uint32_t layer,
                        Role role) {
  const Geometry& g = stats.geometry();
  const uint32_t log2_bins = g.log2_bins_per_octave();
  const uint32_t heads = g.heads(role);
  std::vector<const HeadStatistics*> all(heads);
  RoleScales out;
  bool any_missing = false;
  for (uint32_t h = 0; h < heads; ++h) {
    all[h] = &stats.head(layer, role, h);
    out.count += all[h]->finite_count;
    out.nonfinite += all[h]->nonfinite_count();
    any_missing |= all[h]->finite_count == 0;
  }
  if (any_missing) return out;
  if (options.granularity == Granularity::kPerTensor) {
    const float range = ObserverRange(all, options, log2_bins);
    out.scale.push_back(ScaleFromRange(range, options.margin, options.format));
    out.absmax.push_back(StaticAbsmax(all));
    return out;
  }
  for (uint32_t h = 0; h < heads; ++h) {
    std::span<const HeadStatistics* const> one(&all[h], 1);
    const float range = ObserverRange(one, options, log2_bins);
    out.scale.push_back(ScaleFromRange(range, options.margin, options.format));
    out.absmax.push_back(StaticAbsmax(one));
  }
  if (role == Role::kQ && options.q_per_kv_group) {
    const uint32_t group = g.num_attention_heads / g.num_key_value_heads;
    std::vector<float> scale(g.num_key_value_heads, 0.0f);
    std::vector<float> absmax(g.num_key_value_heads, 0.0f);
    for (uint32_t h = 0; h < heads; ++h) {
      scale[h / group] = std::max(scale[h / group], out.scale[h]);
      absmax[h / group] = std::max(absmax[h / group], out.absmax[h]);
    }
    out.scale = std::move(scale);
    out.absmax = std::move(absmax);
  }
  return out;
}

}  // namespace

absl::StatusOr<ScaleResult> ComputeScales(const SessionStatistics& stats,
                                          const ScaleOptions& options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  const Geometry& g = stats.geometry();
  const ObserverDefinition& observer = *FindObserver(options.observer);
  if (observer.needs_histograms && !g.has_histograms()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the ", observer.name,
        " observer needs histograms; this session was created with "
        "histogram_bins_per_octave = 0"));
  }
  if (stats.finite_values() == 0) {
    const uint64_t nonfinite = stats.nonfinite_values();
    return absl::FailedPreconditionError(
        absl::StrCat("the session has no finite values: nothing to calibrate",
                     nonfinite == 0 ? ""
                                    : absl::StrCat(" (it saw only ", nonfinite,
                                                   " NaN or Inf values)")));
  }
  KVCAL_ASSIGN_OR_RETURN(const std::vector<uint32_t> selected,
                         SelectLayers(g, options.layers));
  KVCAL_RETURN_IF_ERROR(CheckMissing(stats, selected, options.allow_missing));

  ScaleResult result;
  result.layers.resize(selected.size());
  struct Job {
    size_t slot;  // index into result.layers
    uint32_t layer;
    Role role;
  };
  std::vector<Job> jobs;
  for (size_t slot = 0; slot < selected.size(); ++slot) {
    result.layers[slot].layer = selected[slot];
    for (Role role : g.roles()) jobs.push_back({slot, selected[slot], role});
  }
  auto run_job = [&](size_t index) {
    const Job& job = jobs[index];
    result.layers[job.slot].roles[RoleIndex(job.role)] =
        ScalesOfRole(stats, options, job.layer, job.role);
  };
  if (observer.needs_histograms) {  // the costly ones
    ThreadPool::Shared().ParallelFor(jobs.size(), run_job);
  } else {
    for (size_t i = 0; i < jobs.size(); ++i) run_job(i);
  }
  return result;
}

}  // namespace kvcal
