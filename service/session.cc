#include "service/session.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/backend_factory.h"
#include "kernels/nonfinite.h"
#include "util/status_macros.h"

namespace kvcal::service {

std::string ResolveProducerId(absl::string_view producer_id) {
  return producer_id.empty() ? std::string("default")
                             : std::string(producer_id);
}

namespace {

constexpr absl::string_view kHoldoutMustBeFinite =
    "held-out chunks must be finite (Finalize's evaluation runs attention on "
    "them)";

// InvalidArgument when a state would bring NaN or Inf values into session
// `session_id`: in held-out chunks always (as Ingest refuses them), in the
// statistics when the session has reject_non_finite.
absl::Status CheckStateFinite(const std::string& session_id,
                              bool reject_non_finite,
                              const SessionStatistics& stats,
                              const std::vector<HoldoutChunk>& holdout) {
  const NonFiniteHeads found =
      reject_non_finite ? FindNonFiniteHeads(stats, {}, 1) : NonFiniteHeads{};
  if (found.total_heads > 0) {
    const NonFiniteHead& h = found.heads.front();
    return absl::InvalidArgumentError(absl::StrCat(
        "the state holds ", stats.nonfinite_values(), " non-finite values in ",
        found.total_heads, " heads (first: layer ", h.layer, " ",
        RoleName(h.role), " head ", h.head, ", ", h.nan, " NaN, ", h.inf,
        " Inf) and session '", session_id,
        "' rejects non-finite values (created with reject_non_finite)"));
  }
  for (const HoldoutChunk& c : holdout) {
    const ChunkView view = c.view();
    absl::StatusOr<ChunkExtent> extent = ValidateChunk(stats.geometry(), view);
    if (!extent.ok()) return extent.status();
    const ChunkNonFinite nonfinite = CountNonFinite(view, *extent);
    if (nonfinite.total() > 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the state's held-out chunk ", c.sequence, " from producer '",
          c.producer_id, "' holds ", DescribeNonFinite(view, nonfinite), "; ",
          kHoldoutMustBeFinite));
    }
  }
  return absl::OkStatus();
}

}  // namespace

Session::Session(std::string id, std::string tenant, const Geometry& geometry,
                 std::unique_ptr<StatisticsBackend> backend,
                 uint64_t holdout_budget_bytes, bool reject_non_finite)
    : id_(std::move(id)),
      tenant_(std::move(tenant)),
      geometry_(geometry),
      reject_non_finite_(reject_non_finite),
      backend_(std::move(backend)),
      holdout_(holdout_budget_bytes) {}

absl::StatusOr<std::shared_ptr<Session>> Session::Create(
    std::string id, std::string tenant, const Geometry& geometry,
    const SessionOptions& options) {
  KVCAL_RETURN_IF_ERROR(geometry.Validate());
  KVCAL_ASSIGN_OR_RETURN(
      std::unique_ptr<StatisticsBackend> backend,
      CreateBackend(options.backend, geometry, options.backend_options));
  return std::shared_ptr<Session>(new Session(
      std::move(id), std::move(tenant), geometry, std::move(backend),
      options.holdout_budget_bytes, options.reject_non_finite));
}

