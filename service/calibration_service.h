// The kvcal.v1.Calibration gRPC service (callback API). Handlers stay thin:
// authenticate, convert the request (proto_convert.h), call the session
// registry or a session, convert back. Work that touches the statistics
// backend runs on an Executor, never inside a gRPC reaction.
//
//   CalibrationService service(options);
//   builder.RegisterService(&service);
#ifndef KVCAL_SERVICE_CALIBRATION_SERVICE_H_
#define KVCAL_SERVICE_CALIBRATION_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <utility>

#include "kvcal/v1/calibration.grpc.pb.h"
#include "service/auth.h"
#include "service/executor.h"
#include "service/ingest_host.h"
#include "service/metrics.h"
#include "service/session_registry.h"
#include "service/shared_memory.h"

namespace kvcal::service {

struct ServiceOptions {
  RegistryOptions registry;
  // Without a value every RPC is allowed.
  std::optional<TokenAuthenticator> auth;
  // Threads applying chunks and running Finalize/Export/Import.
  int executor_threads = 4;
  // Bytes of received, not yet applied chunks across all streams above which
  // streams stop reading (each stream may still hold one chunk).
  uint64_t max_inflight_bytes = 256ull << 20;
  // Chunks one stream may hold received but not applied.
  int max_pending_per_stream = 4;
  // This worker's stable identity (--worker-id) and backend, reported by
  // GetWorkerInfo and checked against session shard maps.
  std::string worker_id = "worker";
  std::string backend_name = "cpu";
  // Same-host shared-memory regions (RegisterSharedMemory).
  SharedMemoryOptions shared_memory;
};

class IngestReactor;
class SessionPersister;

// The generated kvcal.v1.Calibration service on gRPC's callback API, every
// method typed except Ingest, which is raw (grpc::ByteBuffer in and out):
// the generated CallbackService with WithRawCallbackMethod_Ingest in the
// place of WithCallbackMethod_Ingest. Public generated API only; the order
// of the chain does not matter (each layer registers its own method).
namespace calibration_grpc {
using G = kvcal::v1::Calibration;
using Base = G::WithCallbackMethod_CreateSession<
    G::WithCallbackMethod_GetSession<G::WithCallbackMethod_ListSessions<
        G::WithCallbackMethod_DeleteSession<G::WithRawCallbackMethod_Ingest<
            G::WithCallbackMethod_Finalize<G::WithCallbackMethod_ExportState<
                G::WithCallbackMethod_ImportState<
                    G::WithCallbackMethod_GetWorkerInfo<
                        G::WithCallbackMethod_RegisterSharedMemory<
                            G::WithCallbackMethod_UnregisterSharedMemory<
                                G::WithCallbackMethod_ListSharedMemory<
                                    G::Service>>>>>>>>>>>>;
}  // namespace calibration_grpc

class CalibrationService final : public calibration_grpc::Base,
                                 public IngestHost {
 public:
  explicit CalibrationService(ServiceOptions options);
  ~CalibrationService() override;

  SessionRegistry& registry() { return registry_; }
  SharedMemoryRegistry& shared_memory() { return shared_memory_; }

  // Shutdown, first step: every open Ingest stream stops reading, applies
  // the chunks it already received, sends their responses and ends with
  // UNAVAILABLE so that producers reconnect (to this worker once restarted,
  // or another one).
  void DrainStreams();

  // Open Ingest streams plus unary RPCs not yet finished.
  int64_t InFlightRpcs() const {
    return unary_in_flight_.load() +
           static_cast<int64_t>(metrics_.active_streams());
  }
  // With --state-dir, deletions also remove the session's file.
  void set_persister(SessionPersister* persister) { persister_ = persister; }
  Metrics& metrics() override { return metrics_; }

  grpc::ServerUnaryReactor* CreateSession(
      grpc::CallbackServerContext* context,
      const kvcal::v1::CreateSessionRequest* request,
      kvcal::v1::Session* response) override;
  grpc::ServerUnaryReactor* GetSession(
      grpc::CallbackServerContext* context,
      const kvcal::v1::GetSessionRequest* request,
      kvcal::v1::Session* response) override;
  grpc::ServerUnaryReactor* ListSessions(
      grpc::CallbackServerContext* context,
      const kvcal::v1::ListSessionsRequest* request,
      kvcal::v1::ListSessionsResponse* response) override;
  grpc::ServerUnaryReactor* DeleteSession(
      grpc::CallbackServerContext* context,
      const kvcal::v1::DeleteSessionRequest* request,
      kvcal::v1::DeleteSessionResponse* response) override;
  // Ingest is served raw (ByteBuffer in, ByteBuffer out): chunk data is read
  // in place from gRPC's receive buffer (ingest_wire.h), never copied into a
  // message. One IngestReactor (ingest_reactor.h) per stream.
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Ingest(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* Finalize(
      grpc::CallbackServerContext* context,
      const kvcal::v1::FinalizeRequest* request,
      kvcal::v1::FinalizeResponse* response) override;
  grpc::ServerUnaryReactor* ExportState(
      grpc::CallbackServerContext* context,
      const kvcal::v1::ExportStateRequest* request,
      kvcal::v1::SessionState* response) override;
  grpc::ServerUnaryReactor* ImportState(
      grpc::CallbackServerContext* context,
      const kvcal::v1::ImportStateRequest* request,
      kvcal::v1::Session* response) override;
  grpc::ServerUnaryReactor* GetWorkerInfo(
      grpc::CallbackServerContext* context,
      const kvcal::v1::GetWorkerInfoRequest* request,
      kvcal::v1::WorkerInfo* response) override;
  grpc::ServerUnaryReactor* RegisterSharedMemory(
      grpc::CallbackServerContext* context,
      const kvcal::v1::RegisterSharedMemoryRequest* request,
      kvcal::v1::SharedMemoryRegion* response) override;
  grpc::ServerUnaryReactor* UnregisterSharedMemory(
      grpc::CallbackServerContext* context,
      const kvcal::v1::UnregisterSharedMemoryRequest* request,
      kvcal::v1::UnregisterSharedMemoryResponse* response) override;
  grpc::ServerUnaryReactor* ListSharedMemory(
      grpc::CallbackServerContext* context,
      const kvcal::v1::ListSharedMemoryRequest* request,
      kvcal::v1::ListSharedMemoryResponse* response) override;

 private:
  // IngestHost, for the Ingest streams (ingest_host.h).
  bool RegisterStream(IngestReactor* reactor) override;
  void UnregisterStream(IngestReactor* reactor) override;
  // The caller's tenant (kDefaultTenant without --auth-token-file), or
  // Unauthenticated.
  absl::StatusOr<std::string> Authorize(
      grpc::CallbackServerContext* context) const override;
  void AddInflight(int64_t delta) override;
  bool InflightBelowLimit() const override;
  uint64_t max_inflight_bytes() const override {
    return options_.max_inflight_bytes;
  }
  int max_pending_per_stream() const override {
    return options_.max_pending_per_stream;
  }
  bool BackpressureLogDue(int64_t now_seconds) override;
  void Schedule(std::function<void()> task) override {
    executor_.Schedule(std::move(task));
  }
  // Runs `body` (inline or on the executor), records latency and rejects,
  // and finishes the reactor with its status.
  template <typename Body>
  grpc::ServerUnaryReactor* Unary(grpc::CallbackServerContext* context,
                                  const char* method, bool offload, Body body);
  // Applies one chunk: `request` without its data, which is `data` (views
  // into the received message) or, with `request.shared_memory`, bytes of a
  // registered region held for the duration of the call; the response or
  // the status that ends the stream.
  absl::StatusOr<kvcal::v1::IngestResponse> ApplyChunk(
      const std::string& tenant, const kvcal::v1::IngestRequest& request,
      const std::vector<absl::Span<const std::byte>>& data,
      uint64_t data_bytes) override;
  // The response to an ingested message; an applied one counts `bytes` and
  // `values` in the metrics, another as a duplicate.
  kvcal::v1::IngestResponse Acknowledge(const std::string& producer,
                                        uint64_t sequence,
                                        const IngestOutcome& outcome,
                                        uint64_t bytes, uint64_t values);
  // ApplyChunk for a message carrying partial_statistics instead of a chunk.
  absl::StatusOr<kvcal::v1::IngestResponse> ApplyPartial(
      const std::shared_ptr<Session>& session, const std::string& producer,
      const kvcal::v1::IngestRequest& request, uint64_t data_bytes);

  // SessionInfoToProto plus what the service knows (persistence).
  void SessionToProto(const SessionInfo& info, kvcal::v1::Session* out) const;

  ServiceOptions options_;
  SessionRegistry registry_;
  SharedMemoryRegistry shared_memory_;
  SessionPersister* persister_ = nullptr;
  Metrics metrics_;
  std::atomic<int64_t> inflight_bytes_{0};
  std::atomic<int64_t> unary_in_flight_{0};
  std::atomic<int64_t> last_backpressure_log_{0};
  std::mutex streams_mu_;
  std::set<IngestReactor*> streams_;  // guarded by streams_mu_
  bool draining_ = false;             // guarded by streams_mu_
  Executor executor_;
};

}  // namespace kvcal::service

#endif  // KVCAL_SERVICE_CALIBRATION_SERVICE_H_
