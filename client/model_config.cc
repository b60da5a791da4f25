#include "client/model_config.h"

#include <optional>

#include "absl/strings/str_cat.h"
#include "client/safetensors.h"
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
