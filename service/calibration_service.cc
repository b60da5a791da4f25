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
#include "service/ingest_wire.h"
#include "service/log.h"
#include "service/proto_convert.h"
#include "service/session_persister.h"
#include "util/grpc_status.h"

namespace kvcal::service {
namespace {

// Index of Ingest among kvcal.v1.Calibration's methods (proto order),
// checked by every service test that ingests.
constexpr int kIngestMethodIndex = 4;

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
  // The generated service numbers its methods in the proto's order; a
  // reordered proto must not hand Ingest's raw handler to another method.
  const std::string& method = pb::IngestRequest::descriptor()
                                  ->file()
                                  ->FindServiceByName("Calibration")
                                  ->method(kIngestMethodIndex)
                                  ->name();
  if (method != "Ingest") {
    std::fprintf(stderr,
                 "kvcal-worker: kvcal.v1.Calibration method %d is %s, not "
                 "Ingest: update kIngestMethodIndex\n",
                 kIngestMethodIndex, method.c_str());
    std::abort();
  }
  // Ingest (method 4 of kvcal.v1.Calibration, in the order of the proto)
  // becomes a raw callback method, as the generated
  // WithRawCallbackMethod_Ingest does it; the typed handler is replaced.
  MarkMethodRawCallback(
      kIngestMethodIndex,
      new grpc::internal::CallbackBidiHandler<grpc::ByteBuffer,
                                              grpc::ByteBuffer>(
          [this](grpc::CallbackServerContext* context) {
            return IngestRaw(context);
          }));
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
        absl::StatusOr<Geometry> geometry = GeometryFromProto(*request);
        if (!geometry.ok()) return geometry.status();
        const ShardMap map = ShardMapFromProto(request->shard_map());
        if (!map.empty() &&
            !std::binary_search(map.worker_ids.begin(), map.worker_ids.end(),
                                options_.worker_id)) {
          return absl::FailedPreconditionError(
              absl::StrCat("this worker '", options_.worker_id,
                           "' is not in the session's shard map [",
                           absl::StrJoin(map.worker_ids, ", "), "]"));
        }
        auto session =
            registry_.Create(tenant, request->session_id(), *geometry, map,
                             request->holdout_budget_bytes());
        if (!session.ok()) return session.status();
        if (persister_ != nullptr) {
          // A failing disk is reported (metrics, /healthz) and the session
          // still serves, as with periodic snapshots.
          (void)persister_->Save(*session);
        }
        auto info = (*session)->Info();
        if (!info.ok()) return info.status();
        SessionToProto(*info, response);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* CalibrationService::GetSession(
    grpc::CallbackServerContext* context, const pb::GetSessionRequest* request,
    pb::Session* response) {
  return Unary(
      context, "GetSession", /*offload=*/true,
      [this, request, response](const std::string& tenant) -> absl::Status {
        auto session = registry_.Get(tenant, request->session_id());
        if (!session.ok()) return session.status();
        auto info = (*session)->Info();
        if (!info.ok()) return info.status();
        SessionToProto(*info, response);
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
                   auto info = session->Info();
                   if (!info.ok()) return info.status();
                   SessionToProto(*info, response->add_sessions());
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
        auto session = registry_.Get(tenant, request->session_id());
        if (!session.ok()) return session.status();
        const std::vector<uint32_t> layers(request->layers().begin(),
                                           request->layers().end());
        if (absl::Status s = (*session)->CheckShard(
                std::vector<std::string>(request->shard_worker_ids().begin(),
                                         request->shard_worker_ids().end()),
                layers, options_.worker_id);
            !s.ok()) {
          return absl::Status(s.code(),
                              absl::StrCat("Finalize: ", s.message()));
        }
        absl::StatusOr<EvaluatedFinalizeOptions> options =
            EvaluatedFinalizeOptionsFromProto(*request);
        if (!options.ok()) return options.status();
        auto result = (*session)->Finalize(*options);
        if (!result.ok()) return result.status();
        EvaluatedFinalizeToProto(*result, response);
        ResolvedFinalizeToProto(*request, *options, *result,
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
        auto session = registry_.Get(tenant, request->session_id());
        if (!session.ok()) return session.status();
        auto snapshot = (*session)->Export();
        if (!snapshot.ok()) return snapshot.status();
        SnapshotToProto((*session)->id(), *snapshot, response);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* CalibrationService::ImportState(
    grpc::CallbackServerContext* context, const pb::ImportStateRequest* request,
    pb::Session* response) {
  return Unary(
      context, "ImportState", /*offload=*/true,
      [this, request, response](const std::string& tenant) -> absl::Status {
        absl::Status id_ok = ValidateSessionId(request->session_id(), false);
        if (!id_ok.ok()) return id_ok;
        auto snapshot = SnapshotFromProto(request->state());
        if (!snapshot.ok()) return snapshot.status();
        auto session = registry_.Import(tenant, request->session_id(),
                                        *snapshot, request->import_id());
        if (!session.ok()) return session.status();
        auto info = (*session)->Info();
        if (!info.ok()) return info.status();
        SessionToProto(*info, response);
        return absl::OkStatus();
      });
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
  absl::StatusOr<IngestOutcome> outcome =
      (*session)->Ingest(producer, request.sequence(), chunk, request.holdout(),
                         /*device_data=*/lease.device());
  if (!outcome.ok()) return outcome.status();
  if (outcome->applied) {
    const uint64_t element_size = request.dtype() == pb::DTYPE_F32 ? 4 : 2;
    metrics_.RecordIngest(data_bytes, data_bytes / element_size);
  } else {
    metrics_.RecordDuplicate();
  }
  pb::IngestResponse response;
  response.set_producer_id(producer);
  response.set_sequence(request.sequence());
  response.set_applied(outcome->applied);
  response.set_watermark(outcome->watermark);
  response.set_durable_watermark(outcome->durable_watermark);
  return response;
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
        absl::StatusOr<SharedMemoryRegistration> registration =
            SharedMemoryRegistrationFromProto(*request);
        if (!registration.ok()) return registration.status();
        absl::StatusOr<SharedMemoryRegionInfo> region =
            shared_memory_.Register(tenant, *registration);
        if (!region.ok()) return region.status();
        KVCAL_LOG(INFO) << "tenant '" << tenant
                        << "' registered shared memory region " << region->id
                        << " ('" << region->name << "', " << region->byte_size
                        << " bytes)";
        SharedMemoryRegionToProto(*region, response);
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

// One Ingest stream. Reads chunks while the stream's and the worker's
// in-flight bounds allow (gRPC flow control then slows the producer), applies
// them in order on the executor, and writes one response per chunk in order.
// The first error is sent after the responses of the chunks before it.
class IngestReactor final
    : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
  // Responses produced but not yet sent; beyond this the stream stops
  // reading, so a client that never reads its acks is slowed by gRPC flow
  // control instead of growing the worker's queue.
  static constexpr size_t kMaxUnsentResponses = 64;
  // Applied requests kept for reuse by later reads (their vectors keep
  // their capacity; the received bytes themselves are released).
  static constexpr size_t kMaxSpareRequests = 2;

 public:
  IngestReactor(CalibrationService* service,
                grpc::CallbackServerContext* context)
      : service_(service), start_(Clock::now()) {
    service_->metrics_.StreamOpened();
    absl::StatusOr<std::string> tenant =
        service_->RegisterStream(this)
            ? service_->Authorize(context)
            : absl::UnavailableError("the worker is shutting down");
    if (!tenant.ok()) {
      service_->metrics_.RecordReject(static_cast<int>(tenant.status().code()));
      // Through the one finish decision: a drain that started after
      // RegisterStream may be finishing this stream concurrently.
      {
        std::lock_guard<std::mutex> lock(mu_);
        Fail(ToGrpcStatus(tenant.status()), /*drop_writes=*/false);
      }
      MaybeFinish();
      return;
    }
    tenant_ = *std::move(tenant);
    StartNextRead();
  }

  void OnReadDone(bool ok) override {
    bool schedule = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      reading_ = false;
      if (!ok || failed_ || finished_) {
        // After Finish (a drain finishes with a read still outstanding) a
        // chunk that arrives anyway is dropped unapplied and unanswered:
        // the client resumes from the watermark.
        read_closed_ = true;
        read_buffer_.reset();
      } else {
        const int64_t bytes = static_cast<int64_t>(read_buffer_->wire_bytes());
        pending_bytes_ += bytes;
        service_->AddInflight(bytes);
        pending_.push_back(std::move(read_buffer_));
        if (!applying_) {
          applying_ = true;
          schedule = true;
        }
      }
    }
    if (schedule) {
      Ref();  // ApplyLoop's own reference: the reactor outlives the loop
      service_->executor_.Schedule([this] {
        ApplyLoop();
        Unref();
      });
    }
    StartNextRead();
    MaybeFinish();
  }

  void OnWriteDone(bool ok) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      writing_ = false;
      writes_.pop_front();
      if (!ok) {
        Fail(grpc::Status(grpc::StatusCode::CANCELLED,
                          "the client stopped receiving responses"),
             /*drop_writes=*/true);
      }
    }
    StartNextWrite();
    StartNextRead();  // reads pause while responses pile up
    MaybeFinish();
  }

  void OnCancel() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      Fail(grpc::Status(grpc::StatusCode::CANCELLED, "stream cancelled"),
           /*drop_writes=*/true);
    }
    MaybeFinish();
  }

