// Conformance of what `kvcal patch` writes with what vLLM 0.34.0 loads, per
// target x granularity x format, and the loader rules themselves
// (client/checkpoint/vllm_rules.h) on hand-made checkpoints. Each expectation
// cites the vLLM file and function it comes from (paths inside the `vllm/`
// package of the 0.34.0 sdist; docs/formats.md "What vLLM 0.34.0 does with
// them").
//
// The expected names, shapes and config fields below are written out by
// hand from vLLM's source, not taken from kvcal's code, so a patcher that
// drifts from vLLM fails here. tests/python/test_vllm_own_code.py runs vLLM's
// own parser and mapper on the same outputs where vLLM imports.
#include <cstdio>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "client/checkpoint/checkpoint_inspect.h"
#include "client/checkpoint/checkpoint_patcher.h"
#include "client/checkpoint/demo_model.h"
#include "client/checkpoint/safetensors.h"
#include "client/checkpoint/scales_file.h"
#include "client/checkpoint/vllm_rules.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
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
using ::testing::Contains;
using ::testing::HasSubstr;

constexpr uint32_t kLayers = 3, kHeads = 8, kKvHeads = 2;
constexpr const char* kRoles[] = {"q", "k", "v"};

DemoModelOptions Model() {
  DemoModelOptions o;
  o.geometry = {.num_layers = kLayers,
                .num_attention_heads = kHeads,
                .num_key_value_heads = kKvHeads,
                .head_dim = 8};
  o.intermediate_size = 16;
  o.vocab_size = 32;
  o.sharded = true;
  return o;
}

// Distinct, irregular values so that a reduction over the wrong heads, a
// swapped role or a lost layer shows.
CalibratedScales Scales(Granularity granularity, const std::string& format,
                        bool q_per_kv_group = false) {
  CalibratedScales s;
  s.granularity = granularity;
  s.observer = "static_minmax";
  s.metadata["format"] = format;
  for (uint32_t l = 0; l < kLayers; ++l) {
    for (int r = 0; r < 3; ++r) {
      uint32_t n = 1;
      if (granularity == Granularity::kPerHead) {
        n = r == 0 ? (q_per_kv_group ? kKvHeads : kHeads) : kKvHeads;
      }
      for (uint32_t h = 0; h < n; ++h) {
        s.layers[l][r].push_back(0.01f * (1 + l) + 0.003f * r +
                                 0.0007f * ((h * 5) % 7));
      }
    }
  }
  return s;
}

// The quantization_config of a model already quantized with each tool.
Json ExistingQuantizationConfig(PatchTarget target) {
  switch (target) {
    case PatchTarget::kCompressedTensors:
      return nullptr;  // a plain model
    case PatchTarget::kModelOpt:
      return {{"quant_method", "modelopt"},
              {"quant_algo", "FP8"},
              {"ignore", {"lm_head"}},
              {"producer", {{"name", "modelopt"}, {"version", "0.37.0"}}}};
    case PatchTarget::kQuark:
      return {{"quant_method", "quark"},
              {"global_quant_config",
               {{"weight", {{"dtype", "fp8_e4m3"}, {"qscheme", "per_tensor"}}},
                {"input_tensors",
                 {{"dtype", "fp8_e4m3"}, {"qscheme", "per_tensor"}}},
                {"output_tensors", nullptr}}},
              {"layer_quant_config", Json::object()},
              {"exclude", {"lm_head"}},
              {"export",
               {{"kv_cache_group", Json::array()},
                {"pack_method", "reorder"},
                {"weight_format", "real_quantized"}}}};
  }
  return nullptr;
}

// The checkpoint names vLLM 0.34 loads into self_attn.attn.{q,k,v}_scale
// for each target (base_config.py QuantizationConfig.get_cache_scale_mapper;
// quark.py QuarkConfig.get_cache_scale_mapper), written out by hand.
std::string ExpectedName(PatchTarget target, uint32_t layer, int role) {
  const std::string base =
      "model.layers." + std::to_string(layer) + ".self_attn.";
  const std::string r = kRoles[role];
  switch (target) {
    case PatchTarget::kCompressedTensors:
      return base + r + "_scale";
    case PatchTarget::kModelOpt:
      return role == 0 ? base + "q_scale" : base + r + "_proj." + r + "_scale";
    case PatchTarget::kQuark:
      return base + r + "_proj.output_scale";
  }
  return "";
}

std::vector<float> ReduceQPerGroup(const std::vector<float>& q) {
  std::vector<float> out;
  const uint32_t group = kHeads / kKvHeads;
  for (size_t i = 0; i < q.size(); i += group) {
    float m = q[i];
    for (uint32_t j = 1; j < group; ++j) m = std::max(m, q[i + j]);
    out.push_back(m);
  }
  return out;
}

// Every tensor of a (sharded) checkpoint, by name.
std::map<std::string, std::pair<TensorInfo, std::vector<float>>> Tensors(
    const std::string& dir) {
  std::map<std::string, std::pair<TensorInfo, std::vector<float>>> out;
  const Json index =
      Json::parse(ReadFile((fs::path(dir) / kIndexName).string()));
  std::set<std::string> files;
  for (const auto& [name, file] : index["weight_map"].items()) {
    files.insert(file.get<std::string>());
  }
  for (const std::string& f : files) {
    auto file = SafetensorsFile::Open((fs::path(dir) / f).string());
    EXPECT_TRUE(file.ok()) << file.status();
    if (!file.ok()) continue;
    for (const TensorInfo& t : file->tensors()) {
      out[t.name] = {t, file->ReadFloats(t).value_or(std::vector<float>{})};
    }
  }
  return out;
}

std::string PatchTargetFlag(PatchTarget t) {
  return std::string(PatchTargetName(t));
}

// `kvcal inspect --json` as a user runs it.
Json InspectJson(const std::string& dir, const std::string& extra,
                 int* exit_code) {
  const std::string cmd = std::string(KVCAL_CLI_PATH) + " inspect --json " +
                          extra + " " + dir + " 2>/dev/null";
  FILE* pipe = ::popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  size_t n;
  while (pipe != nullptr && (n = std::fread(buf, 1, sizeof buf, pipe)) > 0) {
    out.append(buf, n);
  }
  const int status = pipe == nullptr ? -1 : ::pclose(pipe);
  *exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return Json::parse(out, nullptr, false);
}

using Case = std::tuple<PatchTarget, Granularity, std::string>;

class TargetConformanceTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    std::tie(target_, granularity_, format_) = GetParam();
    ASSERT_TRUE(WriteDemoCheckpoint(dir_ / "model", Model()).ok());
    const Json existing = ExistingQuantizationConfig(target_);
    if (!existing.is_null()) {
      Json config = Json::parse(ReadFile(dir_ / "model/config.json"));
      config["quantization_config"] = existing;
      WriteFile(dir_ / "model/config.json", config.dump(2));
    }
    scales_ = Scales(granularity_, format_);
    ASSERT_TRUE(WriteScalesFile(dir_ / "scales.safetensors", scales_).ok());
  }
  absl::StatusOr<PatchReport> Patch() {
    return PatchCheckpoint({.checkpoint_dir = dir_ / "model",
                            .scales_path = dir_ / "scales.safetensors",
                            .out_dir = dir_ / "out",
                            .target = target_,
                            .on_step = {},
                            .on_progress = {},
                            .lock_timeout = {},
                            .on_lock_wait = {},
                            .lock = nullptr});
  }
  // What vLLM can load at all (the patcher refuses everything else).
  bool Loadable() const {
    return format_ == "float8_e4m3fn" &&
           (granularity_ == Granularity::kPerTensor ||
            target_ == PatchTarget::kCompressedTensors);
  }

  TempDir dir_;
  PatchTarget target_;
  Granularity granularity_;
  std::string format_;
  CalibratedScales scales_;
};

