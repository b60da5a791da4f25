#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "client/checkpoint/checkpoint_inspect.h"
#include "client/checkpoint/checkpoint_patcher.h"
#include "client/checkpoint/demo_model.h"
#include "client/checkpoint/safetensors.h"
#include "client/checkpoint/scales_file.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/client/test_scales.h"
#include "tests/client/test_util.h"

namespace kvcal {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;
using ::kvcal::testing::ReadFile;
using ::kvcal::testing::Snapshot;
using ::kvcal::testing::StatusIs;
using ::kvcal::testing::TempDir;
using ::kvcal::testing::WriteFile;
using ::testing::HasSubstr;

DemoModelOptions SmallModel(bool sharded) {
  DemoModelOptions o;
  o.geometry = {.num_layers = 3,
                .num_attention_heads = 4,
                .num_key_value_heads = 2,
                .head_dim = 8};
  o.intermediate_size = 16;
  o.vocab_size = 32;
  o.sharded = sharded;
  return o;
}

CalibratedScales MakeScales(const DemoModelOptions& m, Granularity granularity,
                            float base) {
  return ::kvcal::testing::MakeScales(m, granularity, base, "mse", "test");
}

Json ReadJson(const std::string& path) { return Json::parse(ReadFile(path)); }

// Every original tensor of `source` is in `patched`, byte for byte, with the
// same dtype and shape; returns how many were compared.
size_t ExpectOriginalTensorsIdentical(
    const std::string& source, const std::string& patched,
    const std::set<std::string>& except = {}) {
  auto load = [](const std::string& dir) {
    std::map<std::string, std::pair<std::string, std::string>>
        tensors;  // name -> (file, bytes)
    std::vector<std::string> files;
    if (fs::exists(fs::path(dir) / kIndexName)) {
      Json index = ReadJson((fs::path(dir) / kIndexName).string());
      std::set<std::string> seen;
      for (const auto& [name, file] : index["weight_map"].items()) {
        if (seen.insert(file.get<std::string>()).second) {
          files.push_back(file.get<std::string>());
        }
      }
      // Everything the index lists must resolve.
      for (const auto& [name, file] : index["weight_map"].items()) {
        auto f = SafetensorsFile::Open(
            (fs::path(dir) / file.get<std::string>()).string());
        EXPECT_TRUE(f.ok()) << f.status();
        if (f.ok()) {
          EXPECT_NE(f->Find(name), nullptr) << name;
        }
      }
    } else {
      files.push_back("model.safetensors");
    }
    for (const std::string& f : files) {
      auto file = SafetensorsFile::Open((fs::path(dir) / f).string());
      EXPECT_TRUE(file.ok()) << file.status();
      if (!file.ok()) continue;
      for (const TensorInfo& t : file->tensors()) {
        auto data = file->Data(t);
        tensors[t.name] = {
            t.dtype + ShapeString(t.shape),
            std::string(reinterpret_cast<const char*>(data.data()),
                        data.size())};
      }
    }
    return tensors;
  };
  auto before = load(source);
  auto after = load(patched);
  size_t compared = 0;
  for (const auto& [name, value] : before) {
    if (except.count(name)) continue;
    auto it = after.find(name);
    EXPECT_NE(it, after.end()) << name << " missing after the patch";
    if (it == after.end()) continue;
    EXPECT_EQ(it->second.first, value.first) << name;
    EXPECT_TRUE(it->second.second == value.second) << name << " bytes differ";
    ++compared;
  }
  return compared;
}

class PatcherTest : public ::testing::Test {
 protected:
  // Writes the model into "pristine" and copies it to "model".
  void MakeModel(const DemoModelOptions& m) {
    model_ = m;
    ASSERT_TRUE(WriteDemoCheckpoint(dir_ / "pristine", m).ok());
    fs::copy(dir_ / "pristine", dir_ / "model", fs::copy_options::recursive);
  }
  std::string WriteScales(const CalibratedScales& s, const std::string& name) {
    const std::string path = dir_ / name;
    EXPECT_TRUE(WriteScalesFile(path, s).ok());
    return path;
  }
  PatchOptions Options(const std::string& scales) {
    PatchOptions options;
    options.checkpoint_dir = dir_ / "model";
    options.scales_path = scales;
    return options;
  }

