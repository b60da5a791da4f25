#include "service/session_persister.h"

#include "absl/strings/str_cat.h"
#include "service/log.h"
#include "service/proto_convert.h"
#include "util/status_macros.h"

namespace kvcal::service {

SessionPersister::SessionPersister(SessionRegistry* registry, Metrics* metrics,
                                   StateStore store,
                                   std::chrono::milliseconds interval)
    : registry_(registry),
      metrics_(metrics),
      store_(std::move(store)),
      interval_(interval) {}

SessionPersister::~SessionPersister() { Stop(); }

absl::Status SessionPersister::Restore() {
  KVCAL_RETURN_IF_ERROR(store_.Open());
  std::vector<std::string> problems;
  std::vector<StoredState> states = store_.LoadAll(&problems);
  for (const std::string& problem : problems) {
    KVCAL_LOG(ERROR) << "state dir: " << problem;
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (StoredState& stored : states) {
    const std::string& id = stored.state.session_id();
    const std::string tenant = stored.state.tenant().empty()
                                   ? std::string(kDefaultTenant)
                                   : stored.state.tenant();
    absl::StatusOr<SessionSnapshot> snapshot = SnapshotFromProto(stored.state);
    absl::StatusOr<std::shared_ptr<Session>> session =
        snapshot.ok()
            ? registry_->Import(tenant, id, *snapshot, "")
            : absl::StatusOr<std::shared_ptr<Session>>(snapshot.status());
    if (!session.ok()) {
      KVCAL_LOG(ERROR) << "state dir: cannot restore " << stored.path << ": "
                       << session.status().message();
      continue;
    }
    (*session)->MarkDurable(snapshot->producers);
    saved_change_count_[store_.PathFor(tenant, id)] =
        (*session)->change_count();
    KVCAL_LOG(INFO) << "restored session '" << id << "' ("
                    << snapshot->counters.chunks_applied << " chunks) from "
                    << stored.path;
  }
  return absl::OkStatus();
}

void SessionPersister::Start() {
  thread_ = std::thread([this] {
    std::unique_lock<std::mutex> lock(stop_mu_);
    while (!stop_cv_.wait_for(lock, interval_, [this] { return stopping_; })) {
      lock.unlock();
      (void)SaveAll();
      lock.lock();
    }
  });
}

void SessionPersister::Stop() {
  {
    std::lock_guard<std::mutex> lock(stop_mu_);
    stopping_ = true;
  }
  stop_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

absl::Status SessionPersister::SaveLocked(
    const std::shared_ptr<Session>& session) {
  const uint64_t changes = session->change_count();
  const std::string path = store_.PathFor(session->tenant(), session->id());
  auto it = saved_change_count_.find(path);
  if (it != saved_change_count_.end() && it->second == changes) {
    return absl::OkStatus();
  }
  KVCAL_ASSIGN_OR_RETURN(SessionSnapshot snapshot, session->Export());
  kvcal::v1::SessionState state;
  SnapshotToProto(session->id(), snapshot, &state);
  state.set_tenant(session->tenant());
  KVCAL_RETURN_IF_ERROR(store_.Save(session->tenant(), session->id(), state));
  session->MarkDurable(snapshot.producers);
  // Changes made between reading `changes` and the export are in the file
  // too; recording the earlier count at worst writes the session once more.
  saved_change_count_[path] = changes;
  return absl::OkStatus();
}

absl::Status SessionPersister::Save(const std::shared_ptr<Session>& session) {
  std::lock_guard<std::mutex> lock(mu_);
  absl::Status status = SaveLocked(session);
  if (!status.ok()) {
    KVCAL_LOG(ERROR) << "cannot persist session '" << session->id()
                     << "': " << status.message();
    metrics_->RecordPersistFailure(std::string(status.message()));
  }
  return status;
}

absl::Status SessionPersister::SaveAll() {
  std::lock_guard<std::mutex> lock(mu_);
  absl::Status first;
  for (const std::shared_ptr<Session>& session : registry_->ListAll()) {
    absl::Status status = SaveLocked(session);
    if (!status.ok()) {
      KVCAL_LOG(ERROR) << "cannot persist session '" << session->id()
                       << "': " << status.message();
      metrics_->RecordPersistFailure(std::string(status.message()));
      if (first.ok()) first = status;
    }
  }
  if (first.ok()) metrics_->RecordPersistFailure("");
  return first;
}

absl::Status SessionPersister::Delete(absl::string_view tenant,
                                      absl::string_view session_id) {
  std::lock_guard<std::mutex> lock(mu_);
  KVCAL_RETURN_IF_ERROR(registry_->Delete(tenant, session_id));
  const std::string tenant_name(tenant), id(session_id);
  saved_change_count_.erase(store_.PathFor(tenant_name, id));
  absl::Status removed = store_.Remove(tenant_name, id);
  if (!removed.ok()) {
    KVCAL_LOG(ERROR) << "session '" << session_id
                     << "' deleted, but its state file remains: "
                     << removed.message();
  }
  return absl::OkStatus();
}

}  // namespace kvcal::service
