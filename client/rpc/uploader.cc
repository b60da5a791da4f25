#include "client/rpc/uploader.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <iostream>
#include <mutex>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/rpc/shared_memory_ring.h"
#include "proto/wire_enums.h"
#include "util/status_macros.h"

namespace kvcal {
namespace {

bool Retriable(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnknown:
      return true;
    default:
      return false;
  }
}

ChunkView Slice(const ChunkView& chunk, std::vector<uint64_t> shape,
                uint32_t extra_head_offset, size_t byte_offset) {
  ChunkView part = chunk;
  uint64_t elements = 1;
  for (uint64_t d : shape) elements *= d;
  part.shape = std::move(shape);
  part.head_offset = chunk.head_offset + extra_head_offset;
  part.data =
      chunk.data.subspan(byte_offset, elements * DTypeSize(chunk.dtype));
  return part;
}

// What every message of the upload carries: session, producer, sequence and
// the client's worker set.
v1::IngestRequest RequestHeader(uint64_t sequence,
                                const UploaderOptions& options) {
  v1::IngestRequest request;
  request.set_session_id(options.session_id);
  request.set_producer_id(options.producer_id);
  request.set_sequence(sequence);
  for (const std::string& id : options.shard_worker_ids) {
    request.add_shard_worker_ids(id);
  }
  return request;
}

// With `ring`, the chunk's bytes go into its slot and the request
// references them.
v1::IngestRequest MakeRequest(const ChunkView& chunk, uint64_t sequence,
                              const UploaderOptions& options,
                              SharedMemoryRing* ring) {
  v1::IngestRequest request = RequestHeader(sequence, options);
  request.set_batch(chunk.batch);
  request.set_layer(chunk.layer);
  request.set_role(ToWire(chunk.role));
  request.set_dtype(ToWire(chunk.dtype));
  request.set_layout(ToWire(chunk.layout));
  for (uint64_t d : chunk.shape) request.add_shape(d);
  request.set_head_offset(chunk.head_offset);
  if (ring == nullptr) {
    request.set_data(reinterpret_cast<const char*>(chunk.data.data()),
                     chunk.data.size());
  } else {
    // The slot of sequence s was last used by s - slots, which the window
    // guarantees is acknowledged (or, after a reconnect, holds the same
    // chunk's bytes again).
    const size_t slot = static_cast<size_t>((sequence - 1) % ring->slots());
    if (!chunk.data.empty()) {
      std::memcpy(ring->slot(slot), chunk.data.data(), chunk.data.size());
    }
    v1::SharedMemoryReference* ref = request.mutable_shared_memory();
    ref->set_region_id(ring->region_id());
    ref->set_offset(ring->slot_offset(slot));
    ref->set_byte_size(chunk.data.size());
  }
  if (options.holdout_batches.count(chunk.batch) > 0) {
    request.set_holdout(true);
  }
  return request;
}

v1::IngestRequest MakePartialRequest(const PartialUpload& partial,
                                     uint64_t sequence,
                                     const UploaderOptions& options) {
  v1::IngestRequest request = RequestHeader(sequence, options);
  v1::PartialStatistics* p = request.mutable_partial_statistics();
  p->set_statistics(partial.statistics);
  p->set_tensors(partial.tensors);
  p->set_values(partial.values);
  p->set_bytes(partial.bytes);
  return request;
}

}  // namespace

