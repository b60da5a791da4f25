// libFuzzer target: the checkpoint index reader. The input is a
// model.safetensors.index.json, optionally followed by a line "#shard" and
// the bytes of the second shard it may name. The checkpoint (config.json and
// a first shard holding layer 0's scales) sits in a private temporary
// directory; InspectCheckpoint reads the index, opens what it names and
// checks the scales. It must return a report or an error, never crash, never
// open a file outside the checkpoint directory, and the report must render
// as JSON and text.
#include <stdlib.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "client/checkpoint/checkpoint_inspect.h"
#include "client/checkpoint/safetensors.h"
#include "tests/fuzz/fuzz_util.h"

namespace kvcal {
namespace {

namespace fs = std::filesystem;

constexpr char kConfig[] = R"({
  "architectures": ["LlamaForCausalLM"],
  "num_hidden_layers": 2, "num_attention_heads": 4,
  "num_key_value_heads": 2, "hidden_size": 32,
  "quantization_config": {"quant_method": "compressed-tensors",
    "kv_cache_scheme": {"num_bits": 8, "type": "float",
                        "strategy": "tensor"}}})";
constexpr char kShard1[] = "model-00001-of-00002.safetensors";
constexpr char kShard2[] = "model-00002-of-00002.safetensors";
constexpr absl::string_view kSeparator = "\n#shard\n";

void WriteFile(const fs::path& path, absl::string_view bytes) {
  FUZZ_CHECK(WriteOutputFile(path.string(), bytes).ok());
}

// A shard with the scales of `layer` and one weight.
void WriteShard(const fs::path& path, uint32_t layer) {
  static const float kScales[] = {0.5f, 0.25f, 0.125f};
  static const uint16_t kWeight[] = {1, 2, 3, 4};
  std::vector<TensorToWrite> tensors;
  const std::string prefix =
      "model.layers." + std::to_string(layer) + ".self_attn.";
  for (int r = 0; r < 3; ++r) {
    tensors.push_back(
        {prefix + "qkv"[r] + "_scale",
         "F32",
         {1},
         absl::Span<const std::byte>(
             reinterpret_cast<const std::byte*>(&kScales[r]), 4)});
  }
  tensors.push_back({prefix + "o_proj.weight",
                     "BF16",
                     {2, 2},
                     absl::Span<const std::byte>(
                         reinterpret_cast<const std::byte*>(kWeight), 8)});
  FUZZ_CHECK(WriteSafetensors(path.string(), tensors, {}).ok());
}

const fs::path& CheckpointDir() {
  static const fs::path* dir = [] {
    const char* base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    std::string templ = std::string(base) + "/kvcal-fuzz-index-XXXXXX";
    FUZZ_CHECK(mkdtemp(templ.data()) != nullptr);
    auto* path = new fs::path(templ);
    WriteFile(*path / "config.json", kConfig);
    WriteShard(*path / kShard1, 0);
    std::atexit([] {
      std::error_code ignored;
      fs::remove_all(*dir, ignored);
    });
    return path;
  }();
  return *dir;
}

void Run(const uint8_t* data, size_t size) {
  const fs::path& dir = CheckpointDir();
  const absl::string_view input(reinterpret_cast<const char*>(data), size);
  const size_t split = input.find(kSeparator);
  const absl::string_view index = input.substr(0, split);
  // Plain writes (no fsync): the files only need to be readable.
  auto put = [&](const fs::path& path, absl::string_view bytes) {
    FILE* f = std::fopen(path.c_str(), "wb");
    FUZZ_CHECK(f != nullptr);
    FUZZ_CHECK(std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size());
    std::fclose(f);
  };
  put(dir / "model.safetensors.index.json", index);
  if (split == absl::string_view::npos) {
    static const std::string default_shard = [&] {
      WriteShard(dir / kShard2, 1);
      absl::StatusOr<std::string> bytes =
          ReadSmallFile((dir / kShard2).string());
      FUZZ_CHECK(bytes.ok());
      return *bytes;
    }();
    put(dir / kShard2, default_shard);
  } else {
    put(dir / kShard2, input.substr(split + kSeparator.size()));
  }

  absl::StatusOr<InspectReport> report = InspectCheckpoint(dir.string());
  if (!report.ok()) {
    FUZZ_CHECK(report.status().code() == absl::StatusCode::kInvalidArgument ||
               report.status().code() == absl::StatusCode::kNotFound);
    return;
  }
  FUZZ_CHECK(report->sharded);
  FUZZ_CHECK(!report->ToJson().dump().empty());
  FUZZ_CHECK(!report->ToText().empty());
  // Anything the index names that is not a plain file name here is refused
  // before it is opened (CheckShardFileName), so nothing outside `dir` was
  // read: every scale found comes from one of our two shards.
  for (const InspectedLayer& layer : report->layers) {
    for (const InspectedScale& scale : layer.roles) {
      FUZZ_CHECK(scale.tensor.empty() || scale.file == kShard1 ||
                 scale.file == kShard2);
    }
  }
}

}  // namespace
}  // namespace kvcal

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvcal::Run(data, size);
  return 0;
}
