#include "client/report.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "kernels/element_math.h"
#include "proto/names.h"
#include "util/status_macros.h"

namespace kvcal {
namespace {

// The engine's enums spelled through the one names table (proto/names.h).
std::string ObserverName(Observer observer) {
  return CanonicalName(static_cast<v1::Observer>(observer));
}
std::string FormatName(Format format) {
  return CanonicalName(static_cast<v1::Format>(format));
}

using Json = nlohmann::json;
using OrderedJson = nlohmann::ordered_json;

constexpr Role kRoles[3] = {Role::kQ, Role::kK, Role::kV};
constexpr const char* kRoleNames[3] = {"q", "k", "v"};
// The smallest loss difference (nats per predicted token) the
// recommendation acts on: quantize Q too when it costs at most this much over
// K/V only; leave static min-max per tensor only for a row better by more.
// Smaller differences on a few thousand evaluation tokens are noise (on
// SmolLM2, 1020 tokens: scale 1.0 and static min-max per tensor differ by
// 0.013 nats/token with K/V attention errors 5.9% vs 6.1%).
constexpr double kSignificantNats = 0.01;

struct ObserverChoice {
  Observer observer;
  double percentile;  // 0 = the default
  const char* label;  // llm-compressor's name, plus the percentile
  const char* cli;    // `kvcal finalize --observer`
  const char* color;
};
constexpr ObserverChoice kObservers[] = {
    {Observer::kStaticMinMax, 0, "static_minmax", "static-minmax", "#d62728"},
    {Observer::kMinMaxEma, 0, "minmax (EMA)", "minmax-ema", "#ff7f0e"},
    {Observer::kMemorylessMinMax, 0, "memoryless_minmax", "memoryless-minmax",
     "#8c564b"},
    {Observer::kMse, 0, "mse", "mse", "#1f77b4"},
    {Observer::kPercentile, 99.99, "percentile 99.99", "percentile", "#2ca02c"},
    {Observer::kPercentile, 99.9, "percentile 99.9", "percentile", "#9467bd"},
};

struct Variant {
  Granularity granularity;
  bool q_per_kv_group;
  const char* label;
};
constexpr Variant kVariants[] = {
    {Granularity::kPerTensor, false, "tensor"},
    {Granularity::kPerHead, false, "head (q per query head)"},
    {Granularity::kPerHead, true, "head (q per KV group)"},
};

struct RoleFigures {
  double mean_error = 0.0;  // mean over heads of the relative RMS error
  double max_error = 0.0;
  double saturated = 0.0;  // share of the role's values
  double subnormal = 0.0;
};

struct Estimate {
  const ObserverChoice* observer;
  const Variant* variant;
  ScaleResult scales;
  RoleFigures roles[3];
  double kv_error = 0.0;  // mean of K's and V's mean errors
};

std::string Escape(absl::string_view s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string Percent(double share, int digits = 2) {
  return absl::StrFormat("%.*f%%", digits, 100.0 * share);
}

// A colour for t in [0, 1] (viridis, five stops interpolated).
std::string Colour(double t) {
  static constexpr double kStops[5][3] = {{68, 1, 84},
                                          {59, 82, 139},
                                          {33, 145, 140},
                                          {94, 201, 98},
                                          {253, 231, 37}};
  if (!std::isfinite(t)) return "#cccccc";
  t = std::clamp(t, 0.0, 1.0) * 4.0;
  const int i = std::min(static_cast<int>(t), 3);
  const double f = t - i;
  int rgb[3];
  for (int c = 0; c < 3; ++c) {
    rgb[c] = static_cast<int>(
        std::lround(kStops[i][c] + f * (kStops[i + 1][c] - kStops[i][c])));
  }
  return absl::StrFormat("#%02x%02x%02x", rgb[0], rgb[1], rgb[2]);
}

// A layers x heads heatmap of positive values (log colour scale), NaN grey.
// `values[layer][head]`.
std::string Heatmap(const std::string& id, const std::string& caption,
                    const std::vector<std::vector<double>>& values,
                    const std::vector<uint32_t>& layers, bool log_scale,
                    std::vector<std::string>& figures) {
  size_t heads = 0;
  for (const auto& row : values) heads = std::max(heads, row.size());
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  for (const auto& row : values) {
    for (double v : row) {
      if (!std::isfinite(v) || (log_scale && v <= 0)) continue;
      const double x = log_scale ? std::log10(v) : v;
      lo = std::min(lo, x);
      hi = std::max(hi, x);
    }
  }
  const int cell = 14, left = 34, top = 18;
  const int width = std::max(left + static_cast<int>(heads) * cell + 8, 190);
  const int height = top + static_cast<int>(values.size()) * cell + 20;
  std::string svg = absl::StrFormat(
      "<figure><svg id=\"%s\" class=\"heatmap\" xmlns=\"http://www.w3.org/"
      "2000/svg\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\">",
      id, width, height, width, height);
  absl::StrAppendFormat(&svg,
                        "<text x=\"%d\" y=\"12\" class=\"axis\">heads "
                        "&#8594;</text>",
                        left);
  for (size_t r = 0; r < values.size(); ++r) {
    const int y = top + static_cast<int>(r) * cell;
    if (r % 5 == 0 || r + 1 == values.size()) {
      absl::StrAppendFormat(&svg,
                            "<text x=\"%d\" y=\"%d\" class=\"axis\" "
                            "text-anchor=\"end\">L%u</text>",
                            left - 3, y + cell - 3, layers[r]);
    }
    for (size_t h = 0; h < values[r].size(); ++h) {
      const double v = values[r][h];
      double t = std::numeric_limits<double>::quiet_NaN();
      if (std::isfinite(v) && (!log_scale || v > 0)) {
        const double x = log_scale ? std::log10(v) : v;
        t = hi > lo ? (x - lo) / (hi - lo) : 0.5;
      }
      absl::StrAppendFormat(
          &svg,
          "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" "
          "fill=\"%s\"><title>layer %u head %u: %.6g</title></rect>",
          left + static_cast<int>(h) * cell, y, cell - 1, cell - 1, Colour(t),
          layers[r], static_cast<uint32_t>(h), v);
    }
  }
  if (std::isfinite(lo)) {
    const auto shown = [&](double x) {
      return log_scale ? std::pow(10.0, x) : x;
    };
    absl::StrAppendFormat(&svg,
                          "<text x=\"%d\" y=\"%d\" class=\"axis\">%.3g "
                          "(dark) .. %.3g (light)</text>",
                          4, height - 5, shown(lo), shown(hi));
  }
  svg += "</svg>";
  absl::StrAppend(&svg, "<figcaption>", caption, "</figcaption></figure>");
  figures.push_back(id);
  return svg;
}

// One (layer, role)'s |x| histogram summed over heads, log2 |x| on x and
// log10 count on y, with a vertical line at each observer's per-tensor clip
// point (scale x the format's max).
std::string HistogramFigure(
    const std::string& id, const std::string& caption,
    const std::vector<uint64_t>& counts, uint32_t log2_bins, double x_lo,
    double x_hi, const std::vector<std::pair<double, const char*>>& clips,
    double absmax, std::vector<std::string>& figures) {
  const int width = 230, height = 96, left = 4, bottom = 14;
  const double plot_w = width - 2 * left, plot_h = height - bottom - 6;
  const uint32_t per_octave = 1u << log2_bins;
  const uint32_t group = std::max<uint32_t>(1, per_octave / 4);
  const uint32_t overflow = HistogramBinCount(log2_bins) - 1;
  std::vector<std::pair<double, uint64_t>> bars;  // (log2 lower edge, count)
  uint64_t peak = 1;
  for (uint32_t bin = kFirstOctaveBin; bin < overflow; bin += group) {
    uint64_t n = 0;
    for (uint32_t b = bin; b < std::min(bin + group, overflow); ++b) {
      n += counts[b];
    }
    if (n == 0) continue;
    bars.push_back({std::log2(HistogramBinLowerEdge(bin, log2_bins)), n});
    peak = std::max(peak, n);
  }
  const double bar_w = 1.0 / 4.0;  // a quarter octave
  const auto x_of = [&](double l2) {
    return left + plot_w * (l2 - x_lo) / std::max(x_hi - x_lo, 1e-9);
  };
  std::string svg = absl::StrFormat(
      "<figure class=\"small\"><svg id=\"%s\" class=\"histogram\" "
      "xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
      "viewBox=\"0 0 %d %d\">",
      id, width, height, width, height);
  const double log_peak = std::log10(static_cast<double>(peak) + 1.0);
  for (const auto& [l2, n] : bars) {
    const double h = plot_h * std::log10(static_cast<double>(n) + 1.0) /
                     std::max(log_peak, 1e-9);
    const double x0 = x_of(l2), x1 = x_of(l2 + bar_w);
    absl::StrAppendFormat(&svg,
                          "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" "
                          "height=\"%.1f\" fill=\"#777\"><title>|x| from "
                          "%.4g: %u values</title></rect>",
                          x0, 6 + plot_h - h, std::max(x1 - x0, 0.5), h,
                          std::exp2(l2), n);
  }
  for (const auto& [clip, colour] : clips) {
    if (!(clip > 0)) continue;
    const double x = x_of(std::log2(clip));
    absl::StrAppendFormat(&svg,
                          "<line x1=\"%.1f\" x2=\"%.1f\" y1=\"4\" y2=\"%.1f\" "
                          "stroke=\"%s\" stroke-width=\"1.5\"><title>clip "
                          "%.4g</title></line>",
                          x, x, 6 + plot_h, colour, clip);
  }
  if (absmax > 0) {
    const double x = x_of(std::log2(absmax));
    absl::StrAppendFormat(&svg,
                          "<line x1=\"%.1f\" x2=\"%.1f\" y1=\"4\" y2=\"%.1f\" "
                          "stroke=\"#000\" stroke-dasharray=\"2,2\"><title>"
                          "absmax %.4g</title></line>",
                          x, x, 6 + plot_h, absmax);
  }
  absl::StrAppendFormat(&svg,
                        "<text x=\"%d\" y=\"%d\" class=\"axis\">2^%d</text>"
                        "<text x=\"%d\" y=\"%d\" class=\"axis\" "
                        "text-anchor=\"end\">2^%d</text></svg>",
                        left, height - 2, static_cast<int>(std::floor(x_lo)),
                        width - left, height - 2,
                        static_cast<int>(std::ceil(x_hi)));
  absl::StrAppend(&svg, "<figcaption>", caption, "</figcaption></figure>");
  figures.push_back(id);
  return svg;
}

// A horizontal bar chart of (label, value) pairs, values as percentages.
std::string BarChart(const std::string& id,
                     const std::vector<std::pair<std::string, double>>& bars,
                     std::vector<std::string>& figures) {
  double peak = 0.0;
  for (const auto& b : bars) peak = std::max(peak, b.second);
  const int row = 16, label_w = 250, plot_w = 300;
  const int height = static_cast<int>(bars.size()) * row + 8;
  std::string svg = absl::StrFormat(
      "<figure><svg id=\"%s\" class=\"bars\" xmlns=\"http://www.w3.org/2000/"
      "svg\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\">",
      id, label_w + plot_w + 70, height, label_w + plot_w + 70, height);
  for (size_t i = 0; i < bars.size(); ++i) {
    const int y = 4 + static_cast<int>(i) * row;
    const double w = peak > 0 ? plot_w * bars[i].second / peak : 0.0;
    absl::StrAppendFormat(
        &svg,
        "<text x=\"%d\" y=\"%d\" class=\"axis\" text-anchor=\"end\">%s</text>"
        "<rect x=\"%d\" y=\"%d\" width=\"%.1f\" height=\"%d\" "
        "fill=\"#1f77b4\"></rect><text x=\"%.1f\" y=\"%d\" "
        "class=\"axis\">%s</text>",
        label_w - 4, y + row - 5, Escape(bars[i].first), label_w, y,
        std::max(w, 0.5), row - 3, label_w + w + 4, y + row - 5,
        Percent(bars[i].second));
  }
  svg += "</svg></figure>";
  figures.push_back(id);
  return svg;
}

// --- Evaluation results ----------------------------------------------------

struct EvaluationRow {
  std::string name;
  std::string label;
  std::string observer;
  std::string granularity;
  bool kv_only = false;
  bool q_per_kv_group = true;
  double delta_nll = 0.0;       // calibrated - reference
  double delta_nll_ones = 0.0;  // scale 1.0 - reference
  double perplexity = 0.0;
  double reference_perplexity = 0.0;
  double attention_mean = 0.0, attention_worst = 0.0;
  double attention_ones_mean = 0.0;
  double saturated = 0.0, saturated_ones = 0.0;  // max over layers x heads
  double subnormal = 0.0;                        // mean
  // Per role [layer][head]: evaluation absmax and the applied scale.
  std::vector<std::vector<double>> absmax[3];
  std::vector<std::vector<double>> scale[3];
};

absl::StatusOr<std::vector<std::vector<double>>> Matrix(
    const Json& j, const std::string& where) {
  if (!j.is_array()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, " is not a [layers][heads] array"));
  }
  std::vector<std::vector<double>> out;
  for (const Json& row : j) {
    if (!row.is_array()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " is not a [layers][heads] array"));
    }
    std::vector<double> r;
    for (const Json& v : row) {
      r.push_back(v.is_number() ? v.get<double>()
                                : std::numeric_limits<double>::quiet_NaN());
    }
    out.push_back(std::move(r));
  }
  return out;
}

