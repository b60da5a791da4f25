// All sessions of one worker, partitioned by tenant, with the limits that
// protect it: session counts and statistics memory, worker-wide and per
// tenant. A session belongs to the tenant that created it; to every other
// tenant it does not exist (NotFound, absent from List).
//
//   SessionRegistry registry({.max_sessions = 64,
//                             .memory_budget_bytes = 8ull << 30});
//   KVCAL_ASSIGN_OR_RETURN(auto session,
//                          registry.Create("team-a", "", geometry));
#ifndef KVCAL_SERVICE_SESSION_REGISTRY_H_
#define KVCAL_SERVICE_SESSION_REGISTRY_H_

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "service/session.h"

namespace kvcal::service {

// The tenant of every RPC when no --auth-token-file is given, and of bare
// tokens.
inline constexpr absl::string_view kDefaultTenant = "default";

struct RegistryOptions {
  SessionOptions session;
  // 0 = unlimited.
  uint64_t max_sessions = 0;
  uint64_t memory_budget_bytes = 0;
  uint64_t max_sessions_per_tenant = 0;
  uint64_t memory_budget_bytes_per_tenant = 0;
  // Test seam: called while a session is being built (backend allocation,
  // snapshot deserialisation), with the registry's lock not held.
  std::function<void(absl::string_view id)> on_build;
};

// docs/wire-contract.md "Identifiers": [A-Za-z0-9._-]{1,128}. `allow_empty`
// for CreateSession, where empty means the server picks one.
absl::Status ValidateSessionId(absl::string_view id, bool allow_empty);

class SessionRegistry {
 public:
  explicit SessionRegistry(RegistryOptions options);

  // Idempotent: an existing id with an identical geometry and
  // reject_non_finite returns the session; a different one is AlreadyExists.
  // `shard_map` (may be empty) is validated here and recorded
  // (Session::AdoptShardMap; a different existing map is FailedPrecondition).
  // `parameters.holdout_budget_bytes` (0 = the default) applies to a new
  // session only.
  absl::StatusOr<std::shared_ptr<Session>> Create(
      absl::string_view tenant, absl::string_view id, const Geometry& geometry,
      const ShardMap& shard_map = {}, const SessionParameters& parameters = {});
  absl::StatusOr<std::shared_ptr<Session>> Get(absl::string_view tenant,
                                               absl::string_view id);
  // The tenant's sessions, ordered by id.
  std::vector<std::shared_ptr<Session>> List(absl::string_view tenant);
  // Every session of every tenant (persistence).
  std::vector<std::shared_ptr<Session>> ListAll();
  absl::Status Delete(absl::string_view tenant, absl::string_view id);

  // ImportState: creates the session from `snapshot` when `id` does not
  // exist for `tenant`, else merges into it (Session::Merge).
  absl::StatusOr<std::shared_ptr<Session>> Import(
      absl::string_view tenant, absl::string_view id,
      const SessionSnapshot& snapshot, absl::string_view import_id);

  size_t size();
  uint64_t state_bytes();

 private:
  using Key = std::pair<std::string, std::string>;  // (tenant, id)
  struct Usage {
    uint64_t sessions = 0;
    uint64_t bytes = 0;
  };

  absl::Status CheckLimits(absl::string_view tenant,
                           const Geometry& geometry);  // mu_ held
  std::string NewSessionId(absl::string_view tenant);  // mu_ held
  void Add(const std::shared_ptr<Session>& session);   // mu_ held
  // Building a session (backend allocation, a snapshot's statistics) is slow
  // and happens without mu_: the registry reserves the key and the room the
  // limits grant it first (mu_ held), builds, then Commit adds the session
  // (or, on failure, gives the room back) and wakes waiters.
  uint64_t Reserve(const Key& key, const Geometry& geometry);  // mu_ held
  void Commit(const Key& key, uint64_t reserved,
              const std::shared_ptr<Session>& session);  // mu_ held
  // Waits (releasing mu_) while `key` is being built by another call.
  void AwaitBuilt(std::unique_lock<std::mutex>& lock, const Key& key);
  absl::StatusOr<std::shared_ptr<Session>> Build(
      const Key& key, uint64_t reserved,
      const std::function<absl::StatusOr<std::shared_ptr<Session>>()>& build);

  const RegistryOptions options_;
  std::mutex mu_;
  std::map<Key, std::shared_ptr<Session>> sessions_;  // guarded by mu_
  std::map<std::string, Usage, std::less<>> usage_;   // guarded by mu_
  Usage total_;                                       // guarded by mu_
  std::set<Key> building_;                            // guarded by mu_
  std::condition_variable built_;                     // signalled on Commit
};

}  // namespace kvcal::service

#endif  // KVCAL_SERVICE_SESSION_REGISTRY_H_
