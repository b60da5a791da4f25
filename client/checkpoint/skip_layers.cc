#include "client/checkpoint/skip_layers.h"

#include <algorithm>
#include <cstddef>

#include "absl/strings/str_cat.h"

namespace kvcal {

SkipLayerOutliers FindSkipLayerOutliers(
    const std::vector<double>& layer_error) {
  SkipLayerOutliers out;
  const size_t n = layer_error.size();
  if (n == 0) return out;
  std::vector<double> sorted = layer_error;
  std::sort(sorted.begin(), sorted.end());
  out.median = n % 2 ? sorted[n / 2] : (sorted[n / 2 - 1] + sorted[n / 2]) / 2;
  std::vector<int> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = static_cast<int>(i);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return layer_error[a] > layer_error[b];
  });
  const size_t most = std::max<size_t>(
      1, static_cast<size_t>(kSkipMaxShare * static_cast<double>(n)));
  for (int l : order) {
    if (out.layers.size() >= most ||
        !(layer_error[l] > kSkipMedianFactor * out.median)) {
      break;
    }
    out.layers.push_back(l);
  }
  std::sort(out.layers.begin(), out.layers.end());
  return out;
}

std::string SkipLayersArgument(const std::vector<int>& layers) {
  if (layers.empty()) return "";
  std::string out = "--kv-cache-dtype-skip-layers";
  for (int l : layers) absl::StrAppend(&out, " ", l);
  return out;
}

}  // namespace kvcal
