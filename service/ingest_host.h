// What an Ingest stream (IngestReactor, ingest_reactor.h) needs of the
// worker that serves it: the stream registry, authentication, applying a
// chunk, the worker-wide in-flight bound, the executor and the metrics.
// CalibrationService implements it; the reactor knows only this interface,
// so the service and the reactor it creates do not include each other.
#ifndef KVCAL_SERVICE_INGEST_HOST_H_
#define KVCAL_SERVICE_INGEST_HOST_H_

#include <grpcpp/grpcpp.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvcal/v1/calibration.pb.h"
#include "service/metrics.h"

namespace kvcal::service {

class IngestReactor;

class IngestHost {
 public:
  virtual ~IngestHost() = default;

  // False when the worker is draining (the stream then ends at once).
  virtual bool RegisterStream(IngestReactor* reactor) = 0;
  virtual void UnregisterStream(IngestReactor* reactor) = 0;
  // The caller's tenant, or Unauthenticated.
  virtual absl::StatusOr<std::string> Authorize(
      grpc::CallbackServerContext* context) const = 0;
  // Applies one chunk (`request` without its data, which is `data`): the
  // response, or the status that ends the stream.
  virtual absl::StatusOr<kvcal::v1::IngestResponse> ApplyChunk(
      const std::string& tenant, const kvcal::v1::IngestRequest& request,
      const std::vector<absl::Span<const std::byte>>& data,
      uint64_t data_bytes) = 0;

  // The chunk bytes received and not yet applied, over every stream, and
  // whether there is room for more (--max-inflight-bytes).
  virtual void AddInflight(int64_t delta) = 0;
  virtual bool InflightBelowLimit() const = 0;
  virtual uint64_t max_inflight_bytes() const = 0;
  // Chunks one stream may hold unapplied before it stops reading.
  virtual int max_pending_per_stream() const = 0;
  // True at most once every 10 s (`now_seconds` on a steady clock): whether
  // a stream that pauses for the in-flight bound should log it.
  virtual bool BackpressureLogDue(int64_t now_seconds) = 0;

  // Runs `task` on the worker's executor.
  virtual void Schedule(std::function<void()> task) = 0;
  virtual Metrics& metrics() = 0;
};

}  // namespace kvcal::service

#endif  // KVCAL_SERVICE_INGEST_HOST_H_
