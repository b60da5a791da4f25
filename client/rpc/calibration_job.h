// The steps of a calibration job, shared by the `kvcal` subcommands, `kvcal
// calibrate` and `kvcal demo`: create a session from a config.json, push a
// dump directory, finalize into a scales file.
//
//   KVCAL_ASSIGN_OR_RETURN(auto session,
//       kvcal::CreateSessionFromConfig(client, "model/config.json", "", 64));
//   KVCAL_ASSIGN_OR_RETURN(auto pushed,
//       kvcal::PushDump(client, session.session_id(), "dumps", options, true));
//   KVCAL_ASSIGN_OR_RETURN(auto finalized,
//       kvcal::FinalizeToFile(client, request, "scales.safetensors"));
#ifndef KVCAL_CLIENT_RPC_CALIBRATION_JOB_H_
#define KVCAL_CLIENT_RPC_CALIBRATION_JOB_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/checkpoint/scales_file.h"
#include "client/rpc/calibration_client.h"
#include "nlohmann/json.hpp"

namespace kvcal {

// `holdout_budget_bytes`: held-out data the worker may keep (0 = its
// default, 64 MiB). `reject_non_finite`: the workers refuse chunks holding
// NaN or Inf (CreateSessionRequest.reject_non_finite) instead of counting
// them.
absl::StatusOr<v1::Session> CreateSessionFromConfig(
    CalibrationClient& client, const std::string& config_path,
    const std::string& session_id, uint32_t bins_per_octave,
    uint64_t holdout_budget_bytes = 0, bool reject_non_finite = false);

struct PushSummary {
  UploadResult upload;
  uint64_t files = 0;
  uint64_t tensors = 0;
  // Batches sent as held out.
  std::vector<uint64_t> holdout_batches;
  absl::Duration elapsed;
  // The session after the push (GetSession): its non-finite values and where
  // they are. Empty when that call failed (then `after_error` says why).
  std::optional<v1::Session> after;
  std::string after_error;
};

// Lines naming the non-finite values a session holds: "" when it holds none.
// For push's text output.
std::string NonFiniteText(const PushSummary& push);

// Opens the dump (validated against the session's geometry) and uploads it,
// with a progress reporter on stderr when `progress`. The last
// `holdout_last_batches` batch numbers of the dump (by value) are sent as
// held out (UploaderOptions::holdout_batches); InvalidArgument when the dump
// has no more batches than that (nothing would be left to calibrate on).
absl::StatusOr<PushSummary> PushDump(CalibrationClient& client,
                                     const std::string& session_id,
                                     const std::string& dump_dir,
                                     UploaderOptions options, bool progress,
                                     uint64_t holdout_last_batches = 0);

struct FinalizeSummary {
  v1::FinalizeResponse response;
  CalibratedScales scales;
};

// Finalizes and, when `out_path` is not empty, writes the scales file. The
// scales' __metadata__ records observer, options, granularity, format,
// session and per-layer counts.
absl::StatusOr<FinalizeSummary> FinalizeToFile(
    CalibrationClient& client, const v1::FinalizeRequest& request,
    const std::string& out_path);

// A per-layer table of scales (min..max over heads), absmax and counts,
// then the (layer, role, head) triples with non-finite values, if any.
std::string FinalizeTable(const v1::FinalizeResponse& response);
nlohmann::ordered_json FinalizeJson(const v1::FinalizeResponse& response);
// The evaluation (evaluate / observer auto) as a per-layer table: error,
// worst head, scale-1.0 error, saturated and subnormal shares per role, and
// auto's candidates; "" without an evaluation.
std::string EvaluationTable(const v1::FinalizeResponse& response);
nlohmann::ordered_json EvaluationJson(const v1::Evaluation& evaluation);
nlohmann::ordered_json SessionJson(const v1::Session& session);
// [{"layer", "role" ("q", "k", "v"), "head", "nan", "inf"}, ...]
nlohmann::ordered_json NonFiniteHeadsJson(
    const google::protobuf::RepeatedPtrField<v1::NonFiniteHead>& heads);

}  // namespace kvcal

#endif  // KVCAL_CLIENT_RPC_CALIBRATION_JOB_H_