TEST_P(TargetConformanceTest, WritesWhatVllmLoadsOrRefusesNamingTheRule) {
  const auto before = Snapshot(dir_.path());
  auto report = Patch();
  if (!Loadable()) {
    // int8: compressed_tensors.py CompressedTensorsKVCacheMethod.
    //   validate_kv_cache_scheme accepts only type float, num_bits 8.
    // e5m2: no e5m2 scheme exists; attention.py _init_kv_cache_quant refuses
    //   fp8_e5m2 with a kv_cache_scheme, and e4m3 with 1/57344-scaled
    //   values saturates.
    // e4m3fnuz: kv_cache.py BaseKVCacheMethod doubles e4m3fn scales itself
    //   on fnuz hardware; a checkpoint carries e4m3fn scales.
    // per head for ModelOpt/Quark: kv_cache.py KVCacheScaleParameter.
    //   weight_loader accepts one element only.
    const std::string why = format_ == "int8"              ? "int8"
                            : format_ == "float8_e5m2"     ? "e5m2"
                            : format_ == "float8_e4m3fnuz" ? "e4m3fnuz"
                                                           : "per-tensor";
    EXPECT_THAT(report.status(),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(why)));
    EXPECT_TRUE(Snapshot(dir_.path()) == before) << "something was written";
    EXPECT_FALSE(fs::exists(dir_ / "out"));
    return;
  }
  ASSERT_TRUE(report.ok()) << report.status();

  const auto tensors = Tensors(dir_ / "out");
  const Json config = Json::parse(ReadFile(dir_ / "out/config.json"));
  const Json& qc = config["quantization_config"];
  const bool per_head = granularity_ == Granularity::kPerHead;
  for (uint32_t l = 0; l < kLayers; ++l) {
    for (int r = 0; r < 3; ++r) {
      const std::string name = ExpectedName(target_, l, r);
      auto it = tensors.find(name);
      ASSERT_NE(it, tensors.end()) << name << " missing";
      const TensorInfo& t = it->second.first;
      // float32 is accepted everywhere (docs/formats.md).
      EXPECT_EQ(t.dtype, "F32") << name;
      if (target_ == PatchTarget::kCompressedTensors) {
        // compressed_tensors.py create_weights: [1] per tensor; attn_head
        // flattens [heads, 1, 1] in _tp_aware_loader; q keeps every query
        // head (it reduces them itself: view(-1, H/KV)).
        const uint64_t heads = r == 0 ? kHeads : kKvHeads;
        const std::vector<uint64_t> want_shape =
            per_head ? std::vector<uint64_t>{heads, 1, 1}
                     : std::vector<uint64_t>{1};
        EXPECT_EQ(t.shape, want_shape) << name;
      } else {
        // kv_cache.py KVCacheScaleParameter.weight_loader: numel 1.
        EXPECT_EQ(t.elements(), 1u) << name;
      }
      // The values are the scales file's, bit for bit.
      EXPECT_EQ(it->second.second, scales_.layers[l][r]) << name;
    }
  }
  // No other scale tensor that vLLM would also map onto the same parameter.
  size_t scale_like = 0;
  for (const auto& [name, t] : tensors) scale_like += IsVllmScaleName(name);
  EXPECT_EQ(scale_like, 3u * kLayers);

  switch (target_) {
    case PatchTarget::kCompressedTensors: {
      // compressed_tensors.py validate_kv_cache_scheme; attention.py
      // Attention.__init__ switches the cache to fp8 for a scheme.
      const Json& kv = qc["kv_cache_scheme"];
      EXPECT_EQ(qc["quant_method"], "compressed-tensors");
      EXPECT_EQ(kv["type"], "float");
      EXPECT_EQ(kv["num_bits"], 8);
      EXPECT_EQ(kv["symmetric"], true);
      EXPECT_EQ(kv["dynamic"], false);
      EXPECT_EQ(kv["strategy"], per_head ? "attn_head" : "tensor");
      // weight_utils.py get_quant_config passes the head counts the
      // per-head loader needs only when config_groups exists.
      EXPECT_TRUE(qc.contains("config_groups"));
      break;
    }
    case PatchTarget::kModelOpt: {
      // modelopt.py from_config (flat form): a kv_cache_scheme dict of type
      // float, 8 bits makes the KV method; torch_utils.py
      // get_kv_cache_quant_algo_string needs dynamic false for fp8.
      const Json& kv = qc["kv_cache_scheme"];
      EXPECT_EQ(kv["type"], "float");
      EXPECT_EQ(kv["num_bits"], 8);
      EXPECT_EQ(kv["dynamic"], false);
      // Every existing field kept.
      const Json existing = ExistingQuantizationConfig(target_);
      for (const auto& [key, value] : existing.items()) {
        EXPECT_EQ(qc[key], value) << key;
      }
      break;
    }
    case PatchTarget::kQuark: {
      // quark.py QuarkConfig.from_config: export.kv_cache_group, then every
      // matching layer_quant_config entry with equal output_tensors;
      // QuarkKVCacheMethod.validate_kv_cache_config: fp8_e4m3, per_tensor.
      const Json& group = qc["export"]["kv_cache_group"];
      ASSERT_TRUE(group.is_array());
      EXPECT_FALSE(group.empty());
      for (const Json& pattern : group) {
        const Json& entry =
            qc["layer_quant_config"][pattern.get<std::string>()];
        EXPECT_EQ(entry["output_tensors"]["dtype"], "fp8_e4m3");
        EXPECT_EQ(entry["output_tensors"]["qscheme"], "per_tensor");
        EXPECT_EQ(entry["weight"], qc["global_quant_config"]["weight"]);
      }
      EXPECT_EQ(qc["export"]["pack_method"], "reorder");
      EXPECT_EQ(qc["exclude"], Json({"lm_head"}));
      break;
    }
  }

  // `kvcal inspect --json` states what vLLM does: it starts, uses every
  // scale, q reduced per KV group by vLLM itself when per head; and it exits
  // 0. Quark needs --kv-cache-dtype fp8 (nothing switches its cache): with
  // the default it exits 1 saying so.
  const std::string flags =
      target_ == PatchTarget::kQuark ? "--kv-cache-dtype fp8" : "";
  int code = -1;
  const Json inspect = InspectJson(dir_ / "out", flags, &code);
  ASSERT_FALSE(inspect.is_discarded());
  const Json& vllm = inspect["vllm"];
  EXPECT_EQ(code, 0) << inspect.dump(1);
  EXPECT_EQ(vllm["vllm_version"], "0.34.0");
  EXPECT_EQ(vllm["starts"], true);
  EXPECT_EQ(vllm["clean"], true);
  EXPECT_EQ(vllm["per_head"], per_head);
  EXPECT_THAT(vllm["kv_cache_dtype"].get<std::string>(), HasSubstr("fp8"));
  EXPECT_THAT(vllm["backends"].get<std::string>(),
              HasSubstr(per_head ? "FlashAttention 3" : "every FP8"));
  ASSERT_EQ(vllm["layers"].size(), kLayers);
  for (uint32_t l = 0; l < kLayers; ++l) {
    for (int r = 0; r < 3; ++r) {
      const Json& role = vllm["layers"][l][kRoles[r]];
      EXPECT_EQ(role["fate"], "used");
      EXPECT_EQ(role["tensors"], Json({ExpectedName(target_, l, r)}));
      const std::vector<float> want =
          r == 0 && per_head ? ReduceQPerGroup(scales_.layers[l][r])
                             : scales_.layers[l][r];
      EXPECT_EQ(role["effective"].get<std::vector<float>>(), want)
          << "layer " << l << " " << kRoles[r];
    }
  }
  if (target_ == PatchTarget::kQuark) {
    const Json plain = InspectJson(dir_ / "out", "", &code);
    EXPECT_EQ(code, 1);
    EXPECT_EQ(plain["vllm"]["kv_cache_dtype"], "auto");
    EXPECT_THAT(plain["vllm"]["silent"].dump(),
                HasSubstr("--kv-cache-dtype fp8"));
  }
  // On ROCm fnuz hardware ModelOpt/Quark scales are doubled
  // (kv_cache.py BaseKVCacheMethod.process_weights_after_loading); per-head
  // scales have no ROCm backend; compressed-tensors per tensor is not doubled
  // and saturates (CompressedTensorsKVCacheMethod.process_weights_after_
  // loading).
  const Json rocm =
      InspectJson(dir_ / "out", flags + " --platform rocm", &code);
  if (target_ == PatchTarget::kCompressedTensors) {
    EXPECT_EQ(code, 1);
    EXPECT_EQ(rocm["vllm"]["starts"], !per_head);
  } else {
    EXPECT_EQ(code, 0) << rocm.dump(1);
    EXPECT_EQ(rocm["vllm"]["layers"][1]["k"]["effective"],
              Json({2 * scales_.layers[1][1][0]}));
  }
}

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  std::string name = PatchTargetFlag(std::get<0>(info.param)) + "_" +
                     std::string(GranularityName(std::get<1>(info.param))) +
                     "_" + std::get<2>(info.param);
  for (char& c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return name;
}

