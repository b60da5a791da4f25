#include "client/checkpoint/demo_model.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/checkpoint/safetensors.h"
#include "client/checkpoint/tensor_names.h"
#include "nlohmann/json.hpp"
#include "util/status_macros.h"

namespace kvcal {
namespace {

using Json = nlohmann::ordered_json;

struct OwnedTensor {
  std::string name;
  std::vector<uint64_t> shape;
  std::vector<uint16_t> bf16;
};

OwnedTensor RandomBf16(std::string name, std::vector<uint64_t> shape,
                       float stddev, std::mt19937_64& rng) {
  OwnedTensor t{std::move(name), std::move(shape), {}};
  uint64_t n = 1;
  for (uint64_t d : t.shape) n *= d;
  std::normal_distribution<float> normal(0.0f, stddev);
  t.bf16.resize(n);
  for (uint16_t& v : t.bf16) v = EncodeBf16(normal(rng));
  return t;
}

absl::Status WriteOwned(const std::string& path,
                        const std::vector<OwnedTensor>& tensors) {
  std::vector<TensorToWrite> out;
  for (const OwnedTensor& t : tensors) {
    out.push_back({t.name, "BF16", t.shape,
                   absl::Span<const std::byte>(
                       reinterpret_cast<const std::byte*>(t.bf16.data()),
                       t.bf16.size() * 2)});
  }
  return WriteSafetensors(path, out, {{"format", "pt"}});
}

}  // namespace

uint16_t EncodeBf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  if (std::isnan(x)) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

absl::Status WriteDemoCheckpoint(const std::string& dir,
                                 const DemoModelOptions& o) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir));
  const ModelGeometry& g = o.geometry;
  const uint32_t hidden = g.num_attention_heads * g.head_dim;
  const uint32_t kv = g.num_key_value_heads * g.head_dim;
  Json config = {{"architectures", {"LlamaForCausalLM"}},
                 {"model_type", "llama"},
                 {"hidden_size", hidden},
                 {"intermediate_size", o.intermediate_size},
                 {"num_hidden_layers", g.num_layers},
                 {"num_attention_heads", g.num_attention_heads},
                 {"num_key_value_heads", g.num_key_value_heads},
                 {"head_dim", g.head_dim},
                 {"max_position_embeddings", 2048},
                 {"rms_norm_eps", 1e-5},
                 {"rope_theta", 500000.0},
                 {"vocab_size", o.vocab_size},
                 {"tie_word_embeddings", false},
                 {"torch_dtype", "bfloat16"},
                 {"transformers_version", "4.46.0"}};
  KVCAL_RETURN_IF_ERROR(WriteOutputFile(
      (fs::path(dir) / "config.json").string(), config.dump(2) + "\n"));
  std::mt19937_64 rng(o.seed);
  // Shard 1: embeddings and the first half of the layers; shard 2: the rest.
  std::vector<std::vector<OwnedTensor>> shards(o.sharded ? 2 : 1);
  shards[0].push_back(RandomBf16("model.embed_tokens.weight",
                                 {o.vocab_size, hidden}, 0.02f, rng));
  for (uint32_t l = 0; l < g.num_layers; ++l) {
    std::vector<OwnedTensor>& shard =
        shards[o.sharded && l >= (g.num_layers + 1) / 2 ? 1 : 0];
    const std::string p = absl::StrCat("model.layers.", l, ".");
    shard.push_back(
        RandomBf16(p + "input_layernorm.weight", {hidden}, 0.1f, rng));
    shard.push_back(RandomBf16(p + "self_attn.q_proj.weight", {hidden, hidden},
                               0.02f, rng));
    shard.push_back(
        RandomBf16(p + "self_attn.k_proj.weight", {kv, hidden}, 0.02f, rng));
    shard.push_back(
        RandomBf16(p + "self_attn.v_proj.weight", {kv, hidden}, 0.02f, rng));
    shard.push_back(RandomBf16(p + "self_attn.o_proj.weight", {hidden, hidden},
                               0.02f, rng));
    shard.push_back(
        RandomBf16(p + "post_attention_layernorm.weight", {hidden}, 0.1f, rng));
    shard.push_back(RandomBf16(p + "mlp.gate_proj.weight",
                               {o.intermediate_size, hidden}, 0.02f, rng));
    shard.push_back(RandomBf16(p + "mlp.up_proj.weight",
                               {o.intermediate_size, hidden}, 0.02f, rng));
    shard.push_back(RandomBf16(p + "mlp.down_proj.weight",
                               {hidden, o.intermediate_size}, 0.02f, rng));
  }
  shards.back().push_back(RandomBf16("model.norm.weight", {hidden}, 0.1f, rng));
  shards.back().push_back(
      RandomBf16("lm_head.weight", {o.vocab_size, hidden}, 0.02f, rng));
  if (!o.sharded) {
    return WriteOwned((fs::path(dir) / "model.safetensors").string(),
                      shards[0]);
  }
  Json weight_map = Json::object();
  uint64_t total = 0;
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string name =
        absl::StrFormat("model-%05d-of-%05d.safetensors", s + 1, shards.size());
    KVCAL_RETURN_IF_ERROR(
        WriteOwned((fs::path(dir) / name).string(), shards[s]));
    for (const OwnedTensor& t : shards[s]) {
      weight_map[t.name] = name;
      total += t.bf16.size() * 2;
    }
  }
  Json index = {{"metadata", {{"total_size", total}}},
                {"weight_map", weight_map}};
  return WriteOutputFile(
      (fs::path(dir) / "model.safetensors.index.json").string(),
      index.dump(2) + "\n");
}

