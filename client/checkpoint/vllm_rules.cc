// vLLM 0.34's loader rules as code (vllm_rules.h). Over 600 lines on
// purpose: it is one model of one loader, read side by side with vLLM's
// source (each rule cites its file and function, kCt*, kBase*, ...), and the
// three quantization methods' rules share the loaded-tensor and prediction
// types defined here; split apart, a reader checking a rule against vLLM
// would have to follow it across files.
#include "client/checkpoint/vllm_rules.h"

#include <fnmatch.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <regex>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace kvcal {
namespace {

using Json = nlohmann::ordered_json;

constexpr const char* kRoleLetters[] = {"q", "k", "v"};

// Source locations, inside vLLM 0.34.0's `vllm/` package.
constexpr char kLoaderRule[] =
    "model_executor/models/utils.py AutoWeightsLoader._load_module";
constexpr char kCtValidate[] =
    "quantization/compressed_tensors/compressed_tensors.py "
    "CompressedTensorsKVCacheMethod.validate_kv_cache_scheme";
constexpr char kCtLoader[] =
    "quantization/compressed_tensors/compressed_tensors.py "
    "CompressedTensorsKVCacheMethod.create_weights (_tp_aware_loader)";
constexpr char kCtProcess[] =
    "quantization/compressed_tensors/compressed_tensors.py "
    "CompressedTensorsKVCacheMethod.process_weights_after_loading";
constexpr char kBaseProcess[] =
    "quantization/kv_cache.py BaseKVCacheMethod.process_weights_after_loading";
constexpr char kBaseLoader[] =
    "quantization/kv_cache.py KVCacheScaleParameter.weight_loader";
constexpr char kModelOptConfig[] =
    "quantization/modelopt.py ModelOptQuantConfigBase.from_config";
constexpr char kQuarkConfig[] =
    "quantization/quark/quark.py QuarkConfig.from_config";
constexpr char kDtypeResolver[] =
    "utils/torch_utils.py get_kv_cache_quant_algo_string";
constexpr char kAttentionInit[] =
    "model_executor/layers/attention/attention.py Attention.__init__";
constexpr char kFlashInfer[] = "v1/attention/backends/flashinfer.py";
constexpr char kNoBackend[] =
    "\"No valid attention backend found\" (platforms/cuda.py "
    "get_attn_backend_cls)";

const Json* Member(const Json& object, const char* key) {
  if (!object.is_object()) return nullptr;
  auto it = object.find(key);
  return it == object.end() ? nullptr : &*it;
}

std::string StringMember(const Json& object, const char* key) {
  const Json* v = Member(object, key);
  return v != nullptr && v->is_string() ? v->get<std::string>() : "";
}

std::string Lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return std::tolower(c); });
  return s;
}

std::string Upper(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return std::toupper(c); });
  return s;
}

// Python truthiness of a JSON value.
bool Truthy(const Json* v) {
  if (v == nullptr || v->is_null()) return false;
  if (v->is_boolean()) return v->get<bool>();
  if (v->is_number()) return v->get<double>() != 0;
  if (v->is_string() || v->is_array() || v->is_object()) return !v->empty();
  return true;
}

// Python's `value == n` for a JSON number (8 and 8.0 both equal 8).
bool IsNumber(const Json* v, int n) {
  return v != nullptr && v->is_number() && v->get<double>() == n;
}

// transformers_utils/config.py and model_loader/weight_utils.py: the
// quantization config is config.json's quantization_config, else the text
// config's, else compression_config.
const Json* QuantizationConfigOf(const Json& config) {
  if (const Json* q = Member(config, "quantization_config");
      q != nullptr && q->is_object()) {
    return q;
  }
  if (const Json* text = Member(config, "text_config")) {
    if (const Json* q = Member(*text, "quantization_config");
        q != nullptr && q->is_object()) {
      return q;
    }
  }
  if (const Json* q = Member(config, "compression_config");
      q != nullptr && q->is_object()) {
    return q;
  }
  return nullptr;
}

std::string FloatList(const std::vector<float>& v) {
  return absl::StrCat("[", absl::StrJoin(v, ", "), "]");
}

bool AllFinitePositive(const std::vector<float>& v) {
  return std::all_of(v.begin(), v.end(),
                     [](float x) { return std::isfinite(x) && x > 0; });
}

// Python's max(a, b) for the 0-d tensors BaseKVCacheMethod compares: b only
// when b > a (so a NaN b never wins).
float PyMax(float a, float b) { return b > a ? b : a; }

struct Loaded {
  std::vector<std::string> names;
  std::vector<float> values;  // the last tensor loaded wins
  std::vector<uint64_t> shape;
};

// What the quantization config makes of the attention layers.
struct MethodFacts {
  bool kv_method = false;    // the Attention layers get q/k/v_scale parameters
  bool base_method = false;  // BaseKVCacheMethod (ModelOpt, Quark)
  std::string strategy;      // compressed-tensors kv_cache_scheme.strategy
  bool has_scheme = false;   // compressed-tensors kv_cache_scheme present
  std::string cache_from_config;  // what --kv-cache-dtype auto resolves to
};

