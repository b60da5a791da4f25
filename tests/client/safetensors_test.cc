#include "client/checkpoint/safetensors.h"

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/checkpoint/model_config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/test_util.h"

namespace kvcal {
namespace {

using ::kvcal::testing::ReadFile;
using ::kvcal::testing::StatusIs;
using ::kvcal::testing::TempDir;
using ::kvcal::testing::WriteFile;
using ::testing::HasSubstr;

// A raw file: 8-byte length, `header`, then `data_bytes` bytes.
std::string RawFile(const std::string& header, size_t data_bytes,
                    int64_t length_override = -1) {
  const uint64_t n = length_override >= 0
                         ? static_cast<uint64_t>(length_override)
                         : header.size();
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  out += header;
  out.append(data_bytes, '\x5a');
  return out;
}

absl::Status OpenRaw(const std::string& contents) {
  TempDir dir;
  WriteFile(dir / "x.safetensors", contents);
  return SafetensorsFile::Open(dir / "x.safetensors").status();
}

TEST(SafetensorsTest, RoundTripPadsHeaderAndKeepsBytes) {
  TempDir dir;
  std::vector<float> a = {1.5f, -2.0f, 3.25f};
  std::vector<uint16_t> b = {1, 2, 3, 4, 5, 6};
  std::vector<TensorToWrite> tensors = {
      {"a", "F32", {3}, ::kvcal::testing::Bytes(a)},
      {"b", "BF16", {2, 3}, ::kvcal::testing::Bytes(b)},
      {"empty", "F16", {0, 4}, {}}};
  ASSERT_TRUE(
      WriteSafetensors(dir / "t.safetensors", tensors, {{"format", "pt"}})
          .ok());
  const std::string raw = ReadFile(dir / "t.safetensors");
  uint64_t header_len = 0;
  std::memcpy(&header_len, raw.data(), 8);
  EXPECT_EQ(header_len % 8, 0u);
  auto file = SafetensorsFile::Open(dir / "t.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_EQ(file->tensors().size(), 3u);
  EXPECT_EQ(file->metadata().at("format"), "pt");
  const TensorInfo* ta = file->Find("a");
  ASSERT_NE(ta, nullptr);
  EXPECT_EQ(ta->shape, (std::vector<uint64_t>{3}));
  EXPECT_EQ(std::memcmp(file->Data(*ta).data(), a.data(), 12), 0);
  const TensorInfo* tb = file->Find("b");
  ASSERT_NE(tb, nullptr);
  EXPECT_EQ(tb->dtype, "BF16");
  EXPECT_EQ(std::memcmp(file->Data(*tb).data(), b.data(), 12), 0);
  EXPECT_EQ(file->Find("empty")->size(), 0u);
}

TEST(SafetensorsTest, BlockSizeDoesNotChangeTheFile) {
  TempDir dir;
  std::vector<float> a(1000);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(i) * 0.5f;
  std::vector<TensorToWrite> tensors = {
      {"a", "F32", {10, 100}, ::kvcal::testing::Bytes(a)}};
  ASSERT_TRUE(WriteSafetensors(dir / "big.safetensors", tensors, {}).ok());
  ASSERT_TRUE(WriteSafetensors(dir / "small.safetensors", tensors, {},
                               /*block_bytes=*/7)
                  .ok());
  EXPECT_EQ(ReadFile(dir / "big.safetensors"),
            ReadFile(dir / "small.safetensors"));
}

TEST(SafetensorsTest, WriterChecksSizes) {
  TempDir dir;
  std::vector<float> a = {1.0f};
  std::vector<TensorToWrite> tensors = {
      {"a", "F32", {2}, ::kvcal::testing::Bytes(a)}};
  EXPECT_THAT(
      WriteSafetensors(dir / "t.safetensors", tensors, {}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("needs 8 bytes")));
}

TEST(SafetensorsTest, RejectsTruncatedFile) {
  EXPECT_THAT(OpenRaw("abc"), StatusIs(absl::StatusCode::kInvalidArgument,
                                       HasSubstr("truncated")));
}

TEST(SafetensorsTest, RejectsHeaderLengthBeyondFile) {
  EXPECT_THAT(OpenRaw(RawFile("{}", 0, /*length_override=*/4096)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("runs past the end")));
}

TEST(SafetensorsTest, RejectsHeaderThatIsNotJson) {
  EXPECT_THAT(OpenRaw(RawFile("not json at all", 0)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("not a JSON object")));
  EXPECT_THAT(OpenRaw(RawFile("[1,2]", 0)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("not a JSON object")));
}

TEST(SafetensorsTest, RejectsOverlappingOffsets) {
  EXPECT_THAT(
      OpenRaw(
          RawFile(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                  R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                  12)),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overlap")));
}

TEST(SafetensorsTest, RejectsOutOfRangeOffsets) {
  EXPECT_THAT(
      OpenRaw(RawFile(
          R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8)),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("out of range")));
}

TEST(SafetensorsTest, RejectsOffsetsThatDoNotCoverTheBuffer) {
  EXPECT_THAT(
      OpenRaw(RawFile(
          R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8)),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("gap")));
  EXPECT_THAT(
      OpenRaw(RawFile(
          R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 8)),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cover 4 bytes")));
}

TEST(SafetensorsTest, RejectsUnknownDtype) {
  EXPECT_THAT(
      OpenRaw(RawFile(
          R"({"a":{"dtype":"F128","shape":[1],"data_offsets":[0,16]}})", 16)),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("unknown dtype 'F128'")));
}

TEST(SafetensorsTest, RejectsShapeSizeMismatch) {
  EXPECT_THAT(
      OpenRaw(RawFile(
          R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8)),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("shape [3] F32 needs 12 bytes, data_offsets give 8")));
}

TEST(SafetensorsTest, RejectsDuplicateNames) {
  EXPECT_THAT(OpenRaw(RawFile(
                  R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                  R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                  8)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("'a' appears twice")));
}

TEST(SafetensorsTest, ReadsMetadataAndRejectsNonStringMetadata) {
  EXPECT_TRUE(OpenRaw(RawFile(R"({"__metadata__":{"format":"pt"}})", 0)).ok());
  EXPECT_THAT(
      OpenRaw(RawFile(R"({"__metadata__":{"batch":3}})", 0)),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a string")));
}

TEST(SafetensorsTest, MissingFileIsNotFound) {
  EXPECT_EQ(SafetensorsFile::Open("/nonexistent/x.safetensors").status().code(),
            absl::StatusCode::kNotFound);
}

// --- config.json geometry -------------------------------------------------

using Json = nlohmann::ordered_json;

TEST(ModelConfigTest, ReadsLlamaStyleConfig) {
  auto g = ModelGeometryFromConfig(Json::parse(
      R"({"num_hidden_layers": 32, "num_attention_heads": 32,
          "num_key_value_heads": 8, "hidden_size": 4096})"));
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(*g, (ModelGeometry{32, 32, 8, 128}));
}

TEST(ModelConfigTest, KeyValueHeadsDefaultToAttentionHeads) {
  auto g = ModelGeometryFromConfig(Json::parse(
      R"({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64})"));
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->num_key_value_heads, 4u);
  EXPECT_EQ(g->head_dim, 16u);
}

TEST(ModelConfigTest, ExplicitHeadDimWins) {
  auto g = ModelGeometryFromConfig(Json::parse(
      R"({"num_hidden_layers": 2, "num_attention_heads": 8,
          "num_key_value_heads": 4, "hidden_size": 64, "head_dim": 256})"));
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->head_dim, 256u);
}

