// Writes every changed session to the state directory every interval, on
// request (SIGTERM) and removes deleted ones; restores them at start-up.
// A failed write is logged and reported in metrics (and /healthz); the
// worker keeps serving and durable watermarks do not advance.
//
//   SessionPersister persister(&registry, &metrics, StateStore(dir), 10s);
//   KVCAL_RETURN_IF_ERROR(persister.Restore());
//   persister.Start();
#ifndef KVCAL_SERVICE_SESSION_PERSISTER_H_
#define KVCAL_SERVICE_SESSION_PERSISTER_H_

#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "service/metrics.h"
#include "service/session_registry.h"
#include "service/state_store.h"

namespace kvcal::service {

class SessionPersister {
 public:
  SessionPersister(SessionRegistry* registry, Metrics* metrics,
                   StateStore store, std::chrono::milliseconds interval);
  ~SessionPersister();

  // Opens the directory and restores every session found there.
  absl::Status Restore();
  // Starts the periodic writer.
  void Start();
  // Writes every changed session now; the first error, if any.
  absl::Status SaveAll();
  // Writes one session now when it changed (CreateSession: a session and its
  // shard map survive a crash right after they were acknowledged).
  absl::Status Save(const std::shared_ptr<Session>& session);
  // Deletes a session from the registry and its file, atomically with
  // respect to the periodic writer.
  absl::Status Delete(absl::string_view tenant, absl::string_view session_id);
  void Stop();

 private:
  absl::Status SaveLocked(const std::shared_ptr<Session>& session);  // mu_

  SessionRegistry* const registry_;
  Metrics* const metrics_;
  StateStore store_;
  const std::chrono::milliseconds interval_;
  std::mutex mu_;  // serialises saves and deletes
  // Keyed by the session's state file path.
  std::map<std::string, uint64_t> saved_change_count_;  // guarded by mu_
  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace kvcal::service

#endif  // KVCAL_SERVICE_SESSION_PERSISTER_H_