INSTANTIATE_TEST_SUITE_P(
    EveryTarget, TargetConformanceTest,
    ::testing::Combine(
        ::testing::Values(PatchTarget::kCompressedTensors,
                          PatchTarget::kModelOpt, PatchTarget::kQuark),
        ::testing::Values(Granularity::kPerTensor, Granularity::kPerHead),
        ::testing::Values("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
                          "int8")),
    CaseName);

TEST(QPerKvGroupTest, IsRefusedBecauseVllmReducesQItself) {
  // compressed_tensors.py _tp_aware_loader: view(-1, H/KV) over what the
  // checkpoint holds; an already reduced q is reduced again or raises.
  TempDir dir;
  ASSERT_TRUE(WriteDemoCheckpoint(dir / "model", Model()).ok());
  ASSERT_TRUE(WriteScalesFile(dir / "s.safetensors",
                              Scales(Granularity::kPerHead, "float8_e4m3fn",
                                     /*q_per_kv_group=*/true))
                  .ok());
  const auto before = Snapshot(dir / "model");
  EXPECT_THAT(PatchCheckpoint({.checkpoint_dir = dir / "model",
                               .scales_path = dir / "s.safetensors",
                               .out_dir = "",
                               .target = PatchTarget::kCompressedTensors,
                               .on_step = {},
                               .on_progress = {},
                               .lock_timeout = {},
                               .on_lock_wait = {},
                               .lock = nullptr})
                  .status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--q-per-kv-group")));
  EXPECT_TRUE(Snapshot(dir / "model") == before);
}

TEST(ModelOptNestedTest, SetsQuantizationKvCacheQuantAlgo) {
  // modelopt.py from_config, nested form: quantization.kv_cache_quant_algo.
  TempDir dir;
  ASSERT_TRUE(WriteDemoCheckpoint(dir / "model", Model()).ok());
  Json config = Json::parse(ReadFile(dir / "model/config.json"));
  config["quantization_config"] = {
      {"quant_method", "modelopt"},
      {"quantization",
       {{"quant_algo", "FP8"}, {"exclude_modules", {"lm_head"}}}}};
  WriteFile(dir / "model/config.json", config.dump(2));
  ASSERT_TRUE(WriteScalesFile(dir / "s.safetensors",
                              Scales(Granularity::kPerTensor, "float8_e4m3fn"))
                  .ok());
  auto report = PatchCheckpoint({.checkpoint_dir = dir / "model",
                                 .scales_path = dir / "s.safetensors",
                                 .out_dir = "",
                                 .target = PatchTarget::kModelOpt,
                                 .on_step = {},
                                 .on_progress = {},
                                 .lock_timeout = {},
                                 .on_lock_wait = {},
                                 .lock = nullptr});
  ASSERT_TRUE(report.ok()) << report.status();
  const Json q =
      Json::parse(ReadFile(dir / "model/config.json"))["quantization_config"];
  EXPECT_EQ(q["quantization"]["kv_cache_quant_algo"], "FP8");
  EXPECT_EQ(q["quantization"]["exclude_modules"], Json({"lm_head"}));
  EXPECT_FALSE(q.contains("kv_cache_scheme"));
  auto inspect = InspectCheckpoint(dir / "model");
  ASSERT_TRUE(inspect.ok());
  EXPECT_TRUE(inspect->ok()) << inspect->ToText();
  EXPECT_EQ(inspect->vllm.kv_cache_dtype, "fp8_e4m3");
}

TEST(QuarkWithoutExportTest, IsRefusedAndNothingChanges) {
  // quark.py QuarkConfig.from_config: a missing export is a ValueError.
  TempDir dir;
  ASSERT_TRUE(WriteDemoCheckpoint(dir / "model", Model()).ok());
  Json config = Json::parse(ReadFile(dir / "model/config.json"));
  config["quantization_config"] = {{"quant_method", "quark"}};
  WriteFile(dir / "model/config.json", config.dump(2));
  ASSERT_TRUE(WriteScalesFile(dir / "s.safetensors",
                              Scales(Granularity::kPerTensor, "float8_e4m3fn"))
                  .ok());
  const auto before = Snapshot(dir / "model");
  EXPECT_THAT(
      PatchCheckpoint({.checkpoint_dir = dir / "model",
                       .scales_path = dir / "s.safetensors",
                       .out_dir = "",
                       .target = PatchTarget::kQuark,
                       .on_step = {},
                       .on_progress = {},
                       .lock_timeout = {},
                       .on_lock_wait = {},
                       .lock = nullptr})
          .status(),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("'export'")));
  EXPECT_TRUE(Snapshot(dir / "model") == before);
}

