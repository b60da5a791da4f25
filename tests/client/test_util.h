// Helpers shared by the client tests: temporary directories and whole-tree
// snapshots for byte-for-byte comparisons.
#ifndef KVCAL_TESTS_CLIENT_TEST_UTIL_H_
#define KVCAL_TESTS_CLIENT_TEST_UTIL_H_

#include <unistd.h>

#include <cstddef>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <string>

#include "absl/types/span.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcal::testing {

// Matches an absl::Status with `code` and a message matching `message_matcher`.
MATCHER_P2(StatusIs, code, message_matcher, "") {
  return arg.code() == code &&
         ::testing::ExplainMatchResult(
             message_matcher, std::string(arg.message()), result_listener);
}

// A fresh directory under the system temp dir, removed at scope exit.
class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    path_ = std::filesystem::temp_directory_path() /
            ("kvcal-client-test-" + std::to_string(::getpid()) + "-" +
             std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  std::string path() const { return path_.string(); }
  std::string operator/(const std::string& name) const {
    return (path_ / name).string();
  }

 private:
  std::filesystem::path path_;
};

// The bytes of a vector or array, as the safetensors writer takes them.
template <typename Container>
absl::Span<const std::byte> Bytes(const Container& c) {
  return absl::Span<const std::byte>(
      reinterpret_cast<const std::byte*>(std::data(c)),
      std::size(c) * sizeof(*std::data(c)));
}

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

inline void WriteFile(const std::string& path, const std::string& contents) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << contents;
}

// Every regular file under `dir` (relative name -> bytes), skipping `skip`.
inline std::map<std::string, std::string> Snapshot(
    const std::string& dir, const std::string& skip = ".kvcal-patch") {
  std::map<std::string, std::string> files;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(dir)) {
    const std::string rel =
        std::filesystem::relative(entry.path(), dir).string();
    if (rel.rfind(skip, 0) == 0) continue;
    if (entry.is_regular_file()) files[rel] = ReadFile(entry.path().string());
  }
  return files;
}

}  // namespace kvcal::testing

#endif  // KVCAL_TESTS_CLIENT_TEST_UTIL_H_