TEST(ModelConfigTest, ReadsNestedTextConfig) {
  auto g = ModelGeometryFromConfig(Json::parse(
      R"({"model_type": "llava", "vision_config": {"num_attention_heads": 16},
          "text_config": {"num_hidden_layers": 3, "num_attention_heads": 8,
                          "num_key_value_heads": 2, "head_dim": 64}})"));
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(*g, (ModelGeometry{3, 8, 2, 64}));
}

TEST(ModelConfigTest, RejectsConfigWithoutHeadCounts) {
  EXPECT_THAT(ModelGeometryFromConfig(
                  Json::parse(R"({"num_hidden_layers": 2, "hidden_size": 64})"))
                  .status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("num_attention_heads")));
  EXPECT_THAT(
      ModelGeometryFromConfig(
          Json::parse(R"({"num_attention_heads": 2, "hidden_size": 64})"))
          .status(),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("num_hidden_layers")));
}

TEST(ModelConfigTest, RejectsBadGeometry) {
  EXPECT_THAT(
      ModelGeometryFromConfig(
          Json::parse(R"({"num_hidden_layers": 2, "num_attention_heads": 6,
                                  "num_key_value_heads": 4, "head_dim": 8})"))
          .status(),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("multiple of num_key_value_heads")));
  EXPECT_THAT(
      ModelGeometryFromConfig(
          Json::parse(R"({"num_hidden_layers": -1, "num_attention_heads": 4,
                                  "head_dim": 8})"))
          .status(),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("num_hidden_layers is -1")));
}