void CheckCompressedTensors(const Json& qc, const VllmLoadOptions& options,
                            MethodFacts& facts, VllmPrediction& p) {
  facts.kv_method = true;  // get_quant_method: every Attention layer
  const Json* scheme = Member(qc, "kv_cache_scheme");
  if (scheme == nullptr || scheme->is_null()) {
    facts.cache_from_config = "auto";
    return;
  }
  facts.has_scheme = true;
  facts.cache_from_config = "fp8";  // kAttentionInit: a scheme means fp8
  const std::string type = StringMember(*scheme, "type");
  const Json* bits = Member(*scheme, "num_bits");
  if (type != "float" || !IsNumber(bits, 8)) {
    p.refusals.push_back(absl::StrCat(
        "kv_cache_scheme has type '", type, "', num_bits ",
        bits == nullptr ? "null" : bits->dump(),
        ": vLLM supports only type 'float' with num_bits 8 and stops with "
        "NotImplementedError (",
        kCtValidate, ")"));
  }
  facts.strategy = StringMember(*scheme, "strategy");
  if (facts.strategy != "tensor" && facts.strategy != "attn_head") {
    p.refusals.push_back(absl::StrCat(
        "kv_cache_scheme.strategy '", facts.strategy,
        "': vLLM accepts only 'tensor' or 'attn_head' (", kCtValidate, ")"));
  }
  if (!Truthy(Member(*scheme, "symmetric"))) {
    p.refusals.push_back(absl::StrCat(
        "kv_cache_scheme.symmetric is not true: vLLM supports only symmetric "
        "KV-cache scales (",
        kCtValidate, ")"));
  }
  if (absl::StartsWith(options.kv_cache_dtype, "fp8_e5m2")) {
    p.refusals.push_back(absl::StrCat(
        "--kv-cache-dtype fp8_e5m2 with a kv_cache_scheme: \"fp8_e5m2 "
        "kv-cache is not supported with fp8 checkpoints\" (",
        "model_executor/layers/attention/attention.py _init_kv_cache_quant)"));
  }
  if (facts.strategy == "attn_head" && Member(qc, "config_groups") == nullptr) {
    p.refusals.push_back(absl::StrCat(
        "strategy 'attn_head' without quantization_config.config_groups: vLLM "
        "passes the head counts only when config_groups exists "
        "(model_loader/weight_utils.py get_quant_config), and the per-head "
        "loader then fails on the missing total_num_heads (",
        kCtLoader, ")"));
  }
}

void CheckModelOpt(const Json& qc, MethodFacts& facts, VllmPrediction& p) {
  facts.base_method = true;
  // The KV-cache method: nested {"quantization": {...}} reads
  // kv_cache_quant_algo; the flat config.json form reads only a
  // kv_cache_scheme dict.
  std::string algo;
  bool kv_quant = false;
  if (const Json* nested = Member(qc, "quantization")) {
    algo = StringMember(*nested, "quant_algo");
    kv_quant = !StringMember(*nested, "kv_cache_quant_algo").empty();
  } else {
    algo = StringMember(qc, "quant_algo");
    const Json* scheme = Member(qc, "kv_cache_scheme");
    kv_quant = scheme != nullptr && scheme->is_object() &&
               StringMember(*scheme, "type") == "float" &&
               IsNumber(Member(*scheme, "num_bits"), 8);
  }
  if (algo.empty()) {
    p.refusals.push_back(absl::StrCat(
        "ModelOpt quantization_config has no quant_algo: \"Missing "
        "'quant_algo' in quantization config\" (",
        kModelOptConfig, ")"));
  }
  // MIXED_PRECISION gives Attention a KV-cache method only with a KV algo
  // (ModelOptMixedPrecisionConfig.get_quant_method); the others always.
  facts.kv_method = Upper(algo) != "MIXED_PRECISION" || kv_quant;
  if (!facts.kv_method) {
    p.silent.push_back(absl::StrCat(
        "ModelOpt MIXED_PRECISION without a KV-cache algorithm (flat "
        "config.json: a kv_cache_scheme dict; nested: "
        "quantization.kv_cache_quant_algo): the attention layers get no "
        "KV-cache method and every scale is dropped (",
        kModelOptConfig, ", ModelOptMixedPrecisionConfig.get_quant_method)"));
  }
  // kDtypeResolver: what --kv-cache-dtype auto becomes.
  const Json* inner = Member(qc, "quantization");
  if (inner == nullptr) inner = &qc;
  const Json* kv = nullptr;
  for (const Json* candidate :
       {Member(*inner, "kv_cache_scheme"), Member(qc, "kv_cache_scheme"),
        Member(*inner, "kv_cache_quant_algo"),
        Member(qc, "kv_cache_quant_algo")}) {
    if (Truthy(candidate)) {
      kv = candidate;
      break;
    }
  }
  facts.cache_from_config = "auto";
  if (kv != nullptr && kv->is_object()) {
    const Json* dynamic = Member(*kv, "dynamic");
    if (dynamic != nullptr && dynamic->is_boolean() && !dynamic->get<bool>() &&
        IsNumber(Member(*kv, "num_bits"), 8) &&
        StringMember(*kv, "type") == "float") {
      // The dict becomes "fp8", which the string map turns into fp8_e4m3.
      facts.cache_from_config = "fp8_e4m3";
    } else if (IsNumber(Member(*kv, "num_bits"), 4) &&
               StringMember(*kv, "type") == "float") {
      facts.cache_from_config = "nvfp4";
    }
  } else if (kv != nullptr && kv->is_string()) {
    const std::string s = Lower(kv->get<std::string>());
    if (s == "fp8") facts.cache_from_config = "fp8_e4m3";
    if (s == "nvfp4") facts.cache_from_config = "nvfp4";
  }
}

