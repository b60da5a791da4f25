// The report's figures as inline SVG (no script, nothing fetched), and the
// HTML text helpers they share. Each figure function appends its id to
// `figures` (the summary lists them; the tests look them up in the page).
#ifndef KVCAL_CLIENT_REPORT_SVG_H_
#define KVCAL_CLIENT_REPORT_SVG_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"

namespace kvcal::report {

// `s` with &, <, > and " escaped for HTML text and attributes.
std::string Escape(absl::string_view s);

// `share` (0..1) as a percentage with `digits` decimals: "12.34%".
std::string Percent(double share, int digits = 2);

// A colour for t in [0, 1] (viridis, five stops interpolated); grey for NaN.
std::string Colour(double t);

// A layers x heads heatmap of `values[layer][head]` (positive values on a
// log colour scale when `log_scale`), NaN grey; `layers` labels the rows.
std::string Heatmap(const std::string& id, const std::string& caption,
                    const std::vector<std::vector<double>>& values,
                    const std::vector<uint32_t>& layers, bool log_scale,
                    std::vector<std::string>& figures);

// One (layer, role)'s |x| histogram summed over heads, log2 |x| on x
// (x_lo..x_hi) and log10 count on y, with a vertical line at each
// (clip point, colour) and a dashed one at `absmax`.
std::string HistogramFigure(
    const std::string& id, const std::string& caption,
    const std::vector<uint64_t>& counts, uint32_t log2_bins, double x_lo,
    double x_hi, const std::vector<std::pair<double, const char*>>& clips,
    double absmax, std::vector<std::string>& figures);

// A horizontal bar chart of (label, value) pairs, values as percentages.
std::string BarChart(const std::string& id,
                     const std::vector<std::pair<std::string, double>>& bars,
                     std::vector<std::string>& figures);

}  // namespace kvcal::report

#endif  // KVCAL_CLIENT_REPORT_SVG_H_