// Mean and largest finite entry of `m` (either may be null).
void FiniteMeanAndMax(const std::vector<std::vector<double>>& m, double* mean,
                      double* worst) {
  double sum = 0.0, n = 0.0, w = 0.0;
  for (const auto& r : m) {
    for (double v : r) {
      if (!std::isfinite(v)) continue;
      sum += v;
      n += 1;
      w = std::max(w, v);
    }
  }
  if (mean) *mean = n > 0 ? sum / n : 0.0;
  if (worst) *worst = w;
}

// The perplexities and nll deltas of the reference, calibrated and
// scale-1.0 runs.
absl::Status ReadRuns(const Json& runs, const std::string& name,
                      EvaluationRow& row) {
  for (const char* run : {"reference", "calibrated", "ones"}) {
    if (!runs.contains(run) || !runs.at(run).contains("nll")) {
      return absl::InvalidArgumentError(
          absl::StrCat("evaluation ", name, ": runs.", run, ".nll is missing"));
    }
  }
  const double reference = runs.at("reference").at("nll").get<double>();
  row.delta_nll = runs.at("calibrated").at("nll").get<double>() - reference;
  row.delta_nll_ones = runs.at("ones").at("nll").get<double>() - reference;
  row.perplexity = std::exp(runs.at("calibrated").at("nll").get<double>());
  row.reference_perplexity = std::exp(reference);
  return absl::OkStatus();
}

