// Every safetensors tensor name kvcal builds or parses, in one place:
//
//   activation dumps   model.layers.{L}.self_attn.{q,k,v}
//   scales files       model.layers.{L}.self_attn.{q,k,v}_scale
//   checkpoints        {prefix}.layers.{L}.self_attn. + per target:
//     compressed-tensors  {q,k,v}_scale
//     modelopt            q_scale, {k,v}_proj.{k,v}_scale
//     quark               {q,k,v}_proj.output_scale
//
// What vLLM itself does with a name (its remapping rules) is modelled apart,
// in vllm_rules.h: those are vLLM's facts, not names kvcal chooses.
#ifndef KVCAL_CLIENT_CHECKPOINT_TENSOR_NAMES_H_
#define KVCAL_CLIENT_CHECKPOINT_TENSOR_NAMES_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/types.h"

namespace kvcal {

// 'q', 'k' or 'v': the letter checkpoints spell a role with.
char RoleLetter(Role role);

// The checkpoint conventions `kvcal patch --target` writes.
enum class PatchTarget { kCompressedTensors, kModelOpt, kQuark };

// "compressed-tensors", "modelopt" or "quark".
absl::StatusOr<PatchTarget> ParsePatchTarget(absl::string_view name);
absl::string_view PatchTargetName(PatchTarget target);

struct LayerRole {
  uint32_t layer = 0;
  Role role = Role::kQ;
  bool operator==(const LayerRole&) const = default;
};

// "model.layers.3.self_attn.k" for (3, K).
std::string ActivationTensorName(uint32_t layer, Role role);
// The (layer, role) of an activation-dump tensor name. InvalidArgument
// "tensor '<name>' is not named model.layers.{L}.self_attn.{q,k,v}", or
// "...: layer number out of range" past 2^32 - 1.
absl::StatusOr<LayerRole> ParseActivationTensorName(absl::string_view name);

// "model.layers.3.self_attn.k_scale" for (3, K).
std::string ScaleTensorName(uint32_t layer, Role role);
// As ParseActivationTensorName, for model.layers.{L}.self_attn.{q,k,v}_scale.
absl::StatusOr<LayerRole> ParseScaleTensorName(absl::string_view name);

// The name `target` gives the scale of (layer, role) in a checkpoint whose
// attention modules live under `prefix` ("model" for Llama).
std::string CheckpointScaleName(PatchTarget target, absl::string_view prefix,
                                uint32_t layer, Role role);

// A checkpoint tensor name that is a KV-cache scale in one of the
// conventions (any prefix; compressed-tensors' also with vLLM's `.attn.`).
struct CheckpointScale {
  uint32_t layer = 0;
  Role role = Role::kQ;
  PatchTarget convention = PatchTarget::kCompressedTensors;
};
std::optional<CheckpointScale> ParseCheckpointScaleName(absl::string_view name);

// The prefix a checkpoint uses before ".layers.{L}.self_attn." ("model" for
// Llama; "model.language_model" for some multimodal models): that of the
// first such name, else "model".
std::string AttentionPrefix(const std::vector<std::string>& names);

}  // namespace kvcal

#endif  // KVCAL_CLIENT_CHECKPOINT_TENSOR_NAMES_H_
