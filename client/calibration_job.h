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
#ifndef KVCAL_CLIENT_CALIBRATION_JOB_H_
#define KVCAL_CLIENT_CALIBRATION_JOB_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/calibration_client.h"
#include "client/scales_file.h"
#include "nlohmann/json.hpp"

namespace kvcal {

absl::StatusOr<v1::Session> CreateSessionFromConfig(
    CalibrationClient& client, const std::string& config_path,
    const std::string& session_id, uint32_t bins_per_octave);

struct PushSummary {
  UploadResult upload;
  uint64_t files = 0;
  uint64_t tensors = 0;
  absl::Duration elapsed;
};

// Opens the dump (validated against the session's geometry) and uploads it,
// with a progress reporter on stderr when `progress`.
absl::StatusOr<PushSummary> PushDump(CalibrationClient& client,
                                     const std::string& session_id,
                                     const std::string& dump_dir,
                                     UploaderOptions options, bool progress);

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

// A per-layer table of scales (min..max over heads), absmax and counts.
std::string FinalizeTable(const v1::FinalizeResponse& response);
nlohmann::ordered_json FinalizeJson(const v1::FinalizeResponse& response);
nlohmann::ordered_json SessionJson(const v1::Session& session);

}  // namespace kvcal

#endif  // KVCAL_CLIENT_CALIBRATION_JOB_H_
