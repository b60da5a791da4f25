// One calibration session: its statistics backend, producer watermarks
// (exactly-once ingest) and counters. Free of gRPC types: handlers convert
// proto messages to these types in proto_convert.h and call in here.
//
//   KVCAL_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
//                          Session::Create("run-1", geometry, options));
//   KVCAL_ASSIGN_OR_RETURN(IngestOutcome outcome,
//                          session->Ingest("rank0", /*sequence=*/1, chunk));
//   KVCAL_ASSIGN_OR_RETURN(ScaleResult scales,
//                          session->Finalize(scale_options));
#ifndef KVCAL_SERVICE_SESSION_H_
#define KVCAL_SERVICE_SESSION_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <shared_mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "kernels/scale_math.h"
#include "service/finalize_evaluation.h"
#include "service/holdout_store.h"
#include "service/shard_map.h"

namespace kvcal::service {

struct SessionOptions {
  BackendKind backend = BackendKind::kAuto;
  BackendOptions backend_options;
  // Held-out data budget (CreateSession holdout_budget_bytes); 0 = 64 MiB.
  uint64_t holdout_budget_bytes = 0;
  // CreateSession reject_non_finite: chunks holding NaN or Inf are refused
  // (InvalidArgument naming each head and its counts) instead of counted.
  bool reject_non_finite = false;
};

// What a CreateSession request sets besides geometry and shard map.
struct SessionParameters {
  uint64_t holdout_budget_bytes = 0;  // 0 = 64 MiB
  bool reject_non_finite = false;
};

// Session.nonfinite_heads and FinalizeResponse.nonfinite_heads list at most
// this many heads.
inline constexpr size_t kMaxNonFiniteHeadsListed = 1024;

struct ProducerInfo {
  std::string producer_id;
  uint64_t watermark = 0;
  uint64_t durable_watermark = 0;
  friend bool operator==(const ProducerInfo&, const ProducerInfo&) = default;
};

struct SessionCounters {
  uint64_t chunks_applied = 0;
  uint64_t values_ingested = 0;
  uint64_t bytes_ingested = 0;
  uint64_t nonfinite_values = 0;
};

struct SessionInfo {
  std::string session_id;
  Geometry geometry;
  SessionCounters counters;
  std::vector<ProducerInfo> producers;  // sorted by producer_id
  std::string backend;
  uint64_t state_bytes = 0;
  ShardMap shard_map;
  uint64_t holdout_budget_bytes = 0;
  uint64_t holdout_bytes = 0;
  uint64_t holdout_chunks = 0;
  uint64_t holdout_batches = 0;
  bool reject_non_finite = false;
  // Where counters.nonfinite_values are (kMaxNonFiniteHeadsListed at most).
  NonFiniteHeads nonfinite_heads;
};

// All it takes to recreate or merge a session (docs/wire-contract.md).
struct SessionSnapshot {
  Geometry geometry;
  std::string statistics;  // SessionStatistics::Serialize()
  SessionCounters counters;
  std::vector<ProducerInfo> producers;
  std::vector<std::string> applied_import_ids;
  ShardMap shard_map;
  uint64_t holdout_budget_bytes = 0;  // 0 = the default
  std::vector<HoldoutChunk> holdout_chunks;
  bool reject_non_finite = false;
};

struct IngestOutcome {
  bool applied = false;
  uint64_t watermark = 0;
  // The producer's highest sequence on disk (0 without --state-dir).
  uint64_t durable_watermark = 0;
};

// "default" for an empty producer id.
std::string ResolveProducerId(absl::string_view producer_id);

class Session {
 public:
  static absl::StatusOr<std::shared_ptr<Session>> Create(
      std::string id, std::string tenant, const Geometry& geometry,
      const SessionOptions& options);

  // Creates a session from an exported state, restoring statistics, counters,
  // watermarks and applied import ids exactly; `import_id`, if non-empty, is
  // recorded as applied.
  static absl::StatusOr<std::shared_ptr<Session>> FromSnapshot(
      std::string id, std::string tenant, const SessionSnapshot& snapshot,
      const SessionOptions& options, absl::string_view import_id);