// Attention kvcal does not calibrate is refused, naming the key; geometry
// read from such a config would be wrong, not merely incomplete.
absl::Status ConfigStatus(const char* json) {
  return ModelGeometryFromConfig(Json::parse(json)).status();
}

constexpr char kMla[] =
    "DeepSeek-style multi-head latent attention (kv_lora_rank): vLLM 0.34 "
    "caches one compressed latent per token, and its weight loader drops "
    "every calibrated MLA scale";

TEST(ModelConfigTest, RefusesMultiHeadLatentAttention) {
  // DeepSeek-V3's config.json (less the MoE fields): read as ordinary
  // attention it would be 128 KV heads of head_dim 56.
  EXPECT_THAT(
      ConfigStatus(R"({"model_type": "deepseek_v3", "num_hidden_layers": 61,
          "num_attention_heads": 128, "num_key_value_heads": 128,
          "hidden_size": 7168, "kv_lora_rank": 512, "q_lora_rank": 1536,
          "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
          "v_head_dim": 128})"),
      StatusIs(
          absl::StatusCode::kInvalidArgument,
          HasSubstr(absl::StrCat("config.json: kv_lora_rank 512: ", kMla))));
  // kv_lora_rank left to the config class's default.
  EXPECT_THAT(
      ConfigStatus(R"({"model_type": "kimi_k2", "num_hidden_layers": 2,
          "num_attention_heads": 4, "hidden_size": 32})"),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr(absl::StrCat("model_type \"kimi_k2\": ", kMla))));
  // Inside a multimodal model's text_config.
  EXPECT_THAT(ConfigStatus(R"({"model_type": "some_vl", "text_config": {
          "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 32,
          "kv_lora_rank": 64}})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(kMla)));
  // Split RoPE head dims without a latent (DeepSeek-V2 with
  // kv_lora_rank null): per-head, but q/k and v head sizes differ.
  EXPECT_THAT(
      ConfigStatus(R"({"model_type": "deepseek_v2", "num_hidden_layers": 2,
          "num_attention_heads": 4,
          "hidden_size": 32, "kv_lora_rank": null, "qk_rope_head_dim": 8,
          "qk_nope_head_dim": 8, "v_head_dim": 8})"),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("config.json: qk_rope_head_dim: attention with "
                         "separate RoPE and non-RoPE")));
  EXPECT_THAT(ConfigStatus(R"({"num_hidden_layers": 2, "num_attention_heads": 4,
          "head_dim": 16, "v_head_dim": 8})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("config.json: v_head_dim 8: values with a "
                                 "head size other than the keys'")));
}

TEST(ModelConfigTest, RefusesCrossAttention) {
  EXPECT_THAT(
      ConfigStatus(R"({"model_type": "bart", "is_encoder_decoder": true,
          "num_hidden_layers": 12, "num_attention_heads": 16,
          "hidden_size": 1024})"),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("config.json: is_encoder_decoder: encoder-decoder "
                         "models")));
  // Llama 3.2 Vision (mllama): cross-attention layers in the text model.
  EXPECT_THAT(
      ConfigStatus(R"({"model_type": "mllama", "text_config": {
          "num_hidden_layers": 40, "num_attention_heads": 32,
          "num_key_value_heads": 8, "hidden_size": 4096,
          "cross_attention_layers": [3, 8, 13]}})"),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("config.json: cross_attention_layers: models with "
                         "cross-attention layers")));
  EXPECT_THAT(ConfigStatus(R"({"num_hidden_layers": 2, "num_attention_heads": 4,
          "hidden_size": 32, "add_cross_attention": true})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("add_cross_attention")));
}

