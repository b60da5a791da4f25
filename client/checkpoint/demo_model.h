// Small synthetic models and activation dumps, for `kvcal demo` and tests.
//
//   kvcal::DemoModelOptions model;                 // Llama-style, GQA 4:1
//   KVCAL_RETURN_IF_ERROR(kvcal::WriteDemoCheckpoint("model", model));
//   KVCAL_RETURN_IF_ERROR(kvcal::WriteDemoDumps("dumps", model, {}));
//
// The checkpoint has a Llama config.json, random BF16 weights for every
// tensor a LlamaForCausalLM has, in two shards with an index (or one
// model.safetensors). The dumps hold post-RoPE-like Q/K/V activations with
// the shape of real ones: heavy tails (Student t, 3 degrees of freedom), a
// few outlier heads, outlier channels in K, GQA head counts.
#ifndef KVCAL_CLIENT_CHECKPOINT_DEMO_MODEL_H_
#define KVCAL_CLIENT_CHECKPOINT_DEMO_MODEL_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "client/checkpoint/model_config.h"

namespace kvcal {

// The attention geometry (what config.json will say, what the dumps hold)
// and the rest of a Llama model's size.
struct DemoModelOptions {
  ModelGeometry geometry{.num_layers = 4,
                         .num_attention_heads = 8,
                         .num_key_value_heads = 2,
                         .head_dim = 32};
  uint32_t intermediate_size = 512;
  uint32_t vocab_size = 512;
  bool sharded = true;
  uint64_t seed = 1;
};

struct DemoDumpOptions {
  uint32_t batches = 4;
  uint32_t tokens = 96;  // per batch
  uint64_t seed = 7;
  // Write [batch, heads, seq, head_dim] (Hugging Face layout) instead.
  bool heads_tokens_dim = false;
};

[[nodiscard]] absl::Status WriteDemoCheckpoint(const std::string& dir,
                                               const DemoModelOptions& options);
[[nodiscard]] absl::Status WriteDemoDumps(const std::string& dir,
                                          const DemoModelOptions& model,
                                          const DemoDumpOptions& options);

// Round-to-nearest-even float -> bfloat16 bits.
uint16_t EncodeBf16(float x);

}  // namespace kvcal

#endif  // KVCAL_CLIENT_CHECKPOINT_DEMO_MODEL_H_
