// CalibrationClient (calibration_client.h). Over 600 lines on purpose: one
// class, whose parts (endpoint resolution and worker ids, session fan-out
// with the shard map, the worker-set checks, per-worker upload and finalize,
// following a moved worker) all work on the same members and the same
// worker-set invariant; each function is under 80 lines.
#include "client/rpc/calibration_client.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <map>
#include <set>
#include <thread>
#include <tuple>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/checkpoint/safetensors.h"
#include "client/rpc/sharding.h"
#include "proto/wire_geometry.h"
#include "util/host_port.h"
#include "util/status_macros.h"
#include "util/strings.h"

namespace kvcal {
namespace {

constexpr absl::Duration kRpcTimeout = absl::Seconds(60);

void AddCounters(const v1::Session& from, v1::Session& to) {
  to.set_chunks_applied(to.chunks_applied() + from.chunks_applied());
  to.set_values_ingested(to.values_ingested() + from.values_ingested());
  to.set_bytes_ingested(to.bytes_ingested() + from.bytes_ingested());
  to.set_nonfinite_values(to.nonfinite_values() + from.nonfinite_values());
  to.set_state_bytes(to.state_bytes() + from.state_bytes());
  // Each worker lists the heads of its own layers.
  for (const v1::NonFiniteHead& h : from.nonfinite_heads()) {
    *to.add_nonfinite_heads() = h;
  }
  to.set_nonfinite_heads_total(to.nonfinite_heads_total() +
                               from.nonfinite_heads_total());
}

// Orders non-finite heads of several workers as one worker lists them.
void SortNonFiniteHeads(
    google::protobuf::RepeatedPtrField<v1::NonFiniteHead>* heads) {
  std::sort(
      heads->begin(), heads->end(),
      [](const v1::NonFiniteHead& a, const v1::NonFiniteHead& b) {
        return std::tuple(a.layer(), static_cast<int>(a.role()), a.head()) <
               std::tuple(b.layer(), static_cast<int>(b.role()), b.head());
      });
}

// Evaluations (evaluate / observer auto) of one worker's Finalize into
// the merged response.
void MergeEvaluations(const v1::FinalizeResponse& response,
                      v1::FinalizeResponse& total) {
  // Evaluations (evaluate / observer auto): each worker judged its own
  // layers. Their layer rows are concatenated; the session totals are those
  // of the first worker (each worker's own sums are not on the wire), and
  // auto_per_session chooses per worker.
  if (response.has_evaluation()) {
    if (!total.has_evaluation()) {
      *total.mutable_evaluation() = response.evaluation();
    } else {
      for (const v1::LayerEvaluation& l : response.evaluation().layers()) {
        *total.mutable_evaluation()->add_layers() = l;
      }
    }
  }
  if (total.candidates_size() == 0) {
    *total.mutable_candidates() = response.candidates();
  } else {
    for (int c = 0;
         c < response.candidates_size() && c < total.candidates_size(); ++c) {
      for (const v1::LayerEvaluation& l : response.candidates(c).layers()) {
        *total.mutable_candidates(c)->add_layers() = l;
      }
    }
  }
}

absl::StatusOr<std::string> AskWorkerId(v1::Calibration::Stub& stub,
                                        const std::string& endpoint,
                                        const ConnectionOptions& options,
                                        absl::Duration timeout,
                                        bool wait_for_ready) {
  grpc::ClientContext context;
  PrepareContext(context, options, timeout, wait_for_ready);
  v1::WorkerInfo info;
  const grpc::Status status =
      stub.GetWorkerInfo(&context, v1::GetWorkerInfoRequest(), &info);
  // A worker older than GetWorkerInfo: its address is all it has.
  if (status.error_code() == grpc::StatusCode::UNIMPLEMENTED) return endpoint;
  KVCAL_RETURN_IF_ERROR(
      ToAbslStatus(status, absl::StrCat("GetWorkerInfo on ", endpoint)));
  if (info.worker_id().empty()) return endpoint;
  return info.worker_id();
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ExpandEndpoint(
    absl::string_view endpoint) {
  constexpr absl::string_view kDns = "dns:///";
  constexpr absl::string_view kFile = "file:";
  if (absl::StartsWith(endpoint, kFile)) {
    const std::string path(endpoint.substr(kFile.size()));
    KVCAL_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path));
    std::vector<std::string> out;
    for (absl::string_view line : absl::StrSplit(text, '\n')) {
      line = line.substr(0, line.find('#'));
      for (absl::string_view e : absl::StrSplit(line, ',', absl::SkipEmpty())) {
        e = absl::StripAsciiWhitespace(e);
        if (e.empty()) continue;
        if (absl::StartsWith(e, kFile)) {
          return absl::InvalidArgumentError(
              absl::StrCat(path, ": endpoint files do not nest"));
        }
        KVCAL_ASSIGN_OR_RETURN(std::vector<std::string> expanded,
                               ExpandEndpoint(e));
        out.insert(out.end(), expanded.begin(), expanded.end());
      }
    }
    if (out.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, " lists no endpoint"));
    }
    return out;
  }
  if (HasTargetScheme(endpoint)) {
    return std::vector<std::string>{std::string(endpoint)};
  }
  // HOST[:PORT], and dns:///HOST[:PORT]: the port is checked (1..65535) and
  // defaults to kDefaultPort, as the CLI's --server (util/cli.h).
  const bool dns = absl::StartsWith(endpoint, kDns);
  absl::StatusOr<HostPort> parsed =
      ParseHostPort(dns ? endpoint.substr(kDns.size()) : endpoint,
                    {.default_port = kDefaultPort, .min_port = 1});
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("server '", endpoint, "': ", parsed.status().message()));
  }
  if (!dns) return std::vector<std::string>{parsed->ToString()};
  const std::string host = parsed->host;
  const std::string port = std::to_string(parsed->port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (const int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &found);
      rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve ", host, ": ", gai_strerror(rc)));
  }
  std::set<std::string> addresses;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    char text[INET6_ADDRSTRLEN] = {};
    const void* raw =
        a->ai_family == AF_INET
            ? static_cast<const void*>(
                  &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr)
            : static_cast<const void*>(
                  &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr);
    if (inet_ntop(a->ai_family, raw, text, sizeof(text)) == nullptr) continue;
    addresses.insert(a->ai_family == AF_INET6
                         ? absl::StrCat("[", text, "]:", port)
                         : absl::StrCat(text, ":", port));
  }
  freeaddrinfo(found);
  if (addresses.empty()) {
    return absl::UnavailableError(absl::StrCat(host, " has no addresses"));
  }
  // Sorted, so every client that resolves the same set shards alike.
  return std::vector<std::string>(addresses.begin(), addresses.end());
}

