// Streams activation chunks into one session on one worker, exactly once.
//
//   kvcal::UploaderOptions options{.session_id = "run-7", .producer_id =
//   "rank0"}; kvcal::Uploader uploader(channel, connection, options);
//   KVCAL_ASSIGN_OR_RETURN(kvcal::UploadResult result,
//                          uploader.Upload(tensors));  // every chunk acked
//
// Tensors larger than `max_chunk_bytes` are split into token ranges (then
// head ranges, then sequence ranges, as the layout allows) with SplitChunk;
// the chunks are numbered 1..N for the producer. Upload keeps at most
// `window` chunks unacknowledged on the bidi Ingest stream. When the stream
// breaks (worker restarted, connection cut), it backs off, asks GetSession
// for the producer's watermark and resends only the chunks above it; it
// returns once the worker acknowledged chunk N, or with a status saying what
// failed and at which sequence.
//
// Local-statistics messages (PartialUpload) follow the chunks in the same
// numbering and are resent, resumed and waited for like them.
//
// Numbering is deterministic, so a push that died can be run again with
// `resume`: chunks at or below the producer's watermark are skipped. Without
// `resume`, a producer that already has chunks applied is refused, since its
// new chunks would be taken for duplicates.
#ifndef KVCAL_CLIENT_RPC_UPLOADER_H_
#define KVCAL_CLIENT_RPC_UPLOADER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/rpc/connection.h"
#include "kernels/types.h"
#include "kvcal/v1/calibration.grpc.pb.h"