absl::StatusOr<std::shared_ptr<Session>> Session::FromSnapshot(
    std::string id, std::string tenant, const SessionSnapshot& snapshot,
    const SessionOptions& options, absl::string_view import_id) {
  KVCAL_ASSIGN_OR_RETURN(SessionStatistics stats,
                         SessionStatistics::Deserialize(snapshot.statistics));
  if (!(stats.geometry() == snapshot.geometry)) {
    return absl::InvalidArgumentError(
        absl::StrCat("state geometry {", snapshot.geometry.DebugString(),
                     "} does not match its statistics {",
                     stats.geometry().DebugString(), "}"));
  }
  KVCAL_RETURN_IF_ERROR(CheckStateFinite(id, snapshot.reject_non_finite, stats,
                                         snapshot.holdout_chunks));
  SessionOptions with_budget = options;
  with_budget.holdout_budget_bytes = snapshot.holdout_budget_bytes;
  with_budget.reject_non_finite = snapshot.reject_non_finite;
  KVCAL_ASSIGN_OR_RETURN(
      std::shared_ptr<Session> session,
      Create(std::move(id), std::move(tenant), snapshot.geometry, with_budget));
  KVCAL_RETURN_IF_ERROR(session->holdout_.Merge(snapshot.holdout_chunks));
  KVCAL_RETURN_IF_ERROR(session->backend_->Merge(stats));
  session->chunks_applied_ = snapshot.counters.chunks_applied;
  session->values_ingested_ = snapshot.counters.values_ingested;
  session->bytes_ingested_ = snapshot.counters.bytes_ingested;
  for (const ProducerInfo& info : snapshot.producers) {
    Producer* producer = session->FindProducer(info.producer_id, true);
    producer->watermark = info.watermark;
    producer->durable_watermark = info.durable_watermark;
  }
  session->shard_map_ = snapshot.shard_map;
  session->applied_import_ids_.insert(snapshot.applied_import_ids.begin(),
                                      snapshot.applied_import_ids.end());
  if (!import_id.empty()) {
    session->applied_import_ids_.insert(std::string(import_id));
  }
  return session;
}

Session::Producer* Session::FindProducer(const std::string& producer_id,
                                         bool create) {
  std::lock_guard<std::mutex> lock(producers_mu_);
  auto it = producers_.find(producer_id);
  if (it != producers_.end()) return it->second.get();
  if (!create) return nullptr;
  return producers_.emplace(producer_id, std::make_unique<Producer>())
      .first->second.get();
}

// Device data goes only to a backend that keeps its state on a device, and
// never as a held-out chunk (held-out chunks live in host memory).
absl::Status Session::CheckDeviceData(const std::string& what, bool holdout,
                                      bool device_data,
                                      const DeviceDataSink* device) const {
  if (!device_data || (device != nullptr && !holdout)) return absl::OkStatus();
  if (holdout) {
    return absl::InvalidArgumentError(absl::StrCat(
        what,
        ": a held-out chunk cannot be in CUDA IPC memory (the worker keeps "
        "held-out chunks in host memory); send it in-band or from a SYSTEM "
        "region"));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      what, ": its data is in CUDA IPC memory but session '", id_,
      "' keeps its statistics on the ", backend_->name(), " backend"));
}

// A held-out chunk, and any chunk of a session with reject_non_finite, is
// read before anything of it is applied: a refused chunk changes nothing.
absl::Status Session::CheckFinite(const std::string& what,
                                  const ChunkView& chunk,
                                  const ChunkExtent& extent, bool holdout,
                                  DeviceDataSink* device) const {
  if (!reject_non_finite_ && !holdout) return absl::OkStatus();
  absl::StatusOr<ChunkNonFinite> found =
      device != nullptr
          ? device->CountNonFiniteDeviceData(chunk)
          : absl::StatusOr<ChunkNonFinite>(CountNonFinite(chunk, extent));
  if (!found.ok()) {
    return absl::Status(found.status().code(),
                        absl::StrCat(what, ": ", found.status().message()));
  }
  if (found->total() == 0) return absl::OkStatus();
  if (!reject_non_finite_) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", DescribeNonFinite(chunk, *found), "; ",
                     kHoldoutMustBeFinite, ", so nothing of it was kept"));
  }
  return absl::InvalidArgumentError(absl::StrCat(
      what, ": ", DescribeNonFinite(chunk, *found), "; session '", id_,
      "' rejects non-finite values (created with reject_non_finite), so "
      "nothing of the chunk was applied"));
}