size_t CalibrationClient::WorkerFor(absl::string_view session_id,
                                    uint32_t layer) const {
  return LayerOwner(session_id, layer, ids_);
}

absl::StatusOr<std::vector<std::string>> CalibrationClient::ExpandAll() const {
  std::vector<std::string> out;
  for (const std::string& list : specs_) {
    for (absl::string_view e : absl::StrSplit(list, ',', absl::SkipEmpty())) {
      KVCAL_ASSIGN_OR_RETURN(std::vector<std::string> expanded,
                             ExpandEndpoint(e));
      out.insert(out.end(), expanded.begin(), expanded.end());
    }
  }
  return out;
}

std::shared_ptr<grpc::Channel> CalibrationClient::FindMovedWorker(
    const std::string& id, std::string current, std::string* found_at) const {
  absl::StatusOr<std::vector<std::string>> endpoints = ExpandAll();
  if (!endpoints.ok()) return nullptr;
  for (const std::string& endpoint : *endpoints) {
    if (endpoint == current) continue;
    absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
        MakeChannel(endpoint, options_);
    if (!channel.ok()) continue;
    auto stub = v1::Calibration::NewStub(*channel);
    absl::StatusOr<std::string> found =
        AskWorkerId(*stub, endpoint, options_, absl::Seconds(1),
                    /*wait_for_ready=*/false);
    if (found.ok() && *found == id) {
      *found_at = endpoint;
      return *channel;
    }
  }
  return nullptr;
}

