// The report page: its sections in order and the document around them.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/report/common.h"
#include "client/report/decision.h"
#include "client/report/estimates.h"
#include "client/report/evaluation.h"
#include "client/report/recommendation.h"
#include "client/report/report.h"
#include "client/report/svg.h"
#include "kernels/element_math.h"
#include "util/status_macros.h"

namespace kvcal {
namespace report {
namespace {

std::string QuantizedName(bool kv_only) { return kv_only ? "K, V" : "Q, K, V"; }

std::string QScalesName(const EvaluationRow& r) {
  if (r.kv_only) return "&#8212;";
  if (r.granularity == "tensor") return "per tensor";
  return r.q_per_kv_group ? "per KV group" : "per query head";
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
  for (const ObserverChoice& o : ReportObservers()) {
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
        Escape(r.label), Escape(r.granularity),
        QuantizedName(r.kv_only) +
            (r.kv_format == "fp8" ? "" : " (K/V " + r.kv_format + ")"),
        QScalesName(r), r.delta_nll, r.perplexity, Percent(r.attention_mean),
        Percent(r.attention_worst), Percent(r.saturated, 4),
        Percent(r.subnormal, 3), r.delta_nll_ones,
        Percent(r.attention_ones_mean), Percent(r.saturated_ones, 4));
  }
  body += "</table></section>";
}

// Which layers to keep out of the quantized cache (candidates by the
// outlier rule, for `row`: the recommended evaluation) and which cache
// format keeps the model within the tolerance; both into `summary`.
void SkipAndFormatSection(const std::vector<EvaluationRow>& evaluations,
                          const EvaluationRow& row, OrderedJson& summary,
                          Page& page) {
  std::string& body = page.body;
  const SkipCandidates skip = SkipLayerCandidates(row);
  page.Section("skip-layers", "Layers to leave unquantized");
  if (skip.layers.empty()) {
    absl::StrAppendFormat(
        &body,
        "<p>None: no layer's mean attention error in %s exceeds %.0fx the "
        "median layer's (%s).</p>",
        Escape(row.name), kSkipMedianFactor, Percent(skip.median));
  } else {
    std::string layers;
    for (int l : skip.layers) {
      absl::StrAppendFormat(&layers, "%s%d (%s)", layers.empty() ? "" : ", ", l,
                            Percent(row.layer_attention[l]));
    }
    absl::StrAppendFormat(
        &body,
        "<p>Layers whose mean attention error in %s exceeds %.0fx the median "
        "layer's (%s): %s. Candidates for <code>%s</code> (vLLM keeps "
        "those layers' K, V and query in the model's dtype; the KV cache "
        "takes x%.3f the bytes). Confirm that the held-out loss drops with "
        "them unquantized before serving so: kvcal-calibrate does this "
        "re-scoring itself.</p>",
        Escape(row.name), kSkipMedianFactor, Percent(skip.median), layers,
        Escape(skip.argument), skip.cache_ratio);
  }
  body += "</section>";
  summary["skip_layers"] = {{"row", row.name},
                            {"median_layer_error", skip.median},
                            {"layers", skip.layers},
                            {"argument", skip.argument},
                            {"cache_bytes_ratio", skip.cache_ratio}};

  const FormatChoice format = RecommendFormat(evaluations);
  page.Section("cache-format", "Cache format");
  absl::StrAppendFormat(&body, "<p>%s.</p>", Escape(format.reason));
  body += "</section>";
  summary["cache_format"] = format.json;
  summary["cache_format"]["reason"] = format.reason;
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
}  // namespace report

absl::StatusOr<Report> BuildReport(const ReportInputs& in) {
  using namespace report;  // NOLINT: the page's own parts
  if (!in.statistics && !in.scales) {
    return absl::InvalidArgumentError(
        "kvcal report needs a session (--server and --session) or a scales "
        "file (--scales)");
  }
  KVCAL_ASSIGN_OR_RETURN(std::vector<EvaluationRow> evaluations,
                         ParseEvaluations(in.evaluations, in.statistics));
  std::vector<std::string> skipped;
  std::vector<Estimate> estimates;
  if (in.statistics) {
    estimates = EstimateObservers(*in.statistics, in.format, skipped);
  }
  const bool have_estimates =
      in.statistics && in.statistics->geometry().has_histograms();
  const bool have_fp8_rows =
      std::any_of(evaluations.begin(), evaluations.end(),
                  [](const EvaluationRow& r) { return r.kv_format == "fp8"; });
  Recommendation rec;
  if (in.decision) {
    // The rows are named by what they scored, not by files that are gone.
    for (EvaluationRow& r : evaluations) {
      r.name = r.kv_format == "fp8"
                   ? r.label
                   : absl::StrCat(r.label, " (", r.kv_format, " cache)");
    }
    KVCAL_ASSIGN_OR_RETURN(rec,
                           RecommendFromDecision(*in.decision, evaluations));
  } else {
    rec = have_fp8_rows ? RecommendFromEvaluations(evaluations, in.format)
          : have_estimates && !estimates.empty()
              ? RecommendFromEstimates(estimates)
              : NoRecommendation(in.scales);
  }
  rec.json["reason"] = rec.reason;

  Page page;
  if (in.decision) {
    page.body += DecisionServeSection(*in.decision);
    page.body += DecisionCandidatesSection(*in.decision);
  } else {
    RecommendationSection(rec, page);
  }
  ScalesSection(in, rec.json, estimates, page);
  if (have_estimates) HistogramsSection(in, estimates, page);
  OrderedJson estimates_json = OrderedJson::array();
  if (in.statistics) {
    estimates_json = EstimatesSection(in, estimates, skipped, page);
  }
  Report report;
  report.summary = {{"recommendation", rec.json},
                    {"estimates", estimates_json}};
  if (in.decision) {
    page.body += DecisionFormatsSection(*in.decision);
    report.summary["decision"] = (*in.decision)["decision"];
    if (!evaluations.empty()) {
      EvaluationSections(in, evaluations, rec.row, page);
    }
  } else if (!evaluations.empty()) {
    SkipAndFormatSection(evaluations, rec.row ? *rec.row : evaluations.front(),
                         report.summary, page);
    EvaluationSections(in, evaluations, rec.row, page);
  }
  report.html = Document(in, page.body);
  report.summary["figures"] = page.figures;
  return report;
}

}  // namespace kvcal
