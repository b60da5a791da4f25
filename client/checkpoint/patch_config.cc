// What a patch writes into config.json for each target, and the checks
// against vLLM 0.34's loader rules before anything is written
// (patch_config.h).
#include "client/checkpoint/patch_config.h"

#include <algorithm>
#include <filesystem>
#include <set>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/checkpoint/tensor_names.h"
#include "util/status_macros.h"

namespace kvcal::patch_internal {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

// The kv_cache_scheme compressed-tensors (and ModelOpt's flat config.json
// form) declare an FP8 KV cache with.
Json KvCacheScheme(const CalibratedScales& scales) {
  return {{"num_bits", 8},
          {"type", "float"},
          {"symmetric", true},
          {"dynamic", false},
          {"strategy", scales.granularity == Granularity::kPerHead ? "attn_head"
                                                                   : "tensor"},
          {"group_size", nullptr},
          {"block_structure", nullptr},
          {"actorder", nullptr},
          {"observer", scales.observer},
          {"observer_kwargs", Json::object()}};
}

// ModelOpt's flat config.json form of an NVFP4 KV cache: what vLLM 0.34's
// dtype resolver (utils/torch_utils.py get_kv_cache_quant_algo_string)
// turns into an "nvfp4" cache is type float, num_bits 4; the rest says what
// the cache is (blocks of 16 under one per-tensor global scale) and which
// observer made the scales.
Json Nvfp4KvCacheScheme(const CalibratedScales& scales) {
  return {{"num_bits", 4},
          {"type", "float"},
          {"symmetric", true},
          {"dynamic", false},
          {"strategy", "tensor_group"},
          {"group_size", 16},
          {"block_structure", nullptr},
          {"actorder", nullptr},
          {"observer", scales.observer},
          {"observer_kwargs", Json::object()}};
}

// What Quark writes for a KV-cache projection's output (what vLLM 0.34's
// QuarkKVCacheMethod.validate_kv_cache_config accepts: fp8_e4m3, per_tensor).
Json QuarkKvOutputTensors() {
  return {{"dtype", "fp8_e4m3"},
          {"qscheme", "per_tensor"},
          {"ch_axis", nullptr},
          {"group_size", nullptr},
          {"symmetric", true},
          {"round_method", "half_even"},
          {"scale_type", "float"},
          {"is_dynamic", false},
          {"observer_cls", "PerTensorMinMaxObserver"}};
}

absl::Status UpdateQuarkConfig(Json& quark) {
  // vLLM 0.34 (quark/quark.py QuarkConfig.from_config) reads
  // export.kv_cache_group and then takes the KV-cache scheme from the
  // layer_quant_config entries those patterns match; a top-level
  // kv_cache_group is never read.
  if (!quark.contains("export") || !quark["export"].is_object()) {
    return absl::FailedPreconditionError(
        "the Quark quantization_config has no 'export' block, without which "
        "vLLM 0.34 refuses the model (QuarkConfig.from_config); export it "
        "again with Quark");
  }
  // (ordered_json keeps members in a vector: no reference into `quark`
  // may be held across an insertion into it.)
  if (!quark.contains("layer_quant_config") ||
      !quark["layer_quant_config"].is_object()) {
    quark["layer_quant_config"] = Json::object();
  }
  const Json global = quark.contains("global_quant_config") &&
                              quark["global_quant_config"].is_object()
                          ? quark["global_quant_config"]
                          : Json::object();
  Json& exported = quark["export"];
  if (!exported.contains("kv_cache_group") ||
      !exported["kv_cache_group"].is_array() ||
      exported["kv_cache_group"].empty()) {
    exported["kv_cache_group"] = {"*k_proj", "*v_proj"};
  }
  const Json group = exported["kv_cache_group"];
  Json& layers = quark["layer_quant_config"];
  for (const Json& pattern : group) {
    if (!pattern.is_string()) {
      return absl::FailedPreconditionError(
          absl::StrCat("Quark export.kv_cache_group holds ", pattern.dump(),
                       ", not a layer pattern"));
    }
    const std::string name = pattern.get<std::string>();
    if (!layers.contains(name)) {
      // A new entry replaces the global config for the layers it matches,
      // so it starts as a copy of it: their weights stay as they were.
      layers[name] = global;
    }
    Json& entry = layers[name];
    if (!entry.is_object()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "Quark layer_quant_config['", name, "'] is not an object"));
    }
    if (!entry.contains("output_tensors") ||
        entry["output_tensors"].is_null()) {
      entry["output_tensors"] = QuarkKvOutputTensors();
    } else if (!entry["output_tensors"].is_object() ||
               entry["output_tensors"].value("dtype", "") != "fp8_e4m3" ||
               entry["output_tensors"].value("qscheme", "") != "per_tensor") {
      return absl::FailedPreconditionError(absl::StrCat(
          "Quark layer_quant_config['", name, "'].output_tensors is ",
          entry["output_tensors"].dump(),
          "; vLLM 0.34 accepts only an fp8_e4m3 per_tensor KV cache"));
    }
  }
  return absl::OkStatus();
}
}  // namespace

