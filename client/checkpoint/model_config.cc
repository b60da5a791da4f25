#include "client/checkpoint/model_config.h"

#include <optional>
#include <string_view>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/checkpoint/safetensors.h"
#include "util/status_macros.h"

namespace kvcal {
namespace {

using Json = nlohmann::ordered_json;

// A positive integer field, nullopt when absent or null.
absl::StatusOr<std::optional<uint32_t>> PositiveField(const Json& config,
                                                      const char* key) {
  if (!config.contains(key) || config[key].is_null()) return std::nullopt;
  const Json& value = config[key];
  if (!value.is_number_integer() || value.get<int64_t>() <= 0 ||
      value.get<int64_t>() > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: ", key, " is ",
                                                   value.dump(),
                                                   ", not a positive integer"));
  }
  return static_cast<uint32_t>(value.get<int64_t>());
}

bool IsSet(const Json& config, const char* key) {
  return config.contains(key) && !config[key].is_null();
}

// Model types of DeepSeek-style multi-head latent attention architectures
// (from vLLM 0.34's ModelArchConfigConvertor.is_deepseek_mla list): refused
// even when config.json leaves kv_lora_rank out, which their transformers
// config classes then default (512 for deepseek_v2/v3).
constexpr const char* kMlaModelTypes[] = {
    "deepseek_v2", "deepseek_v3",   "deepseek_v32",    "deepseek_mtp",
    "kimi_k2",     "kimi_linear",   "glm4_moe_lite",   "glm_moe_dsa",
    "axk1",        "longcat_flash", "mistral_large_4", "pangu_ultra_moe",
};

// layer_types entries that are ordinary softmax attention over per-head K
// and V: vLLM 0.34 quantizes the KV cache of every one of them with the
// layer's k_scale and v_scale (sliding and chunked windows change which
// positions are attended, not what is cached; Attention.__init__ skips a
// sliding-window layer only when --kv-cache-dtype-skip-layers says so).
// "attention" is the older name of "full_attention".
constexpr const char* kAttentionLayerTypes[] = {
    "full_attention", "sliding_attention", "chunked_attention", "attention"};

// Keys of hybrid and linear-attention configs that name which layers have
// no softmax attention (or a state besides it).
constexpr const char* kHybridLayoutKeys[] = {
    "hybrid_override_pattern", "attn_layer_indices", "attn_layer_period",
    "attn_layer_offset",       "hybrid_layer_ids",   "linear_attn_config",
    "full_attn_idxs",          "full_attention_idx"};

absl::Status Refuse(const std::string& key, absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("config.json: ", key, ": ", why));
}

// Multi-head latent attention and split RoPE/non-RoPE or value head sizes.
absl::Status CheckLatentAttention(const Json& config) {
  // tests/python/test_mla_vllm_loader.py runs vLLM 0.34's loader on a
  // DeepseekV3: no checkpoint name reaches MLAAttention's scales (the
  // cache-scale name mapper renames them past the MLA layer).
  constexpr absl::string_view kMla =
      "DeepSeek-style multi-head latent attention (kv_lora_rank): vLLM 0.34 "
      "caches one compressed latent per token, and its weight loader drops "
      "every calibrated MLA scale whatever the checkpoint calls it ('not "
      "loaded', then 1.0), so there is nothing to patch; "
      "kvcal.torch.capture_mla measures the latent's scales";
  if (IsSet(config, "kv_lora_rank")) {
    return Refuse(absl::StrCat("kv_lora_rank ", config["kv_lora_rank"].dump()),
                  kMla);
  }
  // (An explicit null kv_lora_rank is no latent: the checks below decide.)
  if (!config.contains("kv_lora_rank") && config.contains("model_type") &&
      config["model_type"].is_string()) {
    const std::string type = config["model_type"].get<std::string>();
    for (const char* mla : kMlaModelTypes) {
      if (type == mla) {
        return Refuse(absl::StrCat("model_type \"", type, "\""), kMla);
      }
    }
  }
  for (const char* key : {"qk_rope_head_dim", "qk_nope_head_dim"}) {
    if (IsSet(config, key)) {
      return Refuse(key,
                    "attention with separate RoPE and non-RoPE query/key "
                    "parts (DeepSeek style) is not supported yet");
    }
  }
  if (IsSet(config, "v_head_dim") &&
      !(IsSet(config, "head_dim") &&
        config["head_dim"] == config["v_head_dim"])) {
    return Refuse(
        absl::StrCat("v_head_dim ", config["v_head_dim"].dump()),
        "values with a head size other than the keys' (head_dim) are not "
        "supported");
  }
  return absl::OkStatus();
}

absl::Status CheckCrossAttention(const Json& config) {
  if (config.contains("is_encoder_decoder") &&
      config["is_encoder_decoder"] == true) {
    return Refuse("is_encoder_decoder",
                  "encoder-decoder models (cross-attention, an encoder "
                  "without a KV cache) are not supported");
  }
  if (config.contains("add_cross_attention") &&
      config["add_cross_attention"] == true) {
    return Refuse("add_cross_attention",
                  "decoders with cross-attention are not supported");
  }
  if (config.contains("cross_attention_layers") &&
      config["cross_attention_layers"].is_array() &&
      !config["cross_attention_layers"].empty()) {
    return Refuse("cross_attention_layers",
                  "models with cross-attention layers are not supported");
  }
  return absl::OkStatus();
}