std::vector<ChunkView> SplitChunk(const ChunkView& chunk, size_t max_bytes,
                                  bool whole_sequences) {
  const size_t es = DTypeSize(chunk.dtype);
  if (chunk.data.size() <= max_bytes || chunk.shape.size() < 2) return {chunk};
  if (whole_sequences && chunk.layout == Layout::kTokensHeadsDim) {
    return {chunk};
  }
  std::vector<ChunkView> parts;
  const uint64_t head_dim = chunk.shape.back();
  const uint64_t row = std::max<uint64_t>(1, head_dim * es);
  if (chunk.layout == Layout::kTokensHeadsDim) {
    const uint64_t heads = chunk.shape[chunk.shape.size() - 2];
    uint64_t tokens = 1;
    for (size_t i = 0; i + 2 < chunk.shape.size(); ++i)
      tokens *= chunk.shape[i];
    const uint64_t token_bytes = heads * row;
    if (token_bytes <= max_bytes) {
      const uint64_t per = max_bytes / token_bytes;
      for (uint64_t t = 0; t < tokens; t += per) {
        const uint64_t n = std::min(per, tokens - t);
        parts.push_back(Slice(chunk, {n, heads, head_dim}, 0, t * token_bytes));
      }
    } else {  // one token is too large: split its heads
      const uint64_t per = std::max<uint64_t>(1, max_bytes / row);
      for (uint64_t t = 0; t < tokens; ++t) {
        for (uint64_t h = 0; h < heads; h += per) {
          const uint64_t n = std::min(per, heads - h);
          parts.push_back(Slice(chunk, {1, n, head_dim},
                                static_cast<uint32_t>(h),
                                t * token_bytes + h * row));
        }
      }
    }
    return parts;
  }
  // [batch, heads, seq, head_dim]: whole batch entries, else head ranges of
  // one entry, else sequence ranges of one head; each range is contiguous.
  const uint64_t batch = chunk.shape[0], heads = chunk.shape[1],
                 seq = chunk.shape[2];
  const uint64_t head_bytes = seq * row;
  const uint64_t entry_bytes = heads * head_bytes;
  if (entry_bytes <= max_bytes) {
    const uint64_t per = max_bytes / entry_bytes;
    for (uint64_t b = 0; b < batch; b += per) {
      const uint64_t n = std::min(per, batch - b);
      parts.push_back(
          Slice(chunk, {n, heads, seq, head_dim}, 0, b * entry_bytes));
    }
  } else if (head_bytes <= max_bytes || whole_sequences) {
    const uint64_t per = std::max<uint64_t>(1, max_bytes / head_bytes);
    for (uint64_t b = 0; b < batch; ++b) {
      for (uint64_t h = 0; h < heads; h += per) {
        const uint64_t n = std::min(per, heads - h);
        parts.push_back(Slice(chunk, {1, n, seq, head_dim},
                              static_cast<uint32_t>(h),
                              b * entry_bytes + h * head_bytes));
      }
    }
  } else {
    const uint64_t per = std::max<uint64_t>(1, max_bytes / row);
    for (uint64_t b = 0; b < batch; ++b) {
      for (uint64_t h = 0; h < heads; ++h) {
        for (uint64_t s = 0; s < seq; s += per) {
          const uint64_t n = std::min(per, seq - s);
          parts.push_back(Slice(chunk, {1, 1, n, head_dim},
                                static_cast<uint32_t>(h),
                                b * entry_bytes + h * head_bytes + s * row));
        }
      }
    }
  }
  return parts;
}

Uploader::Uploader(std::shared_ptr<grpc::Channel> channel,
                   ConnectionOptions connection, UploaderOptions options)
    : channel_(std::move(channel)),
      stub_(v1::Calibration::NewStub(channel_)),
      connection_(std::move(connection)),
      options_(std::move(options)) {
  if (options_.producer_id.empty()) options_.producer_id = "default";
  if (options_.window == 0) options_.window = 1;
  if (!options_.counters)
    options_.counters = std::make_shared<UploadCounters>();
}

