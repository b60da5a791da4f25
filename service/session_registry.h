// All sessions of one worker, with the limits that protect it: a maximum
// session count and a memory budget for statistics state.
//
//   SessionRegistry registry({.max_sessions = 64,
//                             .memory_budget_bytes = 8ull << 30});
//   KVCAL_ASSIGN_OR_RETURN(auto session, registry.Create("", geometry));
#ifndef KVCAL_SERVICE_SESSION_REGISTRY_H_
#define KVCAL_SERVICE_SESSION_REGISTRY_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "service/session.h"

namespace kvcal::service {

struct RegistryOptions {
  SessionOptions session;
  // 0 = unlimited.
  uint64_t max_sessions = 0;
  uint64_t memory_budget_bytes = 0;
};

// CONTRACT.md "Sessions": [A-Za-z0-9._-]{1,128}. `allow_empty` for
// CreateSession, where empty means the server picks one.
absl::Status ValidateSessionId(absl::string_view id, bool allow_empty);

class SessionRegistry {
 public:
  explicit SessionRegistry(RegistryOptions options);

  // Idempotent: an existing id with an identical geometry returns the
  // session; a different one is AlreadyExists.
  absl::StatusOr<std::shared_ptr<Session>> Create(absl::string_view id,
                                                  const Geometry& geometry);
  absl::StatusOr<std::shared_ptr<Session>> Get(absl::string_view id);
  std::vector<std::shared_ptr<Session>> List();
  absl::Status Delete(absl::string_view id);

  // ImportState: creates the session from `snapshot` when `id` does not
  // exist, else merges into it (Session::Merge).
  absl::StatusOr<std::shared_ptr<Session>> Import(
      absl::string_view id, const SessionSnapshot& snapshot,
      absl::string_view import_id);

  size_t size();
  uint64_t state_bytes();

 private:
  absl::Status CheckLimits(const Geometry& geometry);  // mu_ held
  std::string NewSessionId();                          // mu_ held

  const RegistryOptions options_;
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<Session>, std::less<>> sessions_;
  uint64_t state_bytes_ = 0;  // guarded by mu_
  uint64_t next_id_ = 1;      // guarded by mu_
};

}  // namespace kvcal::service

#endif  // KVCAL_SERVICE_SESSION_REGISTRY_H_