// Per role: |x| maxima and scales, and over the quantized roles the worst
// saturation (calibrated and scale 1.0) and the mean subnormal share.
absl::Status ReadShares(const Json& j, const std::string& name,
                        EvaluationRow& row) {
  const Json& saturation = j.at("saturation");
  const Json& saturation_ones = j.at("saturation_ones");
  const Json& subnormal = j.at("subnormal");
  const Json& absmax = j.at("absmax");
  double sub_sum = 0.0;
  int sub_n = 0;
  for (int r = 0; r < 3; ++r) {
    const std::string role = kRoleNames[r];
    const bool quantized = !(row.kv_only && r == 0);
    for (const Json* m : {&saturation, &saturation_ones, &subnormal, &absmax}) {
      if (!m->contains(role)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "evaluation ", name, ": no '", role, "' in a share map"));
      }
    }
    KVCAL_ASSIGN_OR_RETURN(auto sat,
                           Matrix(saturation.at(role), name + ": saturation"));
    KVCAL_ASSIGN_OR_RETURN(auto sat1, Matrix(saturation_ones.at(role),
                                             name + ": saturation_ones"));
    KVCAL_ASSIGN_OR_RETURN(auto sub,
                           Matrix(subnormal.at(role), name + ": subnormal"));
    KVCAL_ASSIGN_OR_RETURN(row.absmax[r],
                           Matrix(absmax.at(role), name + ": absmax"));
    if (j.contains("scales") && j["scales"].contains(role)) {
      KVCAL_ASSIGN_OR_RETURN(row.scale[r],
                             Matrix(j["scales"][role], name + ": scales"));
    }
    if (!quantized) continue;
    double worst = 0.0, worst1 = 0.0, mean = 0.0;
    FiniteMeanAndMax(sat, nullptr, &worst);
    FiniteMeanAndMax(sat1, nullptr, &worst1);
    FiniteMeanAndMax(sub, &mean, nullptr);
    row.saturated = std::max(row.saturated, worst);
    row.saturated_ones = std::max(row.saturated_ones, worst1);
    sub_sum += mean;
    ++sub_n;
  }
  row.subnormal = sub_n ? sub_sum / sub_n : 0.0;
  return absl::OkStatus();
}

