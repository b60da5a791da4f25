// kvcal: the user's side of kvcal. Subcommands create, push, status,
// finalize, patch, inspect, calibrate, report and demo; see client/README.md.
// This file parses the command line and runs the chosen subcommand; the
// subcommands live in cmd_*.cc and demo.cc (client/cli/kvcal_cli.h).
#include <grpc/support/log.h>

#include <functional>
#include <iostream>
#include <optional>
#include <string>
#include <utility>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/strings/str_replace.h"
#include "client/cli/kvcal_cli.h"
#include "client/rpc/connection.h"
#include "util/cli.h"

namespace kvcal {
namespace {

using Json = nlohmann::ordered_json;

// gRPC's own log lines (handshake failures and the like) only with
// --verbose: without it, the error a command fails with says in one line
// what went wrong (CondenseConnectionError).
void QuietGrpcLog(gpr_log_func_args* /*args*/) {}

int Main(int argc, char** argv) {
  CLI::App app{
      "kvcal: calibrate FP8 KV-cache (and query) scales with kvcal "
      "workers and write them into Hugging Face checkpoints",
      "kvcal"};
  app.require_subcommand(1);
  // Before the subcommands, which inherit it: --verbose may come after the
  // subcommand's name too.
  app.fallthrough();
  Args a;
  app.add_flag("--verbose", a.verbose,
               "on failure, gRPC's full error and its log lines on stderr");
  cli::AddVersionFlag(app);
  using Run = std::function<absl::StatusOr<CommandResult>(Args&)>;
  const std::pair<CLI::App*, Run> commands[] = {
      {AddCreateCommand(app, a), RunCreate},
      {AddPushCommand(app, a), RunPush},
      {AddStatusCommand(app, a), RunStatus},
      {AddFinalizeCommand(app, a), RunFinalize},
      {AddPatchCommand(app, a), RunPatch},
      {AddInspectCommand(app, a), RunInspect},
      {AddCalibrateCommand(app, a), RunCalibrate},
      {AddReportCommand(app, a), RunReport},
      {AddDemoCommand(app, a),
       [](Args& args) {
         args.demo.json = args.json;
         return RunDemo(args.demo);
       }},
  };

  // A subcommand with a parse-complete callback reads the environment
  // (KVCAL_SERVER, KVCAL_AUTH_TOKEN_FILE) and checks it when it is the one
  // run; without one CLI11 reads it for every subcommand, so a bad
  // KVCAL_SERVER would fail `kvcal inspect`, which takes no --server.
  for (const auto& command : commands)
    command.first->parse_complete_callback([] {});
  // Usage errors: one line on stderr, exit 2 (client/README.md "Exit codes").
  if (std::optional<int> exit = cli::Parse(app, argc, argv)) return *exit;
  if (!a.verbose) gpr_set_log_function(QuietGrpcLog);
  for (const std::string& notice : a.notices) {
    std::cerr << "kvcal: " << notice << "\n";
  }
  CLI::App* chosen = app.get_subcommands().front();
  const std::string name = chosen->get_name();
  absl::StatusOr<CommandResult> result = absl::InternalError("no command ran");
  for (const auto& [sub, run] : commands) {
    if (sub == chosen) result = run(a);
  }
  if (!result.ok()) {
    std::string message = std::string(result.status().message());
    const absl::StatusCode code = result.status().code();
    if (!a.verbose && (code == absl::StatusCode::kUnavailable ||
                       code == absl::StatusCode::kDeadlineExceeded ||
                       code == absl::StatusCode::kUnknown)) {
      message = CondenseConnectionError(message);
    }
    message = absl::StrReplaceAll(message, {{"\n", " "}});
    std::cerr << "kvcal " << name << ": " << message << "\n";
    if (a.json) {
      std::cout << Json{{"ok", false},
                        {"code",
                         absl::StatusCodeToString(result.status().code())},
                        {"error", message}}
                       .dump(2)
                << "\n";
    }
    return cli::kExitFailure;
  }
  if (a.json) std::cout << result->json.dump(2) << "\n";
  return result->exit_code;
}

}  // namespace
}  // namespace kvcal

int main(int argc, char** argv) { return kvcal::Main(argc, argv); }