absl::StatusOr<CalibrationClient> CalibrationClient::Connect(
    const std::vector<std::string>& endpoints, ConnectionOptions options) {
  CalibrationClient client;
  client.options_ = std::move(options);
  client.specs_ = endpoints;
  KVCAL_ASSIGN_OR_RETURN(std::vector<std::string> expanded, client.ExpandAll());
  for (std::string& endpoint : expanded) {
    Worker w;
    w.endpoint = std::move(endpoint);
    KVCAL_ASSIGN_OR_RETURN(w.channel, MakeChannel(w.endpoint, client.options_));
    w.stub = v1::Calibration::NewStub(w.channel);
    client.workers_.push_back(std::move(w));
  }
  if (client.workers_.empty()) {
    return absl::InvalidArgumentError("no server given (--server host:port)");
  }
  if (client.workers_.size() == 1) {
    // One worker holds every layer: no shard map, no id needed.
    client.workers_[0].id = client.workers_[0].endpoint;
    client.ids_.push_back(client.workers_[0].id);
    return client;
  }
  // Every worker's stable id, asked in parallel (each waits for its worker
  // to come up, as CreateSession always did).
  std::vector<absl::StatusOr<std::string>> ids(client.workers_.size(),
                                               std::string());
  {
    std::vector<std::thread> threads;
    for (size_t i = 0; i < client.workers_.size(); ++i) {
      threads.emplace_back([&, i] {
        ids[i] =
            AskWorkerId(*client.workers_[i].stub, client.workers_[i].endpoint,
                        client.options_, kRpcTimeout, /*wait_for_ready=*/true);
      });
    }
    for (std::thread& t : threads) t.join();
  }
  for (size_t i = 0; i < client.workers_.size(); ++i) {
    if (!ids[i].ok()) return ids[i].status();
    client.workers_[i].id = *std::move(ids[i]);
  }
  std::sort(client.workers_.begin(), client.workers_.end(),
            [](const Worker& a, const Worker& b) { return a.id < b.id; });
  for (size_t i = 1; i < client.workers_.size(); ++i) {
    if (client.workers_[i - 1].id == client.workers_[i].id) {
      return absl::FailedPreconditionError(absl::StrCat(
          "workers ", client.workers_[i - 1].endpoint, " and ",
          client.workers_[i].endpoint, " both report worker id '",
          client.workers_[i].id,
          "' (the same worker listed twice, or two workers without their own "
          "--worker-id); layers are assigned by id, so each worker needs its "
          "own"));
    }
  }
  for (const Worker& w : client.workers_) client.ids_.push_back(w.id);
  return client;
}

absl::StatusOr<v1::Session> CalibrationClient::CreateSession(
    v1::CreateSessionRequest request) {
  v1::Session first;
  if (sharded()) {
    if (request.session_id().empty()) {
      // The shard map depends on the id: let the first worker pick it (it
      // takes the map with the second call below).
      grpc::ClientContext context;
      PrepareContext(context, options_, kRpcTimeout, /*wait_for_ready=*/true);
      v1::Session session;
      KVCAL_RETURN_IF_ERROR(ToAbslStatus(
          workers_[0].stub->CreateSession(&context, request, &session),
          absl::StrCat("CreateSession on ", workers_[0].endpoint)));
      request.set_session_id(session.session_id());
    }
    v1::ShardMap* map = request.mutable_shard_map();
    for (const std::string& id : ids_) map->add_worker_ids(id);
    for (uint32_t owner :
         LayerOwners(request.session_id(), request.num_layers(), ids_)) {
      map->add_layer_owners(owner);
    }
  }
  for (size_t i = 0; i < workers_.size(); ++i) {
    grpc::ClientContext context;
    PrepareContext(context, options_, kRpcTimeout, /*wait_for_ready=*/true);
    v1::Session session;
    KVCAL_RETURN_IF_ERROR(ToAbslStatus(
        workers_[i].stub->CreateSession(&context, request, &session),
        absl::StrCat("CreateSession on ", workers_[i].id, " (",
                     workers_[i].endpoint, ")")));
    if (i == 0) {
      first = session;
      request.set_session_id(session.session_id());
    }
  }
  return first;
}

