// A client for one or several kvcal workers holding one calibration job.
//
//   KVCAL_ASSIGN_OR_RETURN(kvcal::CalibrationClient client,
//       kvcal::CalibrationClient::Connect({"w0:50051", "w1:50051"}, {}));
//   KVCAL_ASSIGN_OR_RETURN(kvcal::v1::Session s,
//   client.CreateSession(request)); KVCAL_ASSIGN_OR_RETURN(auto sent,
//   client.Upload(s.session_id(), chunks, {})); KVCAL_ASSIGN_OR_RETURN(auto
//   scales, client.Finalize(finalize_request));
//
// With several workers, each layer goes to one worker chosen by a stable hash
// of (session, layer): FNV-1a 64 over the session id's bytes followed by the
// layer as 4 little-endian bytes, modulo the number of workers, in the order
// the endpoints were given. Clients in other languages use the same rule.
// The session is created on every worker; Finalize asks each worker for its
// own layers (FinalizeRequest.layers) and assembles the result, so one
// worker or many give the same scales.
#ifndef KVCAL_CLIENT_CALIBRATION_CLIENT_H_
#define KVCAL_CLIENT_CALIBRATION_CLIENT_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/connection.h"
#include "client/uploader.h"
#include "kvcal/v1/calibration.grpc.pb.h"

namespace kvcal {

// "dns:///host:port" becomes every address host resolves to, sorted (a
// Kubernetes headless Service names every worker pod this way); any other
// endpoint is returned as it is.
absl::StatusOr<std::vector<std::string>> ExpandEndpoint(
    absl::string_view endpoint);

class CalibrationClient {
 public:
  // Endpoints are host:port; "a:1,b:2" lists are split here too.
  [[nodiscard]] static absl::StatusOr<CalibrationClient> Connect(
      const std::vector<std::string>& endpoints, ConnectionOptions options);

  static size_t WorkerFor(absl::string_view session_id, uint32_t layer,
                          size_t workers);

  size_t worker_count() const { return workers_.size(); }
  const std::string& endpoint(size_t i) const { return workers_[i].endpoint; }
  const ConnectionOptions& connection() const { return options_; }
  std::shared_ptr<grpc::Channel> channel(size_t i) const {
    return workers_[i].channel;
  }

  // On every worker (idempotent there). An empty id: the first worker picks
  // one and the others get the same.
  absl::StatusOr<v1::Session> CreateSession(v1::CreateSessionRequest request);
  // Counters summed over the workers; producers listed per worker (their
  // ids prefixed with "w<index>/" when there are several).
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

  v1::Calibration::Stub& stub(size_t i) { return *workers_[i].stub; }

 private:
  struct Worker {
    std::string endpoint;
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<v1::Calibration::Stub> stub;
  };
  CalibrationClient() = default;

  ConnectionOptions options_;
  std::vector<Worker> workers_;
};

}  // namespace kvcal

#endif  // KVCAL_CLIENT_CALIBRATION_CLIENT_H_