// The output_tensors entry that the layer_quant_config entries matched by
// export.kv_cache_group (`group`, not empty) share, as vLLM 0.34 reads it;
// null, with a refusal in `p`, where vLLM would fail.
const Json* QuarkKvCacheOutputTensors(const Json& qc, const Json& group,
                                      VllmPrediction& p) {
  const Json* layers = Member(qc, "layer_quant_config");
  if (layers == nullptr || !layers->is_object()) {
    p.refusals.push_back(
        absl::StrCat("Quark export.kv_cache_group is set but there is no "
                     "layer_quant_config (",
                     kQuarkConfig, ")"));
    return nullptr;
  }
  std::vector<const Json*> matched;
  for (const auto& [name, entry] : layers->items()) {
    for (const Json& pattern : group) {
      if (pattern.is_string() &&
          ::fnmatch(pattern.get<std::string>().c_str(), name.c_str(), 0) == 0) {
        matched.push_back(&entry);
        break;
      }
    }
  }
  if (matched.empty()) {
    p.refusals.push_back(absl::StrCat(
        "Quark export.kv_cache_group ", group.dump(),
        " matches no layer_quant_config entry: \"no kv_cache quantization "
        "settings were found\" (",
        kQuarkConfig, ")"));
    return nullptr;
  }
  const Json* first = Member(*matched[0], "output_tensors");
  for (const Json* entry : matched) {
    const Json* out = Member(*entry, "output_tensors");
    if ((out == nullptr) != (first == nullptr) ||
        (out != nullptr && *out != *first)) {
      p.refusals.push_back(absl::StrCat(
          "Quark layer_quant_config entries of the kv_cache_group differ in "
          "output_tensors (",
          kQuarkConfig, ")"));
      return nullptr;
    }
  }
  if (first == nullptr || first->is_null()) {
    p.refusals.push_back(absl::StrCat(
        "Quark kv_cache_group entries have no output_tensors: \"The kv_cache "
        "quantization configuration is empty\" (",
        kQuarkConfig, ")"));
    return nullptr;
  }
  return first;
}

void CheckQuark(const Json& qc, MethodFacts& facts, VllmPrediction& p) {
  facts.base_method = true;
  facts.kv_method = true;  // get_quant_method_target: every Attention layer
  // Nothing in vLLM 0.34 switches a Quark model's cache to fp8.
  facts.cache_from_config = "auto";
  const Json* exported = Member(qc, "export");
  if (exported == nullptr || exported->is_null()) {
    p.refusals.push_back(absl::StrCat(
        "Quark quantization_config has no 'export' block: \"The export key "
        "should be included in the configurations of Quark quantized model\" (",
        kQuarkConfig, ")"));
    return;
  }
  const Json* group = Member(*exported, "kv_cache_group");
  if (group == nullptr || !group->is_array()) {
    p.refusals.push_back(absl::StrCat(
        "Quark export.kv_cache_group is missing or not a list: vLLM calls "
        "len() on it and fails (",
        kQuarkConfig, ")"));
    return;
  }
  if (Member(qc, "kv_cache_group") != nullptr) {
    p.notes.push_back(
        "a top-level quantization_config.kv_cache_group is never read by "
        "vLLM 0.34 (it reads export.kv_cache_group)");
  }
  if (group->empty()) return;
  const Json* first = QuarkKvCacheOutputTensors(qc, *group, p);
  if (first == nullptr) return;
  if (StringMember(*first, "dtype") != "fp8_e4m3") {
    p.refusals.push_back(absl::StrCat(
        "Quark KV-cache output_tensors dtype '", StringMember(*first, "dtype"),
        "': vLLM supports only fp8_e4m3 (quantization/quark/quark.py "
        "QuarkKVCacheMethod.validate_kv_cache_config)"));
  }
  if (StringMember(*first, "qscheme") != "per_tensor") {
    p.refusals.push_back(absl::StrCat(
        "Quark KV-cache output_tensors qscheme '",
        StringMember(*first, "qscheme"),
        "': vLLM supports only per_tensor (quantization/quark/quark.py "
        "QuarkKVCacheMethod.validate_kv_cache_config)"));
  }
}

std::optional<std::pair<uint32_t, int>> ParseAttentionParam(
    const std::string& mapped) {
  static const std::regex kParam(
      R"(.*\.layers\.(\d+)\.self_attn\.attn\.([qkv])_scale)");
  std::smatch m;
  if (!std::regex_match(mapped, m, kParam)) return std::nullopt;
  uint32_t layer = 0;
  if (!absl::SimpleAtoi(m[1].str(), &layer)) return std::nullopt;
  const char c = m[2].str()[0];
  return std::make_pair(layer, c == 'q' ? 0 : c == 'k' ? 1 : 2);
}

