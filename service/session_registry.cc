#include "service/session_registry.h"

#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "util/status_macros.h"
#include "util/strings.h"

namespace kvcal::service {

absl::Status ValidateSessionId(absl::string_view id, bool allow_empty) {
  if (id.empty()) {
    if (allow_empty) return absl::OkStatus();
    return absl::InvalidArgumentError("session_id is empty");
  }
  if (id.size() > 128) {
    return absl::InvalidArgumentError(absl::StrCat(
        "session_id is ", id.size(), " characters long; at most 128"));
  }
  const size_t bad = FirstNonIdentifierChar(id);
  if (bad != absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "session_id contains character 0x%02x; allowed: A-Z a-z 0-9 . _ -",
        static_cast<unsigned char>(id[bad])));
  }
  return absl::OkStatus();
}

SessionRegistry::SessionRegistry(RegistryOptions options)
    : options_(std::move(options)) {}

std::string SessionRegistry::NewSessionId(absl::string_view tenant) {
  static thread_local std::mt19937_64 rng(std::random_device{}());
  for (;;) {
    std::string id = absl::StrFormat("s-%016x", rng());
    const Key key(tenant, id);
    if (sessions_.count(key) == 0 && building_.count(key) == 0) return id;
  }
}

absl::Status SessionRegistry::CheckLimits(absl::string_view tenant,
                                          const Geometry& geometry) {
  const uint64_t need = EstimateStateBytes(geometry);
  if (options_.max_sessions != 0 && total_.sessions >= options_.max_sessions) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the worker holds its maximum of ", options_.max_sessions,
                     " sessions (--max-sessions); delete one first"));
  }
  if (options_.memory_budget_bytes != 0 &&
      total_.bytes + need > options_.memory_budget_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("a session of geometry {", geometry.DebugString(),
                     "} needs ", need, " bytes of state; ", total_.bytes,
                     " of the ", options_.memory_budget_bytes,
                     " byte budget (--memory-budget-bytes) are in use"));
  }
  auto it = usage_.find(tenant);
  const Usage usage = it == usage_.end() ? Usage() : it->second;
  if (options_.max_sessions_per_tenant != 0 &&
      usage.sessions >= options_.max_sessions_per_tenant) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "tenant '", tenant, "' holds its maximum of ",
        options_.max_sessions_per_tenant,
        " sessions (--max-sessions-per-tenant); delete one first"));
  }
  if (options_.memory_budget_bytes_per_tenant != 0 &&
      usage.bytes + need > options_.memory_budget_bytes_per_tenant) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "a session of geometry {", geometry.DebugString(), "} needs ", need,
        " bytes of state; tenant '", tenant, "' uses ", usage.bytes, " of its ",
        options_.memory_budget_bytes_per_tenant,
        " byte budget (--memory-budget-bytes-per-tenant)"));
  }
  return absl::OkStatus();
}

void SessionRegistry::Add(const std::shared_ptr<Session>& session) {
  const uint64_t bytes = session->state_bytes();
  Usage& usage = usage_[session->tenant()];
  ++usage.sessions;
  usage.bytes += bytes;
  ++total_.sessions;
  total_.bytes += bytes;
  sessions_.emplace(Key(session->tenant(), session->id()), session);
}

uint64_t SessionRegistry::Reserve(const Key& key, const Geometry& geometry) {
  const uint64_t bytes = EstimateStateBytes(geometry);
  Usage& usage = usage_[key.first];
  ++usage.sessions;
  usage.bytes += bytes;
  ++total_.sessions;
  total_.bytes += bytes;
  building_.insert(key);
  return bytes;
}

void SessionRegistry::Commit(const Key& key, uint64_t reserved,
                             const std::shared_ptr<Session>& session) {
  Usage& usage = usage_[key.first];
  --usage.sessions;
  usage.bytes -= reserved;
  --total_.sessions;
  total_.bytes -= reserved;
  building_.erase(key);
  if (session != nullptr) Add(session);
  built_.notify_all();
}

void SessionRegistry::AwaitBuilt(std::unique_lock<std::mutex>& lock,
                                 const Key& key) {
  built_.wait(lock, [&] { return building_.count(key) == 0; });
}

absl::StatusOr<std::shared_ptr<Session>> SessionRegistry::Build(
    const Key& key, uint64_t reserved,
    const std::function<absl::StatusOr<std::shared_ptr<Session>>()>& build) {
  // mu_ is not held here: other tenants' calls, and this tenant's other
  // sessions, go on while the session is built.
  if (options_.on_build) options_.on_build(key.second);
  absl::StatusOr<std::shared_ptr<Session>> session = build();
  std::lock_guard<std::mutex> lock(mu_);
  Commit(key, reserved, session.ok() ? *session : nullptr);
  return session;
}

