#include "client/uploader.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <iostream>
#include <mutex>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/shared_memory_ring.h"
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

// With `ring`, the chunk's bytes go into its slot and the request
// references them.
v1::IngestRequest MakeRequest(const ChunkView& chunk, uint64_t sequence,
                              const UploaderOptions& options,
                              SharedMemoryRing* ring) {
  v1::IngestRequest request;
  request.set_session_id(options.session_id);
  request.set_producer_id(options.producer_id);
  request.set_sequence(sequence);
  request.set_batch(chunk.batch);
  request.set_layer(chunk.layer);
  request.set_role(static_cast<v1::Role>(chunk.role));
  request.set_dtype(static_cast<v1::DType>(chunk.dtype));
  request.set_layout(static_cast<v1::Layout>(chunk.layout));
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
  for (const std::string& id : options.shard_worker_ids) {
    request.add_shard_worker_ids(id);
  }
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

absl::StatusOr<UploadResult> Uploader::Upload(
    absl::Span<const ChunkView> tensors) {
  std::vector<ChunkView> chunks;
  for (const ChunkView& t : tensors) {
    for (ChunkView& part :
         SplitChunk(t, options_.max_chunk_bytes,
                    options_.holdout_batches.count(t.batch) > 0)) {
      chunks.push_back(std::move(part));
    }
  }
  const uint64_t n = chunks.size();
  // bytes_before[s] = data bytes of chunks 1..s.
  std::vector<uint64_t> bytes_before(n + 1, 0);
  for (uint64_t i = 0; i < n; ++i) {
    bytes_before[i + 1] = bytes_before[i] + chunks[i].data.size();
  }
  UploadResult result;
  result.chunks = n;
  result.bytes = bytes_before[n];
  UploadCounters& counters = *options_.counters;
  const std::string who = absl::StrCat("session ", options_.session_id,
                                       ", producer ", options_.producer_id);

  KVCAL_ASSIGN_OR_RETURN(uint64_t acked, Watermark(/*wait_for_ready=*/true));
  if (acked > 0 && !options_.resume) {
    return absl::FailedPreconditionError(absl::StrCat(
        who, " already has ", acked,
        " chunks applied; use a new producer name, or resume to finish an "
        "interrupted push of the same dump"));
  }
  if (acked > n) {
    return absl::FailedPreconditionError(absl::StrCat(
        who, " has ", acked, " chunks applied but this dump makes only ", n,
        ": not the same dump (or a different chunk size)"));
  }
  result.chunks_skipped = acked;
  // Counters may be shared by several uploaders (one per worker): publish
  // differences, not absolute values.
  uint64_t published = 0;
  auto publish = [&](uint64_t now) {
    counters.chunks_acked.fetch_add(now - published);
    counters.bytes_acked.fetch_add(bytes_before[now] - bytes_before[published]);
    published = now;
  };
  publish(acked);

  // Same-host shared memory, when asked and the worker can read it.
  std::unique_ptr<SharedMemoryRing> ring;
  auto fall_back = [&](const absl::Status& why) {
    ring.reset();
    result.shared_memory = false;
    result.shared_memory_fallback = std::string(why.message());
    std::cerr << "kvcal: " << who
              << ": shared memory not used, sending chunks in-band ("
              << why.message() << ")\n";
  };
  // (Re)registers the ring with the current worker. OK when registered or
  // fallen back to in-band; else the error (retriable ones are retried).
  auto register_ring = [&]() -> absl::Status {
    if (ring == nullptr) return absl::OkStatus();
    absl::Status s = ring->Register(channel_, connection_);
    if (s.ok() || !SharedMemoryFallsBack(s)) return s;
    fall_back(s);
    return absl::OkStatus();
  };
  if (options_.shared_memory && acked < n) {
    size_t slot_bytes = 0;
    for (const ChunkView& c : chunks) {
      slot_bytes = std::max(slot_bytes, c.data.size());
    }
    absl::StatusOr<std::unique_ptr<SharedMemoryRing>> created =
        SharedMemoryRing::Create(options_.window, slot_bytes);
    if (created.ok()) {
      ring = *std::move(created);
      result.shared_memory = true;
      KVCAL_RETURN_IF_ERROR(register_ring());
    } else {
      fall_back(created.status());
    }
  }

  bool needs_register = false;  // set after a reconnect
  int attempts = 0;
  absl::Duration backoff = options_.initial_backoff;
  absl::Status last_error;
  // The most ever acknowledged: only getting past it is progress (a worker
  // that crashes on a chunk and restarts from a snapshot re-acknowledges
  // the same chunks again and again).
  uint64_t best = acked;
  // Backs off before the next try; false once max_attempts tries in a row
  // made no progress.
  auto another_attempt = [&] {
    if (++attempts > options_.max_attempts) return false;
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, options_.max_backoff);
    return true;
  };
  auto gave_up = [&] {
    return absl::UnavailableError(
        absl::StrCat(who, ": gave up after ", options_.max_attempts,
                     " attempts without progress at sequence ", acked + 1,
                     "; last error: ", last_error.message()));
  };
  absl::Time durable_deadline = absl::InfiniteFuture();
  absl::Duration durable_poll = absl::Milliseconds(50);
  for (;;) {
    while (acked < n) {
      if (needs_register) {
        if (absl::Status registered = register_ring(); !registered.ok()) {
          if (!Retriable(registered)) return registered;
          last_error = registered;
          if (!another_attempt()) return gave_up();
          continue;
        }
        needs_register = false;
      }
      const uint64_t start = acked + 1;
      grpc::ClientContext context;
      PrepareContext(context, connection_, absl::InfiniteDuration());
      std::unique_ptr<
          grpc::ClientReaderWriter<v1::IngestRequest, v1::IngestResponse>>
          stream = stub_->Ingest(&context);

      std::mutex mu;
      std::condition_variable cv;
      uint64_t stream_acked = start - 1;  // guarded by mu
      bool stop = false;                  // guarded by mu
      uint64_t sent = 0;
      std::thread writer([&] {
        for (uint64_t seq = start; seq <= n; ++seq) {
          {
            std::unique_lock<std::mutex> lock(mu);
            cv.wait(lock, [&] {
              return stop || seq - stream_acked <= options_.window;
            });
            if (stop) return;
          }
          if (!stream->Write(
                  MakeRequest(chunks[seq - 1], seq, options_, ring.get())))
            return;
          ++sent;
        }
        stream->WritesDone();
      });

      absl::Status protocol_error;
      v1::IngestResponse response;
      uint64_t expected = start;
      bool cut = false;
      bool read_ended = true;  // false: this loop left with the stream open
      while (stream->Read(&response)) {
        if (response.sequence() != expected) {
          protocol_error = absl::InternalError(absl::StrCat(
              who, ": worker acknowledged sequence ", response.sequence(),
              " where ", expected, " was due"));
          read_ended = false;
          break;
        }
        if (response.applied()) {
          ++result.chunks_applied;
        } else {
          ++result.chunks_duplicate;
        }
        {
          std::lock_guard<std::mutex> lock(mu);
          stream_acked = expected;
        }
        cv.notify_one();
        acked = expected;
        publish(acked);
        ++expected;
        if (options_.on_ack && !options_.on_ack(acked)) {
          cut = true;
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
      result.chunks_sent += sent;
      const grpc::Status finish = stream->Finish();
      if (!protocol_error.ok()) return protocol_error;
      absl::Status status = ToAbslStatus(
          finish,
          absl::StrCat("Ingest (", who, ", at sequence ", acked + 1, ")"));
      if (acked == n && (status.ok() || cut)) break;
      if (status.ok()) {
        status = absl::UnavailableError(
            absl::StrCat("Ingest (", who, "): stream ended after sequence ",
                         acked, " of ", n));
      }
      // A worker restarted between the registration and this stream does
      // not know the region: register again and resend.
      const bool region_lost =
          ring != nullptr && absl::IsNotFound(status) &&
          absl::StrContains(status.message(), "shared memory region");
      if (!Retriable(status) && !cut && !region_lost) return status;
      last_error = status;

      // Reconnect: back off, then learn what the worker holds and go on from
      // there; never stream again before the worker said where to start.
      if (acked > best) {
        best = acked;
        attempts = 0;
        backoff = options_.initial_backoff;
      }
      if (!another_attempt()) return gave_up();
      ++result.reconnects;
      ++counters.reconnects;
      absl::StatusOr<uint64_t> watermark = Watermark(/*wait_for_ready=*/true);
      while (!watermark.ok()) {
        if (!Retriable(watermark.status())) return watermark.status();
        last_error = watermark.status();
        if (!another_attempt()) return gave_up();
        watermark = Watermark(/*wait_for_ready=*/true);
      }
      if (*watermark > n) {
        return absl::FailedPreconditionError(
            absl::StrCat(who, ": worker watermark ", *watermark, " beyond the ",
                         n, " chunks of this upload"));
      }
      acked = *watermark;  // may be lower than acknowledged: a restored worker
      publish(acked);
      // A restarted (or relocated) worker does not know the region.
      needs_register = ring != nullptr;
    }
    if (!options_.wait_durable) break;
    // Every chunk is acknowledged: wait until the worker's state dir has them.
    absl::StatusOr<ProducerState> state = State(/*wait_for_ready=*/true);
    if (!state.ok()) {
      if (!Retriable(state.status())) return state.status();
      last_error = state.status();
      if (!another_attempt()) return gave_up();
      continue;
    }
    if (!state->persistent || state->durable_sequence >= n) break;
    if (state->sequence < acked) {
      // The worker restarted from an older snapshot: send the rest again.
      acked = state->sequence;
      publish(acked);
      needs_register = ring != nullptr;
      continue;
    }
    const absl::Time now = absl::Now();
    if (durable_deadline == absl::InfiniteFuture()) {
      durable_deadline = now + options_.durable_timeout;
    } else if (now > durable_deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat(who, ": all ", n, " chunks acknowledged but only ",
                       state->durable_sequence, " durable after ",
                       absl::FormatDuration(options_.durable_timeout),
                       "; can the worker write its --state-dir? (its /healthz "
                       "and log say)"));
    }
    absl::SleepFor(durable_poll);
    durable_poll = std::min(durable_poll * 2, absl::Seconds(1));
  }
  return result;
}

}  // namespace kvcal