namespace {

// compressed-tensors: a new quantization_config, or kv_cache_scheme added to
// the model's own compressed-tensors one.
absl::Status UpdateCompressedTensorsConfig(Json& config, Json* existing,
                                           const std::string& method,
                                           const CalibratedScales& scales) {
  if (existing && method != "compressed-tensors") {
    return absl::FailedPreconditionError(absl::StrCat(
        "config.json already has a '", method,
        "' quantization_config; compressed-tensors scales would not load "
        "(try --target modelopt or quark)"));
  }
  if (!existing) {
    config["quantization_config"] = {
        {"quant_method", "compressed-tensors"},
        {"config_groups", Json::object()},
        {"ignore", Json::array()},
        {"format", "dense"},
        {"quantization_status", "compressed"},
        {"kv_cache_scheme", KvCacheScheme(scales)}};
  } else {
    // vLLM passes the head counts the per-head loader needs only when
    // config_groups exists (weight_utils.py get_quant_config).
    if (!existing->contains("config_groups")) {
      (*existing)["config_groups"] = Json::object();
    }
    (*existing)["kv_cache_scheme"] = KvCacheScheme(scales);
  }
  return absl::OkStatus();
}

// A flat ModelOpt MIXED_PRECISION config cannot declare an NVFP4 cache.
absl::Status CheckFlatModelOptNvfp4(const Json& existing) {
  const std::string algo =
      existing.contains("quant_algo") && existing["quant_algo"].is_string()
          ? existing["quant_algo"].get<std::string>()
          : "";
  if (absl::AsciiStrToUpper(algo) != "MIXED_PRECISION") {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(
      "an NVFP4 KV cache cannot be declared in a flat MIXED_PRECISION "
      "ModelOpt config: vLLM 0.34 makes a KV-cache algorithm of a "
      "num_bits 8 kv_cache_scheme only (modelopt.py "
      "ModelOptQuantConfigBase.from_config), and without one "
      "ModelOptMixedPrecisionConfig.get_quant_method gives the "
      "attention layers no KV-cache method, so the cache would be "
      "nvfp4 with every scale dropped (1.0); patch for fp8, or export "
      "the model with ModelOpt's NVFP4 KV cache");
}

// ModelOpt: the model's own config, nested or flat, declares the cache.
absl::Status UpdateModelOptConfig(Json* existing, const std::string& method,
                                  bool nvfp4, const CalibratedScales& scales,
                                  const fs::path& checkpoint_dir) {
  if (method != "modelopt") {
    std::error_code ec;
    const bool legacy =
        !existing && fs::exists(checkpoint_dir / "hf_quant_config.json", ec);
    return absl::FailedPreconditionError(absl::StrCat(
        "--target modelopt needs a model already quantized with ModelOpt "
        "(quantization_config.quant_method \"modelopt\" in config.json)",
        legacy ? "; this checkpoint keeps its ModelOpt config in "
                 "hf_quant_config.json (ModelOpt <= 0.29), which kvcal "
                 "does not patch: export it again with a current ModelOpt"
               : ""));
  }
  if (existing->contains("quantization") &&
      (*existing)["quantization"].is_object()) {
    // Nested form: ModelOptQuantConfigBase.from_config reads
    // quantization.kv_cache_quant_algo, and the dtype resolver maps
    // "FP8" / "NVFP4" to an fp8_e4m3 / nvfp4 cache
    // (MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP).
    (*existing)["quantization"]["kv_cache_quant_algo"] =
        nvfp4 ? "NVFP4" : "FP8";
    return absl::OkStatus();
  }
  // Flat config.json form: the dtype resolver reads kv_cache_scheme
  // (num_bits 8: fp8_e4m3; num_bits 4: nvfp4); from_config makes a
  // KV-cache algorithm of num_bits 8 only. Every ModelOpt config but
  // MIXED_PRECISION gives the attention layers their KV-cache method
  // anyway (ModelOptQuantConfigBase.get_quant_method).
  if (nvfp4) KVCAL_RETURN_IF_ERROR(CheckFlatModelOptNvfp4(*existing));
  (*existing)["kv_cache_scheme"] =
      nvfp4 ? Nvfp4KvCacheScheme(scales) : KvCacheScheme(scales);
  return absl::OkStatus();
}

}  // namespace

absl::Status UpdateConfig(Json& config, PatchTarget target,
                          PatchKvCache kv_cache, const CalibratedScales& scales,
                          const fs::path& checkpoint_dir) {
  Json* existing = nullptr;
  if (config.contains("quantization_config") &&
      config["quantization_config"].is_object()) {
    existing = &config["quantization_config"];
  }
  const std::string method =
      existing && (*existing).contains("quant_method") &&
              (*existing)["quant_method"].is_string()
          ? (*existing)["quant_method"].get<std::string>()
          : "";
  switch (target) {
    case PatchTarget::kCompressedTensors:
      return UpdateCompressedTensorsConfig(config, existing, method, scales);
    case PatchTarget::kModelOpt:
      return UpdateModelOptConfig(existing, method,
                                  kv_cache == PatchKvCache::kNvfp4, scales,
                                  checkpoint_dir);
    case PatchTarget::kQuark:
      if (method != "quark") {
        return absl::FailedPreconditionError(
            "--target quark needs a model already quantized with Quark "
            "(quantization_config.quant_method \"quark\")");
      }
      return UpdateQuarkConfig(*existing);
  }
  return absl::OkStatus();
}

namespace {

// NVFP4: ModelOpt only, per-tensor scales only.
absl::Status CheckNvfp4Target(const CalibratedScales& scales,
                              PatchTarget target) {
  if (target == PatchTarget::kCompressedTensors) {
    return absl::InvalidArgumentError(
        "--target compressed-tensors cannot declare an NVFP4 KV cache: "
        "vLLM 0.34 accepts only a kv_cache_scheme of type float, num_bits 8 "
        "and stops with NotImplementedError on num_bits 4 "
        "(compressed_tensors.py "
        "CompressedTensorsKVCacheMethod.validate_kv_cache_scheme), and "
        "reads the cache dtype from ModelOpt configs only "
        "(utils/torch_utils.py get_kv_cache_quant_algo_string); use "
        "--target modelopt on a ModelOpt model, or patch for fp8 and start "
        "vLLM with --kv-cache-dtype nvfp4 (check it with `kvcal inspect "
        "--kv-cache-dtype nvfp4`)");
  }
  if (target == PatchTarget::kQuark) {
    return absl::InvalidArgumentError(
        "--target quark cannot declare an NVFP4 KV cache: vLLM 0.34 "
        "accepts only an fp8_e4m3 KV cache in a Quark config "
        "(quark/quark.py QuarkKVCacheMethod.validate_kv_cache_config) and "
        "never takes the cache dtype from one (utils/torch_utils.py "
        "get_kv_cache_quant_algo_string reads ModelOpt configs only); "
        "patch for fp8 and start vLLM with --kv-cache-dtype nvfp4 (check "
        "it with `kvcal inspect --kv-cache-dtype nvfp4`)");
  }
  if (scales.granularity != Granularity::kPerTensor) {
    return absl::InvalidArgumentError(
        "an NVFP4 KV cache takes per-tensor scales only: its global scale "
        "is one scalar per layer and side (1 / k_scale, 1 / v_scale), "
        "which vLLM 0.34's NVFP4 store kernels read "
        "(csrc/nvfp4_kv_cache_kernels.cu; FlashInfer's nvfp4 append), and "
        "the ModelOpt loader accepts scalars only (quantization/kv_cache.py "
        "KVCacheScaleParameter.weight_loader); finalize with "
        "--granularity tensor");
  }
  return absl::OkStatus();
}

// The scales' number format: vLLM 0.34 loads float8_e4m3fn scales only.
absl::Status CheckScalesFormat(const CalibratedScales& scales) {
  auto format = scales.metadata.find("format");
  const std::string fmt =
      format == scales.metadata.end() ? "float8_e4m3fn" : format->second;
  if (fmt == "int8") {
    return absl::InvalidArgumentError(
        "the scales are for an int8 KV cache, which vLLM 0.34 cannot load: a "
        "compressed-tensors kv_cache_scheme must be type float, num_bits 8 "
        "(CompressedTensorsKVCacheMethod.validate_kv_cache_scheme) and "
        "ModelOpt/Quark load only FP8 caches; finalize with --format "
        "fp8-e4m3fn");
  }
  if (fmt == "float8_e5m2") {
    return absl::InvalidArgumentError(
        "the scales are for float8_e5m2 (qmax 57344), but vLLM 0.34 runs "
        "checkpoint scales only with an e4m3 cache (an fp8_e5m2 cache with a "
        "kv_cache_scheme is refused, and an e4m3 cache with these scales "
        "would saturate); finalize with --format fp8-e4m3fn");
  }
  if (fmt == "float8_e4m3fnuz") {
    return absl::InvalidArgumentError(
        "the scales are for float8_e4m3fnuz (qmax 240), but checkpoints carry "
        "e4m3fn scales (qmax 448): vLLM 0.34 doubles ModelOpt/Quark scales "
        "itself on ROCm fnuz hardware, and per-head scales do not run on "
        "ROCm; finalize with --format fp8-e4m3fn");
  }
  if (fmt != "float8_e4m3fn") {
    return absl::InvalidArgumentError(
        absl::StrCat("the scales file names format '", fmt,
                     "'; vLLM 0.34 loads float8_e4m3fn scales"));
  }
  return absl::OkStatus();
}

// Every layer in the model, and per-head scales one per head.
absl::Status CheckScalesGeometry(const CalibratedScales& scales,
                                 const ModelGeometry& g) {
  for (const auto& [layer, roles] : scales.layers) {
    if (layer >= g.num_layers) {
      return absl::InvalidArgumentError(
          absl::StrCat("scales hold layer ", layer, " but config.json has ",
                       g.num_layers, " layers"));
    }
    for (Role role : kAllRoles) {
      const size_t n = roles[RoleIndex(role)].size();
      if (n == 0 || scales.granularity == Granularity::kPerTensor) continue;
      const uint32_t heads =
          role == Role::kQ ? g.num_attention_heads : g.num_key_value_heads;
      if (role == Role::kQ && n == g.num_key_value_heads && n != heads) {
        return absl::InvalidArgumentError(absl::StrCat(
            ScaleTensorName(layer, role), " has ", n,
            " per-head scales, one per KV group (--q-per-kv-group), but vLLM "
            "0.34 needs one per query head (",
            heads, ") and reduces them per group itself (view(-1, ",
            heads / g.num_key_value_heads,
            ")); finalize without --q-per-kv-group"));
      }
      if (n != heads) {
        return absl::InvalidArgumentError(absl::StrCat(
            ScaleTensorName(layer, role), " has ", n,
            " per-head scales but config.json gives ", heads, " heads"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

// What vLLM 0.34 can load at all, checked before anything is written.
absl::Status CheckScalesForVllm(const CalibratedScales& scales,
                                const ModelGeometry& g, PatchTarget target,
                                PatchKvCache kv_cache) {
  if (kv_cache == PatchKvCache::kNvfp4) {
    KVCAL_RETURN_IF_ERROR(CheckNvfp4Target(scales, target));
  }
  KVCAL_RETURN_IF_ERROR(CheckScalesFormat(scales));
  if (target != PatchTarget::kCompressedTensors &&
      scales.granularity != Granularity::kPerTensor) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--target ", PatchTargetName(target),
        " accepts only per-tensor scales (vLLM 0.34 loads them as scalars); "
        "finalize with --granularity tensor"));
  }
  return CheckScalesGeometry(scales, g);
}

// Runs vLLM 0.34's loader rules (vllm_rules.h) on what the patched
// checkpoint will hold: vLLM must start and use every scale exactly as
// written (q per head: reduced per KV group by vLLM itself). Anything else is
// an error before a byte is written; what vLLM will do silently for roles
// the scales file does not have lands in report.warnings.
absl::Status CheckVllmUsesTheScales(
    const Json& config, const ModelGeometry& g, const CalibratedScales& scales,
    PatchTarget target, PatchKvCache kv_cache,
    const std::vector<VllmScaleTensor>& existing,
    const std::vector<NewTensor>& added, PatchReport& report) {
  std::set<std::string> added_names;
  std::vector<VllmScaleTensor> tensors;
  for (const NewTensor& t : added) {
    added_names.insert(t.name);
    tensors.push_back({t.name, t.shape, t.values});
  }
  for (const VllmScaleTensor& t : existing) {
    if (!added_names.count(t.name)) tensors.push_back(t);
  }
  VllmLoadOptions options;
  if (target == PatchTarget::kQuark) {
    // Nothing switches a Quark model's cache to fp8: users pass the flag.
    options.kv_cache_dtype = "fp8";
    report.warnings.push_back(
        "run vLLM with --kv-cache-dtype fp8: vLLM 0.34 never switches a Quark "
        "model's KV cache to fp8 by itself, and ignores the scales otherwise");
  }
  const VllmPrediction p = PredictVllmLoad(config, g, tensors, options);
  std::vector<std::string> problems = p.refusals;
  // The cache the config declares is the one asked for (a stale
  // kv_cache_scheme the resolver reads first would make it another).
  const bool cache_as_asked = kv_cache == PatchKvCache::kNvfp4
                                  ? p.kv_cache_dtype == "nvfp4"
                                  : absl::StartsWith(p.kv_cache_dtype, "fp8");
  if (!cache_as_asked) {
    problems.push_back(absl::StrCat(
        "vLLM ", kVllmVersion, " would run a '", p.kv_cache_dtype,
        "' KV cache with --kv-cache-dtype ", options.kv_cache_dtype,
        ", not the ", PatchKvCacheName(kv_cache),
        " cache asked for (utils/torch_utils.py "
        "get_kv_cache_quant_algo_string)"));
  }
  for (const auto& [layer, roles] : scales.layers) {
    for (Role role : kAllRoles) {
      std::vector<float> want = roles[RoleIndex(role)];
      if (want.empty()) continue;
      if (role == Role::kQ && scales.granularity == Granularity::kPerHead) {
        const uint32_t group = g.num_attention_heads / g.num_key_value_heads;
        std::vector<float> reduced;
        for (size_t i = 0; i + group <= want.size(); i += group) {
          reduced.push_back(
              *std::max_element(want.begin() + i, want.begin() + i + group));
        }
        want = std::move(reduced);
      }
      auto it = p.layers.find(layer);
      const VllmRoleOutcome* got =
          it == p.layers.end() ? nullptr : &it->second[RoleIndex(role)];
      if (got == nullptr || got->fate != "used" || got->effective != want) {
        problems.push_back(
            absl::StrCat(ScaleTensorName(layer, role), ": vLLM ", kVllmVersion,
                         " would not use it as written (",
                         got == nullptr ? "no such layer" : got->fate, ")"));
      }
    }
  }
  if (!problems.empty()) {
    for (const std::string& s : p.silent) problems.push_back(s);
    return absl::FailedPreconditionError(
        absl::StrCat("the patched checkpoint would not load in vLLM ",
                     kVllmVersion, " as intended, so nothing was written: ",
                     absl::StrJoin(problems, "; ")));
  }
  for (const std::string& s : p.silent) report.warnings.push_back(s);
  for (const std::string& s : p.notes) report.warnings.push_back(s);
  return absl::OkStatus();
}

}  // namespace kvcal::patch_internal
