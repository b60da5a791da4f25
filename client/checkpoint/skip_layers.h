// Which layers to keep out of the quantized KV cache: vLLM 0.34's
// --kv-cache-dtype-skip-layers (EngineArgs.kv_cache_dtype_skip_layers, a
// list of strings, one word per layer: "3,17" is one string that matches no
// layer and is ignored) keeps a layer's K, V and query in the model's dtype.
//
// The outlier rule kvcal-calibrate uses
// (python/kvcal/calibrate/skip_layers.py), here for the C++ tools that have
// per-layer attention errors but no model to re-score with (`finalize
// --evaluate`, `kvcal report`): layers whose attention error exceeds
// kSkipMedianFactor x the median layer's, the worst first, at most
// kSkipMaxShare of the layers (at least one). kvcal-calibrate advises them only
// after a held-out pass shows the loss drop; these tools name them as
// candidates to verify.
#ifndef KVCAL_CLIENT_CHECKPOINT_SKIP_LAYERS_H_
#define KVCAL_CLIENT_CHECKPOINT_SKIP_LAYERS_H_

#include <string>
#include <vector>

namespace kvcal {

constexpr double kSkipMedianFactor = 3.0;
constexpr double kSkipMaxShare = 0.25;

struct SkipLayerOutliers {
  std::vector<int> layers;  // ascending
  double median = 0.0;      // the median layer's error
};

// The outliers of `layer_error` (one error per layer, layer order).
SkipLayerOutliers FindSkipLayerOutliers(const std::vector<double>& layer_error);

// "--kv-cache-dtype-skip-layers 3 17" for {3, 17}; "" for none.
std::string SkipLayersArgument(const std::vector<int>& layers);

}  // namespace kvcal

#endif  // KVCAL_CLIENT_CHECKPOINT_SKIP_LAYERS_H_