  TempDir dir_;
  DemoModelOptions model_;
};

TEST_F(PatcherTest, ShardedInPlaceAddsOneShardAndLeavesShardsAlone) {
  MakeModel(SmallModel(/*sharded=*/true));
  const auto before = Snapshot(dir_ / "model");
  const std::string scales = WriteScales(
      MakeScales(model_, Granularity::kPerTensor, 0.01f), "scales.safetensors");
  auto report = PatchCheckpoint(Options(scales));
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_TRUE(report->sharded);
  EXPECT_EQ(report->scale_tensors, 9u);
  const auto after = Snapshot(dir_ / "model");
  // The big shards are untouched, byte for byte.
  for (const auto& [name, bytes] : before) {
    if (name.ends_with(".safetensors")) {
      ASSERT_TRUE(after.count(name)) << name;
      EXPECT_TRUE(after.at(name) == bytes) << name << " was rewritten";
    }
  }
  EXPECT_EQ(after.size(), before.size() + 1);  // + the scales shard
  EXPECT_FALSE(fs::exists(dir_ / "model/.kvcal-patch"));

  auto shard =
      SafetensorsFile::Open(dir_ / "model/kvcal-kv-scales.safetensors");
  ASSERT_TRUE(shard.ok()) << shard.status();
  ASSERT_EQ(shard->tensors().size(), 9u);
  const TensorInfo* k = shard->Find("model.layers.2.self_attn.k_scale");
  ASSERT_NE(k, nullptr);
  EXPECT_EQ(k->shape, (std::vector<uint64_t>{1}));
  float value;
  std::memcpy(&value, shard->Data(*k).data(), 4);
  EXPECT_FLOAT_EQ(value, 0.01f * (1.0f + 2 + 0.01f));

  Json index = ReadJson(dir_ / "model/model.safetensors.index.json");
  EXPECT_EQ(index["weight_map"]["model.layers.0.self_attn.q_scale"],
            "kvcal-kv-scales.safetensors");
  Json old_index = ReadJson(dir_ / "pristine/model.safetensors.index.json");
  EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(),
            old_index["metadata"]["total_size"].get<uint64_t>() + 9 * 4);

  EXPECT_EQ(ExpectOriginalTensorsIdentical(dir_ / "pristine", dir_ / "model"),
            9u * 3 + 3);
  auto inspect = InspectCheckpoint(dir_ / "model");
  ASSERT_TRUE(inspect.ok()) << inspect.status();
  EXPECT_TRUE(inspect->ok()) << inspect->ToText();
  EXPECT_EQ(inspect->layers.size(), 3u);
}

TEST_F(PatcherTest, ConfigKeepsEveryFieldAndKeyOrder) {
  MakeModel(SmallModel(/*sharded=*/true));
  // Odd key order and extra fields the patch must not touch.
  Json config = ReadJson(dir_ / "model/config.json");
  Json reordered = {{"zeta_custom", {{"b", 1}, {"a", 2}}}};
  for (const auto& [key, value] : config.items()) reordered[key] = value;
  reordered["alpha_last"] = "keep me";
  WriteFile(dir_ / "model/config.json", reordered.dump(2));
  const std::string scales = WriteScales(
      MakeScales(model_, Granularity::kPerHead, 0.02f), "scales.safetensors");
  ASSERT_TRUE(PatchCheckpoint(Options(scales)).ok());
  Json patched = ReadJson(dir_ / "model/config.json");
  std::vector<std::string> keys_before, keys_after;
  for (const auto& [key, value] : reordered.items()) keys_before.push_back(key);
  for (const auto& [key, value] : patched.items()) {
    if (key == "quantization_config") continue;
    keys_after.push_back(key);
    EXPECT_EQ(value, reordered[key]) << key;
  }
  EXPECT_EQ(keys_after, keys_before);
  const Json& q = patched["quantization_config"];
  EXPECT_EQ(q["quant_method"], "compressed-tensors");
  EXPECT_TRUE(q["config_groups"].is_object());
  EXPECT_TRUE(q["ignore"].is_array());
  EXPECT_TRUE(q.contains("format"));
  EXPECT_TRUE(q.contains("quantization_status"));
  const Json& scheme = q["kv_cache_scheme"];
  EXPECT_EQ(scheme["num_bits"], 8);
  EXPECT_EQ(scheme["type"], "float");
  EXPECT_EQ(scheme["symmetric"], true);
  EXPECT_EQ(scheme["dynamic"], false);
  EXPECT_EQ(scheme["strategy"], "attn_head");
  EXPECT_TRUE(scheme["group_size"].is_null());
  EXPECT_TRUE(scheme["block_structure"].is_null());
  EXPECT_TRUE(scheme["actorder"].is_null());
  EXPECT_EQ(scheme["observer"], "mse");
  EXPECT_EQ(scheme["observer_kwargs"], Json::object());
}