  const std::string& id() const { return id_; }
  // The tenant that created the session.
  const std::string& tenant() const { return tenant_; }
  const Geometry& geometry() const { return geometry_; }
  bool reject_non_finite() const { return reject_non_finite_; }

  // Exactly-once ingest of one chunk (docs/wire-contract.md "Ingest"): the
  // chunk is validated first (InvalidArgument), then its sequence: <=
  // watermark is a duplicate (applied = false), watermark + 1 is applied,
  // beyond is FailedPrecondition naming the expected sequence. Errors name the
  // sequence and producer. Nothing of a rejected chunk is applied.
  // A `holdout` chunk is kept whole in the session's HoldoutStore instead of
  // the statistics (ResourceExhausted past its budget, nothing applied).
  // With `device_data`, chunk.data is device memory (a CUDA IPC region):
  // FailedPrecondition unless the session's backend is CUDA, which then
  // reads it in place and finishes before this returns (the producer may
  // reuse the memory once the chunk is answered). Held-out chunks are
  // never device data. A session with reject_non_finite refuses a chunk
  // holding NaN or Inf (InvalidArgument naming each head and its counts,
  // nothing applied), after the sequence check (duplicates are acknowledged
  // unread) and before anything of it is applied; every session refuses a
  // held-out chunk holding one (evaluation runs attention on it).
  absl::StatusOr<IngestOutcome> Ingest(absl::string_view producer_id,
                                       uint64_t sequence,
                                       const ChunkView& chunk,
                                       bool holdout = false,
                                       bool device_data = false);

  // Exactly-once merge of a producer's own statistics (IngestRequest.
  // partial_statistics), numbered in the producer's sequence space as a
  // chunk. In order: `statistics` (SessionStatistics::Serialize()) must parse
  // (InvalidArgument) and have been computed with this session's geometry,
  // histogram resolution and roles (FailedPrecondition naming both); the
  // layers it holds data for must pass CheckShard(shard_client_ids, layers,
  // worker_id); with reject_non_finite it must hold no NaN or Inf
  // (InvalidArgument); then the sequence is checked as Ingest checks a
  // chunk's, and the statistics merged and `counters` added (its
  // nonfinite_values is ignored: the statistics carry those). Errors name
  // the sequence and producer; nothing of a refused message is applied.
  absl::StatusOr<IngestOutcome> IngestPartial(
      absl::string_view producer_id, uint64_t sequence,
      absl::string_view statistics, const SessionCounters& counters,
      const std::vector<std::string>& shard_client_ids,
      absl::string_view worker_id);

  absl::StatusOr<SessionInfo> Info();
  absl::StatusOr<ScaleResult> Finalize(const ScaleOptions& options);
  // Finalize with `evaluate` or the `auto` observer on the held-out batches
  // (service/finalize_evaluation.h).
  absl::StatusOr<EvaluatedFinalize> Finalize(
      const EvaluatedFinalizeOptions& options);
  const HoldoutStore& holdout() const { return holdout_; }
  absl::StatusOr<SessionSnapshot> Export();

  // Merges an exported state (same geometry, else InvalidArgument and nothing
  // changes; a state with NaN or Inf in a held-out chunk, or anywhere for a
  // session with reject_non_finite, is refused the same way). With a non-empty
  // import_id that this session already applied, nothing changes. Statistics
  // merge, counters add, each producer's watermark becomes the larger of the
  // two.
  absl::Status Merge(const SessionSnapshot& snapshot,
                     absl::string_view import_id);

  // Records the session's shard map (validated by the caller). A session
  // without one takes it; one with an equal map is unchanged; a different
  // map is FailedPrecondition naming what changed.
  absl::Status AdoptShardMap(const ShardMap& map);
  ShardMap shard_map();
  // For a chunk or Finalize on worker `worker_id`: the client's worker set
  // (empty = not given) must be the map's, and every layer of `layers`
  // (empty = all) this worker's; FailedPrecondition naming what changed or
  // the owner otherwise. A session without a map passes.
  absl::Status CheckShard(const std::vector<std::string>& client_ids,
                          absl::Span<const uint32_t> layers,
                          absl::string_view worker_id);

