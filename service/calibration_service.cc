#include "service/calibration_service.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "proto/wire_geometry.h"
#include "service/ingest_reactor.h"
#include "service/log.h"
#include "service/proto_convert.h"
#include "service/session_persister.h"
#include "util/grpc_status.h"
#include "util/status_macros.h"

namespace kvcal::service {
namespace {

using Clock = std::chrono::steady_clock;
namespace pb = ::kvcal::v1;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

CalibrationService::CalibrationService(ServiceOptions options)
    : options_(std::move(options)),
      registry_(options_.registry),
      shared_memory_(options_.shared_memory),
      executor_(options_.executor_threads) {
  metrics_.SetSessionGauge([this] { return registry_.size(); });
}

CalibrationService::~CalibrationService() = default;

absl::StatusOr<std::string> CalibrationService::Authorize(
    grpc::CallbackServerContext* context) const {
  if (!options_.auth.has_value()) return std::string(kDefaultTenant);
  const auto& metadata = context->client_metadata();
  auto it = metadata.find("authorization");
  if (it == metadata.end()) {
    return absl::UnauthenticatedError(
        "missing 'authorization: Bearer <token>' metadata");
  }
  return options_.auth->Authenticate(
      absl::string_view(it->second.data(), it->second.size()));
}

template <typename Body>
grpc::ServerUnaryReactor* CalibrationService::Unary(
    grpc::CallbackServerContext* context, const char* method, bool offload,
    Body body) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const Clock::time_point start = Clock::now();
  {
    // Once draining, new calls are refused: steady polling must not keep
    // the in-flight count up and use up Shutdown's grace period.
    std::lock_guard<std::mutex> lock(streams_mu_);
    if (draining_) {
      metrics_.RecordReject(static_cast<int>(grpc::StatusCode::UNAVAILABLE));
      reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                   "the worker is shutting down"));
      return reactor;
    }
    unary_in_flight_.fetch_add(1);
  }
  auto run = [this, context, reactor, method, start,
              body = std::move(body)]() mutable {
    absl::StatusOr<std::string> tenant = Authorize(context);
    absl::Status status = tenant.ok() ? body(*tenant) : tenant.status();
    if (!status.ok()) metrics_.RecordReject(static_cast<int>(status.code()));
    metrics_.RecordLatency(method, SecondsSince(start));
    reactor->Finish(ToGrpcStatus(status));
    unary_in_flight_.fetch_sub(1);
  };
  if (offload) {
    executor_.Schedule(std::move(run));
  } else {
    run();
  }
  return reactor;
}