TEST_F(PatcherTest, AlreadyCompressedTensorsModelKeepsItsConfigGroups) {
  MakeModel(SmallModel(/*sharded=*/true));
  Json config = ReadJson(dir_ / "model/config.json");
  const Json existing = Json::parse(R"({
    "quant_method": "compressed-tensors",
    "config_groups": {"group_0": {"targets": ["Linear"],
      "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}},
    "format": "float-quantized", "ignore": ["lm_head"],
    "quantization_status": "compressed", "global_compression_ratio": 1.5})");
  config["quantization_config"] = existing;
  WriteFile(dir_ / "model/config.json", config.dump(2));
  const std::string scales = WriteScales(
      MakeScales(model_, Granularity::kPerTensor, 0.02f), "scales.safetensors");
  ASSERT_TRUE(PatchCheckpoint(Options(scales)).ok());
  Json q = ReadJson(dir_ / "model/config.json")["quantization_config"];
  EXPECT_EQ(q["kv_cache_scheme"]["strategy"], "tensor");
  q.erase("kv_cache_scheme");
  EXPECT_EQ(q, existing);
}

TEST_F(PatcherTest, OutDirLeavesSourceUntouched) {
  MakeModel(SmallModel(/*sharded=*/true));
  const auto before = Snapshot(dir_ / "model");
  const std::string scales = WriteScales(
      MakeScales(model_, Granularity::kPerHead, 0.02f), "scales.safetensors");
  PatchOptions options = Options(scales);
  options.out_dir = dir_ / "out";
  auto report = PatchCheckpoint(options);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_TRUE(Snapshot(dir_ / "model") == before) << "the checkpoint changed";
  EXPECT_GT(report->tensors_verified, 0u);
  EXPECT_EQ(ExpectOriginalTensorsIdentical(dir_ / "model", dir_ / "out"), 30u);
  auto inspect = InspectCheckpoint(dir_ / "out");
  ASSERT_TRUE(inspect.ok());
  EXPECT_TRUE(inspect->ok()) << inspect->ToText();
  EXPECT_FALSE(fs::exists(dir_ / "out.kvcal-partial"));
  // A second run into the same, now non-empty, directory is refused.
  EXPECT_THAT(
      PatchCheckpoint(options).status(),
      StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("not empty")));
}

TEST_F(PatcherTest, SingleFileIsRewrittenWithScalesAdded) {
  MakeModel(SmallModel(/*sharded=*/false));
  const std::string scales = WriteScales(
      MakeScales(model_, Granularity::kPerHead, 0.03f), "scales.safetensors");
  auto report = PatchCheckpoint(Options(scales));
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_FALSE(report->sharded);
  EXPECT_EQ(report->tensors_verified, 30u);
  EXPECT_EQ(ExpectOriginalTensorsIdentical(dir_ / "pristine", dir_ / "model"),
            30u);
  auto file = SafetensorsFile::Open(dir_ / "model/model.safetensors");
  ASSERT_TRUE(file.ok());
  EXPECT_EQ(file->tensors().size(), 30u + 9u);
  EXPECT_EQ(file->metadata().at("format"), "pt");
  const TensorInfo* q = file->Find("model.layers.1.self_attn.q_scale");
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(q->shape, (std::vector<uint64_t>{4, 1, 1}));
  auto inspect = InspectCheckpoint(dir_ / "model");
  ASSERT_TRUE(inspect.ok());
  EXPECT_TRUE(inspect->ok()) << inspect->ToText();
}

// Progress covers the rewrite and the verification of a single-file model:
// the total is the file's kept tensors written plus verified plus the new
// scales, reached exactly at the end, never decreasing on the way.
TEST_F(PatcherTest, ProgressCountsEveryByteStagedAndVerified) {
  MakeModel(SmallModel(/*sharded=*/false));
  const std::string scales = WriteScales(
      MakeScales(model_, Granularity::kPerHead, 0.03f), "scales.safetensors");
  auto source = SafetensorsFile::Open(dir_ / "model/model.safetensors");
  ASSERT_TRUE(source.ok());
  uint64_t tensor_bytes = 0;
  for (const TensorInfo& t : source->tensors()) tensor_bytes += t.size();
  std::vector<std::pair<uint64_t, uint64_t>> calls;
  PatchOptions options = Options(scales);
  options.on_progress = [&](uint64_t done, uint64_t total) {
    calls.emplace_back(done, total);
  };
  auto report = PatchCheckpoint(options);
  ASSERT_TRUE(report.ok()) << report.status();
  ASSERT_GT(calls.size(), 30u);  // at least one per tensor verified
  // 3 layers of 4 q heads, 2 k and 2 v heads.
  const uint64_t scale_bytes = 3 * (4 + 2 + 2) * sizeof(float);
  EXPECT_EQ(calls.back().second, 2 * tensor_bytes + scale_bytes);
  EXPECT_EQ(calls.back().first, calls.back().second);
  for (size_t i = 1; i < calls.size(); ++i) {
    EXPECT_GE(calls[i].first, calls[i - 1].first);
    EXPECT_EQ(calls[i].second, calls[0].second);
  }
  // Inspection reports each tensor file.
  std::vector<uint64_t> files;
  auto inspect =
      InspectCheckpoint(dir_ / "model", VllmLoadOptions(),
                        [&](uint64_t done, uint64_t total, uint64_t bytes) {
                          files.push_back(done);
                          EXPECT_EQ(total, 1u);
                          EXPECT_GT(bytes, tensor_bytes);
                        });
  ASSERT_TRUE(inspect.ok());
  EXPECT_EQ(files, std::vector<uint64_t>{1});
}