absl::StatusOr<v1::Session> CalibrationClient::CheckSessionWorkers(
    const std::string& session_id, bool wait_for_ready) {
  std::vector<absl::StatusOr<v1::Session>> sessions;
  std::vector<std::string> have, lack;
  for (const Worker& w : workers_) {
    grpc::ClientContext context;
    PrepareContext(context, options_, kRpcTimeout, wait_for_ready);
    v1::GetSessionRequest request;
    request.set_session_id(session_id);
    v1::Session session;
    absl::Status status = ToAbslStatus(
        w.stub->GetSession(&context, request, &session),
        absl::StrCat("GetSession on ", w.id, " (", w.endpoint, ")"));
    if (status.ok()) {
      have.push_back(w.id);
      sessions.push_back(std::move(session));
    } else if (status.code() == absl::StatusCode::kNotFound) {
      lack.push_back(w.id);
      sessions.push_back(status);
    } else {
      return status;
    }
  }
  if (have.empty()) return sessions.front().status();
  // The first worker that has the session speaks for it; the others must
  // hold the same map.
  const v1::Session& any = **std::find_if(sessions.begin(), sessions.end(),
                                          [](const auto& s) { return s.ok(); });
  KVCAL_RETURN_IF_ERROR(CheckShardMap(session_id, any, sessions, have, lack));
  return any;
}

