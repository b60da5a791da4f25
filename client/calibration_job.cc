#include "client/calibration_job.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/activation_dump.h"
#include "client/model_config.h"
#include "client/progress.h"
#include "kernels/scale_math.h"
#include "kernels/status_macros.h"

namespace kvcal {
namespace {

using Json = nlohmann::ordered_json;

const v1::RoleScales& RoleOf(const v1::LayerScales& layer, int role) {
  return role == 0 ? layer.q() : role == 1 ? layer.k() : layer.v();
}

std::string Range(const google::protobuf::RepeatedField<float>& values) {
  if (values.empty()) return "-";
  const auto [lo, hi] = std::minmax_element(values.begin(), values.end());
  if (values.size() == 1) return absl::StrFormat("%.4g", *lo);
  return absl::StrFormat("%.3g..%.3g", *lo, *hi);
}

}  // namespace

absl::StatusOr<v1::Observer> ParseObserver(absl::string_view name) {
  if (name == "static-minmax") return v1::OBSERVER_STATIC_MINMAX;
  if (name == "minmax-ema") return v1::OBSERVER_MINMAX_EMA;
  if (name == "memoryless-minmax") return v1::OBSERVER_MEMORYLESS_MINMAX;
  if (name == "mse") return v1::OBSERVER_MSE;
  if (name == "percentile") return v1::OBSERVER_PERCENTILE;
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown observer '", name,
      "' (static-minmax, minmax-ema, memoryless-minmax, mse, percentile)"));
}

absl::StatusOr<v1::Granularity> ParseGranularity(absl::string_view name) {
  if (name == "tensor") return v1::GRANULARITY_PER_TENSOR;
  if (name == "head") return v1::GRANULARITY_PER_HEAD;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown granularity '", name, "' (tensor or head)"));
}

absl::StatusOr<v1::Format> ParseFormat(absl::string_view name) {
  if (name == "fp8-e4m3fn") return v1::FORMAT_FP8_E4M3FN;
  if (name == "fp8-e4m3fnuz") return v1::FORMAT_FP8_E4M3FNUZ;
  if (name == "fp8-e5m2") return v1::FORMAT_FP8_E5M2;
  if (name == "int8") return v1::FORMAT_INT8;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown format '", name,
                   "' (fp8-e4m3fn, fp8-e4m3fnuz, fp8-e5m2, int8)"));
}

absl::StatusOr<v1::Session> CreateSessionFromConfig(
    CalibrationClient& client, const std::string& config_path,
    const std::string& session_id, uint32_t bins_per_octave) {
  KVCAL_ASSIGN_OR_RETURN(ModelGeometry g, ReadModelGeometry(config_path));
  v1::CreateSessionRequest request;
  request.set_session_id(session_id);
  request.set_num_layers(g.num_layers);
  request.set_num_attention_heads(g.num_attention_heads);
  request.set_num_key_value_heads(g.num_key_value_heads);
  request.set_head_dim(g.head_dim);
  request.set_histogram_bins_per_octave(bins_per_octave);
  return client.CreateSession(request);
}

absl::StatusOr<PushSummary> PushDump(CalibrationClient& client,
                                     const std::string& session_id,
                                     const std::string& dump_dir,
                                     UploaderOptions options, bool progress) {
  KVCAL_ASSIGN_OR_RETURN(v1::Session session, client.GetSession(session_id));
  Geometry geometry{.num_layers = session.num_layers(),
                    .num_attention_heads = session.num_attention_heads(),
                    .num_key_value_heads = session.num_key_value_heads(),
                    .head_dim = session.head_dim(),
                    .bins_per_octave = session.histogram_bins_per_octave()};
  KVCAL_ASSIGN_OR_RETURN(ActivationDump dump,
                         ActivationDump::Open(dump_dir, &geometry));
  std::vector<ChunkView> chunks;
  uint64_t total_chunks = 0;
  for (const DumpTensor& t : dump.tensors()) {
    chunks.push_back(ChunkView{.layer = t.layer,
                               .role = t.role,
                               .dtype = t.dtype,
                               .layout = t.layout,
                               .shape = t.shape,
                               .head_offset = 0,
                               .batch = t.batch,
                               .data = t.data,
                               .pieces = {}});
    total_chunks += SplitChunk(chunks.back(), options.max_chunk_bytes).size();
  }
  if (!options.counters) options.counters = std::make_shared<UploadCounters>();
  PushSummary summary;
  summary.files = dump.file_count();
  summary.tensors = dump.tensors().size();
  const absl::Time start = absl::Now();
  std::optional<ProgressReporter> reporter;
  if (progress) {
    reporter.emplace("push", dump.total_bytes(), total_chunks,
                     options.counters);
  }
  auto result = client.Upload(session_id, chunks, options);
  if (reporter) reporter->Finish();
  KVCAL_RETURN_IF_ERROR(result.status());
  summary.upload = *result;
  summary.elapsed = absl::Now() - start;
  return summary;
}

