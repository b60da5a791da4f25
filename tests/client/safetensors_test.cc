#include "client/safetensors.h"

#include <cstring>
#include <string>
#include <vector>

#include "client/model_config.h"
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

}  // namespace
}  // namespace kvcal
