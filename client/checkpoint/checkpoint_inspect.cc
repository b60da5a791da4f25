#include "client/checkpoint/checkpoint_inspect.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <regex>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/checkpoint/checkpoint_lock.h"
#include "client/checkpoint/checkpoint_patcher.h"
#include "client/checkpoint/model_config.h"
#include "client/checkpoint/safetensors.h"
#include "client/checkpoint/tensor_names.h"
#include "client/checkpoint/vllm_rules.h"
#include "kernels/element_math.h"
#include "util/status_macros.h"

namespace kvcal {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

// config.json, with its quant_method and kv_cache_scheme strategy noted.
absl::StatusOr<Json> ReadConfig(const fs::path& dir, InspectReport& report) {
  KVCAL_ASSIGN_OR_RETURN(std::string config_text,
                         ReadSmallFile((dir / "config.json").string()));
  Json config = Json::parse(config_text, nullptr, false);
  if (config.is_discarded()) {
    return absl::InvalidArgumentError(
        absl::StrCat((dir / "config.json").string(), ": not valid JSON"));
  }
  if (config.contains("quantization_config") &&
      config["quantization_config"].is_object()) {
    const Json& q = config["quantization_config"];
    if (q.contains("quant_method") && q["quant_method"].is_string()) {
      report.quant_method = q["quant_method"].get<std::string>();
    }
    if (q.contains("kv_cache_scheme") && q["kv_cache_scheme"].is_object()) {
      const Json& scheme = q["kv_cache_scheme"];
      if (scheme.contains("strategy") && scheme["strategy"].is_string()) {
        report.strategy = scheme["strategy"].get<std::string>();
      }
    }
  }
  return config;
}

// The tensor files to read (the index's in first-appearance order, or the
// single file) and the tensor names the index puts in each.
struct TensorFiles {
  std::vector<std::string> files;
  std::map<std::string, std::vector<std::string>> listed;
};

absl::StatusOr<TensorFiles> ListTensorFiles(const fs::path& dir,
                                            InspectReport& report) {
  TensorFiles out;
  std::error_code ec;
  const fs::path index_path = dir / kIndexName;
  report.sharded = fs::exists(index_path, ec);
  if (!report.sharded) {
    if (!fs::exists(dir / "model.safetensors", ec)) {
      return absl::NotFoundError(absl::StrCat(
          dir.string(), " has neither ", kIndexName, " nor model.safetensors"));
    }
    out.files.push_back("model.safetensors");
    return out;
  }
  KVCAL_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(index_path.string()));
  Json index = Json::parse(text, nullptr, false);
  if (index.is_discarded() || !index.contains("weight_map") ||
      !index["weight_map"].is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(index_path.string(), ": no weight_map"));
  }
  for (const auto& [name, file] : index["weight_map"].items()) {
    const std::string f = file.is_string() ? file.get<std::string>() : "";
    if (absl::Status s = CheckShardFileName(f); !s.ok()) {
      // Never opened: it would be a file outside the checkpoint.
      report.errors.push_back(absl::StrCat(kIndexName, ": weight_map entry '",
                                           name, "': ", s.message()));
      continue;
    }
    if (!out.listed.count(f)) out.files.push_back(f);
    out.listed[f].push_back(name);
  }
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string f = e.path().filename().string();
    if (f.ends_with(".safetensors") && !out.listed.count(f)) {
      report.warnings.push_back(absl::StrCat(
          f, " is not in the index: vLLM and Transformers skip it"));
    }
  }
  return out;
}

// One tensor file's part: the index's claims checked, its scale tensors
// collected (every name vLLM treats as a scale, and the q/k/v scales by
// layer).
void InspectTensorFile(const std::string& f, const SafetensorsFile& file,
                       const std::vector<std::string>& listed,
                       std::map<uint32_t, InspectedLayer>& layers,
                       std::vector<VllmScaleTensor>& scale_tensors,
                       InspectReport& report) {
  for (const std::string& name : listed) {
    if (file.Find(name) == nullptr) {
      report.errors.push_back(absl::StrCat("the index puts '", name, "' in ", f,
                                           ", which does not hold it"));
    }
  }
  report.tensor_count += file.tensors().size();
  for (const TensorInfo& t : file.tensors()) {
    if (IsVllmScaleName(t.name)) {
      scale_tensors.push_back(
          {t.name, t.shape, file.ReadFloats(t).value_or(std::vector<float>{})});
    }
    std::optional<CheckpointScale> parsed = ParseCheckpointScaleName(t.name);
    if (!parsed) continue;
    InspectedLayer& layer = layers[parsed->layer];
    layer.layer = parsed->layer;
    InspectedScale& scale = layer.roles[RoleIndex(parsed->role)];
    scale.tensor = t.name;
    scale.file = f;
    scale.shape = t.shape;
    std::optional<std::vector<float>> values = file.ReadFloats(t);
    if (!values) {
      report.errors.push_back(absl::StrCat(t.name, " has dtype ", t.dtype,
                                           "; scales must be F32/F16/BF16"));
      continue;
    }
    scale.values = *std::move(values);
  }
}

