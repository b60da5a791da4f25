#include "client/report/estimates.h"

#include <algorithm>
#include <span>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/report/common.h"
#include "proto/names.h"

namespace kvcal::report {

const std::vector<ObserverChoice>& ReportObservers() {
  static const std::vector<ObserverChoice>* const choices = [] {
    static constexpr const char* kColors[] = {
        "#d62728", "#ff7f0e", "#8c564b", "#1f77b4", "#2ca02c",
        "#9467bd", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};
    auto* out = new std::vector<ObserverChoice>();
    auto add = [&](const ObserverRow& row, double percentile,
                   std::string label) {
      const size_t n = out->size() % std::size(kColors);
      out->push_back({static_cast<Observer>(row.value), percentile,
                      std::move(label), row.cli, kColors[n]});
    };
    for (const ObserverRow& row : ObserverTable()) {
      if (row.value == v1::OBSERVER_PERCENTILE) {
        add(row, 99.99, row.name + " 99.99");
        add(row, 99.9, row.name + " 99.9");
      } else {
        add(row, 0, row.name);
      }
    }
    return out;
  }();
  return *choices;
}

std::vector<Estimate> EstimateObservers(const SessionStatistics& stats,
                                        Format format,
                                        std::vector<std::string>& skipped) {
  std::vector<Estimate> out;
  const Geometry& g = stats.geometry();
  const uint32_t log2_bins = g.has_histograms() ? g.log2_bins_per_octave() : 0;
  for (const ObserverChoice& o : ReportObservers()) {
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

}  // namespace kvcal::report
