#include "service/state_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kernels/statistics.h"
#include "util/file_io.h"
#include "util/hash.h"

namespace kvcal::service {
namespace {

constexpr char kMagic[8] = {'K', 'V', 'C', 'A', 'L', 'S', 'S', '1'};
constexpr absl::string_view kSuffix = ".kvstate";

// The state dir's errors are UNAVAILABLE: the worker cannot keep state.
absl::Status Errno(absl::string_view what, const std::string& path) {
  return ErrnoError(what, path, absl::StatusCode::kUnavailable);
}

}  // namespace

std::string StateStore::PathFor(const std::string& tenant,
                                const std::string& session_id) const {
  if (tenant.empty() || tenant == "default") {
    return absl::StrCat(dir_, "/", session_id, kSuffix);
  }
  return absl::StrCat(dir_, "/", tenant, "~", session_id, kSuffix);
}

absl::Status StateStore::Open() {
  std::error_code error;
  std::filesystem::create_directories(dir_, error);
  if (error) {
    return absl::UnavailableError(absl::StrCat(
        "--state-dir ", dir_, ": cannot create: ", error.message()));
  }
  if (::access(dir_.c_str(), W_OK | X_OK) != 0) {
    return Errno("--state-dir is not writable:", dir_);
  }
  return absl::OkStatus();
}

std::string StateStore::Encode(const kvcal::v1::SessionState& state) {
  const std::string payload = state.SerializeAsString();
  const uint64_t length = payload.size();
  const uint64_t checksum = Fnv1a64(payload);
  std::string out(kMagic, sizeof(kMagic));
  out.append(reinterpret_cast<const char*>(&length), 8);
  out.append(reinterpret_cast<const char*>(&checksum), 8);
  out += payload;
  return out;
}

absl::StatusOr<kvcal::v1::SessionState> StateStore::Parse(
    const std::string& bytes) {
  if (bytes.size() < 24 || std::memcmp(bytes.data(), kMagic, 8) != 0) {
    return absl::DataLossError("not a kvcal session state file (bad magic)");
  }
  uint64_t length, checksum;
  std::memcpy(&length, bytes.data() + 8, 8);
  std::memcpy(&checksum, bytes.data() + 16, 8);
  if (length != bytes.size() - 24) {
    return absl::DataLossError(
        absl::StrCat("state file is truncated: ", bytes.size() - 24, " of ",
                     length, " payload bytes"));
  }
  const absl::string_view payload(bytes.data() + 24, length);
  if (Fnv1a64(payload) != checksum) {
    return absl::DataLossError("state file checksum mismatch");
  }
  kvcal::v1::SessionState state;
  if (!state.ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
    return absl::DataLossError("state file payload does not parse");
  }
  return state;
}

absl::Status StateStore::Save(const std::string& tenant,
                              const std::string& session_id,
                              const kvcal::v1::SessionState& state) {
  const std::string path = PathFor(tenant, session_id);
  return WriteOutputFile(path, Encode(state), absl::StatusCode::kUnavailable);
}

absl::Status StateStore::Remove(const std::string& tenant,
                                const std::string& session_id) {
  const std::string path = PathFor(tenant, session_id);
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    return Errno("cannot remove", path);
  }
  return SyncDirectory(dir_, absl::StatusCode::kUnavailable);
}

std::vector<StoredState> StateStore::LoadAll(
    std::vector<std::string>* problems) {
  std::vector<StoredState> out;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(dir_, error)) {
    const std::string path = entry.path().string();
    if (absl::EndsWith(path, kOutputTempSuffix) ||
        absl::EndsWith(path, ".kvstate.tmp")) {
      // An interrupted write (".kvstate.tmp": of an older worker).
      std::filesystem::remove(entry.path(), error);
      continue;
    }
    if (!absl::EndsWith(path, kSuffix)) continue;
    std::ifstream in(path, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), {});
    absl::StatusOr<kvcal::v1::SessionState> state = Parse(bytes);
    if (!state.ok()) {
      const std::string aside =
          absl::StrCat(path, ".corrupt-",
                       std::chrono::duration_cast<std::chrono::seconds>(
                           std::chrono::system_clock::now().time_since_epoch())
                           .count());
      std::filesystem::rename(path, aside, error);
      problems->push_back(absl::StrCat(path, ": ", state.status().message(),
                                       "; moved aside to ", aside));
      continue;
    }
    out.push_back({path, *std::move(state)});
  }
  if (error) {
    problems->push_back(
        absl::StrCat("cannot list ", dir_, ": ", error.message()));
  }
  return out;
}

}  // namespace kvcal::service