absl::Status CalibrationClient::CheckShardMap(
    const std::string& session_id, const v1::Session& any,
    const std::vector<absl::StatusOr<v1::Session>>& sessions,
    const std::vector<std::string>& have,
    const std::vector<std::string>& lack) const {
  for (size_t i = 0; i < sessions.size(); ++i) {
    if (sessions[i].ok() && sessions[i]->shard_map().SerializeAsString() !=
                                any.shard_map().SerializeAsString()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "session '", session_id, "' has different shard maps on workers ",
          any.worker_id(), " and ", workers_[i].id,
          " (one of them holds a session of the same name from another "
          "worker set); delete it there or use a new session id"));
    }
  }
  const std::vector<std::string> session_ids(
      any.shard_map().worker_ids().begin(), any.shard_map().worker_ids().end());
  if (!session_ids.empty() && !sharded() && session_ids.size() > 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session '", session_id, "' is sharded over workers ",
        IdList(session_ids), "; this client has only ", workers_[0].endpoint,
        " (missing the others): give every worker of the session"));
  }
  if (!session_ids.empty() && sharded() && session_ids != ids_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session '", session_id, "' is sharded over workers ",
        IdList(session_ids), "; this client has ", IdList(ids_), " (",
        DescribeWorkerSetChange(session_ids, ids_),
        "); give the session's workers, or create a new session for this "
        "set"));
  }
  if (!lack.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("session '", session_id, "' exists on workers ",
                     IdList(have), " but not on ", IdList(lack),
                     session_ids.empty()
                         ? " (it was created over another worker set)"
                         : " (a worker lost it: was its --state-dir lost?)"));
  }
  if (sharded()) {
    if (session_ids.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "session '", session_id,
          "' has no shard map (created by a single-"
          "worker or an older client); use it with the one worker or client "
          "that created it"));
    }
    const std::vector<uint32_t> owners =
        LayerOwners(session_id, any.num_layers(), ids_);
    if (!std::equal(owners.begin(), owners.end(),
                    any.shard_map().layer_owners().begin(),
                    any.shard_map().layer_owners().end())) {
      return absl::FailedPreconditionError(absl::StrCat(
          "session '", session_id,
          "' assigns layers to workers differently from this client's "
          "rendezvous hashing (a client with another sharding rule created "
          "it)"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::Session> CalibrationClient::GetSession(
    const std::string& session_id) {
  KVCAL_RETURN_IF_ERROR(
      CheckSessionWorkers(session_id, /*wait_for_ready=*/false).status());
  v1::Session total;
  for (size_t i = 0; i < workers_.size(); ++i) {
    grpc::ClientContext context;
    PrepareContext(context, options_, kRpcTimeout);
    v1::GetSessionRequest request;
    request.set_session_id(session_id);
    v1::Session session;
    KVCAL_RETURN_IF_ERROR(
        ToAbslStatus(workers_[i].stub->GetSession(&context, request, &session),
                     absl::StrCat("GetSession on ", workers_[i].endpoint)));
    if (i == 0) {
      total = session;
      total.clear_producers();
      total.set_chunks_applied(0);
      total.set_values_ingested(0);
      total.set_bytes_ingested(0);
      total.set_nonfinite_values(0);
      total.set_state_bytes(0);
      total.clear_nonfinite_heads();
      total.set_nonfinite_heads_total(0);
    }
    AddCounters(session, total);
    SortNonFiniteHeads(total.mutable_nonfinite_heads());
    for (const v1::ProducerWatermark& p : session.producers()) {
      v1::ProducerWatermark* out = total.add_producers();
      *out = p;
      if (workers_.size() > 1) {
        out->set_producer_id(
            absl::StrCat(workers_[i].id, "/", p.producer_id()));
      }
    }
  }
  return total;
}

absl::StatusOr<std::vector<v1::Session>> CalibrationClient::ListSessions() {
  std::map<std::string, v1::Session> by_id;
  for (const Worker& w : workers_) {
    grpc::ClientContext context;
    PrepareContext(context, options_, kRpcTimeout);
    v1::ListSessionsResponse response;
    KVCAL_RETURN_IF_ERROR(ToAbslStatus(
        w.stub->ListSessions(&context, v1::ListSessionsRequest(), &response),
        absl::StrCat("ListSessions on ", w.endpoint)));
    for (const v1::Session& s : response.sessions()) {
      auto [it, inserted] = by_id.emplace(s.session_id(), s);
      if (!inserted) AddCounters(s, it->second);
    }
  }
  std::vector<v1::Session> sessions;
  for (auto& [id, s] : by_id) {
    SortNonFiniteHeads(s.mutable_nonfinite_heads());
    sessions.push_back(std::move(s));
  }
  return sessions;
}

absl::Status CalibrationClient::DeleteSession(const std::string& session_id) {
  for (const Worker& w : workers_) {
    grpc::ClientContext context;
    PrepareContext(context, options_, kRpcTimeout);
    v1::DeleteSessionRequest request;
    request.set_session_id(session_id);
    v1::DeleteSessionResponse response;
    KVCAL_RETURN_IF_ERROR(
        ToAbslStatus(w.stub->DeleteSession(&context, request, &response),
                     absl::StrCat("DeleteSession on ", w.endpoint)));
  }
  return absl::OkStatus();
}

absl::Status CalibrationClient::CheckProducerIsNew(
    const std::string& session_id, const std::string& producer_id,
    const std::vector<std::vector<ChunkView>>& per_worker) const {
  for (size_t i = 0; i < workers_.size(); ++i) {
    if (per_worker[i].empty()) continue;
    grpc::ClientContext context;
    PrepareContext(context, options_, kRpcTimeout, /*wait_for_ready=*/true);
    v1::GetSessionRequest request;
    request.set_session_id(session_id);
    v1::Session session;
    KVCAL_RETURN_IF_ERROR(
        ToAbslStatus(workers_[i].stub->GetSession(&context, request, &session),
                     absl::StrCat("GetSession on ", workers_[i].id, " (",
                                  workers_[i].endpoint, ")")));
    uint64_t applied = 0;
    for (const v1::ProducerWatermark& p : session.producers()) {
      if (p.producer_id() == producer_id) applied = p.sequence();
    }
    if (applied > 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          workers_[i].id, " (", workers_[i].endpoint, "): session ", session_id,
          ", producer ", producer_id, " already has ", applied,
          " chunks applied; use a new producer name, or resume to finish "
          "an interrupted push of the same dump"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<UploadResult> CalibrationClient::Upload(
    const std::string& session_id, absl::Span<const ChunkView> chunks,
    UploaderOptions options) {
  options.session_id = session_id;
  if (!options.counters) options.counters = std::make_shared<UploadCounters>();
  // Waits for workers that are coming up, as the uploaders would.
  KVCAL_ASSIGN_OR_RETURN(
      const v1::Session session,
      CheckSessionWorkers(session_id, /*wait_for_ready=*/true));
  if (sharded()) options.shard_worker_ids = ids_;
  std::vector<std::vector<ChunkView>> per_worker(workers_.size());
  for (const ChunkView& c : chunks) {
    per_worker[WorkerFor(session_id, c.layer)].push_back(c);
  }
  // Without resume, a producer that already has chunks on any worker is
  // refused before a chunk goes to any other (each uploader checks only its
  // own worker, and the others would have applied theirs meanwhile).
  if (!options.resume) {
    KVCAL_RETURN_IF_ERROR(
        CheckProducerIsNew(session_id, options.producer_id, per_worker));
  }
  KVCAL_ASSIGN_OR_RETURN(const std::vector<std::vector<PartialUpload>> partials,
                         BuildWorkerPartials(session, options, per_worker));
  // Where a worker was found again under a new address (per worker; each
  // upload thread writes only its own).
  std::vector<std::string> moved_to(workers_.size());
  std::vector<absl::StatusOr<UploadResult>> results(
      workers_.size(), absl::StatusOr<UploadResult>(UploadResult{}));
  std::vector<std::thread> threads;
  for (size_t i = 0; i < workers_.size(); ++i) {
    if (per_worker[i].empty() && partials[i].empty()) continue;
    threads.emplace_back([&, i] {
      UploaderOptions mine = options;
      mine.relocate = [this, i, &moved_to]() {
        return FindMovedWorker(
            workers_[i].id,
            moved_to[i].empty() ? workers_[i].endpoint : moved_to[i],
            &moved_to[i]);
      };
      Uploader uploader(workers_[i].channel, options_, std::move(mine));
      results[i] = uploader.Upload(per_worker[i], partials[i]);
    });
  }
  for (std::thread& t : threads) t.join();
  AdoptMovedWorkers(moved_to);
  return SumUploads(results, per_worker);
}

absl::StatusOr<std::vector<std::vector<PartialUpload>>>
CalibrationClient::BuildWorkerPartials(
    const v1::Session& session, const UploaderOptions& options,
    std::vector<std::vector<ChunkView>>& per_worker) const {
  // Local statistics: each worker's tensors of calibration batches become
  // that worker's partials; only held-out ones stay chunks.
  std::vector<std::vector<PartialUpload>> partials(workers_.size());
  if (options.local_statistics_batches == 0) return partials;
  if (!options.build_partials) {
    return absl::InvalidArgumentError(
        "local statistics need UploaderOptions::build_partials "
        "(kvcal_local_partials' BuildPartials)");
  }
  KVCAL_ASSIGN_OR_RETURN(const Geometry geometry, GeometryFromWire(session));
  for (size_t i = 0; i < workers_.size(); ++i) {
    KVCAL_ASSIGN_OR_RETURN(
        partials[i],
        options.build_partials(geometry, session.reject_non_finite(),
                               per_worker[i], options.holdout_batches,
                               options.local_statistics_batches));
    std::erase_if(per_worker[i], [&](const ChunkView& c) {
      return options.holdout_batches.count(c.batch) == 0;
    });
  }
  return partials;
}

void CalibrationClient::AdoptMovedWorkers(
    const std::vector<std::string>& moved_to) {
  for (size_t i = 0; i < workers_.size(); ++i) {
    if (moved_to[i].empty()) continue;
    absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
        MakeChannel(moved_to[i], options_);
    if (!channel.ok()) continue;
    workers_[i].endpoint = moved_to[i];
    workers_[i].channel = *channel;
    workers_[i].stub = v1::Calibration::NewStub(*channel);
  }
}

absl::StatusOr<UploadResult> CalibrationClient::SumUploads(
    const std::vector<absl::StatusOr<UploadResult>>& results,
    const std::vector<std::vector<ChunkView>>& per_worker) const {
  UploadResult total;
  bool any = false;
  total.shared_memory = true;  // every worker's chunks went by reference
  for (size_t i = 0; i < workers_.size(); ++i) {
    if (!results[i].ok()) {
      return absl::Status(
          results[i].status().code(),
          absl::StrCat(workers_[i].id, " (", workers_[i].endpoint,
                       "): ", results[i].status().message()));
    }
    const UploadResult& r = *results[i];
    total.chunks += r.chunks;
    total.chunks_skipped += r.chunks_skipped;
    total.chunks_sent += r.chunks_sent;
    total.chunks_applied += r.chunks_applied;
    total.chunks_duplicate += r.chunks_duplicate;
    total.bytes += r.bytes;
    total.partials += r.partials;
    total.partial_bytes += r.partial_bytes;
    total.reconnects += r.reconnects;
    if (!per_worker[i].empty()) {
      any = true;
      total.shared_memory = total.shared_memory && r.shared_memory;
      if (total.shared_memory_fallback.empty()) {
        total.shared_memory_fallback = r.shared_memory_fallback;
      }
    }
  }
  total.shared_memory = total.shared_memory && any;
  return total;
}

absl::StatusOr<v1::FinalizeResponse> CalibrationClient::Finalize(
    v1::FinalizeRequest request) {
  std::vector<uint32_t> layers(request.layers().begin(),
                               request.layers().end());
  KVCAL_ASSIGN_OR_RETURN(v1::Session session,
                         CheckSessionWorkers(request.session_id(),
                                             /*wait_for_ready=*/false));
  if (layers.empty()) {
    for (uint32_t l = 0; l < session.num_layers(); ++l) layers.push_back(l);
  }
  if (sharded()) {
    for (const std::string& id : ids_) request.add_shard_worker_ids(id);
  }
  std::vector<std::vector<uint32_t>> per_worker(workers_.size());
  for (uint32_t l : layers) {
    per_worker[WorkerFor(request.session_id(), l)].push_back(l);
  }
  v1::FinalizeResponse total;
  for (size_t i = 0; i < workers_.size(); ++i) {
    if (per_worker[i].empty()) continue;  // empty would mean "all layers"
    v1::FinalizeRequest part = request;
    part.clear_layers();
    for (uint32_t l : per_worker[i]) part.add_layers(l);
    grpc::ClientContext context;
    PrepareContext(context, options_, kRpcTimeout);
    v1::FinalizeResponse response;
    KVCAL_RETURN_IF_ERROR(
        ToAbslStatus(workers_[i].stub->Finalize(&context, part, &response),
                     absl::StrCat("Finalize on ", workers_[i].id, " (",
                                  workers_[i].endpoint, ")")));
    for (v1::LayerScales& l : *response.mutable_layers()) {
      *total.add_layers() = std::move(l);
    }
    for (const v1::NonFiniteHead& h : response.nonfinite_heads()) {
      *total.add_nonfinite_heads() = h;
    }
    total.set_nonfinite_heads_total(total.nonfinite_heads_total() +
                                    response.nonfinite_heads_total());
    if (!total.has_resolved() && response.has_resolved()) {
      // Every worker resolves the same options; the layers are the caller's.
      *total.mutable_resolved() = response.resolved();
      *total.mutable_resolved()->mutable_layers() = request.layers();
    }
    MergeEvaluations(response, total);
  }
  if (total.has_evaluation()) {
    auto* rows = total.mutable_evaluation()->mutable_layers();
    std::sort(rows->begin(), rows->end(),
              [](const v1::LayerEvaluation& a, const v1::LayerEvaluation& b) {
                return a.layer() < b.layer();
              });
  }
  std::sort(total.mutable_layers()->begin(), total.mutable_layers()->end(),
            [](const v1::LayerScales& a, const v1::LayerScales& b) {
              return a.layer() < b.layer();
            });
  SortNonFiniteHeads(total.mutable_nonfinite_heads());
  return total;
}

}  // namespace kvcal
