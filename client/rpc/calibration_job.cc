#include "client/rpc/calibration_job.h"

#include <algorithm>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/checkpoint/activation_dump.h"
#include "client/checkpoint/model_config.h"
#include "client/checkpoint/skip_layers.h"
#include "client/rpc/progress.h"
#include "kernels/scale_math.h"
#include "proto/names.h"
#include "proto/wire_geometry.h"
#include "util/file_io.h"
#include "util/status_macros.h"

namespace kvcal {
namespace {

using Json = nlohmann::ordered_json;

const v1::RoleScales& RoleOf(const v1::LayerScales& layer, int role) {
  return role == 0 ? layer.q() : role == 1 ? layer.k() : layer.v();
}

// Up to kListed heads, one per line, then how many more.
constexpr int kListed = 16;

// ": " and the lines, or "." when the worker did not say where (older
// workers).
std::string NonFiniteLines(
    const google::protobuf::RepeatedPtrField<v1::NonFiniteHead>& heads,
    uint64_t total_heads) {
  if (total_heads == 0) return ".\n";
  std::string out =
      absl::StrCat(", in ", total_heads, " (layer, role, head) triples:\n");
  int listed = 0;
  for (const v1::NonFiniteHead& h : heads) {
    if (listed == kListed) break;
    absl::StrAppend(&out, "  layer ", h.layer(), " ",
                    absl::AsciiStrToUpper(CanonicalName(h.role())), " head ",
                    h.head(), ": ", h.nan(), " NaN, ", h.inf(), " Inf\n");
    ++listed;
  }
  if (total_heads > static_cast<uint64_t>(listed)) {
    absl::StrAppend(&out, "  ... and ", total_heads - listed, " more heads\n");
  }
  return out;
}

std::string Range(const google::protobuf::RepeatedField<float>& values) {
  if (values.empty()) return "-";
  const auto [lo, hi] = std::minmax_element(values.begin(), values.end());
  if (values.size() == 1) return absl::StrFormat("%.4g", *lo);
  return absl::StrFormat("%.3g..%.3g", *lo, *hi);
}

}  // namespace

absl::StatusOr<v1::Session> CreateSessionFromConfig(
    CalibrationClient& client, const std::string& config_path,
    const std::string& session_id, uint32_t bins_per_octave,
    uint64_t holdout_budget_bytes, bool reject_non_finite) {
  KVCAL_ASSIGN_OR_RETURN(ModelGeometry g, ReadModelGeometry(config_path));
  v1::CreateSessionRequest request;
  request.set_session_id(session_id);
  request.set_num_layers(g.num_layers);
  request.set_num_attention_heads(g.num_attention_heads);
  request.set_num_key_value_heads(g.num_key_value_heads);
  request.set_head_dim(g.head_dim);
  request.set_histogram_bins_per_octave(bins_per_octave);
  request.set_holdout_budget_bytes(holdout_budget_bytes);
  request.set_reject_non_finite(reject_non_finite);
  return client.CreateSession(request);
}

absl::StatusOr<PushSummary> PushDump(CalibrationClient& client,
                                     const std::string& session_id,
                                     const std::string& dump_dir,
                                     UploaderOptions options, bool progress,
                                     uint64_t holdout_last_batches) {
  KVCAL_ASSIGN_OR_RETURN(v1::Session session, client.GetSession(session_id));
  // The session's geometry with its roles: a tensor of a role the session
  // does not collect is refused here, naming its file, before anything is
  // sent (the worker would refuse it only after the tensors before it).
  KVCAL_ASSIGN_OR_RETURN(const Geometry geometry, GeometryFromWire(session));
  KVCAL_ASSIGN_OR_RETURN(ActivationDump dump,
                         ActivationDump::Open(dump_dir, &geometry));
  PushSummary summary;
  if (holdout_last_batches > 0) {
    std::set<uint64_t> batches;
    for (const DumpTensor& t : dump.tensors()) batches.insert(t.batch);
    if (batches.size() <= holdout_last_batches) {
      return absl::InvalidArgumentError(
          absl::StrCat("--holdout-batches ", holdout_last_batches,
                       ": the dump in ", dump_dir, " has only ", batches.size(),
                       " batches; at least one must remain for calibration"));
    }
    auto it = batches.end();
    for (uint64_t i = 0; i < holdout_last_batches; ++i) {
      --it;
      options.holdout_batches.insert(*it);
    }
    summary.holdout_batches.assign(options.holdout_batches.begin(),
                                   options.holdout_batches.end());
  }
  std::vector<ChunkView> chunks;
  uint64_t total_chunks = 0;
  // With local statistics: the calibration batches each worker gets, which
  // become ceil(batches / N) messages per worker.
  std::vector<std::set<uint64_t>> local_batches(client.worker_count());
  for (const DumpTensor& t : dump.tensors()) {
    chunks.push_back(t.View());
    const bool holdout = options.holdout_batches.count(t.batch) > 0;
    if (options.local_statistics_batches > 0 && !holdout) {
      local_batches[client.WorkerFor(session_id, t.layer)].insert(t.batch);
      continue;
    }
    total_chunks +=
        SplitChunk(chunks.back(), options.max_chunk_bytes, holdout).size();
  }
  for (const std::set<uint64_t>& batches : local_batches) {
    const uint64_t n = options.local_statistics_batches;
    if (n > 0) total_chunks += (batches.size() + n - 1) / n;
  }
  if (!options.counters) options.counters = std::make_shared<UploadCounters>();
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
  // What the push leaves behind; its data is in, so a failure here only
  // costs the report.
  absl::StatusOr<v1::Session> after = client.GetSession(session_id);
  if (after.ok()) {
    summary.after = *std::move(after);
  } else {
    summary.after_error = std::string(after.status().message());
  }
  return summary;
}

absl::StatusOr<FinalizeSummary> FinalizeToFile(
    CalibrationClient& client, const v1::FinalizeRequest& request,
    const std::string& out_path) {
  FinalizeSummary summary;
  // A path that cannot be written is refused before the worker works.
  if (!out_path.empty()) KVCAL_RETURN_IF_ERROR(CheckOutputPath(out_path));
  KVCAL_ASSIGN_OR_RETURN(summary.response, client.Finalize(request));
  CalibratedScales& scales = summary.scales;
  // The worker echoes the request with its defaults resolved: the scales
  // file records what produced the scales without a copy of the defaults.
  if (!summary.response.has_resolved()) {
    return absl::FailedPreconditionError(
        "Finalize: the worker did not report the options it used "
        "(FinalizeResponse.resolved); upgrade the worker");
  }
  const v1::FinalizeRequest& used = summary.response.resolved();
  scales.granularity = used.granularity() == v1::GRANULARITY_PER_HEAD
                           ? Granularity::kPerHead
                           : Granularity::kPerTensor;
  const v1::Observer observer = used.observer();
  const v1::Format format = used.format();
  scales.observer = CanonicalName(observer);
  if (request.observer() == v1::OBSERVER_AUTO &&
      summary.response.has_evaluation()) {
    // What each layer's scales came from.
    Json chosen = Json::object();
    for (const v1::LayerEvaluation& l :
         summary.response.evaluation().layers()) {
      chosen[std::to_string(l.layer())] = CanonicalName(l.observer());
    }
    scales.metadata["auto_layer_observers"] = chosen.dump();
  }
  Json options = {{"averaging_constant", used.averaging_constant()},
                  {"percentile", used.percentile()},
                  {"margin", used.margin()},
                  {"mse_grid", used.mse_grid()},
                  {"mse_max_shrink", used.mse_max_shrink()},
                  {"mse_norm", used.mse_norm()},
                  {"mse_patience", used.mse_patience()},
                  {"q_per_kv_group", used.q_per_kv_group()},
                  {"allow_missing", used.allow_missing()}};
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
  scales.metadata["format"] = CanonicalName(format);
  scales.metadata["observer_options"] = options.dump();
  scales.metadata["session"] = request.session_id();
  scales.metadata["counts"] = counts.dump();
  scales.metadata["workers"] = std::to_string(client.worker_count());
  if (!out_path.empty()) {
    KVCAL_RETURN_IF_ERROR(WriteScalesFile(out_path, scales));
  }
  return summary;
}

std::string NonFiniteText(const PushSummary& push) {
  if (!push.after.has_value()) {
    return absl::StrCat(
        "warning: could not read the session's non-finite "
        "counts after the push: ",
        push.after_error, "\n");
  }
  const v1::Session& s = *push.after;
  if (s.nonfinite_values() == 0) return "";
  return absl::StrCat(
      "warning: session ", s.session_id(), " holds ", s.nonfinite_values(),
      " non-finite values (NaN or Inf; counted, left out of every "
      "statistic)",
      NonFiniteLines(s.nonfinite_heads(), s.nonfinite_heads_total()),
      "  (a session created with --reject-non-finite refuses such chunks)\n");
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
  uint64_t nonfinite = 0;
  for (const v1::LayerScales& layer : response.layers()) {
    for (int r = 0; r < 3; ++r) nonfinite += RoleOf(layer, r).nonfinite();
  }
  if (nonfinite > 0) {
    absl::StrAppend(
        &out, "warning: ", nonfinite,
        " non-finite values (NaN or Inf) were left out of these scales",
        NonFiniteLines(response.nonfinite_heads(),
                       response.nonfinite_heads_total()));
  }
  return out;
}

namespace {

double MaxOf(const google::protobuf::RepeatedField<double>& values) {
  double m = 0.0;
  for (double v : values) m = std::max(m, v);
  return m;
}

Json SharesJson(const v1::QuantizationShares& s) {
  return {{"saturated",
           std::vector<double>(s.saturated().begin(), s.saturated().end())},
          {"subnormal",
           std::vector<double>(s.subnormal().begin(), s.subnormal().end())},
          {"saturated_all", s.saturated_all()},
          {"subnormal_all", s.subnormal_all()}};
}

std::string ObserverLabel(v1::Observer o) { return CanonicalName(o); }

SkipLayerOutliers SkipOutliers(const v1::Evaluation& e) {
  std::vector<double> layer_error;
  for (const v1::LayerEvaluation& l : e.layers()) {
    layer_error.push_back(l.error());
  }
  return FindSkipLayerOutliers(layer_error);
}

// The skip-layer candidates (checkpoint/skip_layers.h), in one line.
std::string SkipLayersLine(const v1::Evaluation& e) {
  const SkipLayerOutliers skip = SkipOutliers(e);
  if (skip.layers.empty()) {
    return absl::StrFormat(
        "skip layers: none: no layer's error exceeds %gx the median layer's "
        "(%.3f%%)\n",
        kSkipMedianFactor, 100 * skip.median);
  }
  return absl::StrFormat(
      "skip layers: candidates %s (error above %gx the median layer's, "
      "%.3f%%); check that the held-out loss drops with them unquantized "
      "(kvcal-calibrate does) before serving with them\n",
      SkipLayersArgument(skip.layers), kSkipMedianFactor, 100 * skip.median);
}

}  // namespace

std::string EvaluationTable(const v1::FinalizeResponse& response) {
  if (!response.has_evaluation()) return "";
  const v1::Evaluation& e = response.evaluation();
  std::string out = absl::StrFormat(
      "FP8 attention error on %u held-out sequences (%u tokens) per layer%s: "
      "relative RMS error of the attention output, calibrated vs scale 1.0\n",
      e.sequences(), e.tokens(), e.kv_only() ? ", K/V only" : "");
  absl::StrAppend(
      &out,
      absl::StrFormat("%5s %9s %9s %9s %8s %8s %8s %8s %8s %8s  %s\n", "layer",
                      "error", "worst", "scale1.0", "q_sat", "k_sat", "v_sat",
                      "q_sub", "k_sub", "v_sub", "observer"));
  for (const v1::LayerEvaluation& l : e.layers()) {
    absl::StrAppend(
        &out,
        absl::StrFormat(
            "%5u %8.3f%% %8.3f%% %8.3f%% %7.3f%% %7.3f%% %7.3f%% %7.3f%% "
            "%7.3f%% %7.3f%%  %s/%s\n",
            l.layer(), 100 * l.error(), 100 * MaxOf(l.head_error()),
            100 * l.error_ones(), 100 * l.q().saturated_all(),
            100 * l.k().saturated_all(), 100 * l.v().saturated_all(),
            100 * l.q().subnormal_all(), 100 * l.k().subnormal_all(),
            100 * l.v().subnormal_all(), ObserverLabel(l.observer()),
            l.granularity() == v1::GRANULARITY_PER_HEAD ? "head" : "tensor"));
  }
  absl::StrAppend(
      &out, absl::StrFormat("  all %8.3f%% %9s %8.3f%%\n", 100 * e.error(), "",
                            100 * e.error_ones()));
  absl::StrAppend(&out, SkipLayersLine(e));
  if (response.candidates_size() > 0) {
    absl::StrAppend(&out, "auto candidates (error over all layers):\n");
    for (const v1::Evaluation& c : response.candidates()) {
      absl::StrAppend(
          &out,
          absl::StrFormat(
              "  %-18s %-6s %8.3f%%\n", ObserverLabel(c.observer()),
              c.granularity() == v1::GRANULARITY_PER_HEAD ? "head" : "tensor",
              100 * c.error()));
    }
  }
  return out;
}

Json EvaluationJson(const v1::Evaluation& e) {
  Json layers = Json::array();
  for (const v1::LayerEvaluation& l : e.layers()) {
    layers.push_back(
        {{"layer", l.layer()},
         {"error", l.error()},
         {"error_ones", l.error_ones()},
         {"head_error",
          std::vector<double>(l.head_error().begin(), l.head_error().end())},
         {"head_error_ones", std::vector<double>(l.head_error_ones().begin(),
                                                 l.head_error_ones().end())},
         {"q", SharesJson(l.q())},
         {"k", SharesJson(l.k())},
         {"v", SharesJson(l.v())},
         {"q_ones", SharesJson(l.q_ones())},
         {"k_ones", SharesJson(l.k_ones())},
         {"v_ones", SharesJson(l.v_ones())},
         {"observer", ObserverLabel(l.observer())},
         {"granularity",
          l.granularity() == v1::GRANULARITY_PER_HEAD ? "head" : "tensor"}});
  }
  return {{"observer", ObserverLabel(e.observer())},
          {"granularity",
           e.granularity() == v1::GRANULARITY_PER_HEAD ? "head" : "tensor"},
          {"kv_only", e.kv_only()},
          {"sequences", e.sequences()},
          {"tokens", e.tokens()},
          {"error", e.error()},
          {"error_ones", e.error_ones()},
          {"layers", std::move(layers)},
          {"skip_layer_candidates", SkipOutliers(e).layers}};
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

Json NonFiniteHeadsJson(
    const google::protobuf::RepeatedPtrField<v1::NonFiniteHead>& heads) {
  Json out = Json::array();
  for (const v1::NonFiniteHead& h : heads) {
    out.push_back({{"layer", h.layer()},
                   {"role", CanonicalName(h.role())},
                   {"head", h.head()},
                   {"nan", h.nan()},
                   {"inf", h.inf()}});
  }
  return out;
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
          {"nonfinite_heads", NonFiniteHeadsJson(s.nonfinite_heads())},
          {"nonfinite_heads_total", s.nonfinite_heads_total()},
          {"reject_non_finite", s.reject_non_finite()},
          {"state_bytes", s.state_bytes()},
          {"holdout_batches", s.holdout_batches()},
          {"holdout_chunks", s.holdout_chunks()},
          {"holdout_bytes", s.holdout_bytes()},
          {"holdout_budget_bytes", s.holdout_budget_bytes()},
          {"producers", producers}};
}

}  // namespace kvcal
