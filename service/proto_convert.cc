#include "service/proto_convert.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "proto/wire_enums.h"
#include "proto/wire_geometry.h"
#include "util/status_macros.h"

namespace kvcal::service {
namespace {

namespace v1 = kvcal::v1;

void RolesToProto(const Geometry& geometry,
                  google::protobuf::RepeatedField<int>* out) {
  for (Role role : geometry.roles()) out->Add(static_cast<int>(role));
}

// The geometry and counter fields v1::Session and v1::SessionState share
// (same names): written once for both.
template <typename SessionMessage>
void GeometryAndCountersToProto(const Geometry& g,
                                const SessionCounters& counters,
                                SessionMessage* out) {
  out->set_num_layers(g.num_layers);
  out->set_num_attention_heads(g.num_attention_heads);
  out->set_num_key_value_heads(g.num_key_value_heads);
  out->set_head_dim(g.head_dim);
  out->set_histogram_bins_per_octave(g.bins_per_octave);
  RolesToProto(g, out->mutable_roles());
  out->set_chunks_applied(counters.chunks_applied);
  out->set_values_ingested(counters.values_ingested);
  out->set_bytes_ingested(counters.bytes_ingested);
  out->set_nonfinite_values(counters.nonfinite_values);
}

}  // namespace

ChunkView ChunkFromProto(const kvcal::v1::IngestRequest& request) {
  ChunkView chunk;
  chunk.layer = request.layer();
  chunk.role = static_cast<Role>(request.role());
  chunk.dtype = static_cast<DType>(request.dtype());
  chunk.layout = static_cast<Layout>(request.layout());
  chunk.shape.assign(request.shape().begin(), request.shape().end());
  chunk.head_offset = request.head_offset();
  chunk.batch = request.batch();
  chunk.data = absl::Span<const std::byte>(
      reinterpret_cast<const std::byte*>(request.data().data()),
      request.data().size());
  return chunk;
}

absl::StatusOr<ScaleOptions> ScaleOptionsFromProto(
    const kvcal::v1::FinalizeRequest& request) {
  ScaleOptions options;
  if (request.observer() != kvcal::v1::OBSERVER_UNSPECIFIED) {
    options.observer = static_cast<Observer>(request.observer());
  }
  if (request.granularity() != kvcal::v1::GRANULARITY_UNSPECIFIED) {
    options.granularity = static_cast<Granularity>(request.granularity());
  }
  if (request.format() != kvcal::v1::FORMAT_UNSPECIFIED) {
    options.format = static_cast<Format>(request.format());
  }
  if (request.averaging_constant() != 0.0f) {
    options.averaging_constant = request.averaging_constant();
  }
  if (request.percentile() != 0.0) options.percentile = request.percentile();
  if (request.margin() != 0.0f) options.margin = request.margin();
  if (request.mse_grid() != 0) options.mse_grid = request.mse_grid();
  if (request.mse_max_shrink() != 0.0f) {
    options.mse_max_shrink = request.mse_max_shrink();
  }
  if (request.mse_norm() != 0.0f) options.mse_norm = request.mse_norm();
  if (request.mse_patience() != 0)
    options.mse_patience = request.mse_patience();
  options.q_per_kv_group = request.q_per_kv_group();
  options.allow_missing = request.allow_missing();
  options.layers.assign(request.layers().begin(), request.layers().end());
  KVCAL_RETURN_IF_ERROR(options.Validate());
  return options;
}

void ScaleOptionsToProto(const ScaleOptions& options,
                         kvcal::v1::FinalizeRequest* out) {
  out->set_observer(static_cast<kvcal::v1::Observer>(options.observer));
  out->set_granularity(
      static_cast<kvcal::v1::Granularity>(options.granularity));
  out->set_format(static_cast<kvcal::v1::Format>(options.format));
  out->set_averaging_constant(options.averaging_constant);
  out->set_percentile(options.percentile);
  out->set_margin(options.margin);
  out->set_mse_grid(options.mse_grid);
  out->set_mse_max_shrink(options.mse_max_shrink);
  out->set_mse_norm(options.mse_norm);
  out->set_mse_patience(options.mse_patience);
  out->set_q_per_kv_group(options.q_per_kv_group);
  out->set_allow_missing(options.allow_missing);
}

void ResolvedFinalizeToProto(const kvcal::v1::FinalizeRequest& request,
                             const EvaluatedFinalizeOptions& options,
                             const EvaluatedFinalize& result,
                             kvcal::v1::FinalizeRequest* out) {
  *out = request;
  ScaleOptionsToProto(options.scale, out);
  if (!options.auto_observer) return;
  out->set_observer(kvcal::v1::OBSERVER_AUTO);
  if (!result.evaluation.has_value()) return;
  const Evaluation& e = *result.evaluation;
  auto one_of = [](const auto& values) {
    return !values.empty() &&
           std::all_of(values.begin(), values.end(),
                       [&](const auto& v) { return v == values.front(); });
  };
  if (one_of(e.layer_observers)) {
    out->set_observer(
        static_cast<kvcal::v1::Observer>(e.layer_observers.front()));
  }
  if (one_of(e.layer_granularities)) {
    out->set_granularity(
        static_cast<kvcal::v1::Granularity>(e.layer_granularities.front()));
  }
}

void NonFiniteHeadsToProto(
    const NonFiniteHeads& heads,
    google::protobuf::RepeatedPtrField<kvcal::v1::NonFiniteHead>* out) {
  for (const NonFiniteHead& h : heads.heads) {
    kvcal::v1::NonFiniteHead* p = out->Add();
    p->set_layer(h.layer);
    p->set_role(static_cast<kvcal::v1::Role>(h.role));
    p->set_head(h.head);
    p->set_nan(h.nan);
    p->set_inf(h.inf);
  }
}

void SessionInfoToProto(const SessionInfo& info, kvcal::v1::Session* out) {
  out->set_session_id(info.session_id);
  GeometryAndCountersToProto(info.geometry, info.counters, out);
  for (const ProducerInfo& p : info.producers) {
    kvcal::v1::ProducerWatermark* w = out->add_producers();
    w->set_producer_id(p.producer_id);
    w->set_sequence(p.watermark);
    w->set_durable_sequence(p.durable_watermark);
  }
  out->set_backend(info.backend);
  out->set_state_bytes(info.state_bytes);
  if (!info.shard_map.empty()) {
    ShardMapToProto(info.shard_map, out->mutable_shard_map());
  }
  out->set_holdout_budget_bytes(info.holdout_budget_bytes);
  out->set_holdout_bytes(info.holdout_bytes);
  out->set_holdout_chunks(info.holdout_chunks);
  out->set_holdout_batches(info.holdout_batches);
  out->set_reject_non_finite(info.reject_non_finite);
  NonFiniteHeadsToProto(info.nonfinite_heads, out->mutable_nonfinite_heads());
  out->set_nonfinite_heads_total(info.nonfinite_heads.total_heads);
}

absl::StatusOr<EvaluatedFinalizeOptions> EvaluatedFinalizeOptionsFromProto(
    const kvcal::v1::FinalizeRequest& request) {
  EvaluatedFinalizeOptions out;
  out.auto_observer = request.observer() == kvcal::v1::OBSERVER_AUTO;
  if (out.auto_observer) {
    kvcal::v1::FinalizeRequest plain = request;
    plain.set_observer(kvcal::v1::OBSERVER_UNSPECIFIED);
    KVCAL_ASSIGN_OR_RETURN(out.scale, ScaleOptionsFromProto(plain));
  } else {
    KVCAL_ASSIGN_OR_RETURN(out.scale, ScaleOptionsFromProto(request));
  }
  out.evaluate = request.evaluate();
  out.kv_only = request.evaluate_kv_only();
  out.auto_per_session = request.auto_per_session();
  for (int g : request.auto_granularities()) {
    if (g != kvcal::v1::GRANULARITY_PER_TENSOR &&
        g != kvcal::v1::GRANULARITY_PER_HEAD) {
      return absl::InvalidArgumentError(
          absl::StrCat("auto_granularities: unknown granularity ", g));
    }
    const Granularity granularity = static_cast<Granularity>(g);
    if (std::find(out.auto_granularities.begin(), out.auto_granularities.end(),
                  granularity) == out.auto_granularities.end()) {
      out.auto_granularities.push_back(granularity);
    }
  }
  return out;
}

namespace {

void SharesToProto(const RoleShares& shares,
                   kvcal::v1::QuantizationShares* out) {
  out->mutable_saturated()->Add(shares.saturated.begin(),
                                shares.saturated.end());
  out->mutable_subnormal()->Add(shares.subnormal.begin(),
                                shares.subnormal.end());
  out->set_saturated_all(shares.saturated_all);
  out->set_subnormal_all(shares.subnormal_all);
}

void EvaluationToProto(const Evaluation& e, kvcal::v1::Evaluation* out) {
  out->set_sequences(e.sequences);
  out->set_tokens(e.tokens);
  out->set_kv_only(e.kv_only);
  out->set_observer(static_cast<kvcal::v1::Observer>(e.observer));
  out->set_granularity(static_cast<kvcal::v1::Granularity>(e.granularity));
  out->set_error(e.error);
  out->set_error_ones(e.error_ones);
  for (size_t i = 0; i < e.layers.size(); ++i) {
    const LayerEvaluation& l = e.layers[i];
    kvcal::v1::LayerEvaluation* p = out->add_layers();
    p->set_layer(l.layer);
    p->set_error(l.error);
    p->set_error_ones(l.error_ones);
    p->mutable_head_error()->Add(l.head_error.begin(), l.head_error.end());
    p->mutable_head_error_ones()->Add(l.head_error_ones.begin(),
                                      l.head_error_ones.end());
    SharesToProto(l.shares[0], p->mutable_q());
    SharesToProto(l.shares[1], p->mutable_k());
    SharesToProto(l.shares[2], p->mutable_v());
    SharesToProto(l.shares_ones[0], p->mutable_q_ones());
    SharesToProto(l.shares_ones[1], p->mutable_k_ones());
    SharesToProto(l.shares_ones[2], p->mutable_v_ones());
    p->set_observer(static_cast<kvcal::v1::Observer>(e.layer_observers[i]));
    p->set_granularity(
        static_cast<kvcal::v1::Granularity>(e.layer_granularities[i]));
  }
}

}  // namespace

void EvaluatedFinalizeToProto(const EvaluatedFinalize& result,
                              kvcal::v1::FinalizeResponse* out) {
  ScaleResultToProto(result.scales, out);
  NonFiniteHeadsToProto(result.nonfinite_heads, out->mutable_nonfinite_heads());
  out->set_nonfinite_heads_total(result.nonfinite_heads.total_heads);
  if (result.evaluation.has_value()) {
    EvaluationToProto(*result.evaluation, out->mutable_evaluation());
  }
  for (const Evaluation& e : result.candidates) {
    EvaluationToProto(e, out->add_candidates());
  }
}

ShardMap ShardMapFromProto(const kvcal::v1::ShardMap& map) {
  ShardMap out;
  out.worker_ids.assign(map.worker_ids().begin(), map.worker_ids().end());
  out.layer_owners.assign(map.layer_owners().begin(), map.layer_owners().end());
  return out;
}

void ShardMapToProto(const ShardMap& map, kvcal::v1::ShardMap* out) {
  for (const std::string& id : map.worker_ids) out->add_worker_ids(id);
  out->mutable_layer_owners()->Add(map.layer_owners.begin(),
                                   map.layer_owners.end());
}

void ScaleResultToProto(const ScaleResult& result,
                        kvcal::v1::FinalizeResponse* out) {
  for (const LayerScales& layer : result.layers) {
    kvcal::v1::LayerScales* l = out->add_layers();
    l->set_layer(layer.layer);
    for (Role role : kAllRoles) {
      const std::optional<RoleScales>& scales = layer.role(role);
      if (!scales.has_value()) continue;
      kvcal::v1::RoleScales* r = role == Role::kQ   ? l->mutable_q()
                                 : role == Role::kK ? l->mutable_k()
                                                    : l->mutable_v();
      r->mutable_scale()->Add(scales->scale.begin(), scales->scale.end());
      r->mutable_absmax()->Add(scales->absmax.begin(), scales->absmax.end());
      r->set_count(scales->count);
      r->set_nonfinite(scales->nonfinite);
    }
  }
}

void SnapshotToProto(const std::string& session_id,
                     const SessionSnapshot& snapshot,
                     kvcal::v1::SessionState* out) {
  const Geometry& g = snapshot.geometry;
  out->set_format_version(1);
  out->set_session_id(session_id);
  GeometryAndCountersToProto(g, snapshot.counters, out);
  out->set_statistics(snapshot.statistics);
  for (const ProducerInfo& p : snapshot.producers) {
    kvcal::v1::ProducerWatermark* w = out->add_producers();
    w->set_producer_id(p.producer_id);
    w->set_sequence(p.watermark);
    w->set_durable_sequence(p.durable_watermark);
  }
  for (const std::string& id : snapshot.applied_import_ids) {
    out->add_applied_import_ids(id);
  }
  if (!snapshot.shard_map.empty()) {
    ShardMapToProto(snapshot.shard_map, out->mutable_shard_map());
  }
  out->set_holdout_budget_bytes(snapshot.holdout_budget_bytes);
  out->set_reject_non_finite(snapshot.reject_non_finite);
  for (const HoldoutChunk& c : snapshot.holdout_chunks) {
    kvcal::v1::HoldoutChunk* h = out->add_holdout_chunks();
    h->set_producer_id(c.producer_id);
    h->set_sequence(c.sequence);
    h->set_batch(c.batch);
    h->set_layer(c.layer);
    h->set_role(static_cast<kvcal::v1::Role>(c.role));
    h->set_dtype(static_cast<kvcal::v1::DType>(c.dtype));
    h->set_layout(static_cast<kvcal::v1::Layout>(c.layout));
    h->mutable_shape()->Add(c.shape.begin(), c.shape.end());
    h->set_head_offset(c.head_offset);
    h->set_data(c.data);
  }
}

absl::StatusOr<SessionSnapshot> SnapshotFromProto(
    const kvcal::v1::SessionState& state) {
  if (state.format_version() != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("state has format_version ", state.format_version(),
                     "; this worker reads version 1"));
  }
  SessionSnapshot snapshot;
  KVCAL_ASSIGN_OR_RETURN(snapshot.geometry, GeometryFromWire(state));
  const Geometry& g = snapshot.geometry;
  if (absl::Status s = g.Validate(); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("state has invalid geometry: ", s.message()));
  }
  snapshot.statistics = state.statistics();
  snapshot.counters.chunks_applied = state.chunks_applied();
  snapshot.counters.values_ingested = state.values_ingested();
  snapshot.counters.bytes_ingested = state.bytes_ingested();
  snapshot.counters.nonfinite_values = state.nonfinite_values();
  for (const kvcal::v1::ProducerWatermark& w : state.producers()) {
    if (w.producer_id().empty()) {
      return absl::InvalidArgumentError("state has a producer with empty id");
    }
    snapshot.producers.push_back(
        {w.producer_id(), w.sequence(), w.durable_sequence()});
  }
  snapshot.applied_import_ids.assign(state.applied_import_ids().begin(),
                                     state.applied_import_ids().end());
  snapshot.shard_map = ShardMapFromProto(state.shard_map());
  KVCAL_RETURN_IF_ERROR(ValidateShardMap(snapshot.shard_map, g.num_layers));
  snapshot.holdout_budget_bytes = state.holdout_budget_bytes();
  snapshot.reject_non_finite = state.reject_non_finite();
  for (const kvcal::v1::HoldoutChunk& h : state.holdout_chunks()) {
    // The same checks as a chunk arriving by Ingest.
    kvcal::v1::IngestRequest as_chunk;
    as_chunk.set_layer(h.layer());
    as_chunk.set_role(h.role());
    as_chunk.set_dtype(h.dtype());
    as_chunk.set_layout(h.layout());
    *as_chunk.mutable_shape() = h.shape();
    as_chunk.set_head_offset(h.head_offset());
    as_chunk.set_data(h.data());
    const ChunkView view = ChunkFromProto(as_chunk);
    if (absl::StatusOr<ChunkExtent> e = ValidateChunk(g, view); !e.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "state has an invalid held-out chunk (producer '", h.producer_id(),
          "', sequence ", h.sequence(), "): ", e.status().message()));
    }
    snapshot.holdout_chunks.push_back(
        HoldoutChunk::Of(h.producer_id(), h.sequence(), view));
    snapshot.holdout_chunks.back().batch = h.batch();
  }
  return snapshot;
}