absl::StatusOr<Uploader::ProducerState> Uploader::State(bool wait_for_ready) {
  if (!wait_for_ready || !options_.relocate) {
    return StateOnce(options_.rpc_timeout, wait_for_ready);
  }
  // Wait for the worker as long as before, but look for it under a new
  // address about once a second.
  const absl::Time deadline = absl::Now() + options_.rpc_timeout;
  for (;;) {
    if (std::shared_ptr<grpc::Channel> moved = options_.relocate()) {
      channel_ = std::move(moved);
      stub_ = v1::Calibration::NewStub(channel_);
    }
    const absl::Duration left = deadline - absl::Now();
    absl::StatusOr<ProducerState> state =
        StateOnce(std::clamp(left, absl::Milliseconds(100), absl::Seconds(1)),
                  /*wait_for_ready=*/true);
    if (state.ok() || !Retriable(state.status()) || absl::Now() >= deadline) {
      return state;
    }
  }
}

absl::StatusOr<Uploader::ProducerState> Uploader::StateOnce(
    absl::Duration timeout, bool wait_for_ready) {
  grpc::ClientContext context;
  PrepareContext(context, connection_, timeout, wait_for_ready);
  v1::GetSessionRequest request;
  request.set_session_id(options_.session_id);
  v1::Session session;
  KVCAL_RETURN_IF_ERROR(
      ToAbslStatus(stub_->GetSession(&context, request, &session),
                   absl::StrCat("GetSession(", options_.session_id,
                                ") for producer ", options_.producer_id)));
  ProducerState state;
  state.persistent = session.persistent();
  for (const v1::ProducerWatermark& p : session.producers()) {
    if (p.producer_id() == options_.producer_id) {
      state.sequence = p.sequence();
      state.durable_sequence = p.durable_sequence();
    }
  }
  return state;
}

absl::StatusOr<uint64_t> Uploader::Watermark(bool wait_for_ready) {
  KVCAL_ASSIGN_OR_RETURN(ProducerState state, State(wait_for_ready));
  return state.sequence;
}

// One Upload call: the chunks, what the worker has acknowledged, the
// shared-memory ring and the retry state. Go() runs the steps: Start (the
// watermark, the resume rule, the ring), SendAll (Ingest streams from the
// watermark on, reconnecting after a cut), then with wait_durable the
// durable wait (which may send again after a worker restart).
class Uploader::Run {
 public:
  Run(Uploader& uploader, absl::Span<const ChunkView> tensors,
      absl::Span<const PartialUpload> partials)
      : uploader_(uploader),
        options_(uploader.options_),
        counters_(*options_.counters),
        who_(absl::StrCat("session ", options_.session_id, ", producer ",
                          options_.producer_id)),
        backoff_(options_.initial_backoff) {
    partials_ = partials;
    for (const ChunkView& t : tensors) {
      for (ChunkView& part :
           SplitChunk(t, options_.max_chunk_bytes,
                      options_.holdout_batches.count(t.batch) > 0)) {
        chunks_.push_back(std::move(part));
      }
    }
    n_ = chunks_.size() + partials_.size();
    bytes_before_.assign(n_ + 1, 0);
    for (uint64_t i = 0; i < n_; ++i) {
      bytes_before_[i + 1] =
          bytes_before_[i] + (i < chunks_.size()
                                  ? chunks_[i].data.size()
                                  : partials_[i - chunks_.size()].bytes);
    }
    result_.chunks = n_;
    result_.bytes = bytes_before_[n_];
    result_.partials = partials_.size();
    for (const PartialUpload& p : partials_) {
      result_.partial_bytes += p.statistics.size();
    }
  }

  absl::StatusOr<UploadResult> Go() {
    KVCAL_RETURN_IF_ERROR(Start());
    for (;;) {
      KVCAL_RETURN_IF_ERROR(SendAll());
      if (!options_.wait_durable) break;
      KVCAL_ASSIGN_OR_RETURN(const bool durable, Durable());
      if (durable) break;
    }
    return result_;
  }

 private:
  // How one Ingest stream ended.
  struct StreamEnd {
    grpc::Status finish;
    absl::Status protocol_error;  // the worker broke the protocol
    bool cut = false;             // on_ack asked to stop
  };

