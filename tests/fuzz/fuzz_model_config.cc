// libFuzzer target: the config.json geometry reader (client/checkpoint/model_config.h).
//
// The input is a config.json. Parsed as JSON it goes through
// ModelGeometryFromConfig, and as a file through ReadModelGeometry; both must
// agree. An accepted geometry is a valid session geometry, and it equals the
// geometry read from the same fields re-emitted in a minimal config.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "client/checkpoint/model_config.h"
#include "tests/fuzz/fuzz_util.h"

namespace kvcal {
namespace {

using Json = nlohmann::ordered_json;

void Run(const uint8_t* data, size_t size) {
  static const int fd = memfd_create("fuzz-config", 0);
  static const std::string path = "/proc/self/fd/" + std::to_string(fd);
  FUZZ_CHECK(fd >= 0);

  const std::string text(reinterpret_cast<const char*>(data), size);
  const Json config = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  absl::StatusOr<ModelGeometry> geometry =
      config.is_discarded()
          ? absl::StatusOr<ModelGeometry>(absl::InvalidArgumentError("json"))
          : ModelGeometryFromConfig(config);

  FUZZ_CHECK(ftruncate(fd, 0) == 0);
  FUZZ_CHECK(pwrite(fd, data, size, 0) == static_cast<ssize_t>(size));
  absl::StatusOr<ModelGeometry> from_file = ReadModelGeometry(path);
  FUZZ_CHECK(from_file.ok() == geometry.ok());
  if (!geometry.ok()) {
    FUZZ_CHECK(geometry.status().code() == absl::StatusCode::kInvalidArgument);
    FUZZ_CHECK(from_file.status().code() == absl::StatusCode::kInvalidArgument);
    return;
  }
  FUZZ_CHECK(*from_file == *geometry);
  FUZZ_CHECK(geometry->ToGeometry(0).Validate().ok());
  FUZZ_CHECK(geometry->ToGeometry(64).Validate().ok());

  const Json minimal = {{"num_hidden_layers", geometry->num_layers},
                        {"num_attention_heads", geometry->num_attention_heads},
                        {"num_key_value_heads", geometry->num_key_value_heads},
                        {"head_dim", geometry->head_dim}};
  absl::StatusOr<ModelGeometry> again = ModelGeometryFromConfig(minimal);
  FUZZ_CHECK(again.ok() && *again == *geometry);
}

}  // namespace
}  // namespace kvcal

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvcal::Run(data, size);
  return 0;
}