absl::StatusOr<EvaluationRow> ParseEvaluation(const EvaluationInput& in) {
  const Json& j = in.result;
  const auto field = [&](const char* name) -> absl::StatusOr<const Json*> {
    if (!j.is_object() || !j.contains(name)) {
      return absl::InvalidArgumentError(
          absl::StrCat("evaluation ", in.name, ": no field '", name,
                       "' (expected kvcal.torch.evaluate's to_json output)"));
    }
    return &j.at(name);
  };
  EvaluationRow row;
  row.name = in.name;
  try {
    KVCAL_ASSIGN_OR_RETURN(const Json* version,
                           field("kvcal_evaluation_version"));
    if (*version != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("evaluation ", in.name, ": kvcal_evaluation_version ",
                       version->dump(), " is not supported (1)"));
    }
    KVCAL_ASSIGN_OR_RETURN(const Json* granularity, field("granularity"));
    KVCAL_ASSIGN_OR_RETURN(const Json* observer, field("observer"));
    KVCAL_ASSIGN_OR_RETURN(const Json* kv_only, field("kv_only"));
    KVCAL_ASSIGN_OR_RETURN(const Json* q_group, field("q_per_kv_group"));
    KVCAL_ASSIGN_OR_RETURN(const Json* runs, field("runs"));
    KVCAL_ASSIGN_OR_RETURN(const Json* error, field("attention_error"));
    KVCAL_ASSIGN_OR_RETURN(const Json* error_ones,
                           field("attention_error_ones"));
    for (const char* share :
         {"saturation", "saturation_ones", "subnormal", "absmax"}) {
      KVCAL_RETURN_IF_ERROR(field(share).status());
    }
    row.granularity = granularity->get<std::string>();
    row.observer = observer->get<std::string>();
    row.kv_only = kv_only->get<bool>();
    row.q_per_kv_group = q_group->get<bool>();
    row.label = j.contains("label") && j["label"].is_string() &&
                        !j["label"].get<std::string>().empty()
                    ? j["label"].get<std::string>()
                    : row.observer;
    KVCAL_RETURN_IF_ERROR(ReadRuns(*runs, in.name, row));
    KVCAL_ASSIGN_OR_RETURN(auto err,
                           Matrix(*error, in.name + ": attention_error"));
    KVCAL_ASSIGN_OR_RETURN(
        auto err1, Matrix(*error_ones, in.name + ": attention_error_ones"));
    FiniteMeanAndMax(err, &row.attention_mean, &row.attention_worst);
    FiniteMeanAndMax(err1, &row.attention_ones_mean, nullptr);
    KVCAL_RETURN_IF_ERROR(ReadShares(j, in.name, row));
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("evaluation ", in.name, ": ", e.what()));
  }
  return row;
}

std::string QuantizedName(bool kv_only) { return kv_only ? "K, V" : "Q, K, V"; }

std::string QScalesName(const EvaluationRow& r) {
  if (r.kv_only) return "&#8212;";
  if (r.granularity == "tensor") return "per tensor";
  return r.q_per_kv_group ? "per KV group" : "per query head";
}

// --- Statistics ------------------------------------------------------------

std::vector<Estimate> EstimateObservers(const SessionStatistics& stats,
                                        Format format,
                                        std::vector<std::string>& skipped) {
  std::vector<Estimate> out;
  const Geometry& g = stats.geometry();
  const uint32_t log2_bins = g.has_histograms() ? g.log2_bins_per_octave() : 0;
  for (const ObserverChoice& o : kObservers) {
    for (const Variant& v : kVariants) {
      ScaleOptions options;
      options.observer = o.observer;
      options.granularity = v.granularity;
      options.format = format;
      options.q_per_kv_group = v.q_per_kv_group;
      options.allow_missing = true;
      if (o.percentile > 0) options.percentile = o.percentile;
      absl::StatusOr<ScaleResult> result = ComputeScales(stats, options);
      if (!result.ok()) {
        skipped.push_back(absl::StrCat(o.label, " per ", v.label, ": ",
                                       result.status().message()));
        continue;
      }
      Estimate e{&o, &v, std::move(*result), {}, 0.0};
      if (g.has_histograms()) {
        for (int r = 0; r < 3; ++r) {
          if (!g.collects(kRoles[r])) continue;
          const uint32_t heads = g.heads(kRoles[r]);
          const uint32_t group = g.num_attention_heads / g.num_key_value_heads;
          double sum = 0.0, n = 0.0, values = 0.0, sat = 0.0, sub = 0.0;
          for (const LayerScales& layer : e.scales.layers) {
            const auto& role = layer.role(kRoles[r]);
            if (!role || role->scale.empty()) continue;
            for (uint32_t h = 0; h < heads; ++h) {
              const HeadStatistics* head =
                  &stats.head(layer.layer, kRoles[r], h);
              if (head->finite_count == 0) continue;
              float scale = role->scale[0];
              if (role->scale.size() == heads) {
                scale = role->scale[h];
              } else if (role->scale.size() > 1) {
                scale = role->scale[h / group];
              }
              const QuantizationEstimate q = EstimateQuantization(
                  std::span<const HeadStatistics* const>(&head, 1), scale,
                  format, log2_bins);
              sum += q.relative_rms_error;
              n += 1;
              e.roles[r].max_error =
                  std::max(e.roles[r].max_error, q.relative_rms_error);
              const double count = static_cast<double>(head->finite_count);
              values += count;
              sat += q.saturated_share * count;
              sub += q.subnormal_share * count;
            }
          }
          e.roles[r].mean_error = n > 0 ? sum / n : 0.0;
          e.roles[r].saturated = values > 0 ? sat / values : 0.0;
          e.roles[r].subnormal = values > 0 ? sub / values : 0.0;
        }
        e.kv_error = 0.5 * (e.roles[1].mean_error + e.roles[2].mean_error);
      }
      out.push_back(std::move(e));
    }
  }
  return out;
}

// Per (layer, head) values of one role from a scale result (NaN where none).
std::vector<std::vector<double>> ScaleMatrix(const ScaleResult& result,
                                             Role role) {
  std::vector<std::vector<double>> out;
  for (const LayerScales& layer : result.layers) {
    std::vector<double> row;
    if (const auto& r = layer.role(role)) {
      for (float s : r->scale) row.push_back(s);
    }
    out.push_back(std::move(row));
  }
  return out;
}