absl::Status WriteDemoDumps(const std::string& dir, const DemoModelOptions& m,
                            const DemoDumpOptions& o) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir));
  std::mt19937_64 rng(o.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::chi_squared_distribution<float> chi2(3.0f);
  auto student_t = [&] { return normal(rng) / std::sqrt(chi2(rng) / 3.0f); };
  for (uint32_t b = 0; b < o.batches; ++b) {
    std::vector<std::vector<float>> storage;
    std::vector<TensorToWrite> tensors;
    for (uint32_t l = 0; l < m.geometry.num_layers; ++l) {
      for (int r = 0; r < 3; ++r) {
        const uint32_t heads = r == 0 ? m.geometry.num_attention_heads
                                      : m.geometry.num_key_value_heads;
        const uint32_t outlier_head =
            (l * 3 + static_cast<uint32_t>(r)) % heads;
        std::vector<float> values(uint64_t{o.tokens} * heads *
                                  m.geometry.head_dim);
        // Generated as [token][head][dim]; written in the chosen layout.
        for (uint32_t t = 0; t < o.tokens; ++t) {
          for (uint32_t h = 0; h < heads; ++h) {
            const float head_scale =
                (h == outlier_head ? 6.0f : 1.0f) * (1.0f + 0.1f * l) *
                (r == 2 ? 0.5f : 1.5f) * (1.0f + 0.05f * b);
            for (uint32_t d = 0; d < m.geometry.head_dim; ++d) {
              float x = student_t() * head_scale;
              if (r == 1 && (d == 3 || d == m.geometry.head_dim / 2 + 3))
                x *= 10.0f;
              const uint64_t index =
                  o.heads_tokens_dim
                      ? (uint64_t{h} * o.tokens + t) * m.geometry.head_dim + d
                      : (uint64_t{t} * heads + h) * m.geometry.head_dim + d;
              values[index] = x;
            }
          }
        }
        storage.push_back(std::move(values));
        const std::vector<uint64_t> shape =
            o.heads_tokens_dim
                ? std::vector<uint64_t>{1, heads, o.tokens, m.geometry.head_dim}
                : std::vector<uint64_t>{o.tokens, heads, m.geometry.head_dim};
        tensors.push_back(
            {ActivationTensorName(l, kAllRoles[r]), "F32", shape,
             absl::Span<const std::byte>(
                 reinterpret_cast<const std::byte*>(storage.back().data()),
                 storage.back().size() * 4)});
      }
    }
    std::map<std::string, std::string> metadata = {{"batch", absl::StrCat(b)}};
    if (o.heads_tokens_dim) metadata["layout"] = "heads_tokens_dim";
    KVCAL_RETURN_IF_ERROR(WriteSafetensors(
        (fs::path(dir) / absl::StrFormat("batch-%04u.safetensors", b)).string(),
        tensors, metadata));
  }
  return absl::OkStatus();
}

}  // namespace kvcal