static_assert(static_cast<int>(SharedMemoryKind::kSystem) ==
              kvcal::v1::SHARED_MEMORY_KIND_SYSTEM);
static_assert(static_cast<int>(SharedMemoryKind::kCudaIpc) ==
              kvcal::v1::SHARED_MEMORY_KIND_CUDA_IPC);

absl::StatusOr<SharedMemoryRegistration> SharedMemoryRegistrationFromProto(
    const kvcal::v1::RegisterSharedMemoryRequest& request) {
  SharedMemoryRegistration out;
  switch (request.kind()) {
    case kvcal::v1::SHARED_MEMORY_KIND_SYSTEM:
    case kvcal::v1::SHARED_MEMORY_KIND_CUDA_IPC:
      out.kind = static_cast<SharedMemoryKind>(request.kind());
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "RegisterSharedMemory: kind ", static_cast<int>(request.kind()),
          " is not SHARED_MEMORY_KIND_SYSTEM or SHARED_MEMORY_KIND_CUDA_IPC"));
  }
  out.name = request.name();
  out.cuda_ipc_handle = request.cuda_ipc_handle();
  out.device = request.device();
  out.byte_size = request.byte_size();
  out.host_id = request.host_id();
  return out;
}

void SharedMemoryRegionToProto(const SharedMemoryRegionInfo& info,
                               kvcal::v1::SharedMemoryRegion* out) {
  out->set_region_id(info.id);
  out->set_kind(static_cast<kvcal::v1::SharedMemoryKind>(info.kind));
  out->set_name(info.name);
  out->set_device(info.device);
  out->set_byte_size(info.byte_size);
}

}  // namespace kvcal::service