TEST(ModelConfigTest, RefusesHybridAndLinearAttentionLayers) {
  // Qwen3-Next: Gated DeltaNet layers between attention layers.
  EXPECT_THAT(
      ConfigStatus(R"({"num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 8, "layer_types":
          ["linear_attention", "linear_attention", "linear_attention",
           "full_attention"]})"),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("config.json: layer_types[0] \"linear_attention\": "
                         "models with layers other than softmax attention")));
  // Jamba-style block list, LFM2's convolutions.
  EXPECT_THAT(ConfigStatus(R"({"num_hidden_layers": 2, "num_attention_heads": 4,
          "hidden_size": 32, "layers_block_type": ["attention", "mamba"]})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("layers_block_type[1] \"mamba\"")));
  EXPECT_THAT(ConfigStatus(R"({"num_hidden_layers": 2, "num_attention_heads": 4,
          "hidden_size": 32, "layer_types": ["conv", "full_attention"]})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("layer_types[0] \"conv\"")));
  // RecurrentGemma: block_types is a pattern repeated over the layers.
  EXPECT_THAT(
      ConfigStatus(R"({"num_hidden_layers": 26, "num_attention_heads": 4,
          "hidden_size": 32, "block_types": ["recurrent", "recurrent",
          "attention"]})"),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("block_types[0] \"recurrent\"")));
  // Nemotron-H's pattern, Mamba keys, Gemma 3n's KV sharing.
  EXPECT_THAT(ConfigStatus(R"({"num_hidden_layers": 4, "num_attention_heads": 4,
          "hidden_size": 32, "hybrid_override_pattern": "M-M*"})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("config.json: hybrid_override_pattern: "
                                 "hybrid models")));
  EXPECT_THAT(ConfigStatus(R"({"num_hidden_layers": 4, "num_attention_heads": 4,
          "hidden_size": 32, "mamba_d_state": 16})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("config.json: mamba_d_state: models with "
                                 "Mamba")));
  EXPECT_THAT(ConfigStatus(R"({"num_hidden_layers": 4, "num_attention_heads": 4,
          "hidden_size": 32, "num_kv_shared_layers": 2})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("num_kv_shared_layers 2: layers that read "
                                 "another layer's KV cache")));
  EXPECT_THAT(ConfigStatus(R"({"num_hidden_layers": 2, "num_attention_heads": 4,
          "hidden_size": 32, "layer_types": ["full_attention"]})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("config.json: layer_types: has 1 entries "
                                 "for num_hidden_layers 2 layers")));
  EXPECT_THAT(ConfigStatus(R"({"num_hidden_layers": 2, "num_attention_heads": 4,
          "hidden_size": 32, "layer_types": "full_attention"})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("layer_types: is \"full_attention\", not a "
                                 "list")));
}

// Sliding-window and chunked layers are ordinary attention: vLLM 0.34
// quantizes their KV cache with the layer's scales. Null keys are absent.
TEST(ModelConfigTest, AcceptsSlidingWindowAndChunkedAttention) {
  auto g = ModelGeometryFromConfig(Json::parse(
      R"({"model_type": "gemma3_text", "num_hidden_layers": 3,
          "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
          "sliding_window": 512, "layer_types": ["sliding_attention",
          "chunked_attention", "full_attention"], "kv_lora_rank": null,
          "mamba_d_state": null, "num_kv_shared_layers": 0,
          "is_encoder_decoder": false, "v_head_dim": 256})"));
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(*g, (ModelGeometry{3, 8, 4, 256}));
  // Mistral 7B v0.1: every layer a 4096-token window.
  g = ModelGeometryFromConfig(Json::parse(
      R"({"model_type": "mistral", "num_hidden_layers": 32,
          "num_attention_heads": 32, "num_key_value_heads": 8,
          "hidden_size": 4096, "sliding_window": 4096})"));
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(*g, (ModelGeometry{32, 32, 8, 128}));
}

}  // namespace
}  // namespace kvcal
