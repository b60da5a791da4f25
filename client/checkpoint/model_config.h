// Attention geometry from a Hugging Face config.json.
//
//   KVCAL_ASSIGN_OR_RETURN(kvcal::ModelGeometry g,
//                          kvcal::ReadModelGeometry("model/config.json"));
//   kvcal::Geometry session = g.ToGeometry(/*bins_per_octave=*/64);
//
// Reads num_hidden_layers, num_attention_heads, num_key_value_heads (default:
// num_attention_heads) and head_dim (default: hidden_size /
// num_attention_heads), from the top level or from a nested `text_config`
// (multimodal models).
//
// Attention it does not calibrate is refused (InvalidArgument naming the
// config key), never read as if it were ordinary attention: DeepSeek-style
// multi-head latent attention (kv_lora_rank, or a model_type whose config
// defaults it: deepseek_v2/v3, kimi_k2, ...), separate RoPE/value head sizes
// (qk_rope_head_dim, qk_nope_head_dim, v_head_dim), encoder-decoder and
// cross-attention models, hybrid and linear-attention models (layer_types /
// layers_block_type entries other than full_attention, sliding_attention and
// chunked_attention; Mamba keys; hybrid layer maps) and layers sharing
// another layer's KV cache (num_kv_shared_layers). Sliding-window and
// chunked attention are ordinary attention: vLLM 0.34 quantizes those
// layers' KV cache with their scales.
#ifndef KVCAL_CLIENT_CHECKPOINT_MODEL_CONFIG_H_
#define KVCAL_CLIENT_CHECKPOINT_MODEL_CONFIG_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/types.h"
#include "nlohmann/json.hpp"

namespace kvcal {

struct ModelGeometry {
  uint32_t num_layers = 0;
  uint32_t num_attention_heads = 0;
  uint32_t num_key_value_heads = 0;
  uint32_t head_dim = 0;

  Geometry ToGeometry(uint32_t bins_per_octave) const {
    return Geometry{.num_layers = num_layers,
                    .num_attention_heads = num_attention_heads,
                    .num_key_value_heads = num_key_value_heads,
                    .head_dim = head_dim,
                    .bins_per_octave = bins_per_octave};
  }
  friend bool operator==(const ModelGeometry&, const ModelGeometry&) = default;
};

absl::StatusOr<ModelGeometry> ModelGeometryFromConfig(
    const nlohmann::ordered_json& config);
absl::StatusOr<ModelGeometry> ReadModelGeometry(const std::string& config_path);

}  // namespace kvcal

#endif  // KVCAL_CLIENT_CHECKPOINT_MODEL_CONFIG_H_
