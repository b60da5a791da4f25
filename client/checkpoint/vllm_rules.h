// What vLLM 0.34.0 does with a checkpoint's KV-cache (and query) scales: its
// loader's rules as code, so that `kvcal inspect` can predict them and
// `kvcal patch` can refuse to write what vLLM would refuse or ignore.
//
//   VllmLoadOptions options;  // --kv-cache-dtype auto, CUDA
//   VllmPrediction p =
//       PredictVllmLoad(config, geometry, scale_tensors, options);
//   if (!p.refusals.empty()) ...  // vLLM will not start
//   if (!p.silent.empty()) ...    // it starts, but ignores or replaces
//                                 // scales silently
//
// Every rule names the vLLM file and function it comes from (paths inside
// the `vllm/` package of the 0.34.0 sdist; docs/formats.md has the
// summary). Modelled: the compressed-tensors, ModelOpt and Quark quantization
// configs and a checkpoint without a quantization_config, for decoder models
// that load through LlamaForCausalLM-style AutoWeightsLoader (the scale
// names of `{prefix}.layers.{L}.self_attn`). Another quant_method is reported
// as not modelled (a refusal to predict, never a guess).
#ifndef KVCAL_CLIENT_CHECKPOINT_VLLM_RULES_H_
#define KVCAL_CLIENT_CHECKPOINT_VLLM_RULES_H_

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/checkpoint/model_config.h"
#include "nlohmann/json.hpp"

namespace kvcal {

inline constexpr char kVllmVersion[] = "0.34.0";

enum class VllmPlatform {
  kCuda,  // NVIDIA: float8_e4m3fn
  kRocm,  // AMD MI300-class: float8_e4m3fnuz (vLLM's is_fp8_fnuz())
};
absl::StatusOr<VllmPlatform> ParseVllmPlatform(absl::string_view name);
absl::string_view VllmPlatformName(VllmPlatform platform);

struct VllmLoadOptions {
  // vLLM's --kv-cache-dtype: auto, fp8, fp8_e4m3, fp8_e5m2, nvfp4,
  // nvfp4_4over6, bfloat16, ... (nvfp4: the scales are each layer's global
  // scale, 1 / k_scale; the backends are FlashInfer's, by GPU family)
  std::string kv_cache_dtype = "auto";
  VllmPlatform platform = VllmPlatform::kCuda;
};

// A tensor of the checkpoint whose name may be a KV-cache/query scale.
struct VllmScaleTensor {
  std::string name;
  std::vector<uint64_t> shape;
  std::vector<float> values;  // empty when the dtype is not a float type
};

// What one attention parameter (q, k or v of one layer) ends up holding.
struct VllmRoleOutcome {
  std::vector<std::string> tensors;  // checkpoint tensors loaded into it
  // "used", "missing: 1.0", "missing: v := k", "unused: cache not fp8", ...
  std::string fate;
  // The values the attention layer uses (per head: q already reduced per KV
  // group; ROCm: doubled where vLLM doubles); empty where vLLM would not
  // start or the scale is unused.
  std::vector<float> effective;
};

struct VllmPrediction {
  std::string method;  // compressed-tensors | modelopt | quark | none
  // False for a quant_method kvcal does not model: nothing is predicted.
  bool modelled = true;
  // What the cache really is: "fp8", "fp8_e4m3", "nvfp4", "auto", ...
  std::string kv_cache_dtype;
  bool per_head = false;  // compressed-tensors strategy attn_head
  // Backends that start with these scales (and, for NVFP4, on which GPUs).
  std::string backends;
  // vLLM raises at start-up; each entry says why and where.
  std::vector<std::string> refusals;
  // vLLM starts but drops scales, leaves 1.0 for a missing one, or uses a
  // value that is not finite and > 0, without failing.
  std::vector<std::string> silent;
  // Worth knowing, not wrong (warnings vLLM itself logs, ROCm doubling).
  std::vector<std::string> notes;
  std::map<uint32_t, std::array<VllmRoleOutcome, 3>> layers;  // Q, K, V

  bool starts() const { return refusals.empty(); }
  // Starts, and every scale in the checkpoint is used as written.
  bool clean() const { return modelled && refusals.empty() && silent.empty(); }
  nlohmann::ordered_json ToJson() const;
};

// `config` is config.json; `tensors` every tensor of the checkpoint that
// ParseVllmScaleName accepts (others are weights and are not looked at).
VllmPrediction PredictVllmLoad(const nlohmann::ordered_json& config,
                               const ModelGeometry& geometry,
                               const std::vector<VllmScaleTensor>& tensors,
                               const VllmLoadOptions& options);

// True when vLLM 0.34 may treat `name` as a KV-cache or query scale (before
// remapping): `.{q,k,v}_scale`, `.kv_scale`, `.{k,v}_proj.{k,v}_scale`,
// `.{q,k,v}_proj.output_scale`, `.q.scale`, `.{k,v}_cache.scale`.
bool IsVllmScaleName(absl::string_view name);

// The name vLLM's cache-scale mapper gives a checkpoint name under
// `method` (base_config.py QuantizationConfig.get_cache_scale_mapper; Quark
// adds quark.py QuarkConfig.get_cache_scale_mapper's suffixes).
std::string VllmMappedScaleName(absl::string_view method,
                                const std::string& name);

}  // namespace kvcal

#endif  // KVCAL_CLIENT_CHECKPOINT_VLLM_RULES_H_