// Into the held-out store, the host backend, or (finished before the
// response, so the producer may reuse the memory) the device backend.
absl::Status Session::Apply(const std::string& producer_name, uint64_t sequence,
                            const ChunkView& chunk, bool holdout,
                            DeviceDataSink* device) {
  if (holdout) {
    return holdout_.Add(HoldoutChunk::Of(producer_name, sequence, chunk));
  }
  if (device == nullptr) return backend_->Accumulate(chunk);
  KVCAL_RETURN_IF_ERROR(device->AccumulateDeviceData(chunk, nullptr));
  return device->Synchronize();
}

absl::StatusOr<Session::Admission> Session::Admit(
    const std::string& producer_name, uint64_t sequence,
    const std::string& what,
    const std::function<absl::Status()>& before_register) {
  Admission out;
  Producer* producer = FindProducer(producer_name, false);
  if (sequence == 0) {
    // Always a duplicate: acknowledged with the producer's watermark (0 for
    // a producer the session does not know, which it does not register).
    if (producer == nullptr) {
      out.duplicate = IngestOutcome{false, 0};
      return out;
    }
    std::lock_guard<std::mutex> lock(producer->mu);
    out.duplicate =
        IngestOutcome{false, producer->watermark, producer->durable_watermark};
    return out;
  }
  if (producer == nullptr) {
    if (sequence != 1) {
      return absl::FailedPreconditionError(absl::StrCat(
          what, ": sequence gap, expected sequence 1 (watermark 0)"));
    }
    // Checked before a new producer is registered.
    KVCAL_RETURN_IF_ERROR(before_register());
    producer = FindProducer(producer_name, true);
  }
  out.lock = std::unique_lock<std::mutex>(producer->mu);
  if (sequence <= producer->watermark) {
    out.duplicate =
        IngestOutcome{false, producer->watermark, producer->durable_watermark};
    return out;
  }
  if (sequence != producer->watermark + 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, ": sequence gap, expected sequence ", producer->watermark + 1,
        " (watermark ", producer->watermark, ")"));
  }
  out.producer = producer;
  return out;
}

absl::StatusOr<IngestOutcome> Session::Ingest(absl::string_view producer_id,
                                              uint64_t sequence,
                                              const ChunkView& chunk,
                                              bool holdout, bool device_data) {
  const std::string producer_name = ResolveProducerId(producer_id);
  const std::string what =
      absl::StrCat("chunk ", sequence, " from producer '", producer_name, "'");
  absl::StatusOr<ChunkExtent> extent = ValidateChunk(geometry_, chunk);
  if (!extent.ok()) {
    return absl::Status(extent.status().code(),
                        absl::StrCat(what, " (layer ", chunk.layer,
                                     "): ", extent.status().message()));
  }
  DeviceDataSink* const device =
      device_data ? backend_->device_data() : nullptr;
  KVCAL_RETURN_IF_ERROR(CheckDeviceData(what, holdout, device_data, device));
  std::shared_lock<std::shared_mutex> state_lock(state_mu_);
  bool checked_finite = false;
  KVCAL_ASSIGN_OR_RETURN(
      Admission admitted,
      Admit(producer_name, sequence, what, [&]() -> absl::Status {
        checked_finite = true;
        return CheckFinite(what, chunk, *extent, holdout, device);
      }));
  if (admitted.duplicate) return *admitted.duplicate;
  Producer* const producer = admitted.producer;
  if (!checked_finite) {
    // The watermark stays on a refusal, so resending cannot skip the chunk.
    KVCAL_RETURN_IF_ERROR(CheckFinite(what, chunk, *extent, holdout, device));
  }
  if (absl::Status status =
          Apply(producer_name, sequence, chunk, holdout, device);
      !status.ok()) {
    return absl::Status(status.code(),
                        absl::StrCat(what, ": ", status.message()));
  }
  producer->watermark = sequence;
  chunks_applied_.fetch_add(1, std::memory_order_relaxed);
  values_ingested_.fetch_add(extent->elements(), std::memory_order_relaxed);
  bytes_ingested_.fetch_add(chunk.byte_size(), std::memory_order_relaxed);
  return IngestOutcome{true, sequence, producer->durable_watermark};
}