grpc::ServerUnaryReactor* CalibrationService::CreateSession(
    grpc::CallbackServerContext* context,
    const pb::CreateSessionRequest* request, pb::Session* response) {
  return Unary(
      context, "CreateSession", /*offload=*/true,
      [this, request, response](const std::string& tenant) -> absl::Status {
        KVCAL_ASSIGN_OR_RETURN(const Geometry geometry,
                               GeometryFromWire(*request));
        const ShardMap map = ShardMapFromProto(request->shard_map());
        if (!map.empty() &&
            !std::binary_search(map.worker_ids.begin(), map.worker_ids.end(),
                                options_.worker_id)) {
          return absl::FailedPreconditionError(
              absl::StrCat("this worker '", options_.worker_id,
                           "' is not in the session's shard map [",
                           absl::StrJoin(map.worker_ids, ", "), "]"));
        }
        const SessionParameters parameters{
            .holdout_budget_bytes = request->holdout_budget_bytes(),
            .reject_non_finite = request->reject_non_finite()};
        KVCAL_ASSIGN_OR_RETURN(const std::shared_ptr<Session> session,
                               registry_.Create(tenant, request->session_id(),
                                                geometry, map, parameters));
        if (persister_ != nullptr) {
          // A failing disk is reported (metrics, /healthz) and the session
          // still serves, as with periodic snapshots.
          (void)persister_->Save(session);
        }
        KVCAL_ASSIGN_OR_RETURN(const SessionInfo info, session->Info());
        SessionToProto(info, response);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* CalibrationService::GetSession(
    grpc::CallbackServerContext* context, const pb::GetSessionRequest* request,
    pb::Session* response) {
  return Unary(
      context, "GetSession", /*offload=*/true,
      [this, request, response](const std::string& tenant) -> absl::Status {
        KVCAL_ASSIGN_OR_RETURN(const std::shared_ptr<Session> session,
                               registry_.Get(tenant, request->session_id()));
        KVCAL_ASSIGN_OR_RETURN(const SessionInfo info, session->Info());
        SessionToProto(info, response);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* CalibrationService::ListSessions(
    grpc::CallbackServerContext* context,
    const pb::ListSessionsRequest* /*request*/,
    pb::ListSessionsResponse* response) {
  return Unary(context, "ListSessions", /*offload=*/true,
               [this, response](const std::string& tenant) -> absl::Status {
                 for (const auto& session : registry_.List(tenant)) {
                   KVCAL_ASSIGN_OR_RETURN(const SessionInfo info,
                                          session->Info());
                   SessionToProto(info, response->add_sessions());
                 }
                 return absl::OkStatus();
               });
}

grpc::ServerUnaryReactor* CalibrationService::DeleteSession(
    grpc::CallbackServerContext* context,
    const pb::DeleteSessionRequest* request,
    pb::DeleteSessionResponse* /*response*/) {
  return Unary(context, "DeleteSession", /*offload=*/false,
               [this, request](const std::string& tenant) -> absl::Status {
                 if (persister_ != nullptr) {
                   return persister_->Delete(tenant, request->session_id());
                 }
                 return registry_.Delete(tenant, request->session_id());
               });
}

grpc::ServerUnaryReactor* CalibrationService::Finalize(
    grpc::CallbackServerContext* context, const pb::FinalizeRequest* request,
    pb::FinalizeResponse* response) {
  return Unary(
      context, "Finalize", /*offload=*/true,
      [this, request, response](const std::string& tenant) -> absl::Status {
        KVCAL_ASSIGN_OR_RETURN(const std::shared_ptr<Session> session,
                               registry_.Get(tenant, request->session_id()));
        const std::vector<uint32_t> layers(request->layers().begin(),
                                           request->layers().end());
        if (absl::Status s = session->CheckShard(
                std::vector<std::string>(request->shard_worker_ids().begin(),
                                         request->shard_worker_ids().end()),
                layers, options_.worker_id);
            !s.ok()) {
          return absl::Status(s.code(),
                              absl::StrCat("Finalize: ", s.message()));
        }
        KVCAL_ASSIGN_OR_RETURN(const EvaluatedFinalizeOptions options,
                               EvaluatedFinalizeOptionsFromProto(*request));
        KVCAL_ASSIGN_OR_RETURN(const auto result, session->Finalize(options));
        EvaluatedFinalizeToProto(result, response);
        ResolvedFinalizeToProto(*request, options, result,
                                response->mutable_resolved());
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* CalibrationService::ExportState(
    grpc::CallbackServerContext* context, const pb::ExportStateRequest* request,
    pb::SessionState* response) {
  return Unary(
      context, "ExportState", /*offload=*/true,
      [this, request, response](const std::string& tenant) -> absl::Status {
        KVCAL_ASSIGN_OR_RETURN(const std::shared_ptr<Session> session,
                               registry_.Get(tenant, request->session_id()));
        KVCAL_ASSIGN_OR_RETURN(const auto snapshot, session->Export());
        SnapshotToProto(session->id(), snapshot, response);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* CalibrationService::ImportState(
    grpc::CallbackServerContext* context, const pb::ImportStateRequest* request,
    pb::Session* response) {
  return Unary(
      context, "ImportState", /*offload=*/true,
      [this, request, response](const std::string& tenant) -> absl::Status {
        KVCAL_RETURN_IF_ERROR(ValidateSessionId(request->session_id(), false));
        KVCAL_ASSIGN_OR_RETURN(const auto snapshot,
                               SnapshotFromProto(request->state()));
        KVCAL_ASSIGN_OR_RETURN(
            const std::shared_ptr<Session> session,
            registry_.Import(tenant, request->session_id(), snapshot,
                             request->import_id()));
        KVCAL_ASSIGN_OR_RETURN(const SessionInfo info, session->Info());
        SessionToProto(info, response);
        return absl::OkStatus();
      });
}

pb::IngestResponse CalibrationService::Acknowledge(const std::string& producer,
                                                   uint64_t sequence,
                                                   const IngestOutcome& outcome,
                                                   uint64_t bytes,
                                                   uint64_t values) {
  if (outcome.applied) {
    metrics_.RecordIngest(bytes, values);
  } else {
    metrics_.RecordDuplicate();
  }
  pb::IngestResponse response;
  response.set_producer_id(producer);
  response.set_sequence(sequence);
  response.set_applied(outcome.applied);
  response.set_watermark(outcome.watermark);
  response.set_durable_watermark(outcome.durable_watermark);
  return response;
}

absl::StatusOr<pb::IngestResponse> CalibrationService::ApplyChunk(
    const std::string& tenant, const pb::IngestRequest& request,
    const std::vector<absl::Span<const std::byte>>& data, uint64_t data_bytes) {
  const std::string producer = ResolveProducerId(request.producer_id());
  auto session = registry_.Get(tenant, request.session_id());
  if (!session.ok()) {
    return absl::Status(
        session.status().code(),
        absl::StrCat("chunk ", request.sequence(), " from producer '", producer,
                     "': ", session.status().message()));
  }
  if (request.has_partial_statistics()) {
    return ApplyPartial(*session, producer, request, data_bytes);
  }
  // Before anything of the chunk is looked at: a chunk for another worker's
  // layer, or from a client sharding over another worker set, must not be
  // applied (it would split statistics across workers).
  const uint32_t layer = request.layer();
  if (absl::Status shard = (*session)->CheckShard(
          std::vector<std::string>(request.shard_worker_ids().begin(),
                                   request.shard_worker_ids().end()),
          absl::MakeConstSpan(&layer, 1), options_.worker_id);
      !shard.ok()) {
    return absl::Status(shard.code(), absl::StrCat("chunk ", request.sequence(),
                                                   " from producer '", producer,
                                                   "': ", shard.message()));
  }
  ChunkView chunk = ChunkFromProto(request);
  // Held until the chunk is applied (or copied, when held out): the range
  // stays marked in use and the mapping alive through an Unregister.
  SharedMemoryLease lease;
  if (request.has_shared_memory()) {
    const pb::SharedMemoryReference& ref = request.shared_memory();
    absl::StatusOr<SharedMemoryLease> acquired =
        data_bytes != 0 ? absl::InvalidArgumentError(absl::StrCat(
                              "sets both data (", data_bytes,
                              " bytes) and shared_memory; a chunk carries one"))
                        : shared_memory_.Acquire(tenant, ref.region_id(),
                                                 ref.offset(), ref.byte_size());
    if (!acquired.ok()) {
      return absl::Status(
          acquired.status().code(),
          absl::StrCat("chunk ", request.sequence(), " from producer '",
                       producer, "': ", acquired.status().message()));
    }
    lease = *std::move(acquired);
    chunk.data = lease.bytes();
    data_bytes = lease.bytes().size();
  } else {
    chunk.pieces = data;
  }
  KVCAL_ASSIGN_OR_RETURN(
      const IngestOutcome outcome,
      (*session)->Ingest(producer, request.sequence(), chunk, request.holdout(),
                         /*device_data=*/lease.device()));
  const uint64_t element_size = request.dtype() == pb::DTYPE_F32 ? 4 : 2;
  return Acknowledge(producer, request.sequence(), outcome, data_bytes,
                     data_bytes / element_size);
}

absl::StatusOr<pb::IngestResponse> CalibrationService::ApplyPartial(
    const std::shared_ptr<Session>& session, const std::string& producer,
    const pb::IngestRequest& request, uint64_t data_bytes) {
  // A partial carries no chunk: a chunk field set beside it is a client bug.
  std::vector<std::string> set;
  if (data_bytes != 0) set.push_back("data");
  if (request.has_shared_memory()) set.push_back("shared_memory");
  if (request.holdout()) set.push_back("holdout");
  if (request.batch() != 0) set.push_back("batch");
  if (request.layer() != 0) set.push_back("layer");
  if (request.role() != pb::ROLE_UNSPECIFIED) set.push_back("role");
  if (request.dtype() != pb::DTYPE_UNSPECIFIED) set.push_back("dtype");
  if (request.layout() != pb::LAYOUT_UNSPECIFIED) set.push_back("layout");
  if (request.shape_size() != 0) set.push_back("shape");
  if (request.head_offset() != 0) set.push_back("head_offset");
  if (!set.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "partial statistics ", request.sequence(), " from producer '", producer,
        "' also sets ", absl::StrJoin(set, ", "),
        "; a message carries either a chunk or partial statistics"));
  }
  const pb::PartialStatistics& partial = request.partial_statistics();
  SessionCounters counters;
  counters.chunks_applied = partial.tensors();
  counters.values_ingested = partial.values();
  counters.bytes_ingested = partial.bytes();
  KVCAL_ASSIGN_OR_RETURN(
      const IngestOutcome outcome,
      session->IngestPartial(
          producer, request.sequence(), partial.statistics(), counters,
          std::vector<std::string>(request.shard_worker_ids().begin(),
                                   request.shard_worker_ids().end()),
          options_.worker_id));
  return Acknowledge(producer, request.sequence(), outcome,
                     partial.statistics().size(), partial.values());
}

void CalibrationService::SessionToProto(const SessionInfo& info,
                                        pb::Session* out) const {
  SessionInfoToProto(info, out);
  out->set_persistent(persister_ != nullptr);
  out->set_worker_id(options_.worker_id);
}

grpc::ServerUnaryReactor* CalibrationService::GetWorkerInfo(
    grpc::CallbackServerContext* context,
    const pb::GetWorkerInfoRequest* /*request*/, pb::WorkerInfo* response) {
  return Unary(context, "GetWorkerInfo", /*offload=*/false,
               [this, response](const std::string& /*tenant*/) {
                 response->set_worker_id(options_.worker_id);
                 response->set_backend(options_.backend_name);
                 response->set_persistent(persister_ != nullptr);
                 return absl::OkStatus();
               });
}

grpc::ServerUnaryReactor* CalibrationService::RegisterSharedMemory(
    grpc::CallbackServerContext* context,
    const pb::RegisterSharedMemoryRequest* request,
    pb::SharedMemoryRegion* response) {
  return Unary(
      context, "RegisterSharedMemory", /*offload=*/true,
      [this, request, response](const std::string& tenant) -> absl::Status {
        KVCAL_ASSIGN_OR_RETURN(const SharedMemoryRegistration registration,
                               SharedMemoryRegistrationFromProto(*request));
        KVCAL_ASSIGN_OR_RETURN(const SharedMemoryRegionInfo region,
                               shared_memory_.Register(tenant, registration));
        KVCAL_LOG(INFO) << "tenant '" << tenant
                        << "' registered shared memory region " << region.id
                        << " ('" << region.name << "', " << region.byte_size
                        << " bytes)";
        SharedMemoryRegionToProto(region, response);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* CalibrationService::UnregisterSharedMemory(
    grpc::CallbackServerContext* context,
    const pb::UnregisterSharedMemoryRequest* request,
    pb::UnregisterSharedMemoryResponse* /*response*/) {
  return Unary(context, "UnregisterSharedMemory", /*offload=*/false,
               [this, request](const std::string& tenant) -> absl::Status {
                 return shared_memory_.Unregister(tenant, request->region_id());
               });
}

grpc::ServerUnaryReactor* CalibrationService::ListSharedMemory(
    grpc::CallbackServerContext* context,
    const pb::ListSharedMemoryRequest* /*request*/,
    pb::ListSharedMemoryResponse* response) {
  return Unary(context, "ListSharedMemory", /*offload=*/false,
               [this, response](const std::string& tenant) -> absl::Status {
                 for (const SharedMemoryRegionInfo& region :
                      shared_memory_.List(tenant)) {
                   SharedMemoryRegionToProto(region, response->add_regions());
                 }
                 return absl::OkStatus();
               });
}

void CalibrationService::AddInflight(int64_t delta) {
  const int64_t now = inflight_bytes_.fetch_add(delta) + delta;
  metrics_.SetInflightBytes(static_cast<uint64_t>(std::max<int64_t>(now, 0)));
}

bool CalibrationService::InflightBelowLimit() const {
  return inflight_bytes_.load() <
         static_cast<int64_t>(options_.max_inflight_bytes);
}

bool CalibrationService::BackpressureLogDue(int64_t now_seconds) {
  int64_t last = last_backpressure_log_.load();
  return now_seconds - last >= 10 &&
         last_backpressure_log_.compare_exchange_strong(last, now_seconds);
}

bool CalibrationService::RegisterStream(IngestReactor* reactor) {
  std::lock_guard<std::mutex> lock(streams_mu_);
  streams_.insert(reactor);
  return !draining_;
}

void CalibrationService::UnregisterStream(IngestReactor* reactor) {
  std::lock_guard<std::mutex> lock(streams_mu_);
  streams_.erase(reactor);
}

void CalibrationService::DrainStreams() {
  std::vector<IngestReactor*> streams;
  {
    // A registered reactor has not passed OnDone's unregistration, so the
    // reference taken here keeps it alive until Unref below.
    std::lock_guard<std::mutex> lock(streams_mu_);
    draining_ = true;
    for (IngestReactor* reactor : streams_) {
      reactor->Ref();
      streams.push_back(reactor);
    }
  }
  for (IngestReactor* reactor : streams) {
    reactor->Drain();
    reactor->Unref();
  }
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>*
CalibrationService::Ingest(grpc::CallbackServerContext* context) {
  return new IngestReactor(this, context);
}

}  // namespace kvcal::service
