// A client for one or several kvcal workers holding one calibration job.
//
//   KVCAL_ASSIGN_OR_RETURN(kvcal::CalibrationClient client,
//       kvcal::CalibrationClient::Connect({"w0:50051", "w1:50051"}, {}));
//   KVCAL_ASSIGN_OR_RETURN(kvcal::v1::Session s,
//                          client.CreateSession(request));
//   KVCAL_ASSIGN_OR_RETURN(auto sent,
//                          client.Upload(s.session_id(), chunks, {}));
//   KVCAL_ASSIGN_OR_RETURN(auto scales, client.Finalize(finalize_request));
//
// Connect resolves the endpoints and asks every worker for its id
// (GetWorkerInfo); workers are ordered by id, and two workers reporting the
// same id are refused. With several workers, each layer goes to the worker
// that wins rendezvous hashing on (session, layer, worker id)
// (client/rpc/sharding.h), so the order and the addresses of the workers never
// matter. CreateSession records that shard map on every worker; every later
// call first checks that the session's worker set is this client's
// (FAILED_PRECONDITION naming what changed otherwise), and chunks and
// Finalize carry the set so that workers check it too. Finalize asks each
// worker for its own layers (FinalizeRequest.layers) and assembles the
// result, so one worker or many give the same scales. A worker that comes
// back under a new address (a rescheduled pod) is found again by its id
// while an upload reconnects.
#ifndef KVCAL_CLIENT_RPC_CALIBRATION_CLIENT_H_
#define KVCAL_CLIENT_RPC_CALIBRATION_CLIENT_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/rpc/connection.h"
#include "client/rpc/uploader.h"
#include "kvcal/v1/calibration.grpc.pb.h"

namespace kvcal {

// "dns:///host:port" becomes every address host resolves to, sorted (a
// Kubernetes headless Service names every worker pod this way);
// "file:PATH" the endpoints listed in that file (one per line or
// comma-separated, '#' comments; read again whenever the client looks for a
// moved worker); HOST[:PORT] is checked (a port 1..65535, IPv6 in
// brackets) and given port 50051 when it has none (so is dns:///HOST); a
// target with another gRPC scheme (unix:, ipv4:, ...) is returned as it is.
absl::StatusOr<std::vector<std::string>> ExpandEndpoint(
    absl::string_view endpoint);

class CalibrationClient {
 public:
  // Endpoints are host:port; "a:1,b:2" lists are split here too.
  [[nodiscard]] static absl::StatusOr<CalibrationClient> Connect(
      const std::vector<std::string>& endpoints, ConnectionOptions options);

  // Index (in id order) of the worker that holds `layer` of the session.
  size_t WorkerFor(absl::string_view session_id, uint32_t layer) const;

  size_t worker_count() const { return workers_.size(); }
  const std::string& endpoint(size_t i) const { return workers_[i].endpoint; }
  const std::string& worker_id(size_t i) const { return workers_[i].id; }
  // Sorted; what the session's shard map must list.
  const std::vector<std::string>& worker_ids() const { return ids_; }
  const ConnectionOptions& connection() const { return options_; }
  std::shared_ptr<grpc::Channel> channel(size_t i) const {
    return workers_[i].channel;
  }

  // On every worker (idempotent there), with the shard map when there are
  // several. An empty id: the first worker picks one and the others get the
  // same.
  absl::StatusOr<v1::Session> CreateSession(v1::CreateSessionRequest request);
  // Counters summed over the workers; producers listed per worker (their
  // ids prefixed with "<worker id>/" when there are several).
  absl::StatusOr<v1::Session> GetSession(const std::string& session_id);
  absl::StatusOr<std::vector<v1::Session>> ListSessions();
  absl::Status DeleteSession(const std::string& session_id);

  // Streams every chunk to its layer's worker, all workers in parallel.
  // `options.session_id` is set from `session_id`.
  absl::StatusOr<UploadResult> Upload(const std::string& session_id,
                                      absl::Span<const ChunkView> chunks,
                                      UploaderOptions options);

  // Layers sorted; request.layers empty = every layer of the session.
  absl::StatusOr<v1::FinalizeResponse> Finalize(v1::FinalizeRequest request);

  // The session as every worker of this client holds it: OK when each has
  // it with this client's worker set (or, for one worker, any). Otherwise
  // FAILED_PRECONDITION naming the workers that lack it or what changed.
  // Returns the first worker's Session (with its shard map).
  absl::StatusOr<v1::Session> CheckSessionWorkers(const std::string& session_id,
                                                  bool wait_for_ready = false);

  v1::Calibration::Stub& stub(size_t i) { return *workers_[i].stub; }

 private:
  struct Worker {
    std::string endpoint;
    std::string id;
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<v1::Calibration::Stub> stub;
  };
  CalibrationClient() = default;
  // Every endpoint the specs expand to now.
  absl::StatusOr<std::vector<std::string>> ExpandAll() const;
  // A channel to the worker with this id under another address than
  // `current` (that address in *found_at), or null; re-resolves the
  // endpoint specs.
  std::shared_ptr<grpc::Channel> FindMovedWorker(const std::string& id,
                                                 std::string current,
                                                 std::string* found_at) const;
  bool sharded() const { return workers_.size() > 1; }
  // Upload without resume: FAILED_PRECONDITION when `producer_id` already
  // has chunks applied on a worker that `per_worker` sends to, before any
  // chunk goes out (each uploader checks only its own worker).
  absl::Status CheckProducerIsNew(
      const std::string& session_id, const std::string& producer_id,
      const std::vector<std::vector<ChunkView>>& per_worker) const;
  // Upload's steps: local statistics' partials per worker (the chunks of
  // calibration batches leave `per_worker`; none without local statistics),
  // the addresses workers were found again under, the workers' results
  // summed (the first failure, named by its worker).
  absl::StatusOr<std::vector<std::vector<PartialUpload>>> BuildWorkerPartials(
      const v1::Session& session, const UploaderOptions& options,
      std::vector<std::vector<ChunkView>>& per_worker) const;
  void AdoptMovedWorkers(const std::vector<std::string>& moved_to);
  absl::StatusOr<UploadResult> SumUploads(
      const std::vector<absl::StatusOr<UploadResult>>& results,
      const std::vector<std::vector<ChunkView>>& per_worker) const;
  // The session's shard map (the first worker's that has it, `any`) agrees
  // with every worker's and with this client's worker set and sharding
  // rule; `have` and `lack` are the ids of the workers with and without it.
  absl::Status CheckShardMap(
      const std::string& session_id, const v1::Session& any,
      const std::vector<absl::StatusOr<v1::Session>>& sessions,
      const std::vector<std::string>& have,
      const std::vector<std::string>& lack) const;

  ConnectionOptions options_;
  std::vector<std::string> specs_;  // the endpoints as given
  std::vector<Worker> workers_;     // sorted by id
  std::vector<std::string> ids_;
};

}  // namespace kvcal

#endif  // KVCAL_CLIENT_RPC_CALIBRATION_CLIENT_H_
