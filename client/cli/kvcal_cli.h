// Pieces of the `kvcal` command shared between its source files: the
// parsed command line (Args), the flags several subcommands take
// (options.cc), and each subcommand's Add*Command (its flags) and Run* (what
// it does), one source file per group of subcommands:
//   cmd_session.cc    create, push, status, finalize (a worker's session)
//   cmd_patch.cc      patch, inspect (a checkpoint on disk)
//   cmd_calibrate.cc  calibrate (create + push + finalize + patch + inspect)
//   cmd_report.cc     report
//   demo.cc           demo
// kvcal_main.cc parses the command line and runs the chosen subcommand.
#ifndef KVCAL_CLIENT_CLI_KVCAL_CLI_H_
#define KVCAL_CLIENT_CLI_KVCAL_CLI_H_

#include <cstdint>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "client/checkpoint/checkpoint_inspect.h"
#include "client/checkpoint/checkpoint_patcher.h"
#include "client/rpc/calibration_client.h"
#include "client/rpc/calibration_job.h"
#include "client/rpc/uploader.h"
#include "kvcal/v1/calibration.pb.h"
#include "nlohmann/json.hpp"
#include "util/cli.h"

namespace kvcal {

// What a subcommand produced: JSON for --json, and its exit status (inspect
// exits 1 when a check fails even though it ran).
struct CommandResult {
  nlohmann::ordered_json json;
  int exit_code = 0;
};

struct DemoArgs {
  std::string dir;     // empty: a new directory under /tmp
  std::string worker;  // empty: FindWorkerBinary()
  std::string backend = "auto";
  bool json = false;
};

absl::StatusOr<CommandResult> RunDemo(const DemoArgs& args);

struct ConnectionArgs {
  std::vector<std::string> servers;
  std::string auth_token_file;
  std::string tls_ca;
  std::string tls_cert;
  std::string tls_key;
};

// finalize's flags. The observer, granularity and format by name (what the
// user typed, parsed by MakeFinalizeRequest); every other knob is written
// straight into `request` as its flag is read: the FinalizeRequest message
// declares them and their defaults (0 = the worker's, ScaleOptions').
struct FinalizeArgs {
  std::string observer = "static-minmax";
  std::string granularity = "tensor";
  std::string format = "fp8-e4m3fn";
  v1::FinalizeRequest request;
};

struct Args {
  bool json = false;
  bool verbose = false;  // errors with gRPC's own words, and its log
  // "--server HOST has no port: using HOST:50051" lines, printed once the
  // command line parsed.
  std::vector<std::string> notices;
  ConnectionArgs connection;
  std::string config;
  std::string session;
  uint32_t histograms = 64;
  std::string producer = "default";
  std::string dump_dir;
  size_t chunk_bytes = UploaderOptions{}.max_chunk_bytes;
  size_t window = UploaderOptions{}.window;  // docs/producers.md
  bool resume = false;
  bool shm = false;
  // --local-statistics (0: off) / --flush-batches.
  bool local_statistics = false;
  uint64_t flush_batches = 0;
  uint64_t holdout_batches = 0;
  uint64_t holdout_budget_bytes = 0;
  bool reject_non_finite = false;
  FinalizeArgs finalize;
  std::string output;
  std::string checkpoint;
  std::string scales;
  std::string out_dir;
  std::string target = "compressed-tensors";
  // patch, calibrate: seconds to wait for the checkpoint's lock.
  double lock_timeout = 0;
  // kvcal inspect: the vLLM run to predict.
  std::string kv_cache_dtype = "auto";
  std::string platform = "cuda";
  // kvcal report: evaluation results (kvcal.torch.evaluate JSON files).
  std::vector<std::string> evaluations;
  // kvcal report: kvcal-calibrate's decision JSON (--decision).
  std::string decision;
  std::string report_format = "fp8-e4m3fn";
  DemoArgs demo;
};

// A named value (an observer, a format, a target, ...) checked when the
// command line is read, by the function that reads it later: a wrong name
// is a usage error (exit 2) before anything connects, with a guess among
// `names` ("a, b, c") for a typo.
template <typename Parse>
CLI::Validator Named(Parse parse, std::string names) {
  return CLI::Validator(
      [parse, names](std::string& value) -> std::string {
        const auto parsed = parse(value);
        if (parsed.ok()) return "";
        std::string message(parsed.status().message());
        const std::string guess =
            cli::Suggest(value, absl::StrSplit(names, ", ", absl::SkipEmpty()));
        if (!guess.empty())
          absl::StrAppend(&message, "; did you mean '", guess, "'?");
        return message;
      },
      "NAME");
}

inline const std::string kPatchTargets = "compressed-tensors, modelopt, quark";

// options.cc: flags several subcommands share, and what they turn into.
// --server, --auth-token-file and the TLS flags; `required` for the commands
// that always talk to a worker (report needs one only with --session).
void AddConnection(CLI::App* app, ConnectionArgs& c,
                   std::vector<std::string>* notices, bool required = true);
// The observer, granularity, format and the observers' options.
void AddFinalize(CLI::App* app, FinalizeArgs& f);
void AddJsonFlag(CLI::App* sub, Args& a);
void AddLockTimeout(CLI::App* sub, Args& a);
// --chunk-bytes: at most the largest message a worker accepts.
CLI::Validator ChunkBytes();
// --histograms: the worker's rule, 0 or a power of two up to 128.
CLI::Validator HistogramBins();
absl::StatusOr<CalibrationClient> Connect(const ConnectionArgs& c);
absl::StatusOr<v1::FinalizeRequest> MakeFinalizeRequest(
    const FinalizeArgs& f, const std::string& session);
UploaderOptions MakeUploaderOptions(const Args& a);
// push's and calibrate's --local-statistics and --flush-batches.
void AddLocalStatisticsFlags(CLI::App* sub, Args& a);
// `patch` and `calibrate`'s PatchOptions: --checkpoint, --out-dir,
// --lock-timeout and the parsed --target, with no callbacks and no lock.
PatchOptions MakePatchOptions(const Args& a, PatchTarget target,
                              std::string scales_path);

// cmd_session.cc
nlohmann::ordered_json PushJson(const PushSummary& p);
std::string PushText(const PushSummary& p);
CLI::App* AddCreateCommand(CLI::App& app, Args& a);
CLI::App* AddPushCommand(CLI::App& app, Args& a);
CLI::App* AddStatusCommand(CLI::App& app, Args& a);
CLI::App* AddFinalizeCommand(CLI::App& app, Args& a);
absl::StatusOr<CommandResult> RunCreate(const Args& a);
absl::StatusOr<CommandResult> RunPush(const Args& a);
absl::StatusOr<CommandResult> RunStatus(const Args& a);
absl::StatusOr<CommandResult> RunFinalize(const Args& a);

// cmd_patch.cc
nlohmann::ordered_json PatchJson(const PatchReport& r);
std::string PatchText(const PatchReport& r);
// A patch or an inspection with its progress on stderr, like push's; a run
// shorter than a second prints none.
absl::StatusOr<PatchReport> PatchWithProgress(PatchOptions options);
absl::StatusOr<InspectReport> InspectWithProgress(const std::string& dir,
                                                  const VllmLoadOptions& vllm);
// An inspection's findings on stdout, its errors on stderr (each line as
// "kvcal COMMAND: error: ...").
void PrintInspect(const InspectReport& report, absl::string_view command);
CLI::App* AddPatchCommand(CLI::App& app, Args& a);
CLI::App* AddInspectCommand(CLI::App& app, Args& a);
absl::StatusOr<CommandResult> RunPatch(const Args& a);
absl::StatusOr<CommandResult> RunInspect(const Args& a);

// cmd_calibrate.cc
CLI::App* AddCalibrateCommand(CLI::App& app, Args& a);
absl::StatusOr<CommandResult> RunCalibrate(Args a);

// cmd_report.cc
CLI::App* AddReportCommand(CLI::App& app, Args& a);
absl::StatusOr<CommandResult> RunReport(const Args& a);

// demo.cc
CLI::App* AddDemoCommand(CLI::App& app, Args& a);

}  // namespace kvcal

#endif  // KVCAL_CLIENT_CLI_KVCAL_CLI_H_