  // Records that `producers` (watermarks of a snapshot now on disk) are
  // durable: each producer's durable watermark becomes at least that.
  void MarkDurable(const std::vector<ProducerInfo>& producers);

  // Changes with every applied chunk and merge: a persister compares it with
  // the value at its last save.
  uint64_t change_count() const {
    return chunks_applied_.load() + generation_.load();
  }

  // Bytes of statistics state held.
  uint64_t state_bytes() const { return backend_->StateBytes(); }

 private:
  struct Producer {
    std::mutex mu;  // held while a chunk of this producer is applied
    uint64_t watermark = 0;
    uint64_t durable_watermark = 0;
  };

  // What the sequence rules say of a message (state_mu_ held): a duplicate
  // (sequence 0, or at or below the watermark) with its outcome, or the
  // producer to apply it for, its mutex held in `lock`.
  struct Admission {
    std::optional<IngestOutcome> duplicate;
    Producer* producer = nullptr;
    std::unique_lock<std::mutex> lock;
  };
  // The sequence rules Ingest and IngestPartial share: a gap is
  // FailedPrecondition naming `what` and the expected sequence; a new
  // producer (sequence 1) is registered only after `before_register` passed.
  absl::StatusOr<Admission> Admit(
      const std::string& producer_name, uint64_t sequence,
      const std::string& what,
      const std::function<absl::Status()>& before_register);

  Session(std::string id, std::string tenant, const Geometry& geometry,
          std::unique_ptr<StatisticsBackend> backend,
          uint64_t holdout_budget_bytes, bool reject_non_finite);
  Producer* FindProducer(const std::string& producer_id, bool create);
  // Ingest's steps; `what` names the chunk in messages.
  absl::Status CheckDeviceData(const std::string& what, bool holdout,
                               bool device_data,
                               const DeviceDataSink* device) const;
  absl::Status CheckFinite(const std::string& what, const ChunkView& chunk,
                           const ChunkExtent& extent, bool holdout,
                           DeviceDataSink* device) const;
  absl::Status Apply(const std::string& producer_name, uint64_t sequence,
                     const ChunkView& chunk, bool holdout,
                     DeviceDataSink* device);
  std::vector<ProducerInfo> ProducerInfos();

  const std::string id_;
  const std::string tenant_;
  const Geometry geometry_;
  const bool reject_non_finite_;
  std::unique_ptr<StatisticsBackend> backend_;
  HoldoutStore holdout_;

  // Shared by Ingest; exclusive for Export/Merge, so that a snapshot's
  // statistics and watermarks agree.
  std::shared_mutex state_mu_;

  std::mutex producers_mu_;  // guards the map, not the producers
  std::map<std::string, std::unique_ptr<Producer>> producers_;

  std::atomic<uint64_t> chunks_applied_{0};
  std::atomic<uint64_t> values_ingested_{0};
  std::atomic<uint64_t> bytes_ingested_{0};
  std::set<std::string> applied_import_ids_;  // guarded by state_mu_
  std::mutex shard_map_mu_;
  ShardMap shard_map_;  // guarded by shard_map_mu_
  // nonfinite_values (and where they are) is read from a backend snapshot,
  // cached until the next applied chunk or merge.
  std::mutex info_mu_;
  uint64_t nonfinite_cache_ = 0;
  NonFiniteHeads nonfinite_heads_cache_;
  uint64_t nonfinite_cache_chunks_ = UINT64_MAX;
  uint64_t nonfinite_cache_generation_ = 0;
  std::atomic<uint64_t> generation_{0};  // bumped by Merge
};

}  // namespace kvcal::service

#endif  // KVCAL_SERVICE_SESSION_H_