TEST_F(PatcherTest, RecalibrationReplacesScalesInsideAnOriginalShard) {
  MakeModel(SmallModel(/*sharded=*/true));
  // Put old scales of layer 0 inside the first big shard, as a checkpoint
  // calibrated by another tool would have them.
  const std::string shard_name = "model-00001-of-00002.safetensors";
  {
    auto shard = SafetensorsFile::Open(dir_ / ("pristine/" + shard_name));
    ASSERT_TRUE(shard.ok());
    std::vector<TensorToWrite> tensors;
    for (const TensorInfo& t : shard->tensors()) {
      tensors.push_back({t.name, t.dtype, t.shape, shard->Data(t)});
    }
    static const float kOld[] = {7.0f};
    tensors.push_back({"model.layers.0.self_attn.k_scale",
                       "F32",
                       {1},
                       ::kvcal::testing::Bytes(kOld)});
    ASSERT_TRUE(WriteSafetensors(dir_ / "with_old.safetensors", tensors,
                                 shard->metadata())
                    .ok());
  }
  for (const char* d : {"pristine", "model"}) {
    fs::copy_file(dir_ / "with_old.safetensors",
                  dir_ / (std::string(d) + "/" + shard_name),
                  fs::copy_options::overwrite_existing);
    Json index = ReadJson(dir_ / (std::string(d) + "/" + kIndexName));
    index["weight_map"]["model.layers.0.self_attn.k_scale"] = shard_name;
    WriteFile(dir_ / (std::string(d) + "/" + kIndexName), index.dump(2));
  }
  const std::string scales = WriteScales(
      MakeScales(model_, Granularity::kPerTensor, 0.01f), "scales.safetensors");
  auto report = PatchCheckpoint(Options(scales));
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->replaced_tensors, 1u);
  EXPECT_THAT(report->files_written, ::testing::Contains(shard_name));
  EXPECT_EQ(ReadFile(dir_ / "model/model-00002-of-00002.safetensors"),
            ReadFile(dir_ / "pristine/model-00002-of-00002.safetensors"));
  auto shard = SafetensorsFile::Open(dir_ / ("model/" + shard_name));
  ASSERT_TRUE(shard.ok());
  EXPECT_EQ(shard->Find("model.layers.0.self_attn.k_scale"), nullptr);
  EXPECT_EQ(
      ExpectOriginalTensorsIdentical(dir_ / "pristine", dir_ / "model",
                                     {"model.layers.0.self_attn.k_scale"}),
      30u);
  Json index = ReadJson(dir_ / ("model/" + std::string(kIndexName)));
  EXPECT_EQ(index["weight_map"]["model.layers.0.self_attn.k_scale"],
            kScalesShardName);
  auto inspect = InspectCheckpoint(dir_ / "model");
  ASSERT_TRUE(inspect.ok());
  EXPECT_TRUE(inspect->ok()) << inspect->ToText();

  // Calibrating again over our own scales shard replaces it, per head now.
  const std::string scales2 = WriteScales(
      MakeScales(model_, Granularity::kPerHead, 0.5f), "scales2.safetensors");
  ASSERT_TRUE(PatchCheckpoint(Options(scales2)).ok());
  auto ours = SafetensorsFile::Open(dir_ / "model/kvcal-kv-scales.safetensors");
  ASSERT_TRUE(ours.ok());
  EXPECT_EQ(ours->tensors().size(), 9u);
  EXPECT_EQ(ours->Find("model.layers.0.self_attn.q_scale")->shape,
            (std::vector<uint64_t>{4, 1, 1}));
  inspect = InspectCheckpoint(dir_ / "model");
  ASSERT_TRUE(inspect.ok());
  EXPECT_TRUE(inspect->ok()) << inspect->ToText();
  EXPECT_EQ(ReadJson(dir_ / "model/config.json")["quantization_config"]
                                                ["kv_cache_scheme"]["strategy"],
            "attn_head");
}