// The evaluation results, each checked against the session's geometry.
absl::StatusOr<std::vector<EvaluationRow>> ParseEvaluations(
    const ReportInputs& in) {
  std::vector<EvaluationRow> evaluations;
  for (const EvaluationInput& e : in.evaluations) {
    KVCAL_ASSIGN_OR_RETURN(EvaluationRow row, ParseEvaluation(e));
    if (in.statistics) {
      const Geometry& g = in.statistics->geometry();
      for (int r = 0; r < 3; ++r) {
        if (row.absmax[r].size() != g.num_layers) {
          return absl::InvalidArgumentError(absl::StrCat(
              "evaluation ", e.name, ": absmax.", kRoleNames[r], " has ",
              row.absmax[r].size(), " layers, the session ", g.num_layers));
        }
      }
    }
    evaluations.push_back(std::move(row));
  }
  return evaluations;
}

// What the page recommends, why, and the evaluation row it rests on.
struct Recommendation {
  OrderedJson json;
  std::string reason;
  const EvaluationRow* row = nullptr;
};

// How far the evaluation's maxima pass the clip points of `best`'s scales
// (largest ratio over the quantized roles, layers and heads).
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

// Of the rows of one kind (K/V only or Q/K/V): the simplest (static
// min-max per tensor, when evaluated), replaced by the lowest-loss row only
// when its loss is lower by more than kSignificantNats (on a few thousand
// evaluation tokens smaller differences are run-to-run spread) and its mean
// attention error is not larger. Null when no row is of that kind.
const EvaluationRow* SimplestOrBest(
    const std::vector<EvaluationRow>& evaluations, bool kv_only) {
  const EvaluationRow* base = nullptr;
  const EvaluationRow* best = nullptr;
  for (const EvaluationRow& r : evaluations) {
    if (r.kv_only != kv_only) continue;
    if (!best || r.delta_nll < best->delta_nll) best = &r;
    if (!base && r.observer == "static_minmax" && r.granularity == "tensor") {
      base = &r;
    }
  }
  if (!base) return best;
  // A lower loss with a larger attention error is not trusted: on this
  // few tokens the loss moves by chance, the attention error does not.
  return best->delta_nll < base->delta_nll - kSignificantNats &&
                 best->attention_mean <= base->attention_mean
             ? best
             : base;
}

// Why `best` (the chosen row) over static min-max per tensor and over
// scale 1.0.
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

// The scale margin `best` needs so that the evaluation's maxima do not
// saturate (1.0 when they stay within the clip points), and why.
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

// From measured evaluations (kvcal.torch.evaluate).
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

// From the statistics alone: the lowest estimated K/V error.
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

