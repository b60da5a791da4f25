// The Ingest stream of the worker (CalibrationService::Ingest, through
// IngestHost): one
// reactor per stream, on gRPC's callback API with raw messages
// (grpc::ByteBuffer), so chunk data is read in place from gRPC's receive
// buffer (ingest_wire.h) and never copied into a message.
#ifndef KVCAL_SERVICE_INGEST_REACTOR_H_
#define KVCAL_SERVICE_INGEST_REACTOR_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "service/ingest_host.h"
#include "service/ingest_wire.h"

namespace kvcal::service {

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
  IngestReactor(IngestHost* host, grpc::CallbackServerContext* context);

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnCancel() override;

  // Stops reading; chunks already received are applied and answered, then
  // the stream ends with UNAVAILABLE.
  void Drain();

  void OnDone() override;

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
  void Fail(grpc::Status status, bool drop_writes);

  // mu_ held. True (once) when the stream is to be finished with *status.
  bool ShouldFinishLocked(grpc::Status* status);

  // StartRead is issued outside mu_, so no finish may be decided between
  // the decision here and the call. That holds because every caller is a
  // reaction (OnReadDone, OnWriteDone: gRPC keeps the call alive until it
  // returns), the constructor (before binding), or ApplyLoop while
  // applying_ is set (which blocks any finish). Calling it from elsewhere,
  // Drain() for one, would need that reasoning again.
  void StartNextRead();
  void StartNextWrite();
  // Applies the pending chunks in order (on the executor), queues their
  // responses and, once nothing is pending, decides whether to finish.
  void ApplyLoop();
  void MaybeFinish();

  IngestHost* const host_;
  const std::chrono::steady_clock::time_point start_;
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

}  // namespace kvcal::service

#endif  // KVCAL_SERVICE_INGEST_REACTOR_H_