namespace {

// The layers of `stats` with any data: values, non-finite values or
// per-batch records in one of their heads.
std::vector<uint32_t> LayersWithData(const SessionStatistics& stats) {
  const Geometry& g = stats.geometry();
  const size_t per_layer =
      g.num_layers == 0 ? 0 : stats.num_heads_total() / g.num_layers;
  std::vector<uint32_t> layers;
  for (uint32_t layer = 0; layer < g.num_layers; ++layer) {
    for (size_t i = 0; i < per_layer; ++i) {
      const HeadStatistics& h = stats.heads()[layer * per_layer + i];
      if (h.finite_count > 0 || h.nonfinite_count() > 0 || !h.batches.empty()) {
        layers.push_back(layer);
        break;
      }
    }
  }
  return layers;
}

}  // namespace

absl::StatusOr<IngestOutcome> Session::IngestPartial(
    absl::string_view producer_id, uint64_t sequence,
    absl::string_view statistics, const SessionCounters& counters,
    const std::vector<std::string>& shard_client_ids,
    absl::string_view worker_id) {
  const std::string producer_name = ResolveProducerId(producer_id);
  const std::string what = absl::StrCat("partial statistics ", sequence,
                                        " from producer '", producer_name, "'");
  auto named = [&what](const absl::Status& status) {
    return absl::Status(status.code(),
                        absl::StrCat(what, ": ", status.message()));
  };
  // Everything about the message itself before any lock.
  absl::StatusOr<SessionStatistics> stats =
      SessionStatistics::Deserialize(statistics);
  if (!stats.ok()) return named(stats.status());
  if (!(stats->geometry() == geometry_)) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, ": computed with geometry {", stats->geometry().DebugString(),
        "}, but session '", id_, "' has {", geometry_.DebugString(),
        "}; make the producer's engine from the session's options"));
  }
  const std::vector<uint32_t> layers = LayersWithData(*stats);
  // Empty statistics touch no layer (CheckShard would read an empty list
  // as every layer).
  if (!layers.empty()) {
    if (absl::Status shard = CheckShard(shard_client_ids, layers, worker_id);
        !shard.ok()) {
      return named(shard);
    }
  }
  if (absl::Status finite =
          CheckStateFinite(id_, reject_non_finite_, *stats, {});
      !finite.ok()) {
    return named(finite);
  }
  std::unique_lock<std::shared_mutex> state_lock(state_mu_);
  KVCAL_ASSIGN_OR_RETURN(
      Admission admitted,
      Admit(producer_name, sequence, what, [] { return absl::OkStatus(); }));
  if (admitted.duplicate) return *admitted.duplicate;
  Producer* const producer = admitted.producer;
  if (absl::Status merged = backend_->Merge(*stats); !merged.ok()) {
    return named(merged);
  }
  producer->watermark = sequence;
  chunks_applied_ += counters.chunks_applied;
  values_ingested_ += counters.values_ingested;
  bytes_ingested_ += counters.bytes_ingested;
  generation_.fetch_add(1);  // the persister and the non-finite cache see it
  return IngestOutcome{true, sequence, producer->durable_watermark};
}

void Session::MarkDurable(const std::vector<ProducerInfo>& producers) {
  for (const ProducerInfo& info : producers) {
    Producer* producer = FindProducer(info.producer_id, false);
    if (producer == nullptr) continue;
    std::lock_guard<std::mutex> lock(producer->mu);
    producer->durable_watermark =
        std::max(producer->durable_watermark, info.watermark);
  }
}