// The compressed-tensors per-head loader (kCtLoader) at tensor-parallel size
// 1: flatten, q reduced by max over groups of H/KV, the first KV values copied
// (a single value broadcasts). Empty and a refusal when it raises.
std::vector<float> LoadPerHead(const Loaded& in, int role,
                               const ModelGeometry& g, const std::string& what,
                               VllmPrediction& p) {
  std::vector<float> v = in.values;
  const uint32_t kv = g.num_key_value_heads;
  if (role == 0) {
    const uint32_t group = g.num_attention_heads / kv;
    if (v.empty() || v.size() % group != 0) {
      p.refusals.push_back(absl::StrCat(
          what, " has ", v.size(), " values: vLLM's view(-1, ", group,
          ") to reduce q per KV group raises (", kCtLoader, ")"));
      return {};
    }
    if (v.size() != g.num_attention_heads) {
      p.silent.push_back(absl::StrCat(
          what, " has ", v.size(), " values, not one per query head (",
          g.num_attention_heads, "): vLLM reduces groups of ", group,
          " consecutive values itself, so an already reduced q is reduced "
          "again (",
          kCtLoader, ")"));
    }
    std::vector<float> reduced;
    for (size_t i = 0; i < v.size(); i += group) {
      float m = v[i];
      for (size_t j = 1; j < group; ++j) m = std::max(m, v[i + j]);
      reduced.push_back(m);
    }
    v = std::move(reduced);
  }
  if (v.size() > kv) {
    p.silent.push_back(absl::StrCat(what, " holds ", v.size(),
                                    " values after reduction; vLLM keeps the "
                                    "first ",
                                    kv, " (", kCtLoader, ")"));
    v.resize(kv);
  }
  if (v.size() == 1 && kv > 1) {
    p.notes.push_back(absl::StrCat(what,
                                   " holds one value: vLLM copies it to every "
                                   "KV head"));
    v.assign(kv, v[0]);
  }
  if (v.size() != kv) {
    p.refusals.push_back(absl::StrCat(
        what, " gives ", v.size(), " values for ", kv,
        " KV heads: the copy into the parameter raises (", kCtLoader, ")"));
    return {};
  }
  return v;
}

}  // namespace

absl::StatusOr<VllmPlatform> ParseVllmPlatform(absl::string_view name) {
  if (name == "cuda") return VllmPlatform::kCuda;
  if (name == "rocm") return VllmPlatform::kRocm;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown platform '", name, "' (cuda or rocm)"));
}

absl::string_view VllmPlatformName(VllmPlatform platform) {
  return platform == VllmPlatform::kRocm ? "rocm" : "cuda";
}

bool IsVllmScaleName(absl::string_view name) {
  static const std::regex kScale(
      R"(.*\.(?:[qkv]_scale|kv_scale|[qkv]_proj\.output_scale|self_attn\.q\.scale|self_attn\.[kv]_cache\.scale))");
  return std::regex_match(name.begin(), name.end(), kScale);
}

std::string VllmMappedScaleName(absl::string_view method,
                                const std::string& name) {
  if (method == "none") return name;  // no quantization config, no mapper
  // base_config.py QuantizationConfig.get_cache_scale_mapper, regexes in
  // order, each applied to the result of the previous one.
  static const std::vector<std::pair<std::regex, std::string>> kRegexes = {
      {std::regex(R"(\.kv_scale$)"), ".attn.k_scale"},
      {std::regex(R"(\.self_attn\.[kv]_proj\.([kv])_scale$)"),
       ".self_attn.attn.$1_scale"},
      {std::regex(R"(\.self_attn\.qk(?:qk)?v_proj\.([kv])_scale$)"),
       ".self_attn.attn.$1_scale"},
      {std::regex(R"(\.mixer\.[kv]_proj\.([kv])_scale$)"),
       ".mixer.attn.$1_scale"},
      {std::regex(R"(\.self_attn\.q\.scale$)"), ".self_attn.attn.q_scale"},
      {std::regex(R"(\.self_attn\.([kv])_cache\.scale$)"),
       ".self_attn.attn.$1_scale"},
  };
  std::string key = name;
  for (const auto& [pattern, replacement] : kRegexes) {
    if (std::regex_search(key, pattern)) {
      key = std::regex_replace(key, pattern, replacement);
    }
  }
  // `(?<!\.attn)\.([qkv])_scale$` -> `.attn.\1_scale` (std::regex has no
  // look-behind).
  for (const char* letter : kRoleLetters) {
    const std::string suffix = absl::StrCat(".", letter, "_scale");
    if (absl::EndsWith(key, suffix) &&
        !absl::EndsWith(key, absl::StrCat(".attn", suffix))) {
      key = absl::StrCat(key.substr(0, key.size() - suffix.size()), ".attn",
                         suffix);
      break;
    }
  }
  if (method == "quark") {
    // quark.py QuarkConfig.get_cache_scale_mapper: suffixes, after the
    // regexes.
    static const std::pair<const char*, const char*> kSuffixes[] = {
        {".k_proj.output_scale", ".attn.k_scale"},
        {".v_proj.output_scale", ".attn.v_scale"},
        {".q_proj.output_scale", ".attn.q_scale"},
    };
    for (const auto& [from, to] : kSuffixes) {
      if (absl::EndsWith(key, from)) {
        key = absl::StrCat(key.substr(0, key.size() - std::strlen(from)), to);
      }
    }
  }
  return key;
}

