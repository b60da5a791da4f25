// The configuration phase of a patch (checkpoint_patcher.cc's step 2, plan):
// the config.json a patch writes for each target (compressed-tensors,
// ModelOpt, Quark), and the checks against vLLM 0.34 that run before
// anything is written. Internal to kvcal_checkpoint: PatchCheckpoint
// (checkpoint_patcher.h) is the interface.
#ifndef KVCAL_CLIENT_CHECKPOINT_PATCH_CONFIG_H_
#define KVCAL_CLIENT_CHECKPOINT_PATCH_CONFIG_H_

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "client/checkpoint/checkpoint_patcher.h"
#include "client/checkpoint/model_config.h"
#include "client/checkpoint/scales_file.h"
#include "client/checkpoint/vllm_rules.h"
#include "nlohmann/json.hpp"

namespace kvcal::patch_internal {

// A scale tensor the patch adds, under its checkpoint name.
struct NewTensor {
  std::string name;
  std::vector<uint64_t> shape;
  std::vector<float> values;
};

// Writes into `config` (config.json) what `target` needs for vLLM to run
// with a `kv_cache` (FP8 or NVFP4) KV cache and read the scales; refuses,
// naming the reason, a model the target does not fit.
absl::Status UpdateConfig(nlohmann::ordered_json& config, PatchTarget target,
                          PatchKvCache kv_cache, const CalibratedScales& scales,
                          const std::filesystem::path& checkpoint_dir);

// What vLLM 0.34 can load at all, checked before anything is written: the
// scales' format and granularity, and whether `target` can declare
// `kv_cache` (NVFP4: ModelOpt only, per-tensor scales only).
absl::Status CheckScalesForVllm(const CalibratedScales& scales,
                                const ModelGeometry& g, PatchTarget target,
                                PatchKvCache kv_cache);

// Runs vLLM 0.34's loader rules (vllm_rules.h) on what the patched
// checkpoint will hold: vLLM must start with the `kv_cache` cache (under
// --kv-cache-dtype auto; Quark: fp8, which users pass) and use every scale
// exactly as
// written (q per head: reduced per KV group by vLLM itself). Anything else is
// an error before a byte is written; what vLLM will do silently for roles
// the scales file does not have lands in report.warnings.
absl::Status CheckVllmUsesTheScales(
    const nlohmann::ordered_json& config, const ModelGeometry& g,
    const CalibratedScales& scales, PatchTarget target, PatchKvCache kv_cache,
    const std::vector<VllmScaleTensor>& existing,
    const std::vector<NewTensor>& added, PatchReport& report);

}  // namespace kvcal::patch_internal

#endif  // KVCAL_CLIENT_CHECKPOINT_PATCH_CONFIG_H_