// What vLLM itself will do with the scales, as errors and warnings.
void AddVllmPrediction(const Json& config, const ModelGeometry& g,
                       const std::vector<VllmScaleTensor>& scale_tensors,
                       const VllmLoadOptions& vllm, InspectReport& report) {
  report.vllm_options = vllm;
  report.vllm = PredictVllmLoad(config, g, scale_tensors, vllm);
  if (!report.vllm.modelled) {
    report.errors.push_back(
        absl::StrCat("quantization_config.quant_method '", report.quant_method,
                     "': kvcal cannot predict what vLLM ", kVllmVersion,
                     " does with these scales"));
  }
  for (const std::string& r : report.vllm.refusals) {
    report.errors.push_back(
        absl::StrCat("vLLM ", kVllmVersion, " will not start: ", r));
  }
  for (const std::string& r : report.vllm.silent) {
    report.errors.push_back(absl::StrCat("vLLM ", kVllmVersion, ": ", r));
  }
  for (const std::string& n : report.vllm.notes) report.warnings.push_back(n);
}

// Staged files or a journal in the staging directory, or a lock file that
// still names its (dead) holder: nullopt when there are none, else the
// holder the lock file names ("" when it names none).
std::optional<std::string> InterruptedPatchLeft(const fs::path& dir) {
  std::error_code ec;
  const fs::path staging = dir / kPatchStagingDir;
  if (!fs::is_directory(staging, ec)) return std::nullopt;
  bool left = false;
  std::string holder;
  for (const fs::directory_entry& e : fs::directory_iterator(staging, ec)) {
    if (e.path().filename() != kCheckpointLockName) {
      left = true;
      continue;
    }
    absl::StatusOr<std::string> line = ReadSmallFile(e.path().string());
    if (line.ok() && !line->empty()) {
      left = true;
      holder = ParseLockHolder(*line).Describe();
    }
  }
  if (!left) return std::nullopt;
  return holder;
}

}  // namespace

absl::StatusOr<InspectReport> InspectCheckpoint(
    const std::string& dir_name, const VllmLoadOptions& vllm,
    const std::function<void(uint64_t, uint64_t, uint64_t)>& on_shard) {
  const fs::path dir(dir_name);
  InspectReport report;
  report.checkpoint_dir = dir_name;
  // A writer at work (its lock held: a non-blocking probe), or what one
  // that died left behind (staged files, a journal, its name in the lock).
  absl::StatusOr<std::optional<std::string>> writer = PatchInProgress(dir_name);
  if (!writer.ok()) {
    report.errors.push_back(std::string(writer.status().message()));
  } else if (*writer) {
    report.errors.push_back(absl::StrCat(
        "a kvcal patch is in progress: ", **writer,
        "; what follows may change when it finishes: inspect again then"));
  } else if (std::optional<std::string> holder = InterruptedPatchLeft(dir)) {
    report.errors.push_back(absl::StrCat(
        "an interrupted kvcal patch left ", kPatchStagingDir, "/",
        holder->empty() ? ""
                        : absl::StrCat(" (its holder, ", *holder, ", is gone)"),
        "; run `kvcal patch` again to complete or discard it"));
  }
  KVCAL_ASSIGN_OR_RETURN(Json config, ReadConfig(dir, report));
  KVCAL_ASSIGN_OR_RETURN(ModelGeometry g, ModelGeometryFromConfig(config));
  KVCAL_ASSIGN_OR_RETURN(TensorFiles files, ListTensorFiles(dir, report));

  std::map<uint32_t, InspectedLayer> layers;
  std::vector<VllmScaleTensor> scale_tensors;
  uint64_t files_done = 0;
  uint64_t bytes_done = 0;
  for (const std::string& f : files.files) {
    auto file = SafetensorsFile::Open((dir / f).string());
    ++files_done;
    if (file.ok()) {
      bytes_done += file->file_size();
    } else {
      report.errors.push_back(std::string(file.status().message()));
    }
    if (on_shard) on_shard(files_done, files.files.size(), bytes_done);
    if (!file.ok()) continue;
    InspectTensorFile(f, *file, files.listed[f], layers, scale_tensors, report);
  }
  if (layers.empty()) {
    report.errors.push_back(
        "no q/k/v scales found: vLLM would use 1.0 for every scale");
  }
  AddVllmPrediction(config, g, scale_tensors, vllm, report);
  for (auto& [l, layer] : layers) report.layers.push_back(layer);
  return report;
}