  // Stops reading; chunks already received are applied and answered, then
  // the stream ends with UNAVAILABLE.
  void Drain() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (draining_ || finished_) return;
      draining_ = true;
    }
    MaybeFinish();
  }

  void OnDone() override {
    service_->UnregisterStream(this);
    service_->metrics_.RecordLatency("Ingest", SecondsSince(start_));
    service_->metrics_.StreamClosed();
    Unref();
  }

  // gRPC holds one reference until OnDone; DrainStreams holds one while it
  // drains a stream outside its lock; a scheduled ApplyLoop holds one until
  // it returns.
  void Ref() { refs_.fetch_add(1); }
  void Unref() {
    if (refs_.fetch_sub(1) == 1) delete this;
  }

 private:
  // mu_ held. Drops every chunk not yet applied; with `drop_writes` (the
  // client is gone) also the responses not yet written, else those are still
  // sent before the error.
  void Fail(grpc::Status status, bool drop_writes) {
    if (drop_writes) {
      while (writes_.size() > (writing_ ? 1u : 0u)) writes_.pop_back();
    }
    if (failed_) return;
    failed_ = true;
    final_status_ = std::move(status);
    service_->AddInflight(-pending_bytes_);
    pending_bytes_ = 0;
    pending_.clear();
  }

  // mu_ held. True (once) when the stream is to be finished with *status.
  bool ShouldFinishLocked(grpc::Status* status) {
    if (finished_ || applying_ || writing_ || !writes_.empty()) return false;
    const bool drained = draining_ && pending_.empty();
    if (!failed_ && !drained && !(read_closed_ && pending_.empty())) {
      return false;
    }
    finished_ = true;
    if (failed_) {
      *status = final_status_;
    } else if (drained && !read_closed_) {
      *status = grpc::Status(grpc::StatusCode::UNAVAILABLE,
                             "the worker is shutting down; every chunk "
                             "acknowledged on this stream is applied");
    } else {
      *status = grpc::Status::OK;
    }
    return true;
  }

  // StartRead is issued outside mu_, so no finish may be decided between
  // the decision here and the call. That holds because every caller is a
  // reaction (OnReadDone, OnWriteDone: gRPC keeps the call alive until it
  // returns), the constructor (before binding), or ApplyLoop while
  // applying_ is set (which blocks any finish). Calling it from elsewhere,
  // Drain() for one, would need that reasoning again.
  void StartNextRead() {
    grpc::ByteBuffer* target = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (reading_ || read_closed_ || failed_ || finished_ || draining_) {
        return;
      }
      if (static_cast<int>(pending_.size()) >=
          service_->options_.max_pending_per_stream) {
        return;  // resumed by ApplyLoop
      }
      if (writes_.size() >= kMaxUnsentResponses) {
        return;  // a client that stops reading acks stops being read
      }
      if (!pending_.empty() && !service_->InflightBelowLimit()) {
        const int64_t now = std::chrono::duration_cast<std::chrono::seconds>(
                                Clock::now().time_since_epoch())
                                .count();
        int64_t last = service_->last_backpressure_log_.load();
        if (now - last >= 10 &&
            service_->last_backpressure_log_.compare_exchange_strong(last,
                                                                     now)) {
          KVCAL_LOG(WARNING)
              << "ingest: in-flight chunk memory reached the "
              << service_->options_.max_inflight_bytes
              << " byte bound (--max-inflight-bytes); pausing reads";
        }
        return;  // resumed by ApplyLoop once this stream's chunks drain
      }
      if (spare_.empty()) {
        read_buffer_ = std::make_unique<ReceivedIngestRequest>();
      } else {
        read_buffer_ = std::move(spare_.back());
        spare_.pop_back();
      }
      target = read_buffer_->buffer();
      reading_ = true;
    }
    StartRead(target);
  }

  void StartNextWrite() {
    const grpc::ByteBuffer* message = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (writing_ || writes_.empty() || finished_) return;
      writing_ = true;
      message = &writes_.front();
    }
    StartWrite(message);
  }

  void ApplyLoop() {
    for (;;) {
      std::unique_ptr<ReceivedIngestRequest> request;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (pending_.empty() || failed_) {
          // Decide under the same lock that clears applying_: once it is
          // clear a reaction may finish the stream and delete this reactor.
          applying_ = false;
          grpc::Status status;
          if (!ShouldFinishLocked(&status)) return;
          request.reset();
          final_for_finish_ = std::move(status);
        }
        if (applying_) {
          request = std::move(pending_.front());
          pending_.pop_front();
        }
      }
      if (request == nullptr) {
        Finish(final_for_finish_);
        return;
      }
      const int64_t bytes = static_cast<int64_t>(request->wire_bytes());
      absl::StatusOr<pb::IngestResponse> response;
      if (absl::Status parsed = request->Parse(); !parsed.ok()) {
        response = std::move(parsed);
      } else {
        response = service_->ApplyChunk(tenant_, request->header(),
                                        request->data(), request->data_bytes());
      }
      grpc::ByteBuffer serialized;
      if (response.ok()) {
        bool own = false;
        grpc::Status s =
            grpc::SerializationTraits<pb::IngestResponse>::Serialize(
                *response, &serialized, &own);
        if (!s.ok()) response = absl::InternalError(s.error_message());
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!failed_) {
          pending_bytes_ -= bytes;
          service_->AddInflight(-bytes);
        }
        // Cleared (the received slices released), the request keeps its
        // vectors for the next read.
        request->Clear();
        if (spare_.size() < kMaxSpareRequests) {
          spare_.push_back(std::move(request));
        }
        if (response.ok()) {
          if (!failed_) writes_.push_back(std::move(serialized));
        } else {
          service_->metrics_.RecordReject(
              static_cast<int>(response.status().code()));
          Fail(ToGrpcStatus(response.status()), /*drop_writes=*/false);
        }
      }
      request.reset();
      StartNextWrite();
      StartNextRead();
    }
  }

  void MaybeFinish() {
    grpc::Status status;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!ShouldFinishLocked(&status)) return;
    }
    Finish(status);
  }

  CalibrationService* const service_;
  const Clock::time_point start_;
  std::string tenant_;  // set once, before the first read
  std::mutex mu_;
  std::unique_ptr<ReceivedIngestRequest> read_buffer_;
  std::deque<std::unique_ptr<ReceivedIngestRequest>> pending_;
  std::vector<std::unique_ptr<ReceivedIngestRequest>> spare_;
  int64_t pending_bytes_ = 0;
  std::deque<grpc::ByteBuffer> writes_;  // front is being written
  bool reading_ = false;
  bool read_closed_ = false;
  bool applying_ = false;
  bool writing_ = false;
  bool failed_ = false;
  bool draining_ = false;
  bool finished_ = false;
  std::atomic<int> refs_{1};
  grpc::Status final_status_;
  grpc::Status final_for_finish_;  // handed from ApplyLoop's lock to Finish
};

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
CalibrationService::IngestRaw(grpc::CallbackServerContext* context) {
  return new IngestReactor(this, context);
}

}  // namespace kvcal::service