// ---- The rules themselves, on hand-made checkpoints. ----

const ModelGeometry kGeometry{kLayers, kHeads, kKvHeads, 8};

Json CtConfig(const std::string& strategy) {
  return {{"quantization_config",
           {{"quant_method", "compressed-tensors"},
            {"config_groups", Json::object()},
            {"kv_cache_scheme",
             {{"type", "float"},
              {"num_bits", 8},
              {"symmetric", true},
              {"dynamic", false},
              {"strategy", strategy}}}}}};
}

std::vector<VllmScaleTensor> CtTensors(const std::vector<float>& q,
                                       const std::vector<float>& kv) {
  std::vector<VllmScaleTensor> out;
  for (uint32_t l = 0; l < kLayers; ++l) {
    for (int r = 0; r < 3; ++r) {
      const std::vector<float>& v = r == 0 ? q : kv;
      out.push_back({"model.layers." + std::to_string(l) + ".self_attn." +
                         kRoles[r] + "_scale",
                     {v.size(), 1, 1},
                     v});
    }
  }
  return out;
}

std::string All(const VllmPrediction& p) {
  return ::testing::PrintToString(p.refusals) +
         ::testing::PrintToString(p.silent);
}

TEST(VllmRulesTest, CompressedTensorsSchemeValidation) {
  // compressed_tensors.py validate_kv_cache_scheme.
  Json config = CtConfig("tensor");
  config["quantization_config"]["kv_cache_scheme"]["type"] = "int";
  VllmPrediction p =
      PredictVllmLoad(config, kGeometry, CtTensors({0.1f}, {0.1f}), {});
  EXPECT_FALSE(p.starts());
  EXPECT_THAT(p.refusals, Contains(HasSubstr("NotImplementedError")));

  config = CtConfig("channel");
  p = PredictVllmLoad(config, kGeometry, CtTensors({0.1f}, {0.1f}), {});
  EXPECT_THAT(p.refusals, Contains(HasSubstr("'tensor' or 'attn_head'")));

  config = CtConfig("tensor");
  config["quantization_config"]["kv_cache_scheme"]["symmetric"] = false;
  p = PredictVllmLoad(config, kGeometry, CtTensors({0.1f}, {0.1f}), {});
  EXPECT_THAT(p.refusals, Contains(HasSubstr("symmetric")));

  // attention.py _init_kv_cache_quant: e5m2 cache with a scheme.
  VllmLoadOptions e5m2;
  e5m2.kv_cache_dtype = "fp8_e5m2";
  p = PredictVllmLoad(CtConfig("tensor"), kGeometry, CtTensors({0.1f}, {0.1f}),
                      e5m2);
  EXPECT_THAT(p.refusals, Contains(HasSubstr("fp8_e5m2")));

  // A valid per-tensor checkpoint: fp8 cache, every scale used.
  p = PredictVllmLoad(CtConfig("tensor"), kGeometry, CtTensors({0.5f}, {0.25f}),
                      {});
  EXPECT_TRUE(p.clean()) << All(p);
  EXPECT_EQ(p.kv_cache_dtype, "fp8");
  EXPECT_EQ(p.layers.at(2)[0].effective, std::vector<float>{0.5f});
}

TEST(VllmRulesTest, PerHeadNeedsConfigGroupsAndAllQueryHeads) {
  std::vector<float> q(kHeads), kv = {0.2f, 0.3f};
  for (uint32_t h = 0; h < kHeads; ++h) q[h] = 0.1f * (h % 5 + 1);
  VllmPrediction p =
      PredictVllmLoad(CtConfig("attn_head"), kGeometry, CtTensors(q, kv), {});
  EXPECT_TRUE(p.clean()) << All(p);
  // _tp_aware_loader: amax over view(-1, H/KV).
  EXPECT_EQ(p.layers.at(0)[0].effective, (std::vector<float>{0.4f, 0.5f}));
  EXPECT_EQ(p.layers.at(0)[1].effective, kv);

  Json no_groups = CtConfig("attn_head");
  no_groups["quantization_config"].erase("config_groups");
  p = PredictVllmLoad(no_groups, kGeometry, CtTensors(q, kv), {});
  EXPECT_THAT(p.refusals, Contains(HasSubstr("config_groups")));

  // q reduced to KV values: 2 values, view(-1, 4) raises.
  p = PredictVllmLoad(CtConfig("attn_head"), kGeometry,
                      CtTensors({0.4f, 0.5f}, kv), {});
  EXPECT_THAT(p.refusals, Contains(HasSubstr("view(-1, 4)")));
  // 9 query / 3 KV heads, q reduced to 3: reduced again to one value and
  // copied to every head, silently.
  const ModelGeometry smol{kLayers, 9, 3, 64};
  p = PredictVllmLoad(CtConfig("attn_head"), smol,
                      CtTensors({0.1f, 0.7f, 0.2f}, {0.1f, 0.2f, 0.3f}), {});
  EXPECT_TRUE(p.starts()) << All(p);
  EXPECT_THAT(p.silent, Contains(HasSubstr("reduced again")));
  EXPECT_EQ(p.layers.at(0)[0].effective,
            (std::vector<float>{0.7f, 0.7f, 0.7f}));

  // No ROCm backend takes per-head scales; elsewhere only FA3+.
  VllmLoadOptions rocm;
  rocm.platform = VllmPlatform::kRocm;
  p = PredictVllmLoad(CtConfig("attn_head"), kGeometry, CtTensors(q, kv), rocm);
  EXPECT_THAT(p.refusals, Contains(HasSubstr("No valid attention backend")));
}

TEST(VllmRulesTest, CompressedTensorsUsesWhatItFindsWithoutChecking) {
  // compressed_tensors.py create_weights (torch.ones) and
  // process_weights_after_loading: missing stays 1.0, bad values are used.
  std::vector<VllmScaleTensor> t = CtTensors({0.5f}, {0.0f});
  t.erase(t.begin());  // layer 0 q
  VllmPrediction p = PredictVllmLoad(CtConfig("tensor"), kGeometry, t, {});
  EXPECT_TRUE(p.starts());
  EXPECT_EQ(p.layers.at(0)[0].fate, "missing: 1.0");
  EXPECT_EQ(p.layers.at(0)[0].effective, std::vector<float>{1.0f});
  EXPECT_THAT(p.silent, Contains(HasSubstr("layer 0 has no q_scale")));
  EXPECT_THAT(p.silent, Contains(HasSubstr("holds [0]")));
  // A [H,1,1] tensor under strategy tensor: default_weight_loader asserts.
  p = PredictVllmLoad(CtConfig("tensor"), kGeometry,
                      CtTensors({0.1f, 0.2f}, {0.1f}), {});
  EXPECT_THAT(p.refusals, Contains(HasSubstr("default_weight_loader")));
  // ROCm: not doubled, saturates e4m3fn-calibrated values.
  VllmLoadOptions rocm;
  rocm.platform = VllmPlatform::kRocm;
  p = PredictVllmLoad(CtConfig("tensor"), kGeometry, CtTensors({0.5f}, {0.25f}),
                      rocm);
  EXPECT_TRUE(p.starts());
  EXPECT_EQ(p.layers.at(0)[1].effective, std::vector<float>{0.25f});
  EXPECT_THAT(p.silent, Contains(HasSubstr("not doubled")));
}