std::vector<ProducerInfo> Session::ProducerInfos() {
  std::vector<ProducerInfo> out;
  std::lock_guard<std::mutex> map_lock(producers_mu_);
  for (auto& [name, producer] : producers_) {
    std::lock_guard<std::mutex> lock(producer->mu);
    out.push_back({name, producer->watermark, producer->durable_watermark});
  }
  return out;  // std::map: sorted by id
}

absl::StatusOr<SessionInfo> Session::Info() {
  SessionInfo info;
  info.session_id = id_;
  info.geometry = geometry_;
  info.backend = std::string(backend_->name());
  info.state_bytes = backend_->StateBytes();
  info.producers = ProducerInfos();
  info.shard_map = shard_map();
  info.holdout_budget_bytes = holdout_.budget_bytes();
  info.holdout_bytes = holdout_.bytes();
  info.holdout_chunks = holdout_.chunks();
  info.holdout_batches = holdout_.batches();
  info.reject_non_finite = reject_non_finite_;
  info.counters.chunks_applied = chunks_applied_.load();
  info.counters.values_ingested = values_ingested_.load();
  info.counters.bytes_ingested = bytes_ingested_.load();
  const uint64_t generation = generation_.load();
  std::lock_guard<std::mutex> lock(info_mu_);
  if (nonfinite_cache_chunks_ != info.counters.chunks_applied ||
      nonfinite_cache_generation_ != generation) {
    KVCAL_ASSIGN_OR_RETURN(SessionStatistics stats, backend_->Snapshot());
    nonfinite_cache_ = stats.nonfinite_values();
    nonfinite_heads_cache_ =
        FindNonFiniteHeads(stats, {}, kMaxNonFiniteHeadsListed);
    nonfinite_cache_chunks_ = info.counters.chunks_applied;
    nonfinite_cache_generation_ = generation;
  }
  info.counters.nonfinite_values = nonfinite_cache_;
  info.nonfinite_heads = nonfinite_heads_cache_;
  return info;
}

absl::StatusOr<ScaleResult> Session::Finalize(const ScaleOptions& options) {
  KVCAL_ASSIGN_OR_RETURN(SessionStatistics stats, backend_->Snapshot());
  return ComputeScales(stats, options);
}

absl::StatusOr<EvaluatedFinalize> Session::Finalize(
    const EvaluatedFinalizeOptions& options) {
  KVCAL_ASSIGN_OR_RETURN(SessionStatistics stats, backend_->Snapshot());
  KVCAL_ASSIGN_OR_RETURN(EvaluatedFinalize result,
                         FinalizeAndEvaluate(stats, holdout_, options));
  std::vector<uint32_t> layers;
  for (const LayerScales& l : result.scales.layers) layers.push_back(l.layer);
  if (!layers.empty()) {
    result.nonfinite_heads =
        FindNonFiniteHeads(stats, layers, kMaxNonFiniteHeadsListed);
  }
  return result;
}

absl::StatusOr<SessionSnapshot> Session::Export() {
  std::unique_lock<std::shared_mutex> state_lock(state_mu_);
  KVCAL_ASSIGN_OR_RETURN(SessionStatistics stats, backend_->Snapshot());
  SessionSnapshot snapshot;
  snapshot.geometry = geometry_;
  snapshot.statistics = stats.Serialize();
  snapshot.counters.chunks_applied = chunks_applied_.load();
  snapshot.counters.values_ingested = values_ingested_.load();
  snapshot.counters.bytes_ingested = bytes_ingested_.load();
  snapshot.counters.nonfinite_values = stats.nonfinite_values();
  snapshot.producers = ProducerInfos();
  snapshot.applied_import_ids.assign(applied_import_ids_.begin(),
                                     applied_import_ids_.end());
  snapshot.shard_map = shard_map();
  snapshot.holdout_budget_bytes = holdout_.budget_bytes();
  snapshot.holdout_chunks = holdout_.Chunks();
  snapshot.reject_non_finite = reject_non_finite_;
  return snapshot;
}