absl::StatusOr<FinalizeSummary> FinalizeToFile(
    CalibrationClient& client, const v1::FinalizeRequest& request,
    const std::string& out_path) {
  FinalizeSummary summary;
  KVCAL_ASSIGN_OR_RETURN(summary.response, client.Finalize(request));
  CalibratedScales& scales = summary.scales;
  scales.granularity = request.granularity() == v1::GRANULARITY_PER_HEAD
                           ? Granularity::kPerHead
                           : Granularity::kPerTensor;
  const v1::Observer observer = request.observer() == v1::OBSERVER_UNSPECIFIED
                                    ? v1::OBSERVER_STATIC_MINMAX
                                    : request.observer();
  const v1::Format format = request.format() == v1::FORMAT_UNSPECIFIED
                                ? v1::FORMAT_FP8_E4M3FN
                                : request.format();
  scales.observer = std::string(ObserverName(static_cast<Observer>(observer)));
  Json options = {
      {"averaging_constant", request.averaging_constant() == 0
                                 ? 0.01f
                                 : request.averaging_constant()},
      {"percentile", request.percentile() == 0 ? 99.99 : request.percentile()},
      {"margin", request.margin() == 0 ? 1.0f : request.margin()},
      {"mse_grid", request.mse_grid() == 0 ? 100u : request.mse_grid()},
      {"mse_max_shrink",
       request.mse_max_shrink() == 0 ? 0.2f : request.mse_max_shrink()},
      {"mse_norm", request.mse_norm() == 0 ? 2.4f : request.mse_norm()},
      {"mse_patience",
       request.mse_patience() == 0 ? 5u : request.mse_patience()},
      {"q_per_kv_group", request.q_per_kv_group()},
      {"allow_missing", request.allow_missing()}};
  Json counts = Json::object();
  for (const v1::LayerScales& layer : summary.response.layers()) {
    auto& roles = scales.layers[layer.layer()];
    Json layer_counts = Json::object();
    for (int r = 0; r < 3; ++r) {
      const v1::RoleScales& role = RoleOf(layer, r);
      roles[r].assign(role.scale().begin(), role.scale().end());
      layer_counts[std::string(1, "qkv"[r])] = role.count();
    }
    counts[std::to_string(layer.layer())] = std::move(layer_counts);
  }
  scales.metadata["format"] =
      std::string(FormatName(static_cast<Format>(format)));
  scales.metadata["observer_options"] = options.dump();
  scales.metadata["session"] = request.session_id();
  scales.metadata["counts"] = counts.dump();
  scales.metadata["workers"] = std::to_string(client.worker_count());
  if (!out_path.empty()) {
    KVCAL_RETURN_IF_ERROR(WriteScalesFile(out_path, scales));
  }
  return summary;
}

std::string FinalizeTable(const v1::FinalizeResponse& response) {
  std::string out = absl::StrFormat(
      "%5s  %-17s %-17s %-17s %9s %9s %9s %12s\n", "layer", "q_scale",
      "k_scale", "v_scale", "q_absmax", "k_absmax", "v_absmax", "values");
  for (const v1::LayerScales& layer : response.layers()) {
    float absmax[3] = {0, 0, 0};
    uint64_t values = 0;
    for (int r = 0; r < 3; ++r) {
      for (float a : RoleOf(layer, r).absmax())
        absmax[r] = std::max(absmax[r], a);
      values += RoleOf(layer, r).count();
    }
    absl::StrAppend(
        &out,
        absl::StrFormat("%5u  %-17s %-17s %-17s %9.4g %9.4g %9.4g %12u\n",
                        layer.layer(), Range(layer.q().scale()),
                        Range(layer.k().scale()), Range(layer.v().scale()),
                        absmax[0], absmax[1], absmax[2], values));
  }
  return out;
}

Json FinalizeJson(const v1::FinalizeResponse& response) {
  Json layers = Json::array();
  for (const v1::LayerScales& layer : response.layers()) {
    Json row = {{"layer", layer.layer()}};
    for (int r = 0; r < 3; ++r) {
      const v1::RoleScales& role = RoleOf(layer, r);
      row[std::string(1, "qkv"[r])] = {
          {"scale",
           std::vector<float>(role.scale().begin(), role.scale().end())},
          {"absmax",
           std::vector<float>(role.absmax().begin(), role.absmax().end())},
          {"count", role.count()},
          {"nonfinite", role.nonfinite()}};
    }
    layers.push_back(std::move(row));
  }
  return layers;
}

Json SessionJson(const v1::Session& s) {
  Json producers = Json::array();
  for (const v1::ProducerWatermark& p : s.producers()) {
    producers.push_back(
        {{"producer", p.producer_id()}, {"sequence", p.sequence()}});
  }
  return {{"session", s.session_id()},
          {"num_layers", s.num_layers()},
          {"num_attention_heads", s.num_attention_heads()},
          {"num_key_value_heads", s.num_key_value_heads()},
          {"head_dim", s.head_dim()},
          {"histogram_bins_per_octave", s.histogram_bins_per_octave()},
          {"backend", s.backend()},
          {"chunks_applied", s.chunks_applied()},
          {"values_ingested", s.values_ingested()},
          {"bytes_ingested", s.bytes_ingested()},
          {"nonfinite_values", s.nonfinite_values()},
          {"state_bytes", s.state_bytes()},
          {"producers", producers}};
}

}  // namespace kvcal
