#include "client/checkpoint/tensor_names.h"

#include <regex>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvcal {
namespace {

Role RoleOfLetter(char letter) {
  return letter == 'q' ? Role::kQ : letter == 'k' ? Role::kK : Role::kV;
}

// `name` against `pattern` (groups: layer digits, role letter).
absl::StatusOr<LayerRole> ParseLayerRole(absl::string_view name,
                                         const std::regex& pattern,
                                         absl::string_view spelled) {
  const std::string text(name);
  std::smatch m;
  if (!std::regex_match(text, m, pattern)) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", name, "' is not named ", spelled));
  }
  LayerRole parsed;
  if (!absl::SimpleAtoi(m[1].str(), &parsed.layer)) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", name, "': layer number out of range"));
  }
  parsed.role = RoleOfLetter(m[2].str()[0]);
  return parsed;
}

}  // namespace

char RoleLetter(Role role) { return "qkv"[RoleIndex(role)]; }

absl::StatusOr<PatchTarget> ParsePatchTarget(absl::string_view name) {
  if (name == "compressed-tensors") return PatchTarget::kCompressedTensors;
  if (name == "modelopt") return PatchTarget::kModelOpt;
  if (name == "quark") return PatchTarget::kQuark;
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown target '", name, "' (compressed-tensors, modelopt or quark)"));
}

absl::string_view PatchTargetName(PatchTarget target) {
  switch (target) {
    case PatchTarget::kCompressedTensors:
      return "compressed-tensors";
    case PatchTarget::kModelOpt:
      return "modelopt";
    case PatchTarget::kQuark:
      return "quark";
  }
  return "unknown";
}

std::string ActivationTensorName(uint32_t layer, Role role) {
  return absl::StrCat("model.layers.", layer, ".self_attn.",
                      std::string(1, RoleLetter(role)));
}

absl::StatusOr<LayerRole> ParseActivationTensorName(absl::string_view name) {
  static const std::regex kName(R"(model\.layers\.(\d+)\.self_attn\.([qkv]))");
  return ParseLayerRole(name, kName, "model.layers.{L}.self_attn.{q,k,v}");
}

std::string ScaleTensorName(uint32_t layer, Role role) {
  return absl::StrCat(ActivationTensorName(layer, role), "_scale");
}

absl::StatusOr<LayerRole> ParseScaleTensorName(absl::string_view name) {
  static const std::regex kName(
      R"(model\.layers\.(\d+)\.self_attn\.([qkv])_scale)");
  return ParseLayerRole(name, kName,
                        "model.layers.{L}.self_attn.{q,k,v}_scale");
}

std::string CheckpointScaleName(PatchTarget target, absl::string_view prefix,
                                uint32_t layer, Role role) {
  const std::string letter(1, RoleLetter(role));
  const std::string base =
      absl::StrCat(prefix, ".layers.", layer, ".self_attn.");
  switch (target) {
    case PatchTarget::kCompressedTensors:
      return absl::StrCat(base, letter, "_scale");
    case PatchTarget::kModelOpt:
      // ModelOpt's own names for k and v; q has none of its own, and vLLM's
      // common mapper loads `self_attn.q_scale` into the attention layer.
      if (role == Role::kQ) return absl::StrCat(base, "q_scale");
      return absl::StrCat(base, letter, "_proj.", letter, "_scale");
    case PatchTarget::kQuark:
      // LlamaForCausalLM's outer AutoWeightsLoader applies Quark's suffix
      // mapper (`.k_proj.output_scale` -> `.attn.k_scale`) before the inner
      // model's stacked q/k/v_proj -> qkv_proj renaming, so these load.
      return absl::StrCat(base, letter, "_proj.output_scale");
  }
  return "";
}

std::optional<CheckpointScale> ParseCheckpointScaleName(
    absl::string_view name) {
  static const std::regex kCompressed(
      R"(.*\.layers\.(\d+)\.self_attn\.(?:attn\.)?([qkv])_scale)");
  static const std::regex kModelOpt(
      R"(.*\.layers\.(\d+)\.self_attn\.([kv])_proj\.[kv]_scale)");
  static const std::regex kQuark(
      R"(.*\.layers\.(\d+)\.self_attn\.([qkv])_proj\.output_scale)");
  const std::string text(name);
  for (const auto& [pattern, convention] :
       {std::pair{&kCompressed, PatchTarget::kCompressedTensors},
        std::pair{&kModelOpt, PatchTarget::kModelOpt},
        std::pair{&kQuark, PatchTarget::kQuark}}) {
    std::smatch m;
    if (!std::regex_match(text, m, *pattern)) continue;
    // A layer number beyond uint32 names no layer.
    CheckpointScale parsed;
    if (!absl::SimpleAtoi(m[1].str(), &parsed.layer)) return std::nullopt;
    parsed.role = RoleOfLetter(m[2].str()[0]);
    parsed.convention = convention;
    return parsed;
  }
  return std::nullopt;
}

std::string AttentionPrefix(const std::vector<std::string>& names) {
  static const std::regex kAttention(R"((.*)\.layers\.\d+\.self_attn\..*)");
  for (const std::string& name : names) {
    std::smatch m;
    if (std::regex_match(name, m, kAttention)) return m[1].str();
  }
  return "model";
}

}  // namespace kvcal