absl::Status Session::AdoptShardMap(const ShardMap& map) {
  if (map.empty()) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(shard_map_mu_);
  if (shard_map_.empty()) {
    shard_map_ = map;
    generation_.fetch_add(1);  // the persister writes it
    return absl::OkStatus();
  }
  if (shard_map_ == map) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "session '", id_, "' exists with a different shard map: ",
      DescribeWorkerSetChange(shard_map_.worker_ids, map.worker_ids),
      " (its workers: ", absl::StrJoin(shard_map_.worker_ids, ", "),
      "); a changed worker set needs a new session"));
}

absl::Status Session::CheckShard(const std::vector<std::string>& client_ids,
                                 absl::Span<const uint32_t> layers,
                                 absl::string_view worker_id) {
  std::lock_guard<std::mutex> lock(shard_map_mu_);
  if (shard_map_.empty()) return absl::OkStatus();
  KVCAL_RETURN_IF_ERROR(CheckWorkerSet(id_, shard_map_, client_ids));
  if (layers.empty()) {
    for (uint32_t l = 0; l < geometry_.num_layers; ++l) {
      KVCAL_RETURN_IF_ERROR(CheckLayerOwner(id_, shard_map_, l, worker_id));
    }
    return absl::OkStatus();
  }
  for (uint32_t l : layers) {
    KVCAL_RETURN_IF_ERROR(CheckLayerOwner(id_, shard_map_, l, worker_id));
  }
  return absl::OkStatus();
}

ShardMap Session::shard_map() {
  std::lock_guard<std::mutex> lock(shard_map_mu_);
  return shard_map_;
}

absl::Status Session::Merge(const SessionSnapshot& snapshot,
                            absl::string_view import_id) {
  if (!(snapshot.geometry == geometry_)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot import state of geometry {",
                     snapshot.geometry.DebugString(), "} into session '", id_,
                     "' of geometry {", geometry_.DebugString(), "}"));
  }
  // Parse before taking any lock or changing anything.
  KVCAL_ASSIGN_OR_RETURN(SessionStatistics stats,
                         SessionStatistics::Deserialize(snapshot.statistics));
  if (!(stats.geometry() == geometry_)) {
    return absl::InvalidArgumentError(
        "state statistics do not match the state's geometry");
  }
  KVCAL_RETURN_IF_ERROR(CheckStateFinite(id_, reject_non_finite_, stats,
                                         snapshot.holdout_chunks));
  std::unique_lock<std::shared_mutex> state_lock(state_mu_);
  if (!import_id.empty() &&
      applied_import_ids_.count(std::string(import_id)) > 0) {
    return absl::OkStatus();  // a retried import: already applied
  }
  // Held-out chunks first: past the budget, nothing changes.
  KVCAL_RETURN_IF_ERROR(holdout_.Merge(snapshot.holdout_chunks));
  KVCAL_RETURN_IF_ERROR(backend_->Merge(stats));
  chunks_applied_ += snapshot.counters.chunks_applied;
  values_ingested_ += snapshot.counters.values_ingested;
  bytes_ingested_ += snapshot.counters.bytes_ingested;
  for (const ProducerInfo& info : snapshot.producers) {
    Producer* producer = FindProducer(info.producer_id, true);
    std::lock_guard<std::mutex> lock(producer->mu);
    producer->watermark = std::max(producer->watermark, info.watermark);
    producer->durable_watermark =
        std::max(producer->durable_watermark, info.durable_watermark);
  }
  applied_import_ids_.insert(snapshot.applied_import_ids.begin(),
                             snapshot.applied_import_ids.end());
  if (!import_id.empty()) applied_import_ids_.insert(std::string(import_id));
  {
    std::lock_guard<std::mutex> lock(shard_map_mu_);
    if (shard_map_.empty()) shard_map_ = snapshot.shard_map;
  }
  generation_.fetch_add(1);
  return absl::OkStatus();
}

}  // namespace kvcal::service