TEST_F(PatcherTest, ModelOptTargetNamesAndConfig) {
  MakeModel(SmallModel(/*sharded=*/true));
  const std::string scales = WriteScales(
      MakeScales(model_, Granularity::kPerTensor, 0.01f), "scales.safetensors");
  PatchOptions options = Options(scales);
  options.target = PatchTarget::kModelOpt;
  // Without a ModelOpt quantization_config: refused, nothing changed.
  const auto before = Snapshot(dir_ / "model");
  EXPECT_THAT(
      PatchCheckpoint(options).status(),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("modelopt")));
  EXPECT_TRUE(Snapshot(dir_ / "model") == before) << "the checkpoint changed";

  Json config = ReadJson(dir_ / "model/config.json");
  config["quantization_config"] = {{"quant_method", "modelopt"},
                                   {"quant_algo", "FP8"}};
  WriteFile(dir_ / "model/config.json", config.dump(2));
  ASSERT_TRUE(PatchCheckpoint(options).ok());
  auto shard =
      SafetensorsFile::Open(dir_ / "model/kvcal-kv-scales.safetensors");
  ASSERT_TRUE(shard.ok());
  EXPECT_EQ(shard->tensors().size(), 9u);
  // ModelOpt's names for k and v; q under the name vLLM's common mapper
  // loads (base_config.py QuantizationConfig.get_cache_scale_mapper). All
  // scalars (kv_cache.py KVCacheScaleParameter.weight_loader).
  for (const char* name : {"model.layers.1.self_attn.k_proj.k_scale",
                           "model.layers.1.self_attn.v_proj.v_scale",
                           "model.layers.1.self_attn.q_scale"}) {
    const TensorInfo* t = shard->Find(name);
    ASSERT_NE(t, nullptr) << name;
    EXPECT_TRUE(t->shape.empty()) << name;
  }
  // The flat config.json form: modelopt.py from_config reads the KV method
  // from a kv_cache_scheme dict only, and the dtype resolver
  // (torch_utils.py get_kv_cache_quant_algo_string) makes it an fp8 cache.
  Json q = ReadJson(dir_ / "model/config.json")["quantization_config"];
  EXPECT_EQ(q["kv_cache_scheme"]["type"], "float");
  EXPECT_EQ(q["kv_cache_scheme"]["num_bits"], 8);
  EXPECT_EQ(q["kv_cache_scheme"]["dynamic"], false);
  EXPECT_EQ(q["quant_algo"], "FP8");
  auto inspect = InspectCheckpoint(dir_ / "model");
  ASSERT_TRUE(inspect.ok());
  EXPECT_TRUE(inspect->ok()) << inspect->ToText();
}