  // Learns the watermark, applies the resume rule, sets up shared memory.
  absl::Status Start() {
    KVCAL_ASSIGN_OR_RETURN(acked_,
                           uploader_.Watermark(/*wait_for_ready=*/true));
    if (acked_ > 0 && !options_.resume) {
      return absl::FailedPreconditionError(absl::StrCat(
          who_, " already has ", acked_,
          " chunks applied; use a new producer name, or resume to finish an "
          "interrupted push of the same dump"));
    }
    if (acked_ > n_) {
      return absl::FailedPreconditionError(absl::StrCat(
          who_, " has ", acked_, " chunks applied but this dump makes only ",
          n_, ": not the same dump (or a different chunk size)"));
    }
    result_.chunks_skipped = acked_;
    best_ = acked_;
    Publish(acked_);
    if (options_.shared_memory && acked_ < n_) {
      size_t slot_bytes = 0;
      for (const ChunkView& c : chunks_) {
        slot_bytes = std::max(slot_bytes, c.data.size());
      }
      absl::StatusOr<std::unique_ptr<SharedMemoryRing>> created =
          SharedMemoryRing::Create(options_.window, slot_bytes);
      if (!created.ok()) {
        FallBack(created.status());
        return absl::OkStatus();
      }
      ring_ = *std::move(created);
      result_.shared_memory = true;
      KVCAL_RETURN_IF_ERROR(RegisterRing());
    }
    return absl::OkStatus();
  }

  // gRPC's "Received message larger than max (N vs. M)" from the worker,
  // with what the user can change.
  static absl::Status ExplainMessageLimit(const absl::Status& status) {
    if (!absl::IsResourceExhausted(status) ||
        !absl::StrContains(status.message(), "larger than max")) {
      return status;
    }
    return absl::ResourceExhaustedError(absl::StrCat(
        status.message(),
        ": a message was over the worker's --max-message-bytes; send smaller "
        "ones (--chunk-bytes, or --flush-batches with --local-statistics) or "
        "raise the worker's limit"));
  }

  // Streams until every chunk is acknowledged, reconnecting after cuts.
  absl::Status SendAll() {
    while (acked_ < n_) {
      if (needs_register_) {
        if (absl::Status registered = RegisterRing(); !registered.ok()) {
          KVCAL_RETURN_IF_ERROR(BackOffAfter(registered));
          continue;
        }
        needs_register_ = false;
      }
      const StreamEnd end = StreamFrom(acked_ + 1);
      if (!end.protocol_error.ok()) return end.protocol_error;
      absl::Status status = ToAbslStatus(
          end.finish,
          absl::StrCat("Ingest (", who_, ", at sequence ", acked_ + 1, ")"));
      if (acked_ == n_ && (status.ok() || end.cut)) break;
      status = ExplainMessageLimit(status);
      if (status.ok()) {
        status = absl::UnavailableError(
            absl::StrCat("Ingest (", who_, "): stream ended after sequence ",
                         acked_, " of ", n_));
      }
      // A worker restarted between the registration and this stream does
      // not know the region: register again and resend.
      const bool region_lost =
          ring_ != nullptr && absl::IsNotFound(status) &&
          absl::StrContains(status.message(), "shared memory region");
      if (!Retriable(status) && !end.cut && !region_lost) return status;
      last_error_ = status;
      KVCAL_RETURN_IF_ERROR(Reconnect());
    }
    return absl::OkStatus();
  }

