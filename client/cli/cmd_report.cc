// `kvcal report`: the page of client/report/ from a live session (its
// statistics exported from every worker that holds a part) and/or a scales
// file, with evaluation results.
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/cli/kvcal_cli.h"
#include "client/report/report.h"
#include "client/rpc/calibration_client.h"
#include "client/rpc/connection.h"
#include "proto/names.h"
#include "proto/wire_enums.h"
#include "util/file_io.h"
#include "util/grpc_status.h"
#include "util/status_macros.h"

namespace kvcal {
namespace {

using Json = nlohmann::ordered_json;

// The session's statistics merged over every worker that holds a part.
absl::StatusOr<SessionStatistics> ExportStatistics(CalibrationClient& client,
                                                   const std::string& session) {
  std::optional<SessionStatistics> merged;
  for (size_t i = 0; i < client.worker_count(); ++i) {
    grpc::ClientContext context;
    PrepareContext(context, client.connection(), absl::Seconds(300));
    v1::ExportStateRequest request;
    request.set_session_id(session);
    v1::SessionState state;
    const grpc::Status status =
        client.stub(i).ExportState(&context, request, &state);
    if (!status.ok()) {
      return ToAbslStatus(status,
                          absl::StrCat("ExportState on ", client.endpoint(i)));
    }
    absl::StatusOr<SessionStatistics> stats =
        SessionStatistics::Deserialize(state.statistics());
    if (!stats.ok()) {
      return absl::DataLossError(absl::StrCat(
          "session ", session, " on ", client.endpoint(i),
          ": its statistics do not decode: ", stats.status().message()));
    }
    if (!merged) {
      merged = std::move(*stats);
    } else {
      KVCAL_RETURN_IF_ERROR(merged->Merge(*stats));
    }
  }
  return std::move(*merged);
}

// The JSON document in `path`; NotFound / InvalidArgument naming `what`.
absl::StatusOr<nlohmann::json> ReadJson(const std::string& path,
                                        const std::string& what) {
  std::ifstream f(path);
  if (!f) return absl::NotFoundError(absl::StrCat(what, ": cannot open it"));
  std::stringstream text;
  text << f.rdbuf();
  nlohmann::json j = nlohmann::json::parse(text.str(), nullptr,
                                           /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": not valid JSON"));
  }
  return j;
}

}  // namespace

absl::StatusOr<CommandResult> RunReport(const Args& a) {
  ReportInputs in;
  if (a.session.empty() && a.scales.empty()) {
    return absl::InvalidArgumentError(
        "give a session (--server and --session) or a scales file "
        "(--scales)");
  }
  KVCAL_RETURN_IF_ERROR(CheckOutputPath(a.output));
  std::vector<std::string> inputs = a.evaluations;
  if (!a.scales.empty()) inputs.push_back(a.scales);
  if (!a.decision.empty()) inputs.push_back(a.decision);
  for (const std::string& input : inputs) {
    if (SameFile(input, a.output)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "-o ", a.output, " is the input ", input,
          ", which the report would replace; write the report elsewhere"));
    }
  }
  KVCAL_ASSIGN_OR_RETURN(v1::Format format, ParseFormat(a.report_format));
  in.format = FromWire(format);
  std::vector<std::string> sources;
  if (!a.session.empty()) {
    if (a.connection.servers.empty()) {
      return absl::InvalidArgumentError("--session needs --server");
    }
    KVCAL_ASSIGN_OR_RETURN(CalibrationClient client, Connect(a.connection));
    KVCAL_ASSIGN_OR_RETURN(in.statistics, ExportStatistics(client, a.session));
    sources.push_back(absl::StrCat("session ", a.session, " on ",
                                   absl::StrJoin(a.connection.servers, ",")));
  }
  if (!a.scales.empty()) {
    KVCAL_ASSIGN_OR_RETURN(in.scales, ReadScalesFile(a.scales));
    sources.push_back(absl::StrCat("scales file ", a.scales));
  }
  in.source = absl::StrJoin(sources, "; ");
  for (const std::string& path : a.evaluations) {
    KVCAL_ASSIGN_OR_RETURN(nlohmann::json j,
                           ReadJson(path, absl::StrCat("evaluation ", path)));
    in.evaluations.push_back({path, std::move(j)});
  }
  if (!a.decision.empty()) {
    KVCAL_ASSIGN_OR_RETURN(
        in.decision,
        ReadJson(a.decision, absl::StrCat("--decision ", a.decision)));
    if (!in.decision->is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--decision ", a.decision, ": not a JSON object"));
    }
  }
  KVCAL_ASSIGN_OR_RETURN(Report report, BuildReport(in));
  KVCAL_RETURN_IF_ERROR(WriteOutputFile(a.output, report.html));
  const Json& rec = report.summary["recommendation"];
  if (!a.json) {
    std::cout << "recommendation: " << rec["observer"].get<std::string>()
              << " per " << rec["granularity"].get<std::string>()
              << (rec["quantize"] == "k_v" ? ", K and V" : ", Q, K and V")
              << ", margin " << rec["margin"].get<double>() << "\n  "
              << rec["reason"].get<std::string>() << "\nwrote " << a.output
              << " (" << report.summary["figures"].size() << " figures)\n";
  }
  Json out = report.summary;
  out["output"] = a.output;
  return CommandResult{out};
}

CLI::App* AddReportCommand(CLI::App& app, Args& a) {
  CLI::App* sub = app.add_subcommand(
      "report",
      "write a self-contained HTML report: scales, histograms with each "
      "observer's clip point, estimated errors, evaluation results and a "
      "recommendation");
  AddConnection(sub, a.connection, &a.notices, /*required=*/false);
  sub->add_option("--session", a.session,
                  "a live session: its statistics (histograms, maxima)")
      ->needs("--server");
  sub->add_option("--scales", a.scales,
                  "a scales file from finalize (without a session: the "
                  "scales only)");
  sub->add_option("--eval", a.evaluations,
                  "kvcal.torch.evaluate results (Evaluation.to_json); "
                  "repeat for several");
  sub->add_option("--decision", a.decision,
                  "kvcal-calibrate's decision JSON: the page shows it as the "
                  "recommendation (no rule of the report's own)");
  sub->add_option("--format", a.report_format,
                  "fp8-e4m3fn|fp8-e4m3fnuz|fp8-e5m2|int8")
      ->check(Named(ParseFormat, CliNames(v1::Format_descriptor())))
      ->capture_default_str();
  sub->add_option("-o,--output", a.output, "report.html to write")->required();
  AddJsonFlag(sub, a);
  return sub;
}

}  // namespace kvcal