std::vector<VllmScaleTensor> BaseTensors(float q, float k, float v,
                                         bool with_q = true, bool with_v = true,
                                         bool with_k = true) {
  std::vector<VllmScaleTensor> out;
  for (uint32_t l = 0; l < kLayers; ++l) {
    const std::string base =
        "model.layers." + std::to_string(l) + ".self_attn.";
    if (with_q) out.push_back({base + "q_scale", {}, {q}});
    if (with_k) out.push_back({base + "k_proj.k_scale", {}, {k}});
    if (with_v) out.push_back({base + "v_proj.v_scale", {}, {v}});
  }
  return out;
}

Json ModelOptFlat(bool with_scheme, const std::string& algo = "FP8") {
  Json qc = {{"quant_method", "modelopt"}, {"quant_algo", algo}};
  if (with_scheme) {
    qc["kv_cache_scheme"] = {
        {"type", "float"}, {"num_bits", 8}, {"dynamic", false}};
  }
  return {{"quantization_config", qc}};
}

TEST(VllmRulesTest, BaseKvCacheMethodValueRules) {
  // kv_cache.py BaseKVCacheMethod.process_weights_after_loading.
  VllmPrediction p = PredictVllmLoad(ModelOptFlat(true), kGeometry,
                                     BaseTensors(0.3f, 0.2f, 0.1f), {});
  EXPECT_TRUE(p.clean()) << All(p);
  // torch_utils.py get_kv_cache_quant_algo_string: the dict becomes "fp8",
  // then MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP makes it fp8_e4m3.
  EXPECT_EQ(p.kv_cache_dtype, "fp8_e4m3");
  EXPECT_EQ(p.layers.at(1)[0].effective, std::vector<float>{0.3f});

  // v missing: silently k for both.
  p = PredictVllmLoad(ModelOptFlat(true), kGeometry,
                      BaseTensors(0.3f, 0.2f, 0.1f, true, false), {});
  EXPECT_TRUE(p.starts());
  EXPECT_EQ(p.layers.at(0)[2].fate, "missing: v := k");
  EXPECT_EQ(p.layers.at(0)[2].effective, std::vector<float>{0.2f});
  // v NaN: Python's max(k, NaN) keeps k.
  p = PredictVllmLoad(ModelOptFlat(true), kGeometry,
                      BaseTensors(0.3f, 0.2f, std::nanf("")), {});
  EXPECT_EQ(p.layers.at(0)[2].effective, std::vector<float>{0.2f});
  // k missing with v present: AssertionError at start.
  p = PredictVllmLoad(ModelOptFlat(true), kGeometry,
                      BaseTensors(0.3f, 0.2f, 0.1f, true, true, false), {});
  EXPECT_THAT(p.refusals, Contains(HasSubstr("AssertionError")));
  // k zero: AssertionError as well.
  p = PredictVllmLoad(ModelOptFlat(true), kGeometry,
                      BaseTensors(0.3f, 0.0f, 0.1f), {});
  EXPECT_THAT(p.refusals, Contains(HasSubstr("AssertionError")));
  // Both negative: 1.0 with a warning.
  p = PredictVllmLoad(ModelOptFlat(true), kGeometry,
                      BaseTensors(0.3f, -1.0f, -2.0f), {});
  EXPECT_TRUE(p.starts());
  EXPECT_EQ(p.layers.at(0)[1].effective, std::vector<float>{1.0f});
  // q missing: 1.0 (not k, whatever the log says).
  p = PredictVllmLoad(ModelOptFlat(true), kGeometry,
                      BaseTensors(0.3f, 0.2f, 0.1f, false), {});
  EXPECT_EQ(p.layers.at(0)[0].effective, std::vector<float>{1.0f});
  EXPECT_THAT(p.silent, Contains(HasSubstr("q_scale missing")));
  // ROCm fnuz: doubled.
  VllmLoadOptions rocm;
  rocm.platform = VllmPlatform::kRocm;
  p = PredictVllmLoad(ModelOptFlat(true), kGeometry,
                      BaseTensors(0.3f, 0.2f, 0.1f), rocm);
  EXPECT_EQ(p.layers.at(0)[0].effective, std::vector<float>{0.6f});
  EXPECT_EQ(p.layers.at(0)[2].effective, std::vector<float>{0.2f});
  // More than one element: KVCacheScaleParameter.weight_loader raises.
  auto t = BaseTensors(0.3f, 0.2f, 0.1f);
  t[1].values = {0.2f, 0.2f};
  t[1].shape = {2};
  p = PredictVllmLoad(ModelOptFlat(true), kGeometry, t, {});
  EXPECT_THAT(p.refusals, Contains(HasSubstr("scalar")));
}

TEST(VllmRulesTest, ModelOptKvMethodAndCacheDtype) {
  // Flat FP8 without a scheme: scales load but --kv-cache-dtype auto keeps
  // an unquantized cache (torch_utils.py get_kv_cache_quant_algo_string).
  VllmPrediction p = PredictVllmLoad(ModelOptFlat(false), kGeometry,
                                     BaseTensors(0.3f, 0.2f, 0.1f), {});
  EXPECT_EQ(p.kv_cache_dtype, "auto");
  EXPECT_THAT(p.silent, Contains(HasSubstr("ignores every scale")));
  // MIXED_PRECISION without a scheme: no KV method, scales dropped
  // (ModelOptMixedPrecisionConfig.get_quant_method).
  VllmLoadOptions fp8;
  fp8.kv_cache_dtype = "fp8";
  p = PredictVllmLoad(ModelOptFlat(false, "MIXED_PRECISION"), kGeometry,
                      BaseTensors(0.3f, 0.2f, 0.1f), fp8);
  EXPECT_TRUE(p.starts());
  EXPECT_THAT(p.silent, Contains(HasSubstr("is dropped")));
  EXPECT_EQ(p.layers.at(0)[1].effective, std::vector<float>{1.0f});
  // ... and with one, the scales load.
  p = PredictVllmLoad(ModelOptFlat(true, "MIXED_PRECISION"), kGeometry,
                      BaseTensors(0.3f, 0.2f, 0.1f), {});
  EXPECT_TRUE(p.clean()) << All(p);
}