  // One Ingest stream from sequence `start`: a writer thread sends within
  // the window while this thread reads the acknowledgements.
  StreamEnd StreamFrom(uint64_t start) {
    grpc::ClientContext context;
    PrepareContext(context, uploader_.connection_, absl::InfiniteDuration());
    std::unique_ptr<
        grpc::ClientReaderWriter<v1::IngestRequest, v1::IngestResponse>>
        stream = uploader_.stub_->Ingest(&context);

    std::mutex mu;
    std::condition_variable cv;
    uint64_t stream_acked = start - 1;  // guarded by mu
    bool stop = false;                  // guarded by mu
    uint64_t sent = 0;
    std::thread writer([&] {
      for (uint64_t seq = start; seq <= n_; ++seq) {
        {
          std::unique_lock<std::mutex> lock(mu);
          cv.wait(lock, [&] {
            return stop || seq - stream_acked <= options_.window;
          });
          if (stop) return;
        }
        if (!stream->Write(
                seq <= chunks_.size()
                    ? MakeRequest(chunks_[seq - 1], seq, options_, ring_.get())
                    : MakePartialRequest(partials_[seq - 1 - chunks_.size()],
                                         seq, options_)))
          return;
        ++sent;
      }
      stream->WritesDone();
    });

    StreamEnd end;
    v1::IngestResponse response;
    uint64_t expected = start;
    bool read_ended = true;  // false: this loop left with the stream open
    while (stream->Read(&response)) {
      if (response.sequence() != expected) {
        end.protocol_error = absl::InternalError(
            absl::StrCat(who_, ": worker acknowledged sequence ",
                         response.sequence(), " where ", expected, " was due"));
        read_ended = false;
        break;
      }
      if (response.applied()) {
        ++result_.chunks_applied;
      } else {
        ++result_.chunks_duplicate;
      }
      {
        std::lock_guard<std::mutex> lock(mu);
        stream_acked = expected;
      }
      cv.notify_one();
      acked_ = expected;
      Publish(acked_);
      ++expected;
      if (options_.on_ack && !options_.on_ack(acked_)) {
        end.cut = true;
        read_ended = false;
        break;
      }
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      stop = true;
    }
    cv.notify_one();
    // Only a stream this loop left open is cancelled: after Read returned
    // false the call is over, and cancelling it would replace the worker's
    // status (say INVALID_ARGUMENT naming the chunk) with CANCELLED.
    if (!read_ended) context.TryCancel();
    writer.join();
    result_.chunks_sent += sent;
    end.finish = stream->Finish();
    return end;
  }

  // After a failed stream: back off, then learn what the worker holds and go
  // on from there; never stream again before the worker said where to start.
  absl::Status Reconnect() {
    if (acked_ > best_) {
      best_ = acked_;
      attempts_ = 0;
      backoff_ = options_.initial_backoff;
    }
    if (!AnotherAttempt()) return GaveUp();
    ++result_.reconnects;
    ++counters_.reconnects;
    absl::StatusOr<uint64_t> watermark =
        uploader_.Watermark(/*wait_for_ready=*/true);
    while (!watermark.ok()) {
      KVCAL_RETURN_IF_ERROR(BackOffAfter(watermark.status()));
      watermark = uploader_.Watermark(/*wait_for_ready=*/true);
    }
    if (*watermark > n_) {
      return absl::FailedPreconditionError(
          absl::StrCat(who_, ": worker watermark ", *watermark, " beyond the ",
                       n_, " chunks of this upload"));
    }
    acked_ = *watermark;  // may be lower than acknowledged: a restored worker
    Publish(acked_);
    // A restarted (or relocated) worker does not know the region.
    needs_register_ = ring_ != nullptr;
    return absl::OkStatus();
  }

  // With every chunk acknowledged: true once the worker's state dir has them
  // (or it has none); false to go round again (poll again, or send again
  // after the worker restarted from an older snapshot).
  absl::StatusOr<bool> Durable() {
    absl::StatusOr<ProducerState> state =
        uploader_.State(/*wait_for_ready=*/true);
    if (!state.ok()) {
      KVCAL_RETURN_IF_ERROR(BackOffAfter(state.status()));
      return false;
    }
    if (!state->persistent || state->durable_sequence >= n_) return true;
    if (state->sequence < acked_) {
      acked_ = state->sequence;
      Publish(acked_);
      needs_register_ = ring_ != nullptr;
      return false;
    }
    const absl::Time now = absl::Now();
    if (durable_deadline_ == absl::InfiniteFuture()) {
      durable_deadline_ = now + options_.durable_timeout;
    } else if (now > durable_deadline_) {
      return absl::DeadlineExceededError(
          absl::StrCat(who_, ": all ", n_, " chunks acknowledged but only ",
                       state->durable_sequence, " durable after ",
                       absl::FormatDuration(options_.durable_timeout),
                       "; can the worker write its --state-dir? (its /healthz "
                       "and log say)"));
    }
    absl::SleepFor(durable_poll_);
    durable_poll_ = std::min(durable_poll_ * 2, absl::Seconds(1));
    return false;
  }

