// Durable session state (--state-dir): one file per session, written
// atomically (temp file, fsync, rename, fsync of the directory).
//
//   StateStore store("/var/lib/kvcal");
//   KVCAL_RETURN_IF_ERROR(store.Open());
//   KVCAL_RETURN_IF_ERROR(store.Save("team-a", "run-1", state));  // a SessionState
//   std::vector<std::string> problems;       // corrupt files, moved aside
//   for (const StoredState& s : store.LoadAll(&problems)) ...
//
// File format: 8 bytes magic "KVCALSS1", u64 payload length, u64 FNV-1a 64 of
// the payload, then the payload: a serialized kvcal.v1.SessionState. All
// little-endian.
#ifndef KVCAL_SERVICE_STATE_STORE_H_
#define KVCAL_SERVICE_STATE_STORE_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvcal/v1/calibration.pb.h"

namespace kvcal::service {

struct StoredState {
  std::string path;
  kvcal::v1::SessionState state;
};

class StateStore {
 public:
  explicit StateStore(std::string dir) : dir_(std::move(dir)) {}

  // Creates the directory if needed and checks that it is writable.
  absl::Status Open();

  // Files are named <id>.kvstate for the default tenant and
  // <tenant>~<id>.kvstate for others ('~' appears in neither).
  absl::Status Save(const std::string& tenant, const std::string& session_id,
                    const kvcal::v1::SessionState& state);
  absl::Status Remove(const std::string& tenant, const std::string& session_id);

  // Every readable state. A corrupt or truncated file is reported in
  // `problems` and renamed to <name>.corrupt-<time> so start-up goes on.
  std::vector<StoredState> LoadAll(std::vector<std::string>* problems);

  // Parses one file's bytes (exposed for tests and fuzzing).
  static absl::StatusOr<kvcal::v1::SessionState> Parse(
      const std::string& bytes);
  static std::string Encode(const kvcal::v1::SessionState& state);

  const std::string& dir() const { return dir_; }
  std::string PathFor(const std::string& tenant,
                      const std::string& session_id) const;

 private:
  std::string dir_;
};

}  // namespace kvcal::service

#endif  // KVCAL_SERVICE_STATE_STORE_H_