namespace {

// Which attention backends can run the scales (v1/attention/backend.py
// validate_configuration: per-head scales need
// supports_per_head_quant_scales, which only FlashAttention 3+ has).
void PredictBackends(bool rocm, VllmPrediction& p) {
  if (p.per_head) {
    p.backends =
        "FLASH_ATTN with FlashAttention 3 or later only (Hopper and newer)";
    p.notes.push_back(
        "per-head scales: on any other attention backend (FlashInfer, "
        "Triton, FA2 on Ampere/Ada, ROCm) vLLM stops at start with \"No valid "
        "attention backend found\" (platforms/cuda.py "
        "get_attn_backend_cls)");
    if (rocm) {
      p.refusals.push_back(
          "per-head scales on ROCm: no ROCm attention backend supports them; "
          "\"No valid attention backend found\" (platforms/rocm.py)");
    }
  } else {
    p.backends = "every FP8-capable attention backend";
  }
}

// The NVFP4 caches vLLM 0.34 serves for a decoder (non-MLA) model
// (config/cache.py CacheDType; v1/kv_cache_interface.py get_kv_quant_mode:
// KVQuantMode.NVFP4, a quantized cache for BaseKVCacheMethod).
bool IsNvfp4Cache(const std::string& dtype) {
  return dtype == "nvfp4" || dtype == "nvfp4_4over6";
}

// Which attention backends serve an NVFP4 cache (kFlashInfer). FlashInfer
// is the only one whose supported_kv_cache_dtypes list nvfp4 (FLASH_ATTN,
// TRITON_ATTN, FLEX_ATTENTION, B12X and the ROCm backends do not).
// FlashInferBackend.supports_kv_cache_dtype splits it by GPU family:
// 8.x, 9.x and 12.x (_nvfp4_kv_on_fa2) run its FA2 path, "nvfp4" only (its
// store, FlashInfer's nvfp4_quantize_append_paged_kv_cache_with_slot_mapping,
// has no 4over6 scale search), not at head size 64 and not with attention
// sinks (supports_combination), the query kept in the model dtype
// (FlashInferMetadataBuilder.get_q_data_type; FlashInferImpl.forward passes
// q_scale=1.0); 10.x runs trtllm-gen (supports_trtllm_attention for prefill
// and decode), both variants, stored by vLLM's reshape_and_cache_flash
// NVFP4 kernel, the query quantized to FP8 with q_scale. Both stores read
// one scalar per layer and side: the global scale 1 / k_scale (1 / v_scale).
void PredictNvfp4Backends(const VllmLoadOptions& options,
                          const ModelGeometry& g, VllmPrediction& p) {
  const std::string& dtype = p.kv_cache_dtype;
  if (options.platform == VllmPlatform::kRocm) {
    p.refusals.push_back(absl::StrCat(
        "--kv-cache-dtype ", dtype,
        " on ROCm: no ROCm attention backend lists nvfp4 among its "
        "supported_kv_cache_dtypes; ",
        kNoBackend));
    return;
  }
  if (p.per_head) {
    p.refusals.push_back(absl::StrCat(
        "per-head scales with an ", dtype,
        " cache: FlashInfer, the only backend with an NVFP4 cache, has no "
        "per-head quant scales (v1/attention/backend.py "
        "validate_configuration) and its NVFP4 store reads one global scale "
        "per layer; ",
        kNoBackend));
    return;
  }
  const uint32_t head = g.head_dim;
  if (head != 64 && head != 128 && head != 256 && head != 512) {
    p.refusals.push_back(absl::StrCat(
        "head size ", head,
        ": FlashInfer, the only backend with an NVFP4 "
        "cache, supports head sizes 64, 128, 256 and 512 (",
        kFlashInfer, " FlashInferBackend.get_supported_head_sizes); ",
        kNoBackend));
    return;
  }
  const bool fa2 = dtype == "nvfp4" && head != 64;
  if (fa2) {
    p.backends =
        "FLASHINFER only: trtllm-gen on compute capability 10.x (SM100 "
        "family), its FA2 path on 8.x, 9.x and 12.x";
  } else {
    p.backends =
        "FLASHINFER trtllm-gen only, on compute capability 10.x (SM100 "
        "family)";
    p.notes.push_back(absl::StrCat(
        dtype == "nvfp4" ? "head size 64" : "nvfp4_4over6",
        ": FlashInfer's FA2 path (compute capability 8.x, 9.x, 12.x) refuses "
        "it (",
        kFlashInfer,
        dtype == "nvfp4"
            ? " FlashInferBackend.supports_combination: \"fa2 prefill "
              "misreads an NVFP4 KV cache at head_size 64\")"
            : " FlashInferBackend.supports_kv_cache_dtype: the FA2 store has "
              "no 4over6 scale search)",
        "; other GPUs stop at start with ", kNoBackend));
  }
  p.notes.push_back(absl::StrCat(
      dtype,
      " cache: each block of 16 K (V) values gets an e4m3 block scale "
      "relative to the layer's global scale 1 / k_scale (1 / v_scale); on "
      "compute capability 10.x (trtllm-gen) vLLM also quantizes the query to "
      "FP8 with q_scale and writes the attention output in FP8",
      fa2 ? "; on the FA2 path the query stays in the model dtype and "
            "q_scale is not used"
          : "",
      " (", kFlashInfer,
      " FlashInferMetadataBuilder.get_q_data_type, "
      "FlashInferImpl.forward)"));
}

// Which attention parameter each scale tensor loads into (kLoaderRule), by
// (layer, role index); names that load nowhere are refusals or silent drops.
std::map<std::pair<uint32_t, int>, Loaded> MapScaleTensors(
    const std::vector<VllmScaleTensor>& tensors, const ModelGeometry& g,
    const MethodFacts& facts, VllmPrediction& p) {
  std::map<std::pair<uint32_t, int>, Loaded> loaded;
  for (const VllmScaleTensor& t : tensors) {
    const std::string mapped = VllmMappedScaleName(p.method, t.name);
    const auto param = ParseAttentionParam(mapped);
    if (param && param->first < g.num_layers && facts.kv_method) {
      Loaded& l = loaded[*param];
      l.names.push_back(t.name);
      l.values = t.values;
      l.shape = t.shape;
      continue;
    }
    // With a quantization config, unexpected names ending in .q_scale,
    // .k_scale or .v_scale are skipped silently
    // (base_config.py QuantizationConfig._ignore_unexpected_suffixes).
    const bool ignorable =
        p.method != "none" && (absl::EndsWith(mapped, ".q_scale") ||
                               absl::EndsWith(mapped, ".k_scale") ||
                               absl::EndsWith(mapped, ".v_scale"));
    if (ignorable && (!param || param->first < g.num_layers)) {
      p.silent.push_back(absl::StrCat(
          t.name, " is dropped: it maps to ", mapped,
          ", a parameter the model does not have, and vLLM skips unexpected "
          "*_scale names without a word (",
          kLoaderRule, ")"));
    } else {
      p.refusals.push_back(absl::StrCat(
          t.name, " maps to ", mapped,
          ": \"There is no module or parameter named\" it; vLLM stops "
          "loading the checkpoint (",
          kLoaderRule, ")"));
    }
  }
  for (const auto& [key, l] : loaded) {
    if (l.names.size() > 1) {
      p.silent.push_back(absl::StrCat(
          "layer ", key.first, ": ", absl::StrJoin(l.names, " and "),
          " all load into self_attn.attn.", kRoleLetters[key.second],
          "_scale; the one read last wins"));
    }
  }
  return loaded;
}

// What is said once per prediction, not once per layer.
struct Warned {
  bool unused = false;
  bool no_method = false;
  bool rocm = false;
};

// compressed-tensors: scales are loaded as written, never checked
// (kCtProcess).
void PredictCompressedTensorsLayer(const std::string& where,
                                   const std::array<const Loaded*, 3>& in,
                                   const ModelGeometry& g, bool rocm,
                                   Warned& warned, VllmPrediction& p,
                                   std::array<VllmRoleOutcome, 3>& out) {
  for (int r = 0; r < 3; ++r) {
    const std::string what =
        in[r] != nullptr ? in[r]->names.back()
                         : absl::StrCat(where, kRoleLetters[r], "_scale");
    const size_t n_params = p.per_head ? g.num_key_value_heads : 1;
    std::vector<float> v;
    if (in[r] == nullptr) {
      v.assign(n_params, 1.0f);
      out[r].fate = "missing: 1.0";
      p.silent.push_back(absl::StrCat(
          where, "has no ", kRoleLetters[r],
          "_scale: vLLM keeps 1.0 without a warning (", kCtProcess, ")"));
    } else if (p.per_head) {
      v = LoadPerHead(*in[r], r, g, what, p);
      out[r].fate = v.empty() ? "refused" : "used";
    } else if (in[r]->values.size() != 1) {
      p.refusals.push_back(absl::StrCat(
          what, " has ", in[r]->values.size(),
          " values but strategy 'tensor' makes a [1] parameter: "
          "\"Attempted to load weight\" (model_loader/weight_utils.py "
          "default_weight_loader)"));
      out[r].fate = "refused";
    } else {
      v = in[r]->values;
      out[r].fate = "used";
    }
    if (!v.empty() && in[r] != nullptr && !AllFinitePositive(v)) {
      p.silent.push_back(absl::StrCat(
          what, " holds ", FloatList(in[r]->values),
          ": vLLM uses scales as they are, without checking they are "
          "finite and > 0 (",
          kCtProcess, ")"));
    }
    out[r].effective = v;
  }
  if (rocm && !warned.rocm) {
    warned.rocm = true;
    p.silent.push_back(absl::StrCat(
        "ROCm fp8 (e4m3fnuz): compressed-tensors scales are used as "
        "written, not doubled like the ModelOpt/Quark path; scales "
        "calibrated for e4m3fn (qmax 448) then saturate values beyond "
        "240/448 of the calibrated range (",
        kCtProcess, ")"));
  }
}

// ModelOpt / Quark: BaseKVCacheMethod (kBaseProcess).
// The scalar each loaded scale holds (-1, vLLM's sentinel, where none was
// loaded); false, with a refusal, where one holds more than one value.
bool ScalarScales(const std::array<const Loaded*, 3>& in, VllmPrediction& p,
                  std::array<float, 3>& raw) {
  raw = {-1.0f, -1.0f, -1.0f};
  bool scalar = true;
  for (int r = 0; r < 3; ++r) {
    if (in[r] == nullptr) continue;
    if (in[r]->values.size() != 1) {
      p.refusals.push_back(
          absl::StrCat(in[r]->names.back(), " has ", in[r]->values.size(),
                       " values: \"KV-cache scale expects a scalar weight\" (",
                       kBaseLoader, ")"));
      scalar = false;
      continue;
    }
    raw[r] = in[r]->values[0];
  }
  return scalar;
}

// The k and v scales vLLM's process_weights_after_loading makes of the
// loaded ones (`raw`, times `factor` on ROCm), with their fates in `out`;
// false, with a refusal, where vLLM stops at start.
bool ResolveKvScales(const std::string& where,
                     const std::array<const Loaded*, 3>& in,
                     const std::array<float, 3>& raw, float factor,
                     VllmPrediction& p, std::array<VllmRoleOutcome, 3>& out) {
  float k = raw[1], v = raw[2];
  if (k > 0 && v > 0) {
    out[1].fate = out[2].fate = "used";
    k *= factor;
    v *= factor;
  } else if (k < 0 && v < 0) {
    k = v = 1.0f;
    out[1].fate = out[2].fate = "missing: 1.0";
    p.silent.push_back(absl::StrCat(
        where,
        "has no usable k_scale and v_scale: vLLM uses 1.0 for both (and "
        "logs a warning) (",
        kBaseProcess, ")"));
  } else if (!(k > 0)) {
    p.refusals.push_back(absl::StrCat(
        where, "k_scale ", in[1] == nullptr ? "missing" : absl::StrCat(k),
        " with v_scale ", in[2] == nullptr ? "missing" : absl::StrCat(v),
        ": vLLM stops at start with an AssertionError (", kBaseProcess, ")"));
    return false;
  } else {
    out[1].fate = "used";
    out[2].fate = "missing: v := k";
    p.silent.push_back(absl::StrCat(
        where, "v_scale ", in[2] == nullptr ? "missing" : absl::StrCat(raw[2]),
        ": vLLM silently uses max(k_scale, v_scale) = k_scale for both (",
        kBaseProcess, ")"));
    k = v = PyMax(k, v) * factor;
  }
  out[1].effective = {k};
  out[2].effective = {v};
  return true;
}

void PredictBaseKvCacheLayer(uint32_t layer, const std::string& where,
                             const std::array<const Loaded*, 3>& in, bool rocm,
                             Warned& warned, VllmPrediction& p,
                             std::array<VllmRoleOutcome, 3>& out) {
  std::array<float, 3> raw;
  const float factor = rocm ? 2.0f : 1.0f;
  if (!ScalarScales(in, p, raw) ||
      !ResolveKvScales(where, in, raw, factor, p, out)) {
    for (int r = 0; r < 3; ++r) out[r].fate = "refused";
    return;
  }
  float q = raw[0];
  if (q > 0) {
    q *= factor;
    out[0].fate = "used";
  } else {
    q = 1.0f;
    out[0].fate = "missing: 1.0";
    p.silent.push_back(absl::StrCat(
        where, "q_scale ", in[0] == nullptr ? "missing" : absl::StrCat(raw[0]),
        ": vLLM quantizes the query with 1.0 (its log says it falls back to "
        "k_scale, the code then sets 1.0) (",
        kBaseProcess, ")",
        IsNvfp4Cache(p.kv_cache_dtype)
            ? "; with an NVFP4 cache that is the FP8 query of compute "
              "capability 10.x (trtllm-gen)"
            : ""));
  }
  for (int r = 1; r < 3; ++r) {
    if (in[r] != nullptr && !std::isfinite(raw[r])) {
      p.silent.push_back(absl::StrCat(in[r]->names.back(), " holds ", raw[r],
                                      ": vLLM uses it as it is (", kBaseProcess,
                                      ")"));
    }
  }
  out[0].effective = {q};
  if (layer == 0 && p.kv_cache_dtype == "fp8") {
    p.notes.push_back(absl::StrCat(
        "vLLM logs \"Using uncalibrated q_scale ... and/or prob_scale 1.0 "
        "with fp8 attention\": the checkpoint has no prob_scale (the "
        "softmax probabilities' scale, which kvcal does not calibrate), so "
        "vLLM uses 1.0 for it (",
        kBaseProcess, ")"));
  }
  if (rocm && !warned.rocm) {
    warned.rocm = true;
    p.notes.push_back(absl::StrCat(
        "ROCm fp8 (e4m3fnuz): vLLM doubles every ", p.method,
        " scale it loads, which is right for scales calibrated for e4m3fn "
        "(",
        kBaseProcess, ")"));
  }
}

// A layer whose KV cache is not fp8: vLLM ignores every scale (said once,
// where the checkpoint has any).
void PredictUnusedCacheLayer(bool any_loaded, const VllmLoadOptions& options,
                             Warned& warned, VllmPrediction& p,
                             std::array<VllmRoleOutcome, 3>& out) {
  for (int r = 0; r < 3; ++r) {
    out[r].fate = absl::StrCat("unused: cache ", p.kv_cache_dtype);
  }
  if (warned.unused || !any_loaded) return;
  warned.unused = true;
  p.silent.push_back(
      absl::StrCat("the KV cache is not quantized (--kv-cache-dtype ",
                   options.kv_cache_dtype, " resolves to '", p.kv_cache_dtype,
                   "' for a ", p.method,
                   " checkpoint): vLLM ignores every scale; run it with "
                   "--kv-cache-dtype fp8 (or nvfp4) (",
                   kAttentionInit, ", ", kDtypeResolver, ")"));
}

// A layer without a KV-cache quantization method: scale 1.0 for all three
// (said once).
void PredictNoMethodLayer(Warned& warned, VllmPrediction& p,
                          std::array<VllmRoleOutcome, 3>& out) {
  for (int r = 0; r < 3; ++r) {
    out[r].fate = "missing: 1.0";
    out[r].effective = {1.0f};
  }
  if (warned.no_method) return;
  warned.no_method = true;
  p.silent.push_back(absl::StrCat(
      "no KV-cache quantization method for the attention layers: vLLM "
      "runs the ",
      p.kv_cache_dtype,
      " cache with scale 1.0 everywhere "
      "(model_executor/layers/attention/attention.py "
      "set_default_quant_scales)"));
}

}  // namespace