// layer_types and its spellings: every layer softmax attention, one entry
// per layer.
absl::Status CheckLayerTypes(const Json& config) {
  for (const char* key : {"layer_types", "layers_block_type", "block_types"}) {
    if (!IsSet(config, key)) continue;
    const Json& types = config[key];
    if (!types.is_array()) {
      return Refuse(key, absl::StrCat("is ", types.dump(), ", not a list"));
    }
    for (size_t i = 0; i < types.size(); ++i) {
      bool attention = false;
      if (types[i].is_string()) {
        for (const char* ok : kAttentionLayerTypes) {
          attention = attention || types[i].get<std::string>() == ok;
        }
      }
      if (!attention) {
        return Refuse(
            absl::StrCat(key, "[", i, "] ", types[i].dump()),
            "models with layers other than softmax attention (linear "
            "attention, Mamba or other state-space, convolution or hybrid "
            "layers) are not supported yet; accepted: full_attention, "
            "sliding_attention, chunked_attention");
      }
    }
    // (block_types is a pattern that repeats over the layers.)
    if (std::string_view(key) != "block_types" &&
        IsSet(config, "num_hidden_layers") &&
        config["num_hidden_layers"].is_number_integer() &&
        config["num_hidden_layers"].get<int64_t>() !=
            static_cast<int64_t>(types.size())) {
      return Refuse(
          key,
          absl::StrCat("has ", types.size(), " entries for num_hidden_layers ",
                       config["num_hidden_layers"].dump(), " layers"));
    }
  }
  return absl::OkStatus();
}

// Shared KV caches, hybrid layouts and Mamba layers.
absl::Status CheckHybrid(const Json& config) {
  if (config.contains("num_kv_shared_layers") &&
      config["num_kv_shared_layers"].is_number() &&
      config["num_kv_shared_layers"] != 0) {
    return Refuse(
        absl::StrCat("num_kv_shared_layers ",
                     config["num_kv_shared_layers"].dump()),
        "layers that read another layer's KV cache (Gemma 3n style) are not "
        "supported yet");
  }
  for (const char* key : kHybridLayoutKeys) {
    if (IsSet(config, key)) {
      return Refuse(key,
                    "hybrid models whose layers are not all softmax attention "
                    "are not supported yet");
    }
  }
  for (const auto& [key, value] : config.items()) {
    if (absl::StartsWith(key, "mamba") && !value.is_null()) {
      return Refuse(key,
                    "models with Mamba (state-space) layers are not "
                    "supported yet");
    }
  }
  return absl::OkStatus();
}

// InvalidArgument when `config` describes attention kvcal does not
// calibrate: geometry read from it would be wrong, never just incomplete.
// The message names the key that says so.
absl::Status CheckAttentionKind(const Json& config) {
  KVCAL_RETURN_IF_ERROR(CheckLatentAttention(config));
  KVCAL_RETURN_IF_ERROR(CheckCrossAttention(config));
  KVCAL_RETURN_IF_ERROR(CheckLayerTypes(config));
  return CheckHybrid(config);
}

}  // namespace

absl::StatusOr<ModelGeometry> ModelGeometryFromConfig(const Json& root) {
  if (!root.is_object()) {
    return absl::InvalidArgumentError("config.json is not a JSON object");
  }
  const Json* config = &root;
  if (!root.contains("num_attention_heads") && root.contains("text_config") &&
      root["text_config"].is_object()) {
    config = &root["text_config"];
  }
  // The model as a whole (encoder-decoder, model_type) and its text model.
  KVCAL_RETURN_IF_ERROR(CheckAttentionKind(root));
  if (config != &root) KVCAL_RETURN_IF_ERROR(CheckAttentionKind(*config));
  KVCAL_ASSIGN_OR_RETURN(auto layers,
                         PositiveField(*config, "num_hidden_layers"));
  KVCAL_ASSIGN_OR_RETURN(auto heads,
                         PositiveField(*config, "num_attention_heads"));
  KVCAL_ASSIGN_OR_RETURN(auto kv_heads,
                         PositiveField(*config, "num_key_value_heads"));
  KVCAL_ASSIGN_OR_RETURN(auto head_dim, PositiveField(*config, "head_dim"));
  KVCAL_ASSIGN_OR_RETURN(auto hidden, PositiveField(*config, "hidden_size"));
  if (!layers) {
    return absl::InvalidArgumentError(
        "config.json has no num_hidden_layers (top level or text_config)");
  }
  if (!heads) {
    return absl::InvalidArgumentError(
        "config.json has no num_attention_heads (top level or text_config)");
  }
  ModelGeometry g;
  g.num_layers = *layers;
  g.num_attention_heads = *heads;
  g.num_key_value_heads = kv_heads.value_or(*heads);
  if (head_dim) {
    g.head_dim = *head_dim;
  } else if (hidden) {
    if (*hidden % *heads != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("config.json: hidden_size ", *hidden,
                       " is not a multiple of num_attention_heads ", *heads,
                       " and there is no head_dim"));
    }
    g.head_dim = *hidden / *heads;
  } else {
    return absl::InvalidArgumentError(
        "config.json has neither head_dim nor hidden_size");
  }
  KVCAL_RETURN_IF_ERROR(g.ToGeometry(0).Validate());
  return g;
}

absl::StatusOr<ModelGeometry> ReadModelGeometry(const std::string& path) {
  KVCAL_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path));
  Json config = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (config.is_discarded()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not valid JSON"));
  }
  auto geometry = ModelGeometryFromConfig(config);
  if (!geometry.ok()) {
    return absl::Status(geometry.status().code(),
                        absl::StrCat(path, ": ", geometry.status().message()));
  }
  return geometry;
}

}  // namespace kvcal