Json InspectReport::ToJson() const {
  Json out = {{"checkpoint", checkpoint_dir},  {"sharded", sharded},
              {"tensors", tensor_count},       {"quant_method", quant_method},
              {"kv_cache_strategy", strategy}, {"ok", ok()}};
  Json rows = Json::array();
  for (const InspectedLayer& layer : layers) {
    Json row = {{"layer", layer.layer}};
    for (Role role : kAllRoles) {
      const InspectedScale& s = layer.roles[RoleIndex(role)];
      const std::string key(1, RoleLetter(role));
      if (s.tensor.empty()) {
        row[key] = nullptr;
      } else {
        row[key] = {{"tensor", s.tensor},
                    {"file", s.file},
                    {"shape", s.shape},
                    {"values", s.values}};
      }
    }
    rows.push_back(std::move(row));
  }
  out["layers"] = std::move(rows);
  Json vllm_json = vllm.ToJson();
  vllm_json["platform"] = std::string(VllmPlatformName(vllm_options.platform));
  vllm_json["kv_cache_dtype_flag"] = vllm_options.kv_cache_dtype;
  out["vllm"] = std::move(vllm_json);
  out["errors"] = errors;
  out["warnings"] = warnings;
  return out;
}

std::string InspectReport::ToText() const {
  return FindingsText() + ErrorsText();
}

std::string InspectReport::ErrorsText() const {
  std::string out;
  for (const std::string& e : errors) absl::StrAppend(&out, "error: ", e, "\n");
  if (!ok()) absl::StrAppend(&out, "FAILED\n");
  return out;
}

std::string InspectReport::FindingsText() const {
  std::string out = absl::StrCat(
      checkpoint_dir, ": ", sharded ? "sharded" : "single file", ", ",
      tensor_count, " tensors, quantization_config ",
      quant_method.empty() ? "none" : quant_method,
      strategy.empty() ? "" : absl::StrCat(", kv_cache_scheme ", strategy),
      "\n");
  absl::StrAppend(
      &out, "vLLM ", kVllmVersion, " (",
      VllmPlatformName(vllm_options.platform), ", --kv-cache-dtype ",
      vllm_options.kv_cache_dtype, "): ", vllm.method, ", KV cache ",
      vllm.kv_cache_dtype, vllm.per_head ? ", per-head scales" : "",
      vllm.backends.empty() ? "" : absl::StrCat("; starts on ", vllm.backends),
      "\n");
  absl::StrAppend(&out,
                  "layer  q_scale vLLM uses        k_scale vLLM uses        "
                  "v_scale vLLM uses\n");
  for (const auto& [layer, roles] : vllm.layers) {
    absl::StrAppend(&out, absl::StrFormat("%5u", layer));
    for (int r = 0; r < 3; ++r) {
      const VllmRoleOutcome& o = roles[r];
      std::string cell;
      if (!o.effective.empty()) {
        float lo = o.effective[0], hi = o.effective[0];
        for (float v : o.effective) {
          lo = std::min(lo, v);
          hi = std::max(hi, v);
        }
        cell = o.effective.size() == 1
                   ? absl::StrFormat("%.4g", lo)
                   : absl::StrFormat("%.3g..%.3g x%zu", lo, hi,
                                     o.effective.size());
        if (o.fate != "used") absl::StrAppend(&cell, " (", o.fate, ")");
      } else {
        cell = o.fate.empty() ? "-" : o.fate;
      }
      absl::StrAppend(&out, absl::StrFormat("  %-23s", cell));
    }
    absl::StrAppend(&out, "\n");
  }
  for (const std::string& w : warnings)
    absl::StrAppend(&out, "warning: ", w, "\n");
  if (ok()) absl::StrAppend(&out, "OK\n");
  return out;
}

}  // namespace kvcal