TEST_F(PatcherTest, QuarkTargetNamesAndConfig) {
  MakeModel(SmallModel(/*sharded=*/false));
  Json config = ReadJson(dir_ / "model/config.json");
  const Json global = {{"weight", {{"dtype", "fp8_e4m3"}}},
                       {"input_tensors", {{"dtype", "fp8_e4m3"}}},
                       {"output_tensors", nullptr}};
  config["quantization_config"] = {
      {"quant_method", "quark"},
      {"global_quant_config", global},
      {"layer_quant_config", Json::object()},
      {"export",
       {{"kv_cache_group", Json::array()}, {"pack_method", "reorder"}}}};
  WriteFile(dir_ / "model/config.json", config.dump(2));
  const std::string scales = WriteScales(
      MakeScales(model_, Granularity::kPerTensor, 0.01f), "scales.safetensors");
  PatchOptions options = Options(scales);
  options.target = PatchTarget::kQuark;
  ASSERT_TRUE(PatchCheckpoint(options).ok());
  auto file = SafetensorsFile::Open(dir_ / "model/model.safetensors");
  ASSERT_TRUE(file.ok());
  for (const char* r : {"q", "k", "v"}) {
    EXPECT_NE(file->Find(std::string("model.layers.2.self_attn.") + r +
                         "_proj.output_scale"),
              nullptr);
  }
  // quark.py QuarkConfig.from_config reads export.kv_cache_group and takes
  // the scheme from the layer_quant_config entries it matches
  // (QuarkKVCacheMethod.validate_kv_cache_config: fp8_e4m3, per_tensor); a
  // new entry copies the global config so the layers' weights stay as they
  // were.
  Json q = ReadJson(dir_ / "model/config.json")["quantization_config"];
  EXPECT_EQ(q["export"]["kv_cache_group"], Json({"*k_proj", "*v_proj"}));
  EXPECT_EQ(q["export"]["pack_method"], "reorder");
  EXPECT_FALSE(q.contains("kv_cache_group"));
  for (const char* p : {"*k_proj", "*v_proj"}) {
    const Json& entry = q["layer_quant_config"][p];
    EXPECT_EQ(entry["weight"], global["weight"]) << p;
    EXPECT_EQ(entry["input_tensors"], global["input_tensors"]) << p;
    EXPECT_EQ(entry["output_tensors"]["dtype"], "fp8_e4m3") << p;
    EXPECT_EQ(entry["output_tensors"]["qscheme"], "per_tensor") << p;
  }
  EXPECT_EQ(q["global_quant_config"], global);
  // Nothing in vLLM switches a Quark model's cache to fp8: with the default
  // --kv-cache-dtype auto the scales are ignored, and inspect says so.
  auto by_default = InspectCheckpoint(dir_ / "model");
  ASSERT_TRUE(by_default.ok());
  EXPECT_FALSE(by_default->ok());
  EXPECT_THAT(by_default->errors,
              ::testing::Contains(HasSubstr("--kv-cache-dtype fp8")));
  VllmLoadOptions fp8;
  fp8.kv_cache_dtype = "fp8";
  auto inspect = InspectCheckpoint(dir_ / "model", fp8);
  ASSERT_TRUE(inspect.ok());
  EXPECT_TRUE(inspect->ok()) << inspect->ToText();
}

TEST_F(PatcherTest, PerHeadScalesAreRefusedForPerTensorTargets) {
  MakeModel(SmallModel(/*sharded=*/true));
  const std::string scales = WriteScales(
      MakeScales(model_, Granularity::kPerHead, 0.01f), "scales.safetensors");
  PatchOptions options = Options(scales);
  options.target = PatchTarget::kQuark;
  EXPECT_THAT(PatchCheckpoint(options).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("only per-tensor")));
}

TEST_F(PatcherTest, MalformedInputsFailAndChangeNothing) {
  MakeModel(SmallModel(/*sharded=*/true));
  const std::string scales = WriteScales(
      MakeScales(model_, Granularity::kPerTensor, 0.01f), "scales.safetensors");
  struct Case {
    const char* what;
    std::function<void()> corrupt;
    absl::StatusCode code;
    const char* message;
  };
  const std::string shard = dir_ / "model/model-00002-of-00002.safetensors";
  const std::vector<Case> cases = {
      {"truncated shard",
       [&] { WriteFile(shard, ReadFile(shard).substr(0, 5)); },
       absl::StatusCode::kInvalidArgument, "truncated"},
      {"header length beyond file",
       [&] {
         std::string b = ReadFile(shard);
         b[6] = '\x7f';
         WriteFile(shard, b);
       },
       absl::StatusCode::kInvalidArgument, "runs past the end"},
      {"header not json",
       [&] {
         std::string b = ReadFile(shard);
         b[8] = '#';
         WriteFile(shard, b);
       },
       absl::StatusCode::kInvalidArgument, "not a JSON object"},
      {"shard data cut short",
       [&] {
         std::string b = ReadFile(shard);
         WriteFile(shard, b.substr(0, b.size() - 2));
       },
       absl::StatusCode::kInvalidArgument, "out of range"},
      {"config without head counts",
       [&] {
         Json c = ReadJson(dir_ / "model/config.json");
         c.erase("num_attention_heads");
         WriteFile(dir_ / "model/config.json", c.dump());
       },
       absl::StatusCode::kInvalidArgument, "num_attention_heads"},
      {"config not json", [&] { WriteFile(dir_ / "model/config.json", "{"); },
       absl::StatusCode::kInvalidArgument, "not a JSON object"},
      {"index names a missing tensor",
       [&] {
         Json index = ReadJson(dir_ / "model/model.safetensors.index.json");
         index["weight_map"]["ghost"] = "model-00001-of-00002.safetensors";
         WriteFile(dir_ / "model/model.safetensors.index.json", index.dump());
       },
       absl::StatusCode::kInvalidArgument, "does not hold it"},
      {"index names a file outside the checkpoint",
       [&] {
         Json index = ReadJson(dir_ / "model/model.safetensors.index.json");
         index["weight_map"]["model.norm.weight"] =
             "../pristine/model-00002-of-00002.safetensors";
         WriteFile(dir_ / "model/model.safetensors.index.json", index.dump());
       },
       absl::StatusCode::kInvalidArgument, "not a plain file name"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    fs::remove_all(dir_ / "model");
    fs::copy(dir_ / "pristine", dir_ / "model", fs::copy_options::recursive);
    c.corrupt();
    const auto before = Snapshot(dir_ / "model");
    EXPECT_THAT(PatchCheckpoint(Options(scales)).status(),
                StatusIs(c.code, HasSubstr(c.message)));
    EXPECT_TRUE(Snapshot(dir_ / "model") == before) << "the checkpoint changed";
    EXPECT_FALSE(fs::exists(dir_ / "model/.kvcal-patch"));
  }
  // Scales that do not fit the model.
  fs::remove_all(dir_ / "model");
  fs::copy(dir_ / "pristine", dir_ / "model", fs::copy_options::recursive);
  DemoModelOptions wider = model_;
  wider.geometry.num_key_value_heads = 4;
  const std::string bad = WriteScales(
      MakeScales(wider, Granularity::kPerHead, 0.01f), "bad.safetensors");
  EXPECT_THAT(PatchCheckpoint(Options(bad)).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("per-head scales but config.json gives 2")));
}

