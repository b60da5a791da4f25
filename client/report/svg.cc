#include "client/report/svg.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/element_math.h"

namespace kvcal::report {

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

std::string Percent(double share, int digits) {
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
}  // namespace kvcal::report