TEST(VllmRulesTest, QuarkConfigRules) {
  Json qc = {{"quant_method", "quark"}};
  const auto tensors = [] {
    std::vector<VllmScaleTensor> out;
    for (uint32_t l = 0; l < kLayers; ++l) {
      for (int r = 0; r < 3; ++r) {
        out.push_back({"model.layers." + std::to_string(l) + ".self_attn." +
                           kRoles[r] + "_proj.output_scale",
                       {},
                       {0.1f}});
      }
    }
    return out;
  }();
  VllmLoadOptions fp8;
  fp8.kv_cache_dtype = "fp8";
  VllmPrediction p =
      PredictVllmLoad({{"quantization_config", qc}}, kGeometry, tensors, fp8);
  EXPECT_THAT(p.refusals, Contains(HasSubstr("'export'")));

  qc["export"] = {{"kv_cache_group", {"*k_proj", "*v_proj"}}};
  qc["layer_quant_config"] = {{"*o_proj", {{"output_tensors", nullptr}}}};
  p = PredictVllmLoad({{"quantization_config", qc}}, kGeometry, tensors, fp8);
  EXPECT_THAT(p.refusals, Contains(HasSubstr("matches no layer_quant_config")));

  const Json out = {{"dtype", "fp8_e4m3"}, {"qscheme", "per_tensor"}};
  qc["layer_quant_config"] = {{"*k_proj", {{"output_tensors", out}}},
                              {"*v_proj", {{"output_tensors", out}}}};
  p = PredictVllmLoad({{"quantization_config", qc}}, kGeometry, tensors, fp8);
  EXPECT_TRUE(p.clean()) << All(p);
  // Without --kv-cache-dtype fp8 nothing switches the cache.
  p = PredictVllmLoad({{"quantization_config", qc}}, kGeometry, tensors, {});
  EXPECT_THAT(p.silent, Contains(HasSubstr("--kv-cache-dtype fp8")));

  qc["layer_quant_config"]["*v_proj"]["output_tensors"]["qscheme"] =
      "per_channel";
  p = PredictVllmLoad({{"quantization_config", qc}}, kGeometry, tensors, fp8);
  EXPECT_THAT(p.refusals, Contains(HasSubstr("differ in output_tensors")));
}

TEST(VllmRulesTest, NamesAndMissingConfig) {
  // Without a quantization config the attention layers have no q/k/v_scale
  // parameters and the loader raises on the names
  // (models/utils.py AutoWeightsLoader._load_module).
  VllmPrediction p =
      PredictVllmLoad(Json::object(), kGeometry, CtTensors({0.1f}, {0.1f}), {});
  EXPECT_FALSE(p.starts());
  EXPECT_THAT(p.refusals, Contains(HasSubstr("no module or parameter")));
  // Quark's names in a compressed-tensors checkpoint map to nothing and are
  // not skippable: the same error.
  std::vector<VllmScaleTensor> t = CtTensors({0.1f}, {0.1f});
  t.push_back({"model.layers.0.self_attn.k_proj.output_scale", {}, {0.1f}});
  p = PredictVllmLoad(CtConfig("tensor"), kGeometry, t, {});
  EXPECT_THAT(p.refusals, Contains(HasSubstr("k_proj.output_scale")));
  // A scale for a layer the model does not have.
  t = CtTensors({0.1f}, {0.1f});
  t.push_back({"model.layers.7.self_attn.k_scale", {1}, {0.1f}});
  p = PredictVllmLoad(CtConfig("tensor"), kGeometry, t, {});
  EXPECT_THAT(p.refusals, Contains(HasSubstr("layers.7")));
  // Two names that load into one parameter.
  t = CtTensors({0.1f}, {0.1f});
  t.push_back({"model.layers.0.self_attn.k_proj.k_scale", {1}, {0.2f}});
  p = PredictVllmLoad(CtConfig("tensor"), kGeometry, t, {});
  EXPECT_THAT(p.silent, Contains(HasSubstr("the one read last wins")));
  // The mapper itself (base_config.py get_cache_scale_mapper).
  EXPECT_EQ(VllmMappedScaleName("modelopt",
                                "model.layers.3.self_attn.k_proj.k_scale"),
            "model.layers.3.self_attn.attn.k_scale");
  EXPECT_EQ(VllmMappedScaleName("compressed-tensors",
                                "model.layers.3.self_attn.attn.q_scale"),
            "model.layers.3.self_attn.attn.q_scale");
  EXPECT_EQ(VllmMappedScaleName("compressed-tensors",
                                "model.layers.3.self_attn.kv_scale"),
            "model.layers.3.self_attn.attn.k_scale");
  EXPECT_EQ(VllmMappedScaleName("quark",
                                "model.layers.3.self_attn.v_proj.output_scale"),
            "model.layers.3.self_attn.attn.v_scale");
  EXPECT_FALSE(
      IsVllmScaleName("model.layers.0.self_attn.qkv_proj.weight_scale"));
  EXPECT_FALSE(IsVllmScaleName("model.layers.0.self_attn.k_proj.input_scale"));
}

TEST(VllmRulesTest, UnknownMethodIsNotGuessed) {
  Json config = {{"quantization_config", {{"quant_method", "awq"}}}};
  VllmPrediction p =
      PredictVllmLoad(config, kGeometry, CtTensors({0.1f}, {0.1f}), {});
  EXPECT_FALSE(p.modelled);
  EXPECT_FALSE(p.clean());
}

// ---- NVFP4 KV caches (vLLM 0.34: --kv-cache-dtype nvfp4, nvfp4_4over6). ----

// A model FlashInfer, the only backend with an NVFP4 cache, can serve: head
// size 128 (v1/attention/backends/flashinfer.py get_supported_head_sizes:
// 64, 128, 256, 512).
DemoModelOptions Nvfp4Model() {
  DemoModelOptions o;
  o.geometry = {.num_layers = 2,
                .num_attention_heads = 2,
                .num_key_value_heads = 1,
                .head_dim = 128};
  o.intermediate_size = 16;
  o.vocab_size = 32;
  o.sharded = true;
  return o;
}

CalibratedScales Nvfp4Scales(Granularity granularity) {
  const DemoModelOptions m = Nvfp4Model();
  CalibratedScales s;
  s.granularity = granularity;
  s.observer = "static_minmax";
  s.metadata["format"] = "float8_e4m3fn";
  for (uint32_t l = 0; l < m.geometry.num_layers; ++l) {
    for (int r = 0; r < 3; ++r) {
      const uint32_t n = granularity == Granularity::kPerTensor ? 1
                         : r == 0 ? m.geometry.num_attention_heads
                                  : m.geometry.num_key_value_heads;
      for (uint32_t h = 0; h < n; ++h) {
        s.layers[l][r].push_back(0.02f * (1 + l) + 0.005f * r + 0.001f * h);
      }
    }
  }
  return s;
}