// Names of the files that differ between two snapshots.
std::string DifferingFiles(const std::map<std::string, std::string>& a,
                           const std::map<std::string, std::string>& b) {
  std::string out;
  for (const auto& [name, bytes] : a) {
    auto it = b.find(name);
    if (it == b.end() || it->second != bytes) out += name + " ";
  }
  for (const auto& [name, bytes] : b) {
    if (!a.count(name)) out += name + "(missing) ";
  }
  return out;
}

// Runs the patch in a child process that kills itself at step `step`.
// Returns true when the child finished (the step is past the last one).
bool PatchInChildCrashingAt(int step, const PatchOptions& options) {
  const pid_t pid = fork();
  if (pid == 0) {
    PatchOptions crashing = options;
    crashing.on_step = [step](int at) {
      if (at == step) ::raise(SIGKILL);
    };
    _exit(PatchCheckpoint(crashing).ok() ? 0 : 3);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  if (WIFEXITED(status)) {
    EXPECT_EQ(WEXITSTATUS(status), 0) << "patch failed at step " << step;
    return true;
  }
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  return false;
}

class FaultInjectionTest : public PatcherTest,
                           public ::testing::WithParamInterface<bool> {};

TEST_P(FaultInjectionTest, KillAtEveryStepLeavesLoadableCheckpoint) {
  const bool sharded = GetParam();
  MakeModel(SmallModel(sharded));
  const std::string scales = WriteScales(
      MakeScales(model_, Granularity::kPerHead, 0.01f), "scales.safetensors");
  // The reference: one uninterrupted patch.
  fs::copy(dir_ / "pristine", dir_ / "reference", fs::copy_options::recursive);
  PatchOptions reference_options = Options(scales);
  reference_options.checkpoint_dir = dir_ / "reference";
  ASSERT_TRUE(PatchCheckpoint(reference_options).ok());
  const auto reference = Snapshot(dir_ / "reference");
  const auto pristine = Snapshot(dir_ / "pristine");

  int crashes = 0;
  for (int step = 1; step < 50; ++step) {
    SCOPED_TRACE(::testing::Message() << "crash at step " << step);
    fs::remove_all(dir_ / "model");
    fs::copy(dir_ / "pristine", dir_ / "model", fs::copy_options::recursive);
    if (PatchInChildCrashingAt(step, Options(scales))) break;
    ++crashes;
    const bool committed = fs::exists(dir_ / "model/.kvcal-patch/COMMIT");
    // Whatever the step, inspect names the interrupted patch first.
    if (fs::exists(dir_ / "model/.kvcal-patch")) {
      auto inspect = InspectCheckpoint(dir_ / "model");
      ASSERT_TRUE(inspect.ok()) << inspect.status();
      ASSERT_FALSE(inspect->errors.empty());
      EXPECT_THAT(inspect->errors[0], HasSubstr("interrupted kvcal patch"));
    }
    // Loadable right after the kill: every file the index names parses and
    // holds its tensors; every original tensor is there, byte for byte.
    ExpectOriginalTensorsIdentical(dir_ / "pristine", dir_ / "model");
    // Before the commit point the checkpoint is unchanged; after the last
    // rename it is the finished patch.
    const auto state = Snapshot(dir_ / "model");
    if (!committed) {
      EXPECT_TRUE(state == pristine || state == reference)
          << "differs from both: " << DifferingFiles(state, pristine);
    }
    // Recovery rolls forward a committed patch and discards the rest.
    auto recovered = RecoverInterruptedPatch(dir_ / "model");
    ASSERT_TRUE(recovered.ok()) << recovered.status();
    EXPECT_FALSE(fs::exists(dir_ / "model/.kvcal-patch"));
    const auto after = Snapshot(dir_ / "model");
    if (committed) {
      EXPECT_TRUE(after == reference) << DifferingFiles(after, reference);
    } else {
      EXPECT_TRUE(after == state) << DifferingFiles(after, state);
    }
  }
  EXPECT_GE(crashes, sharded ? 8 : 7);
}

INSTANTIATE_TEST_SUITE_P(ShardedAndSingleFile, FaultInjectionTest,
                         ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& param) {
                           return param.param ? "Sharded" : "SingleFile";
                         });