VllmPrediction PredictVllmLoad(const Json& config, const ModelGeometry& g,
                               const std::vector<VllmScaleTensor>& tensors,
                               const VllmLoadOptions& options) {
  VllmPrediction p;
  const Json* qc = QuantizationConfigOf(config);
  p.method = qc == nullptr ? "none" : StringMember(*qc, "quant_method");
  if (p.method.empty()) p.method = "unknown";
  const bool rocm = options.platform == VllmPlatform::kRocm;

  MethodFacts facts;
  if (p.method == "compressed-tensors") {
    CheckCompressedTensors(*qc, options, facts, p);
  } else if (absl::StartsWith(p.method, "modelopt")) {
    CheckModelOpt(*qc, facts, p);
  } else if (p.method == "quark") {
    CheckQuark(*qc, facts, p);
  } else if (p.method == "none") {
    facts.cache_from_config = "auto";
  } else {
    p.modelled = false;
    p.kv_cache_dtype = options.kv_cache_dtype;
    p.notes.push_back(
        absl::StrCat("kvcal does not model vLLM's '", p.method,
                     "' loader: nothing about its scales is predicted"));
    return p;
  }
  p.per_head = facts.strategy == "attn_head";
  p.kv_cache_dtype = options.kv_cache_dtype == "auto" ? facts.cache_from_config
                                                      : options.kv_cache_dtype;
  const bool nvfp4_cache = IsNvfp4Cache(p.kv_cache_dtype);
  // kv_cache.py BaseKVCacheMethod.process_weights_after_loading uses the
  // scales for every quantized cache (is_quantized_kv_cache).
  const bool quantized_cache =
      absl::StartsWith(p.kv_cache_dtype, "fp8") || nvfp4_cache;

  if (nvfp4_cache) {
    PredictNvfp4Backends(options, g, p);
  } else {
    PredictBackends(rocm, p);
  }
  const std::map<std::pair<uint32_t, int>, Loaded> loaded =
      MapScaleTensors(tensors, g, facts, p);
  Warned warned;
  for (uint32_t layer = 0; layer < g.num_layers; ++layer) {
    std::array<VllmRoleOutcome, 3>& out = p.layers[layer];
    std::array<const Loaded*, 3> in{};
    for (int r = 0; r < 3; ++r) {
      auto it = loaded.find({layer, r});
      if (it != loaded.end()) {
        in[r] = &it->second;
        out[r].tensors = it->second.names;
      }
    }
    const std::string where = absl::StrCat("layer ", layer, " ");
    if (!quantized_cache) {
      PredictUnusedCacheLayer(!loaded.empty(), options, warned, p, out);
    } else if (!facts.kv_method) {
      PredictNoMethodLayer(warned, p, out);
    } else if (!facts.base_method) {
      PredictCompressedTensorsLayer(where, in, g, rocm, warned, p, out);
    } else {
      PredictBaseKvCacheLayer(layer, where, in, rocm, warned, p, out);
    }
  }
  return p;
}

Json VllmPrediction::ToJson() const {
  Json out = {{"vllm_version", kVllmVersion},
              {"quant_method", method},
              {"modelled", modelled},
              {"kv_cache_dtype", kv_cache_dtype},
              {"per_head", per_head},
              {"backends", backends},
              {"starts", starts()},
              {"clean", clean()},
              {"refusals", refusals},
              {"silent", silent},
              {"notes", notes}};
  Json rows = Json::array();
  for (const auto& [layer, roles] : layers) {
    Json row = {{"layer", layer}};
    for (int r = 0; r < 3; ++r) {
      row[kRoleLetters[r]] = {{"tensors", roles[r].tensors},
                              {"fate", roles[r].fate},
                              {"effective", roles[r].effective}};
    }
    rows.push_back(std::move(row));
  }
  out["layers"] = std::move(rows);
  return out;
}

}  // namespace kvcal