class Nvfp4PatchTest : public ::testing::Test {
 protected:
  // A ModelOpt (or other) model with `quantization_config`, and scales.
  void Write(const Json& quantization_config,
             Granularity granularity = Granularity::kPerTensor) {
    ASSERT_TRUE(WriteDemoCheckpoint(dir_ / "model", Nvfp4Model()).ok());
    Json config = Json::parse(ReadFile(dir_ / "model/config.json"));
    if (!quantization_config.is_null()) {
      config["quantization_config"] = quantization_config;
    }
    WriteFile(dir_ / "model/config.json", config.dump(2));
    scales_ = Nvfp4Scales(granularity);
    ASSERT_TRUE(WriteScalesFile(dir_ / "s.safetensors", scales_).ok());
  }
  absl::StatusOr<PatchReport> Patch(PatchTarget target) {
    return PatchCheckpoint({.checkpoint_dir = dir_ / "model",
                            .scales_path = dir_ / "s.safetensors",
                            .out_dir = "",
                            .target = target,
                            .on_step = {},
                            .on_progress = {},
                            .lock_timeout = {},
                            .on_lock_wait = {},
                            .lock = nullptr,
                            .kv_cache = PatchKvCache::kNvfp4});
  }
  Json QuantizationConfig() const {
    return Json::parse(
        ReadFile(dir_ / "model/config.json"))["quantization_config"];
  }
  // vLLM's prediction for the patched checkpoint: an nvfp4 cache with
  // --kv-cache-dtype auto, every scale used as written.
  void ExpectNvfp4WithEveryScale() {
    auto inspect = InspectCheckpoint(dir_ / "model");
    ASSERT_TRUE(inspect.ok()) << inspect.status();
    EXPECT_TRUE(inspect->ok()) << inspect->ToText();
    EXPECT_EQ(inspect->vllm.kv_cache_dtype, "nvfp4");
    EXPECT_THAT(inspect->vllm.backends, HasSubstr("FLASHINFER"));
    const auto tensors = Tensors(dir_ / "model");
    for (uint32_t l = 0; l < 2; ++l) {
      for (int r = 0; r < 3; ++r) {
        // The ModelOpt names (base_config.py get_cache_scale_mapper).
        const std::string name = ExpectedName(PatchTarget::kModelOpt, l, r);
        ASSERT_TRUE(tensors.count(name)) << name;
        EXPECT_EQ(tensors.at(name).second, scales_.layers[l][r]) << name;
        const VllmRoleOutcome& o = inspect->vllm.layers.at(l)[r];
        EXPECT_EQ(o.fate, "used") << name;
        EXPECT_EQ(o.effective, scales_.layers[l][r]) << name;
      }
    }
  }

  TempDir dir_;
  CalibratedScales scales_;
};

TEST_F(Nvfp4PatchTest, ModelOptFlatWritesANum4FloatKvCacheScheme) {
  // utils/torch_utils.py get_kv_cache_quant_algo_string: a kv_cache_scheme
  // dict with num_bits 4 and type float is an "nvfp4" cache.
  Write({{"quant_method", "modelopt"}, {"quant_algo", "FP8"}});
  auto report = Patch(PatchTarget::kModelOpt);
  ASSERT_TRUE(report.ok()) << report.status();
  const Json q = QuantizationConfig();
  EXPECT_EQ(q["kv_cache_scheme"]["num_bits"], 4);
  EXPECT_EQ(q["kv_cache_scheme"]["type"], "float");
  EXPECT_EQ(q["quant_algo"], "FP8");
  ExpectNvfp4WithEveryScale();
  // The patch says on which GPUs vLLM serves it.
  EXPECT_THAT(report->warnings, Contains(HasSubstr("1 / k_scale")));
}

TEST_F(Nvfp4PatchTest, ModelOptNestedSetsKvCacheQuantAlgoNvfp4) {
  // modelopt.py from_config reads quantization.kv_cache_quant_algo;
  // MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP: "nvfp4" -> "nvfp4".
  Write({{"quant_method", "modelopt"},
         {"quantization",
          {{"quant_algo", "FP8"}, {"exclude_modules", {"lm_head"}}}}});
  ASSERT_TRUE(Patch(PatchTarget::kModelOpt).ok());
  const Json q = QuantizationConfig();
  EXPECT_EQ(q["quantization"]["kv_cache_quant_algo"], "NVFP4");
  EXPECT_FALSE(q.contains("kv_cache_scheme"));
  ExpectNvfp4WithEveryScale();
}

TEST_F(Nvfp4PatchTest, RefusedWhereVllmCannotRunItAndNothingChanges) {
  struct Refusal {
    Json config;
    PatchTarget target;
    Granularity granularity;
    absl::StatusCode code;
    std::string why;
  };
  const Json modelopt = {{"quant_method", "modelopt"}, {"quant_algo", "FP8"}};
  const std::vector<Refusal> cases = {
      // compressed_tensors.py validate_kv_cache_scheme: num_bits 8 only.
      {nullptr, PatchTarget::kCompressedTensors, Granularity::kPerTensor,
       absl::StatusCode::kInvalidArgument, "validate_kv_cache_scheme"},
      // quark.py QuarkKVCacheMethod.validate_kv_cache_config: fp8_e4m3 only.
      {ExistingQuantizationConfig(PatchTarget::kQuark), PatchTarget::kQuark,
       Granularity::kPerTensor, absl::StatusCode::kInvalidArgument,
       "validate_kv_cache_config"},
      // One global scale per layer: per-head scales are refused.
      {modelopt, PatchTarget::kModelOpt, Granularity::kPerHead,
       absl::StatusCode::kInvalidArgument, "per-tensor scales only"},
      // Flat MIXED_PRECISION: no KV-cache method from a num_bits 4 scheme.
      {{{"quant_method", "modelopt"}, {"quant_algo", "MIXED_PRECISION"}},
       PatchTarget::kModelOpt,
       Granularity::kPerTensor,
       absl::StatusCode::kFailedPrecondition,
       "MIXED_PRECISION"},
  };
  for (const Refusal& c : cases) {
    SCOPED_TRACE(c.why);
    std::filesystem::remove_all(dir_ / "model");
    Write(c.config, c.granularity);
    const auto before = Snapshot(dir_ / "model");
    EXPECT_THAT(Patch(c.target).status(), StatusIs(c.code, HasSubstr(c.why)));
    EXPECT_TRUE(Snapshot(dir_ / "model") == before) << "something changed";
  }
}