absl::StatusOr<std::shared_ptr<Session>> SessionRegistry::Create(
    absl::string_view tenant, absl::string_view id, const Geometry& geometry,
    const ShardMap& shard_map, const SessionParameters& parameters) {
  KVCAL_RETURN_IF_ERROR(ValidateSessionId(id, /*allow_empty=*/true));
  KVCAL_RETURN_IF_ERROR(geometry.Validate());
  KVCAL_RETURN_IF_ERROR(ValidateShardMap(shard_map, geometry.num_layers));
  std::unique_lock<std::mutex> lock(mu_);
  if (!id.empty()) {
    AwaitBuilt(lock, Key(tenant, id));
    auto it = sessions_.find(Key(tenant, id));
    if (it != sessions_.end()) {
      if (it->second->geometry() == geometry) {
        if (it->second->reject_non_finite() != parameters.reject_non_finite) {
          return absl::AlreadyExistsError(absl::StrCat(
              "session '", id, "' exists with reject_non_finite ",
              it->second->reject_non_finite() ? "true" : "false",
              "; requested ", parameters.reject_non_finite ? "true" : "false",
              " (fixed at creation: delete the session or use another id)"));
        }
        KVCAL_RETURN_IF_ERROR(it->second->AdoptShardMap(shard_map));
        return it->second;
      }
      return absl::AlreadyExistsError(
          absl::StrCat("session '", id, "' exists with different parameters {",
                       it->second->geometry().DebugString(), "}; requested {",
                       geometry.DebugString(), "}"));
    }
  }
  KVCAL_RETURN_IF_ERROR(CheckLimits(tenant, geometry));
  const Key key{std::string(tenant),
                id.empty() ? NewSessionId(tenant) : std::string(id)};
  const uint64_t reserved = Reserve(key, geometry);
  lock.unlock();
  SessionOptions session_options = options_.session;
  session_options.holdout_budget_bytes = parameters.holdout_budget_bytes;
  session_options.reject_non_finite = parameters.reject_non_finite;
  return Build(
      key, reserved, [&]() -> absl::StatusOr<std::shared_ptr<Session>> {
        KVCAL_ASSIGN_OR_RETURN(
            std::shared_ptr<Session> session,
            Session::Create(key.second, key.first, geometry, session_options));
        KVCAL_RETURN_IF_ERROR(session->AdoptShardMap(shard_map));
        return session;
      });
}

absl::StatusOr<std::shared_ptr<Session>> SessionRegistry::Get(
    absl::string_view tenant, absl::string_view id) {
  KVCAL_RETURN_IF_ERROR(ValidateSessionId(id, /*allow_empty=*/false));
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sessions_.find(Key(tenant, id));
  if (it == sessions_.end()) {
    return absl::NotFoundError(absl::StrCat("session '", id, "' not found"));
  }
  return it->second;
}

std::vector<std::shared_ptr<Session>> SessionRegistry::List(
    absl::string_view tenant) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::shared_ptr<Session>> out;
  for (auto it = sessions_.lower_bound(Key(tenant, ""));
       it != sessions_.end() && it->first.first == tenant; ++it) {
    out.push_back(it->second);
  }
  return out;
}

std::vector<std::shared_ptr<Session>> SessionRegistry::ListAll() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::shared_ptr<Session>> out;
  out.reserve(sessions_.size());
  for (const auto& [key, session] : sessions_) out.push_back(session);
  return out;
}

absl::Status SessionRegistry::Delete(absl::string_view tenant,
                                     absl::string_view id) {
  KVCAL_RETURN_IF_ERROR(ValidateSessionId(id, /*allow_empty=*/false));
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sessions_.find(Key(tenant, id));
  if (it == sessions_.end()) {
    return absl::NotFoundError(absl::StrCat("session '", id, "' not found"));
  }
  const uint64_t bytes = it->second->state_bytes();
  Usage& usage = usage_[std::string(tenant)];
  --usage.sessions;
  usage.bytes -= bytes;
  --total_.sessions;
  total_.bytes -= bytes;
  sessions_.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Session>> SessionRegistry::Import(
    absl::string_view tenant, absl::string_view id,
    const SessionSnapshot& snapshot, absl::string_view import_id) {
  KVCAL_RETURN_IF_ERROR(ValidateSessionId(id, /*allow_empty=*/false));
  if (absl::Status s = snapshot.geometry.Validate(); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("state has invalid geometry: ", s.message()));
  }
  std::shared_ptr<Session> existing;
  {
    std::unique_lock<std::mutex> lock(mu_);
    const Key key{std::string(tenant), std::string(id)};
    AwaitBuilt(lock, key);
    auto it = sessions_.find(key);
    if (it == sessions_.end()) {
      KVCAL_RETURN_IF_ERROR(CheckLimits(tenant, snapshot.geometry));
      const uint64_t reserved = Reserve(key, snapshot.geometry);
      lock.unlock();
      // Deserialising the snapshot's statistics into a backend is the slow
      // part of a large import; it runs without the registry's lock.
      return Build(key, reserved, [&] {
        return Session::FromSnapshot(key.second, key.first, snapshot,
                                     options_.session, import_id);
      });
    }
    existing = it->second;
  }
  KVCAL_RETURN_IF_ERROR(existing->Merge(snapshot, import_id));
  return existing;
}

size_t SessionRegistry::size() {
  std::lock_guard<std::mutex> lock(mu_);
  return sessions_.size();
}

uint64_t SessionRegistry::state_bytes() {
  std::lock_guard<std::mutex> lock(mu_);
  return total_.bytes;
}

}  // namespace kvcal::service