TEST_F(PatcherTest, CorruptJournalIsAClearErrorNotACrash) {
  MakeModel(SmallModel(/*sharded=*/true));
  const std::string scales = WriteScales(
      MakeScales(model_, Granularity::kPerTensor, 0.01f), "scales.safetensors");
  fs::create_directories(dir_ / "model/.kvcal-patch");
  for (const std::string& journal :
       {std::string("not json"), std::string("{\"renames\": [1, 2]}"),
        std::string("{\"renames\": [\"../../etc/passwd\"]}"),
        std::string("{\"renames\": []}"), std::string("[]")}) {
    SCOPED_TRACE(journal);
    WriteFile(dir_ / "model/.kvcal-patch/COMMIT", journal);
    const auto before = Snapshot(dir_ / "model", "\x01");
    EXPECT_THAT(RecoverInterruptedPatch(dir_ / "model").status(),
                StatusIs(absl::StatusCode::kDataLoss, HasSubstr("journal")));
    EXPECT_THAT(PatchCheckpoint(Options(scales)).status(),
                StatusIs(absl::StatusCode::kDataLoss, HasSubstr("journal")));
    EXPECT_TRUE(Snapshot(dir_ / "model", "\x01") == before);
  }
}

TEST_F(PatcherTest, InspectFlagsMissingAndBadScales) {
  MakeModel(SmallModel(/*sharded=*/false));
  auto plain = InspectCheckpoint(dir_ / "model");
  ASSERT_TRUE(plain.ok());
  EXPECT_FALSE(plain->ok());
  EXPECT_THAT(plain->errors, ::testing::Contains(HasSubstr("no q/k/v scales")));

  CalibratedScales s = MakeScales(model_, Granularity::kPerTensor, 0.01f);
  s.layers[1][RoleIndex(Role::kQ)].clear();
  ASSERT_TRUE(PatchCheckpoint(Options(WriteScales(s, "s.safetensors"))).ok());
  auto report = InspectCheckpoint(dir_ / "model");
  ASSERT_TRUE(report.ok());
  // compressed-tensors keeps 1.0 for a missing q without a word
  // (CompressedTensorsKVCacheMethod.create_weights/process_weights_after_
  // loading): inspect fails on it.
  EXPECT_FALSE(report->ok()) << report->ToText();
  EXPECT_THAT(report->errors,
              ::testing::Contains(HasSubstr("layer 1 has no q_scale")));
  EXPECT_EQ(report->vllm.layers.at(1)[0].fate, "missing: 1.0");
  EXPECT_EQ(report->vllm.layers.at(0)[0].fate, "used");

  // A zero scale written by someone else is an error.
  auto file = SafetensorsFile::Open(dir_ / "model/model.safetensors");
  ASSERT_TRUE(file.ok());
  std::vector<TensorToWrite> tensors;
  static const float kZero[] = {0.0f};
  for (const TensorInfo& t : file->tensors()) {
    if (t.name == "model.layers.0.self_attn.v_scale") {
      tensors.push_back(
          {t.name, t.dtype, t.shape, ::kvcal::testing::Bytes(kZero)});
    } else {
      tensors.push_back({t.name, t.dtype, t.shape, file->Data(t)});
    }
  }
  ASSERT_TRUE(WriteSafetensors(dir_ / "zero.safetensors", tensors, {}).ok());
  fs::rename(dir_ / "zero.safetensors", dir_ / "model/model.safetensors");
  report = InspectCheckpoint(dir_ / "model");
  ASSERT_TRUE(report.ok());
  EXPECT_FALSE(report->ok());
  EXPECT_THAT(report->errors,
              ::testing::Contains(HasSubstr("v_scale holds [0]")));
}

}  // namespace
}  // namespace kvcal