TEST(Nvfp4KvCacheDtypeTest, ParsesFp8AndNvfp4Only) {
  EXPECT_EQ(*ParsePatchKvCache("fp8"), PatchKvCache::kFp8);
  EXPECT_EQ(*ParsePatchKvCache("nvfp4"), PatchKvCache::kNvfp4);
  // A checkpoint cannot declare 4over6 (MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP).
  EXPECT_THAT(ParsePatchKvCache("nvfp4_4over6").status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--kv-cache-dtype nvfp4_4over6")));
  EXPECT_FALSE(ParsePatchKvCache("int4").ok());
}

Json ModelOptNvfp4Flat(const std::string& algo = "FP8",
                       const std::string& type = "float") {
  return {{"quantization_config",
           {{"quant_method", "modelopt"},
            {"quant_algo", algo},
            {"kv_cache_scheme", {{"num_bits", 4}, {"type", type}}}}}};
}

VllmLoadOptions KvCacheDtype(const std::string& dtype,
                             VllmPlatform platform = VllmPlatform::kCuda) {
  VllmLoadOptions o;
  o.kv_cache_dtype = dtype;
  o.platform = platform;
  return o;
}

TEST(VllmRulesNvfp4Test, CacheDtypeFromModelOptConfigs) {
  const ModelGeometry g{kLayers, kHeads, kKvHeads, 128};
  // get_kv_cache_quant_algo_string: {num_bits 4, type float} -> nvfp4.
  VllmPrediction p = PredictVllmLoad(ModelOptNvfp4Flat(), g,
                                     BaseTensors(0.3f, 0.2f, 0.1f), {});
  EXPECT_EQ(p.kv_cache_dtype, "nvfp4");
  EXPECT_TRUE(p.clean()) << All(p);
  // ... a num_bits 4 int scheme is unknown: "auto", scales ignored.
  p = PredictVllmLoad(ModelOptNvfp4Flat("FP8", "int"), g,
                      BaseTensors(0.3f, 0.2f, 0.1f), {});
  EXPECT_EQ(p.kv_cache_dtype, "auto");
  EXPECT_THAT(p.silent, Contains(HasSubstr("ignores every scale")));
  // Nested: quantization.kv_cache_quant_algo "NVFP4".
  const Json nested = {
      {"quantization_config",
       {{"quant_method", "modelopt"},
        {"quantization",
         {{"quant_algo", "FP8"}, {"kv_cache_quant_algo", "NVFP4"}}}}}};
  p = PredictVllmLoad(nested, g, BaseTensors(0.3f, 0.2f, 0.1f), {});
  EXPECT_EQ(p.kv_cache_dtype, "nvfp4");
  EXPECT_TRUE(p.clean()) << All(p);
  // Every global scale as written (BaseKVCacheMethod: one scalar each).
  EXPECT_EQ(p.layers.at(2)[1].effective, std::vector<float>{0.2f});
  EXPECT_EQ(p.layers.at(2)[2].effective, std::vector<float>{0.1f});
  // An explicit flag wins over the checkpoint (resolve_kv_cache_dtype_string).
  p = PredictVllmLoad(nested, g, BaseTensors(0.3f, 0.2f, 0.1f),
                      KvCacheDtype("fp8"));
  EXPECT_EQ(p.kv_cache_dtype, "fp8");
  // MIXED_PRECISION flat with a num_bits 4 scheme: the cache is nvfp4 but
  // from_config makes no KV algorithm, so no KV-cache method: 1.0.
  p = PredictVllmLoad(ModelOptNvfp4Flat("MIXED_PRECISION"), g,
                      BaseTensors(0.3f, 0.2f, 0.1f), {});
  EXPECT_EQ(p.kv_cache_dtype, "nvfp4");
  EXPECT_EQ(p.layers.at(0)[1].effective, std::vector<float>{1.0f});
  EXPECT_THAT(p.silent,
              Contains(HasSubstr("runs the nvfp4 cache with scale 1.0")));
}

TEST(VllmRulesNvfp4Test, BackendsByGpuFamilyAndHeadSize) {
  const ModelGeometry g128{kLayers, kHeads, kKvHeads, 128};
  const ModelGeometry g64{kLayers, kHeads, kKvHeads, 64};
  const ModelGeometry g96{kLayers, kHeads, kKvHeads, 96};
  const auto t = BaseTensors(0.3f, 0.2f, 0.1f);
  // flashinfer.py: trtllm-gen on 10.x, FA2 on 8.x/9.x/12.x.
  VllmPrediction p = PredictVllmLoad(ModelOptNvfp4Flat(), g128, t, {});
  EXPECT_THAT(p.backends, HasSubstr("FLASHINFER only"));
  EXPECT_THAT(p.backends, HasSubstr("10.x"));
  EXPECT_THAT(p.backends, HasSubstr("FA2 path on 8.x, 9.x and 12.x"));
  EXPECT_THAT(p.notes, Contains(HasSubstr("q_scale is not used")));
  // Head size 64: supports_combination refuses the FA2 path.
  p = PredictVllmLoad(ModelOptNvfp4Flat(), g64, t, {});
  EXPECT_TRUE(p.starts());
  EXPECT_THAT(p.backends, HasSubstr("trtllm-gen only"));
  EXPECT_THAT(p.notes, Contains(HasSubstr("head_size 64")));
  // nvfp4_4over6: supports_kv_cache_dtype refuses it on the FA2 path.
  p = PredictVllmLoad(ModelOptNvfp4Flat(), g128, t,
                      KvCacheDtype("nvfp4_4over6"));
  EXPECT_EQ(p.kv_cache_dtype, "nvfp4_4over6");
  EXPECT_TRUE(p.clean()) << All(p);
  EXPECT_THAT(p.backends, HasSubstr("trtllm-gen only"));
  EXPECT_THAT(p.notes, Contains(HasSubstr("4over6 scale search")));
  // A head size FlashInfer does not have: no backend at all.
  p = PredictVllmLoad(ModelOptNvfp4Flat(), g96, t, {});
  EXPECT_THAT(p.refusals, Contains(HasSubstr("head size 96")));
  // ROCm: no backend lists nvfp4.
  p = PredictVllmLoad(ModelOptNvfp4Flat(), g128, t,
                      KvCacheDtype("nvfp4", VllmPlatform::kRocm));
  EXPECT_THAT(p.refusals, Contains(HasSubstr("on ROCm")));
}

TEST(VllmRulesNvfp4Test, ScalesQScaleAndPerHead) {
  const ModelGeometry g{kLayers, kHeads, kKvHeads, 128};
  // No q_scale: BaseKVCacheMethod sets 1.0 in the end (its log says k_scale);
  // that is the FP8 query of trtllm-gen.
  VllmPrediction p = PredictVllmLoad(ModelOptNvfp4Flat(), g,
                                     BaseTensors(0.3f, 0.2f, 0.1f, false), {});
  EXPECT_EQ(p.layers.at(0)[0].fate, "missing: 1.0");
  EXPECT_EQ(p.layers.at(0)[0].effective, std::vector<float>{1.0f});
  EXPECT_THAT(p.silent, Contains(HasSubstr("FP8 query")));
  // No k/v scales: global scale 1.0.
  p = PredictVllmLoad(ModelOptNvfp4Flat(), g,
                      BaseTensors(0.3f, 0.2f, 0.1f, true, false, false), {});
  EXPECT_EQ(p.layers.at(1)[1].fate, "missing: 1.0");
  EXPECT_EQ(p.layers.at(1)[1].effective, std::vector<float>{1.0f});
  // compressed-tensors per tensor with --kv-cache-dtype nvfp4: its scales
  // become the global scales (CompressedTensorsKVCacheMethod).
  const ModelGeometry ct_g{kLayers, kHeads, kKvHeads, 128};
  p = PredictVllmLoad(CtConfig("tensor"), ct_g, CtTensors({0.4f}, {0.25f}),
                      KvCacheDtype("nvfp4"));
  EXPECT_EQ(p.kv_cache_dtype, "nvfp4");
  EXPECT_TRUE(p.clean()) << All(p);
  EXPECT_EQ(p.layers.at(0)[1].effective, std::vector<float>{0.25f});
  // ... per head: FlashInfer has no per-head scales, FlashAttention no
  // NVFP4: "No valid attention backend found".
  p = PredictVllmLoad(CtConfig("attn_head"), ct_g,
                      CtTensors(std::vector<float>(kHeads, 0.4f),
                                std::vector<float>(kKvHeads, 0.25f)),
                      KvCacheDtype("nvfp4"));
  EXPECT_FALSE(p.starts());
  EXPECT_THAT(p.refusals, Contains(HasSubstr("per-head scales")));
  EXPECT_THAT(p.refusals, Contains(HasSubstr("No valid attention backend")));
}

}  // namespace
}  // namespace kvcal