// Neither evaluations nor histograms: the page shows the scales only.
Recommendation NoRecommendation(const ReportInputs& in) {
  Recommendation out;
  out.json = {{"observer", in.scales ? in.scales->observer : "static_minmax"},
              {"granularity",
               in.scales ? std::string(GranularityName(in.scales->granularity))
                         : "tensor"},
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

// The page as it is written: its body and the ids of its figures.
struct Page {
  std::string body;
  std::vector<std::string> figures;
  void Section(const std::string& id, const std::string& title) {
    absl::StrAppend(&body, "<section id=\"", id, "\"><h2>", Escape(title),
                    "</h2>");
  }
};

void RecommendationSection(const Recommendation& recommendation, Page& page) {
  const OrderedJson& rec = recommendation.json;
  std::string& body = page.body;
  page.Section("recommendation", "Recommendation");
  absl::StrAppendFormat(
      &body,
      "<p class=\"rec\"><b>%s</b>, per <b>%s</b>, quantize <b>%s</b>%s, "
      "margin <b>%.2f</b></p><p>%s</p>",
      Escape(rec.contains("label") ? rec["label"].get<std::string>()
                                   : rec["observer"].get<std::string>()),
      Escape(rec["granularity"].get<std::string>()),
      rec["quantize"] == "k_v" ? "K and V (FP8 KV cache)"
                               : "Q, K and V (FP8 attention)",
      rec.value("q_per_kv_group", false) && rec["granularity"] == "head" &&
              rec["quantize"] == "q_k_v"
          ? " (q reduced per KV group)"
          : "",
      rec["margin"].get<double>(), Escape(recommendation.reason));
  body += "</section>";
}

// The scales of a scales file as a ScaleResult (for the heatmaps).
ScaleResult ScaleResultOf(const CalibratedScales& scales) {
  ScaleResult result;
  for (const auto& [layer, roles] : scales.layers) {
    LayerScales ls;
    ls.layer = layer;
    for (int r = 0; r < 3; ++r) {
      if (roles[r].empty()) continue;
      RoleScales rs;
      rs.scale = roles[r];
      ls.roles[r] = rs;
    }
    result.layers.push_back(ls);
  }
  return result;
}

// The estimate whose scales the report shows, and its name: the
// recommended observer per head (its label first: percentile 99.9 and 99.99
// share an observer name), else the first estimate; null when there is none.
const Estimate* ShownEstimate(const OrderedJson& rec,
                              const std::vector<Estimate>& estimates,
                              std::string& name) {
  for (bool by_label : {true, false}) {
    for (const Estimate& e : estimates) {
      const bool head = e.variant->granularity == Granularity::kPerHead;
      const std::string observer(ObserverName(e.observer->observer));
      const bool label_ok =
          !by_label || (rec.contains("label") &&
                        rec["label"] == std::string(e.observer->label));
      if (rec["observer"] == observer && label_ok && head &&
          !e.variant->q_per_kv_group) {
        name = absl::StrCat(e.observer->label, " per head");
        return &e;
      }
    }
  }
  if (estimates.empty()) return nullptr;
  const Estimate& first = estimates.front();
  name = absl::StrCat(first.observer->label, " per ", first.variant->label);
  return &first;
}

// Heatmaps of the calibration |x| maxima per layer and head.
void AbsmaxHeatmaps(const SessionStatistics& statistics, Page& page) {
  const Geometry& g = statistics.geometry();
  std::vector<std::vector<double>> amax[3];
  std::vector<uint32_t> all_layers;
  for (uint32_t l = 0; l < g.num_layers; ++l) {
    all_layers.push_back(l);
    for (int r = 0; r < 3; ++r) {
      std::vector<double> row;
      if (g.collects(kRoles[r])) {
        for (uint32_t h = 0; h < g.heads(kRoles[r]); ++h) {
          const HeadStatistics& hs = statistics.head(l, kRoles[r], h);
          row.push_back(hs.finite_count
                            ? hs.absmax()
                            : std::numeric_limits<double>::quiet_NaN());
        }
      }
      amax[r].push_back(std::move(row));
    }
  }
  page.body +=
      "<p>Calibration |x| maxima per layer and head.</p><div "
      "class=\"row\">";
  for (int r = 0; r < 3; ++r) {
    absl::StrAppend(&page.body,
                    Heatmap(absl::StrCat("heatmap-absmax-", kRoleNames[r]),
                            absl::StrCat("|", kRoleNames[r], "| max"), amax[r],
                            all_layers, true, page.figures));
  }
  page.body += "</div>";
}

// Scale heatmaps (the scales file's, else the recommended ones) and the
// calibration maxima per layer and head.
void ScalesSection(const ReportInputs& in, const OrderedJson& rec,
                   const std::vector<Estimate>& estimates, Page& page) {
  page.Section("scales", "Scales per layer and head");
  const ScaleResult* shown = nullptr;
  std::string shown_name;
  ScaleResult from_file;
  if (in.scales) {
    from_file = ScaleResultOf(*in.scales);
    shown = &from_file;
    shown_name = absl::StrCat("the scales file (", in.scales->observer, " per ",
                              GranularityName(in.scales->granularity), ")");
  } else if (const Estimate* e = ShownEstimate(rec, estimates, shown_name)) {
    shown = &e->scales;
  }
  if (shown) {
    absl::StrAppend(&page.body, "<p>Scales of ", Escape(shown_name),
                    "; one row per layer, one column per head (per tensor: "
                    "one column). Hover a cell for its value.</p><div "
                    "class=\"row\">");
    std::vector<uint32_t> layers;
    for (const LayerScales& l : shown->layers) layers.push_back(l.layer);
    for (int r = 0; r < 3; ++r) {
      absl::StrAppend(
          &page.body,
          Heatmap(absl::StrCat("heatmap-scale-", kRoleNames[r]),
                  absl::StrCat(kRoleNames[r], "_scale"),
                  ScaleMatrix(*shown, kRoles[r]), layers, true, page.figures));
    }
    page.body += "</div>";
    if (in.statistics) AbsmaxHeatmaps(*in.statistics, page);
  }
  page.body += "</section>";
}

// |x| histograms per layer with each observer's clip point.
void HistogramsSection(const ReportInputs& in,
                       const std::vector<Estimate>& estimates, Page& page) {
  std::string& body = page.body;
  std::vector<std::string>& figures = page.figures;
  const Geometry* g = &in.statistics->geometry();
  page.Section("histograms", "|x| histograms and clip points");
  body +=
      "<p>Per layer, summed over heads; log<sub>2</sub> |x| across, "
      "log count up. Lines: each observer's per-tensor clip point "
      "(scale &#215; format max); dashed: the calibration maximum.</p>"
      "<p class=\"legend\">";
  for (const ObserverChoice& o : kObservers) {
    absl::StrAppendFormat(&body, "<span style=\"color:%s\">&#9608; %s</span> ",
                          o.color, o.label);
  }
  body += "</p>";
  const uint32_t log2_bins = g->log2_bins_per_octave();
  for (int r = 0; r < 3; ++r) {
    if (!g->collects(kRoles[r])) continue;
    // One x range for the role: the smallest non-empty octave bin to the
    // largest maximum or clip point.
    double x_lo = std::numeric_limits<double>::infinity(), x_hi = -x_lo;
    std::vector<std::vector<uint64_t>> counts(g->num_layers);
    std::vector<double> absmax(g->num_layers, 0.0);
    for (uint32_t l = 0; l < g->num_layers; ++l) {
      counts[l].assign(g->histogram_bins(), 0);
      for (uint32_t h = 0; h < g->heads(kRoles[r]); ++h) {
        const HeadStatistics& hs = in.statistics->head(l, kRoles[r], h);
        for (size_t b = 0; b < hs.histogram.size(); ++b) {
          counts[l][b] += hs.histogram[b];
        }
        if (hs.finite_count)
          absmax[l] = std::max<double>(absmax[l], hs.absmax());
      }
      for (uint32_t b = kFirstOctaveBin; b + 1 < counts[l].size(); ++b) {
        if (counts[l][b] == 0) continue;
        x_lo = std::min<double>(x_lo,
                                std::log2(HistogramBinLowerEdge(b, log2_bins)));
        break;
      }
      if (absmax[l] > 0) x_hi = std::max(x_hi, std::log2(absmax[l]));
    }
    if (!std::isfinite(x_lo) || !std::isfinite(x_hi)) continue;
    x_hi += 0.5;
    absl::StrAppend(&body, "<h3>", kRoleNames[r], "</h3><div class=\"row\">");
    for (uint32_t l = 0; l < g->num_layers; ++l) {
      std::vector<std::pair<double, const char*>> clips;
      for (const Estimate& e : estimates) {
        if (e.variant->granularity != Granularity::kPerTensor) continue;
        for (const LayerScales& ls : e.scales.layers) {
          if (ls.layer != l) continue;
          const auto& role = ls.role(kRoles[r]);
          if (role && !role->scale.empty()) {
            clips.push_back(
                {role->scale[0] * FormatMax(in.format), e.observer->color});
          }
        }
      }
      absl::StrAppend(
          &body, HistogramFigure(absl::StrCat("hist-", l, "-", kRoleNames[r]),
                                 absl::StrCat("layer ", l, " ", kRoleNames[r]),
                                 counts[l], log2_bins, x_lo, x_hi, clips,
                                 absmax[l], figures));
    }
    body += "</div>";
  }
  body += "</section>";
}

// The estimated quantization error per observer and granularity; returns
// the same as JSON for the summary.
OrderedJson EstimatesSection(const ReportInputs& in,
                             const std::vector<Estimate>& estimates,
                             const std::vector<std::string>& skipped,
                             Page& page) {
  std::string& body = page.body;
  std::vector<std::string>& figures = page.figures;
  const bool have_estimates = in.statistics->geometry().has_histograms();
  OrderedJson estimates_json = OrderedJson::array();
  page.Section("estimates", "Quantization error estimated from the statistics");
  if (!have_estimates) {
    body +=
        "<p>The session has no histograms (created with "
        "histogram_bins_per_octave = 0): nothing to estimate from.</p>";
  } else {
    body +=
        "<p>For every observer and granularity the engine computes the "
        "scales (as Finalize would) and, per head, the relative RMS error "
        "sqrt(&#931;(fq(x) &#8722; x)&#178; / &#931;x&#178;) of quantizing "
        "its calibration values: exact for each head's 256 largest |x|, "
        "integrated over each histogram bin for the rest. Saturated: "
        "values beyond the clip point; subnormal: values below scale "
        "&#215; the smallest normal. Means over heads; shares over "
        "values.</p><table><tr><th>observer</th><th>granularity</th>";
    for (const char* role : kRoleNames) {
      absl::StrAppend(&body, "<th>", role, " error mean / max</th>");
    }
    body += "<th>saturated q / k / v</th><th>subnormal q / k / v</th></tr>";
    std::vector<std::pair<std::string, double>> bars;
    for (const Estimate& e : estimates) {
      absl::StrAppend(&body, "<tr><td>", e.observer->label, "</td><td>",
                      e.variant->label, "</td>");
      OrderedJson ej = {{"observer", ObserverName(e.observer->observer)},
                        {"label", e.observer->label},
                        {"granularity", e.variant->label}};
      std::string sat, sub;
      for (int r = 0; r < 3; ++r) {
        absl::StrAppend(&body, "<td>", Percent(e.roles[r].mean_error), " / ",
                        Percent(e.roles[r].max_error), "</td>");
        absl::StrAppend(&sat, r ? " / " : "", Percent(e.roles[r].saturated, 4));
        absl::StrAppend(&sub, r ? " / " : "", Percent(e.roles[r].subnormal, 3));
        ej[kRoleNames[r]] = {{"mean_error", e.roles[r].mean_error},
                             {"max_error", e.roles[r].max_error},
                             {"saturated", e.roles[r].saturated},
                             {"subnormal", e.roles[r].subnormal}};
      }
      absl::StrAppend(&body, "<td>", sat, "</td><td>", sub, "</td></tr>");
      estimates_json.push_back(std::move(ej));
      if (!e.variant->q_per_kv_group) {
        bars.push_back(
            {absl::StrCat(e.observer->label, " per ",
                          e.variant->granularity == Granularity::kPerTensor
                              ? "tensor"
                              : "head"),
             e.kv_error});
      }
    }
    body += "</table><p>Mean relative RMS error of K and V:</p>";
    absl::StrAppend(&body, BarChart("chart-estimated-error", bars, figures));
  }
  for (const std::string& s : skipped) {
    absl::StrAppend(&body, "<p class=\"note\">Not computed: ", Escape(s),
                    "</p>");
  }
  body += "</section>";
  return estimates_json;
}

// Evaluation maxima against calibration maxima (or clip points) for `row`.
void HeadroomSection(const ReportInputs& in, const EvaluationRow& row,
                     Page& page) {
  std::string& body = page.body;
  const Geometry* g = in.statistics ? &in.statistics->geometry() : nullptr;
  page.Section("headroom", "Headroom: evaluation maxima vs calibration");
  std::vector<uint32_t> layers;
  for (size_t l = 0; l < row.absmax[1].size(); ++l) {
    layers.push_back(static_cast<uint32_t>(l));
  }
  std::string against;
  double worst = 0.0;
  std::vector<std::vector<double>> ratio[3];
  for (int r = 0; r < 3; ++r) {
    for (size_t l = 0; l < row.absmax[r].size(); ++l) {
      std::vector<double> out;
      for (size_t h = 0; h < row.absmax[r][l].size(); ++h) {
        double base = std::numeric_limits<double>::quiet_NaN();
        if (g && g->collects(kRoles[r]) && h < g->heads(kRoles[r]) &&
            l < g->num_layers) {
          const HeadStatistics& hs = in.statistics->head(
              static_cast<uint32_t>(l), kRoles[r], static_cast<uint32_t>(h));
          if (hs.finite_count) base = hs.absmax();
          against = "the calibration maximum of the same head";
        } else if (l < row.scale[r].size() && h < row.scale[r][l].size()) {
          base = row.scale[r][l][h] * FormatMax(in.format);
          against = "the clip point of the evaluated scales";
        }
        const double v = row.absmax[r][l][h] / base;
        if (std::isfinite(v)) worst = std::max(worst, v);
        out.push_back(v);
      }
      ratio[r].push_back(std::move(out));
    }
  }
  absl::StrAppendFormat(
      &body,
      "<p>Evaluation |x| maximum (%s) divided by %s: above 1, the "
      "evaluation saw values the calibration did not. Largest: %.3f.</p>"
      "<div class=\"row\">",
      Escape(row.name), against, worst);
  for (int r = 0; r < 3; ++r) {
    absl::StrAppend(
        &body,
        Heatmap(absl::StrCat("heatmap-headroom-", kRoleNames[r]),
                absl::StrCat(kRoleNames[r], ": evaluation / calibration max"),
                ratio[r], layers, false, page.figures));
  }
  body += "</div></section>";
}

// The table of every evaluation, `chosen_row` marked.
void EvaluationTableSection(const std::vector<EvaluationRow>& evaluations,
                            const EvaluationRow* chosen_row, Page& page) {
  std::string& body = page.body;
  page.Section("evaluation", "Evaluation (kvcal.torch.evaluate)");
  absl::StrAppendFormat(
      &body,
      "<p>Unquantized perplexity %.3f. Each row: the model run with its "
      "scales; &#916; is the mean negative log-likelihood per token "
      "against the unquantized run. Attention error: relative RMS error "
      "of the attention output per layer and head. Saturated: the largest "
      "share of any layer and head; subnormal: the mean share.</p>",
      evaluations.front().reference_perplexity);
  body +=
      "<table><tr><th>result</th><th>observer</th><th>granularity</th>"
      "<th>quantized</th><th>q scales</th><th>&#916; nats/token</th>"
      "<th>perplexity</th><th>attention error mean / worst</th>"
      "<th>saturated</th><th>subnormal</th><th>scale 1.0: &#916; / "
      "attention error / saturated</th></tr>";
  for (const EvaluationRow& r : evaluations) {
    absl::StrAppendFormat(
        &body,
        "<tr%s><td>%s</td><td>%s</td><td>%s</td><td>%s</td><td>%s</td>"
        "<td>%+.4f</td><td>%.3f</td><td>%s / %s</td><td>%s</td><td>%s</td>"
        "<td>%+.4f / %s / %s</td></tr>",
        &r == chosen_row ? " class=\"chosen\"" : "", Escape(r.name),
        Escape(r.label), Escape(r.granularity), QuantizedName(r.kv_only),
        QScalesName(r), r.delta_nll, r.perplexity, Percent(r.attention_mean),
        Percent(r.attention_worst), Percent(r.saturated, 4),
        Percent(r.subnormal, 3), r.delta_nll_ones,
        Percent(r.attention_ones_mean), Percent(r.saturated_ones, 4));
  }
  body += "</table></section>";
}

// Evaluation maxima against calibration maxima (or clip points) for the
// recommended row, and the table of every evaluation.
void EvaluationSections(const ReportInputs& in,
                        const std::vector<EvaluationRow>& evaluations,
                        const EvaluationRow* chosen_row, Page& page) {
  HeadroomSection(in, chosen_row ? *chosen_row : evaluations.front(), page);
  EvaluationTableSection(evaluations, chosen_row, page);
}

// The whole HTML document around `body`.
std::string Document(const ReportInputs& in, const std::string& body) {
  const Geometry* g = in.statistics ? &in.statistics->geometry() : nullptr;
  std::string source = Escape(in.source);
  if (g) {
    absl::StrAppendFormat(&source,
                          " &#8212; %u layers, %u query heads, %u KV heads, "
                          "head_dim %u, %u histogram bins per octave, %u "
                          "finite values",
                          g->num_layers, g->num_attention_heads,
                          g->num_key_value_heads, g->head_dim,
                          g->bins_per_octave, in.statistics->finite_values());
  }
  return absl::StrCat(
      "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
      "<title>",
      Escape(in.title),
      "</title><style>body{font:14px sans-serif;margin:1.5em;max-width:"
      "1400px}h2{border-bottom:1px solid #ccc}table{border-collapse:collapse}"
      "td,th{border:1px solid #ddd;padding:2px 6px;text-align:right}"
      "th{background:#f4f4f4}tr.chosen{background:#e8f4e8}.row{display:flex;"
      "flex-wrap:wrap;gap:8px}figure{margin:4px}figcaption{font-size:11px;"
      "text-align:center}.axis{font-size:9px;fill:#333}.rec{font-size:16px}"
      ".note{color:#a33}</style></head><body><h1>",
      Escape(in.title), "</h1><p>", source, " &#8212; format ",
      FormatName(in.format), "</p>", body, "</body></html>\n");
}

}  // namespace

absl::StatusOr<Report> BuildReport(const ReportInputs& in) {
  if (!in.statistics && !in.scales) {
    return absl::InvalidArgumentError(
        "kvcal report needs a session (--server and --session) or a scales "
        "file (--scales)");
  }
  KVCAL_ASSIGN_OR_RETURN(std::vector<EvaluationRow> evaluations,
                         ParseEvaluations(in));
  std::vector<std::string> skipped;
  std::vector<Estimate> estimates;
  if (in.statistics) {
    estimates = EstimateObservers(*in.statistics, in.format, skipped);
  }
  const bool have_estimates =
      in.statistics && in.statistics->geometry().has_histograms();
  Recommendation rec =
      !evaluations.empty() ? RecommendFromEvaluations(evaluations, in.format)
      : have_estimates && !estimates.empty() ? RecommendFromEstimates(estimates)
                                             : NoRecommendation(in);
  rec.json["reason"] = rec.reason;

  Page page;
  RecommendationSection(rec, page);
  ScalesSection(in, rec.json, estimates, page);
  if (have_estimates) HistogramsSection(in, estimates, page);
  OrderedJson estimates_json = OrderedJson::array();
  if (in.statistics) {
    estimates_json = EstimatesSection(in, estimates, skipped, page);
  }
  if (!evaluations.empty()) {
    EvaluationSections(in, evaluations, rec.row, page);
  }
  Report report;
  report.html = Document(in, page.body);
  report.summary = {{"recommendation", rec.json},
                    {"estimates", estimates_json},
                    {"figures", page.figures}};
  return report;
}

}  // namespace kvcal
