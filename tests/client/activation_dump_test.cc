#include "client/checkpoint/activation_dump.h"

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "client/checkpoint/demo_model.h"
#include "client/checkpoint/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/test_util.h"

namespace kvcal {
namespace {

using ::kvcal::testing::StatusIs;
using ::kvcal::testing::TempDir;
using ::testing::HasSubstr;

// True when [data, data + size) lies inside one mapping of the file `path`
// in this process (/proc/self/maps: "start-end perms offset dev inode path").
bool InsideMappingOf(const std::string& path,
                     absl::Span<const std::byte> data) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  const auto begin = reinterpret_cast<uintptr_t>(data.data());
  const auto end = begin + data.size();
  while (std::getline(maps, line)) {
    const size_t slash = line.find('/');
    if (slash == std::string::npos || line.substr(slash) != path) continue;
    uintptr_t lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx", &lo, &hi) == 2 && lo <= begin &&
        end <= hi) {
      return true;
    }
  }
  return false;
}

TEST(ActivationDumpTest, ReadsDemoDumpsInNameOrderWithoutCopying) {
  TempDir dir;
  DemoModelOptions model;
  model.geometry.num_layers = 2;
  ASSERT_TRUE(
      WriteDemoDumps(dir.path(), model, {.batches = 3, .tokens = 5}).ok());
  const Geometry geometry = model.geometry.ToGeometry(64);
  auto dump = ActivationDump::Open(dir.path(), &geometry);
  ASSERT_TRUE(dump.ok()) << dump.status();
  EXPECT_EQ(dump->file_count(), 3u);
  ASSERT_EQ(dump->tensors().size(), 3u * 2 * 3);
  const DumpTensor& first = dump->tensors().front();
  EXPECT_EQ(first.file, "batch-0000.safetensors");
  EXPECT_EQ(first.batch, 0u);
  const DumpTensor& last = dump->tensors().back();
  EXPECT_EQ(last.batch, 2u);
  EXPECT_EQ(last.layer, 1u);
  EXPECT_EQ(last.role, Role::kV);
  EXPECT_EQ(last.shape, (std::vector<uint64_t>{5, 2, 32}));
  EXPECT_EQ(last.layout, Layout::kTokensHeadsDim);
  uint64_t bytes = 0;
  for (const DumpTensor& t : dump->tensors()) bytes += t.data.size();
  EXPECT_EQ(bytes, dump->total_bytes());
  // Nothing is copied: every span lies inside a mapping of its own file
  // (/proc/self/maps), not in heap memory.
  for (const DumpTensor& t : dump->tensors()) {
    const std::string path = std::filesystem::canonical(dir / t.file).string();
    EXPECT_TRUE(InsideMappingOf(path, t.data)) << t.file << " " << t.name;
  }
  // And the bytes are the file's.
  auto file = SafetensorsFile::Open(dir / "batch-0002.safetensors");
  ASSERT_TRUE(file.ok());
  auto data = file->Data(*file->Find("model.layers.1.self_attn.v"));
  ASSERT_EQ(data.size(), last.data.size());
  EXPECT_EQ(std::memcmp(data.data(), last.data.data(), data.size()), 0);
}

TEST(ActivationDumpTest, HeadsTokensDimLayoutFromMetadata) {
  TempDir dir;
  DemoModelOptions model;
  model.geometry.num_layers = 1;
  ASSERT_TRUE(
      WriteDemoDumps(dir.path(), model,
                     {.batches = 1, .tokens = 4, .heads_tokens_dim = true})
          .ok());
  auto dump = ActivationDump::Open(dir.path());
  ASSERT_TRUE(dump.ok()) << dump.status();
  EXPECT_EQ(dump->tensors()[0].layout, Layout::kHeadsTokensDim);
  EXPECT_EQ(dump->tensors()[0].shape, (std::vector<uint64_t>{1, 8, 4, 32}));
}

TEST(ActivationDumpTest, BatchDefaultsToFilePosition) {
  TempDir dir;
  std::vector<float> values(2 * 1 * 4, 1.0f);
  for (const char* name : {"b.safetensors", "a.safetensors"}) {
    ASSERT_TRUE(WriteSafetensors(dir / name,
                                 {{"model.layers.0.self_attn.k",
                                   "F32",
                                   {2, 1, 4},
                                   ::kvcal::testing::Bytes(values)}},
                                 {})
                    .ok());
  }
  auto dump = ActivationDump::Open(dir.path());
  ASSERT_TRUE(dump.ok()) << dump.status();
  EXPECT_EQ(dump->tensors()[0].file, "a.safetensors");
  EXPECT_EQ(dump->tensors()[0].batch, 0u);
  EXPECT_EQ(dump->tensors()[1].batch, 1u);
}

TEST(ActivationDumpTest, RejectsBadNamesDtypesAndGeometry) {
  std::vector<int32_t> ints(8, 1);
  std::vector<float> floats(8, 1.0f);
  struct Case {
    TensorToWrite tensor;
    const char* message;
  };
  const std::vector<Case> cases = {
      {{"model.layers.0.mlp.up",
        "F32",
        {2, 1, 4},
        ::kvcal::testing::Bytes(floats)},
       "is not named model.layers.{L}.self_attn.{q,k,v}"},
      {{"model.layers.0.self_attn.q",
        "I32",
        {2, 1, 4},
        ::kvcal::testing::Bytes(ints)},
       "must be F32, F16 or BF16"},
      {{"model.layers.0.self_attn.q",
        "F32",
        {8},
        ::kvcal::testing::Bytes(floats)},
       "rank 1"},
      {{"model.layers.0.self_attn.q",
        "F32",
        {1, 2, 4},
        ::kvcal::testing::Bytes(floats)},
       "head_dim"},
      {{"model.layers.99999999999.self_attn.q",
        "F32",
        {1, 2, 4},
        ::kvcal::testing::Bytes(floats)},
       "layer number out of range"},
  };
  const Geometry geometry{.num_layers = 1,
                          .num_attention_heads = 2,
                          .num_key_value_heads = 1,
                          .head_dim = 8};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.message);
    TempDir dir;
    ASSERT_TRUE(WriteSafetensors(dir / "x.safetensors", {c.tensor}, {}).ok());
    EXPECT_THAT(
        ActivationDump::Open(dir.path(), &geometry).status(),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.message)));
  }
  TempDir empty;
  EXPECT_THAT(
      ActivationDump::Open(empty.path()).status(),
      StatusIs(absl::StatusCode::kNotFound, HasSubstr("no *.safetensors")));
}

}  // namespace
}  // namespace kvcal
