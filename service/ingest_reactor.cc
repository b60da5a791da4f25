#include "service/ingest_reactor.h"

#include <utility>

#include "absl/status/statusor.h"
// SerializationTraits for the responses (the generated gRPC header brings
// this gRPC version's protobuf serialization).
#include "kvcal/v1/calibration.grpc.pb.h"
#include "service/log.h"
#include "util/grpc_status.h"

namespace kvcal::service {

namespace pb = ::kvcal::v1;

IngestReactor::IngestReactor(IngestHost* host,
                             grpc::CallbackServerContext* context)
    : host_(host), start_(std::chrono::steady_clock::now()) {
  host_->metrics().StreamOpened();
  absl::StatusOr<std::string> tenant =
      host_->RegisterStream(this)
          ? host_->Authorize(context)
          : absl::UnavailableError("the worker is shutting down");
  if (!tenant.ok()) {
    host_->metrics().RecordReject(static_cast<int>(tenant.status().code()));
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

void IngestReactor::OnReadDone(bool ok) {
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
      host_->AddInflight(bytes);
      pending_.push_back(std::move(read_buffer_));
      if (!applying_) {
        applying_ = true;
        schedule = true;
      }
    }
  }
  if (schedule) {
    Ref();  // ApplyLoop's own reference: the reactor outlives the loop
    host_->Schedule([this] {
      ApplyLoop();
      Unref();
    });
  }
  StartNextRead();
  MaybeFinish();
}

void IngestReactor::OnWriteDone(bool ok) {
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

void IngestReactor::OnCancel() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    Fail(grpc::Status(grpc::StatusCode::CANCELLED, "stream cancelled"),
         /*drop_writes=*/true);
  }
  MaybeFinish();
}

void IngestReactor::Drain() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (draining_ || finished_) return;
    draining_ = true;
  }
  MaybeFinish();
}

void IngestReactor::OnDone() {
  host_->UnregisterStream(this);
  host_->metrics().RecordLatency(
      "Ingest",
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_)
          .count());
  host_->metrics().StreamClosed();
  Unref();
}

void IngestReactor::Fail(grpc::Status status, bool drop_writes) {
  if (drop_writes) {
    while (writes_.size() > (writing_ ? 1u : 0u)) writes_.pop_back();
  }
  if (failed_) return;
  failed_ = true;
  final_status_ = std::move(status);
  host_->AddInflight(-pending_bytes_);
  pending_bytes_ = 0;
  pending_.clear();
}

bool IngestReactor::ShouldFinishLocked(grpc::Status* status) {
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

void IngestReactor::StartNextRead() {
  grpc::ByteBuffer* target = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (reading_ || read_closed_ || failed_ || finished_ || draining_) {
      return;
    }
    if (static_cast<int>(pending_.size()) >= host_->max_pending_per_stream()) {
      return;  // resumed by ApplyLoop
    }
    if (writes_.size() >= kMaxUnsentResponses) {
      return;  // a client that stops reading acks stops being read
    }
    if (!pending_.empty() && !host_->InflightBelowLimit()) {
      const int64_t now =
          std::chrono::duration_cast<std::chrono::seconds>(
              std::chrono::steady_clock::now().time_since_epoch())
              .count();
      if (host_->BackpressureLogDue(now)) {
        KVCAL_LOG(WARNING)
            << "ingest: in-flight chunk memory reached the "
            << host_->max_inflight_bytes()
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

void IngestReactor::StartNextWrite() {
  const grpc::ByteBuffer* message = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (writing_ || writes_.empty() || finished_) return;
    writing_ = true;
    message = &writes_.front();
  }
  StartWrite(message);
}

void IngestReactor::ApplyLoop() {
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
      response = host_->ApplyChunk(tenant_, request->header(), request->data(),
                                   request->data_bytes());
    }
    grpc::ByteBuffer serialized;
    if (response.ok()) {
      bool own = false;
      grpc::Status s = grpc::SerializationTraits<pb::IngestResponse>::Serialize(
          *response, &serialized, &own);
      if (!s.ok()) response = absl::InternalError(s.error_message());
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!failed_) {
        pending_bytes_ -= bytes;
        host_->AddInflight(-bytes);
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
        host_->metrics().RecordReject(
            static_cast<int>(response.status().code()));
        Fail(ToGrpcStatus(response.status()), /*drop_writes=*/false);
      }
    }
    request.reset();
    StartNextWrite();
    StartNextRead();
  }
}

void IngestReactor::MaybeFinish() {
  grpc::Status status;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!ShouldFinishLocked(&status)) return;
  }
  Finish(status);
}

}  // namespace kvcal::service