  // (Re)registers the ring with the current worker. OK when registered or
  // fallen back to in-band; else the error (retriable ones are retried).
  absl::Status RegisterRing() {
    if (ring_ == nullptr) return absl::OkStatus();
    absl::Status s = ring_->Register(uploader_.channel_, uploader_.connection_);
    if (s.ok() || !SharedMemoryFallsBack(s)) return s;
    FallBack(s);
    return absl::OkStatus();
  }

  void FallBack(const absl::Status& why) {
    ring_.reset();
    result_.shared_memory = false;
    result_.shared_memory_fallback = std::string(why.message());
    std::cerr << "kvcal: " << who_
              << ": shared memory not used, sending chunks in-band ("
              << why.message() << ")\n";
  }

  // Counters may be shared by several uploaders (one per worker): publish
  // differences, not absolute values.
  void Publish(uint64_t now) {
    counters_.chunks_acked.fetch_add(now - published_);
    counters_.bytes_acked.fetch_add(bytes_before_[now] -
                                    bytes_before_[published_]);
    published_ = now;
  }

  // After a failed call: the error itself when it is not retriable, the
  // give-up error once max_attempts tries in a row made no progress, else
  // OK after backing off (try again).
  absl::Status BackOffAfter(const absl::Status& error) {
    if (!Retriable(error)) return error;
    last_error_ = error;
    if (!AnotherAttempt()) return GaveUp();
    return absl::OkStatus();
  }

  // Backs off before the next try; false once max_attempts tries in a row
  // made no progress.
  bool AnotherAttempt() {
    if (++attempts_ > options_.max_attempts) return false;
    absl::SleepFor(backoff_);
    backoff_ = std::min(backoff_ * 2, options_.max_backoff);
    return true;
  }

  absl::Status GaveUp() const {
    return absl::UnavailableError(
        absl::StrCat(who_, ": gave up after ", options_.max_attempts,
                     " attempts without progress at sequence ", acked_ + 1,
                     "; last error: ", last_error_.message()));
  }

  Uploader& uploader_;
  const UploaderOptions& options_;
  UploadCounters& counters_;
  const std::string who_;
  std::vector<ChunkView> chunks_;
  absl::Span<const PartialUpload> partials_;  // numbered after chunks_
  uint64_t n_ = 0;
  // bytes_before_[s] = data bytes of chunks 1..s.
  std::vector<uint64_t> bytes_before_;
  UploadResult result_;
  uint64_t acked_ = 0;      // the worker's watermark as last learned
  uint64_t published_ = 0;  // what Publish last gave the counters
  // The most ever acknowledged: only getting past it is progress (a worker
  // that crashes on a chunk and restarts from a snapshot re-acknowledges
  // the same chunks again and again).
  uint64_t best_ = 0;
  std::unique_ptr<SharedMemoryRing> ring_;  // same-host shared memory
  bool needs_register_ = false;             // set after a reconnect
  int attempts_ = 0;
  absl::Duration backoff_;
  absl::Status last_error_;
  absl::Time durable_deadline_ = absl::InfiniteFuture();
  absl::Duration durable_poll_ = absl::Milliseconds(50);
};

absl::StatusOr<UploadResult> Uploader::Upload(
    absl::Span<const ChunkView> tensors,
    absl::Span<const PartialUpload> partials) {
  return Run(*this, tensors, partials).Go();
}

}  // namespace kvcal