namespace kvcal {

// Progress counters shared with a reporter thread.
struct UploadCounters {
  std::atomic<uint64_t> chunks_acked{0};
  std::atomic<uint64_t> bytes_acked{0};
  std::atomic<uint64_t> reconnects{0};
};

// One local-statistics message: what BuildPartials made of a group of
// batches, numbered after the upload's chunks.
struct PartialUpload {
  std::string statistics;  // SessionStatistics::Serialize()
  uint64_t tensors = 0;    // what the session's counters grow by
  uint64_t values = 0;
  uint64_t bytes = 0;  // data bytes of the tensors it covers
};

struct UploaderOptions {
  std::string session_id;
  std::string producer_id = "default";
  size_t max_chunk_bytes = size_t{4} << 20;
  size_t window = 16;
  bool resume = false;
  // Attempts without progress before giving up.
  int max_attempts = 8;
  absl::Duration initial_backoff = absl::Milliseconds(100);
  absl::Duration max_backoff = absl::Seconds(5);
  // Deadline of GetSession and of each wait for a worker to come back.
  absl::Duration rpc_timeout = absl::Seconds(30);
  // After the last acknowledgement, wait until the worker has every chunk
  // in its state dir (the session is `persistent`), so that a worker crash
  // right after Upload returns cannot lose acknowledged chunks; chunks a
  // restarted worker lost meanwhile are sent again. Workers without
  // --state-dir are not waited for. DEADLINE_EXCEEDED after durable_timeout.
  bool wait_durable = true;
  absl::Duration durable_timeout = absl::Seconds(120);
  std::shared_ptr<UploadCounters> counters;
  // Sent with every chunk (IngestRequest.shard_worker_ids): the worker set a
  // sharding client assigned layers over; the worker refuses chunks from a
  // client whose set differs from the session's. Empty for one worker.
  std::vector<std::string> shard_worker_ids;
  // While reconnecting, asked about once a second for the worker's current
  // channel: a sharding client re-resolves its endpoints and finds the
  // worker by its id, so a worker restarted under a new address is followed.
  // Returning null keeps the channel.
  std::function<std::shared_ptr<grpc::Channel>()> relocate;
  // Test hook, called on the reader thread after each acknowledgement with
  // its sequence; returning false cuts the stream (as a network failure
  // would) and the uploader recovers.
  std::function<bool(uint64_t sequence)> on_ack;
  // Chunks of these batches are sent as held out (IngestRequest.holdout):
  // the worker keeps them whole for Finalize's evaluate/auto instead of
  // adding them to the statistics. They are split only into whole
  // sequences and head ranges (SplitChunk's whole_sequences).
  std::set<uint64_t> holdout_batches;
  // Same-host shared memory (docs/shared_memory.md): chunks are written into
  // a ring of `window` slots in a POSIX shared-memory object registered with
  // the worker and sent as references (IngestRequest.shared_memory), a slot
  // reused once its chunk is acknowledged. When the worker cannot use it
  // (another host, shared memory off, an older worker: SharedMemoryFallsBack)
  // one line goes to stderr and the chunks go in-band. After a reconnect
  // the region is registered again.
  bool shared_memory = false;
  // Local statistics (docs/local-statistics.md): > 0 makes
  // CalibrationClient::Upload accumulate the tensors of batches that are not
  // held out in this process, with the worker's engine, and send each
  // worker one partial-statistics message (IngestRequest.
  // partial_statistics) per this many batches (in ascending batch order)
  // instead of their chunks. Held-out batches still go as chunks, first.
  uint64_t local_statistics_batches = 0;
  // Makes one worker's partials of its tensors (with every argument below):
  // BuildPartials of kvcal_local_partials (client/rpc/local_partials.h),
  // given by the caller so that this library stays free of the engine's
  // backends. Required with local_statistics_batches.
  std::function<absl::StatusOr<std::vector<PartialUpload>>(
      const Geometry& geometry, bool reject_non_finite,
      absl::Span<const ChunkView> tensors,
      const std::set<uint64_t>& holdout_batches, uint64_t batches_per_partial)>
      build_partials;
};

struct UploadResult {
  uint64_t chunks = 0;            // N, after splitting
  uint64_t chunks_skipped = 0;    // at or below the watermark at start
  uint64_t chunks_sent = 0;       // including resends
  uint64_t chunks_applied = 0;    // acked with applied = true
  uint64_t chunks_duplicate = 0;  // acked with applied = false
  uint64_t bytes = 0;             // data bytes of all N chunks
  // Of the chunks, local-statistics messages and the bytes they carried
  // (UploaderOptions::local_statistics_batches).
  uint64_t partials = 0;
  uint64_t partial_bytes = 0;
  uint64_t reconnects = 0;
  // Chunks went by shared-memory reference (UploaderOptions::shared_memory
  // and the worker accepted the region); else why not, when it was asked.
  bool shared_memory = false;
  std::string shared_memory_fallback;
};

// Splits one tensor into chunks of at most `max_bytes` of data (never
// smaller than one head_dim row). Chunks share `chunk.data`. With
// `whole_sequences` (held-out batches) a sequence is never cut: a
// [batch, heads, tokens, head_dim] tensor splits into batch entries, then
// head ranges of one entry (one head of one sequence may pass max_bytes);
// a [..., heads, head_dim] tensor is sent whole.
std::vector<ChunkView> SplitChunk(const ChunkView& chunk, size_t max_bytes,
                                  bool whole_sequences = false);

class Uploader {
 public:
  Uploader(std::shared_ptr<grpc::Channel> channel, ConnectionOptions connection,
           UploaderOptions options);

  // `partials` are numbered after the chunks of `tensors`.
  [[nodiscard]] absl::StatusOr<UploadResult> Upload(
      absl::Span<const ChunkView> tensors,
      absl::Span<const PartialUpload> partials = {});

 private:
  struct ProducerState {
    uint64_t sequence = 0;          // applied watermark
    uint64_t durable_sequence = 0;  // of it, in the worker's state dir
    bool persistent = false;        // the worker has a state dir
  };
  absl::StatusOr<ProducerState> State(bool wait_for_ready);
  absl::StatusOr<uint64_t> Watermark(bool wait_for_ready);
  absl::StatusOr<ProducerState> StateOnce(absl::Duration timeout,
                                          bool wait_for_ready);

  class Run;  // one Upload call (uploader.cc)

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Calibration::Stub> stub_;
  ConnectionOptions connection_;
  UploaderOptions options_;
};

}  // namespace kvcal

#endif  // KVCAL_CLIENT_RPC_UPLOADER_H_
