// kvcal: the user's side of kvcal. Subcommands create, push, status,
// finalize, patch, inspect, calibrate, report and demo; see client/README.md.
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <grpc/support/log.h>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "client/checkpoint/checkpoint_inspect.h"
#include "client/checkpoint/checkpoint_lock.h"
#include "client/checkpoint/checkpoint_patcher.h"
#include "client/cli/kvcal_cli.h"
#include "client/report/report.h"
#include "client/rpc/calibration_client.h"
#include "client/rpc/calibration_job.h"
#include "client/rpc/connection.h"
#include "client/rpc/progress.h"
#include "kernels/scale_math.h"
#include "proto/names.h"
#include "util/cli.h"
#include "util/file_io.h"
#include "util/status_macros.h"

namespace kvcal {
namespace {

using Json = nlohmann::ordered_json;

struct ConnectionArgs {
  std::vector<std::string> servers;
  std::string auth_token_file;
  std::string tls_ca;
  std::string tls_cert;
  std::string tls_key;
};

struct FinalizeArgs {
  std::string observer = "static-minmax";
  std::string granularity = "tensor";
  std::string format = "fp8-e4m3fn";
  float averaging_constant = 0;
  double percentile = 0;
  float margin = 0;
  uint32_t mse_grid = 0;
  float mse_max_shrink = 0;
  float mse_norm = 0;
  uint32_t mse_patience = 0;
  bool q_per_kv_group = false;
  bool allow_missing = false;
  bool evaluate = false;
  bool evaluate_kv_only = false;
  bool auto_per_session = false;
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
  std::string report_format = "fp8-e4m3fn";
  DemoArgs demo;
};

absl::StatusOr<VllmLoadOptions> InspectOptions(const Args& a) {
  VllmLoadOptions options;
  KVCAL_ASSIGN_OR_RETURN(options.platform, ParseVllmPlatform(a.platform));
  options.kv_cache_dtype = a.kv_cache_dtype;
  return options;
}

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
        const std::string guess = cli::Suggest(
            value, absl::StrSplit(names, ", ", absl::SkipEmpty()));
        if (!guess.empty()) absl::StrAppend(&message, "; did you mean '", guess, "'?");
        return message;
      },
      "NAME");
}

const std::string kPatchTargets = "compressed-tensors, modelopt, quark";

// --server, --auth-token-file and the TLS flags; `required` for the commands
// that always talk to a worker (report needs one only with --session).
void AddConnection(CLI::App* app, ConnectionArgs& c,
                   std::vector<std::string>* notices, bool required = true) {
  CLI::Option* server =
      app->add_option("--server", c.servers,
                      "worker HOST[:PORT] (port 50051 when left out); "
                      "repeat or comma-separate for several, dns:///name:port "
                      "for every address of a name, file:PATH for a list "
                      "(layers are sharded by worker id)")
          ->envname("KVCAL_SERVER")
          ->delimiter(',')
          // One value per --server (repeat it, or comma-separate): without
          // this CLI11 reads "[::1]" as a list and drops the brackets.
          ->allow_extra_args(false)
          ->check(cli::ServerAddress(notices));
  if (required) server->required();
  app->add_option("--auth-token-file", c.auth_token_file,
                  "file holding the bearer token the workers expect")
      ->envname("KVCAL_AUTH_TOKEN_FILE");
  app->add_option("--tls-ca", c.tls_ca, "PEM CA bundle: connect with TLS");
  CLI::Option* cert = app->add_option("--tls-cert", c.tls_cert,
                                      "PEM client certificate (mutual TLS)");
  CLI::Option* key =
      app->add_option("--tls-key", c.tls_key, "PEM client key (mutual TLS)");
  cert->needs(key);
  key->needs(cert);
}

void AddFinalize(CLI::App* app, FinalizeArgs& f) {
  // Spellings from the one names table (proto/names.h): config.json's
  // "minmax", "static_minmax", "attn_head" are accepted as well.
  app->add_option("--observer", f.observer,
                  CliNames(v1::Observer_descriptor()) +
                      " (or the name config.json records); auto: every "
                      "observer, judged on the held-out batches")
      ->check(Named(ParseObserver, CliNames(v1::Observer_descriptor())))
      ->capture_default_str();
  app->add_flag("--evaluate", f.evaluate,
                "also measure the scales' FP8 attention error on the "
                "session's held-out batches (push --holdout-batches)");
  app->add_flag("--evaluate-kv-only", f.evaluate_kv_only,
                "evaluate with Q unquantized (FP8 KV cache, bf16 query)");
  app->add_flag("--auto-per-session", f.auto_per_session,
                "observer auto: one observer for every layer (default: the "
                "best per layer)");
  app->add_option("--granularity", f.granularity,
                  CliNames(v1::Granularity_descriptor()))
      ->check(Named(ParseGranularity, CliNames(v1::Granularity_descriptor())))
      ->capture_default_str();
  app->add_option("--format", f.format, CliNames(v1::Format_descriptor()))
      ->check(Named(ParseFormat, CliNames(v1::Format_descriptor())))
      ->capture_default_str();
  // 0 = the worker's default; the defaults live in ScaleOptions, the valid
  // ranges in ScaleOptions::Validate (kernels/scale_math.cc): checked here
  // too, so that a wrong value is a usage error before anything is sent.
  const ScaleOptions d;
  const auto worker_default = [](auto value) {
    return absl::StrCat("the worker's default, ", value);
  };
  constexpr double kInf = std::numeric_limits<double>::infinity();
  constexpr uint64_t kU32 = std::numeric_limits<uint32_t>::max();
  app->add_option(
         "--averaging-constant", f.averaging_constant,
         absl::StrCat("minmax-ema constant (0 = ", d.averaging_constant, ")"))
      ->check(cli::InRange(cli::RealRange{
          0, 1, true, false, worker_default(d.averaging_constant)}));
  app->add_option("--percentile", f.percentile,
                  absl::StrCat("percentile p (0 = ", d.percentile, ")"))
      ->check(cli::InRange(
          cli::RealRange{0, 100, true, false, worker_default(d.percentile)}));
  app->add_option("--margin", f.margin,
                  absl::StrCat("multiplies every range (0 = ", d.margin, ")"))
      ->check(cli::InRange(
          cli::RealRange{0, kInf, true, true, worker_default(d.margin)}));
  app->add_option("--mse-grid", f.mse_grid,
                  absl::StrCat("MSE grid (0 = ", d.mse_grid, ")"))
      ->check(cli::InRange(cli::IntRange{
          0, kU32, absl::StrCat("0 = ", worker_default(d.mse_grid))}));
  app->add_option("--mse-max-shrink", f.mse_max_shrink,
                  absl::StrCat("MSE max shrink (0 = ", d.mse_max_shrink, ")"))
      ->check(cli::InRange(
          cli::RealRange{0, 1, true, true, worker_default(d.mse_max_shrink)}));
  app->add_option("--mse-norm", f.mse_norm,
                  absl::StrCat("MSE error norm (0 = ", d.mse_norm, ")"))
      ->check(cli::InRange(
          cli::RealRange{0, kInf, true, true, worker_default(d.mse_norm)}));
  app->add_option("--mse-patience", f.mse_patience,
                  "accepted for llm-compressor compatibility; the MSE search "
                  "covers the whole grid")
      ->check(cli::InRange(cli::IntRange{
          0, kU32, absl::StrCat("0 = ", worker_default(d.mse_patience))}));
  app->add_flag("--q-per-kv-group", f.q_per_kv_group,
                "per head: reduce Q scales to one per KV group (max); not for "
                "vLLM 0.34 checkpoints, which reduce q themselves");
  app->add_flag(
      "--allow-missing", f.allow_missing,
      "roles with heads that saw no data get no scale instead of an error");
}

absl::StatusOr<CalibrationClient> Connect(const ConnectionArgs& c) {
  ConnectionOptions options;
  if (!c.auth_token_file.empty()) {
    absl::StatusOr<std::string> token = ReadTokenFile(c.auth_token_file);
    if (!token.ok()) {
      return absl::Status(token.status().code(),
                          absl::StrCat("--auth-token-file: ",
                                       token.status().message()));
    }
    options.auth_token = *std::move(token);
  }
  options.tls_ca_file = c.tls_ca;
  options.tls_cert_file = c.tls_cert;
  options.tls_key_file = c.tls_key;
  return CalibrationClient::Connect(c.servers, options);
}

absl::StatusOr<v1::FinalizeRequest> MakeFinalizeRequest(
    const FinalizeArgs& f, const std::string& session) {
  v1::FinalizeRequest r;
  r.set_session_id(session);
  KVCAL_ASSIGN_OR_RETURN(v1::Observer observer, ParseObserver(f.observer));
  KVCAL_ASSIGN_OR_RETURN(v1::Granularity granularity,
                         ParseGranularity(f.granularity));
  KVCAL_ASSIGN_OR_RETURN(v1::Format format, ParseFormat(f.format));
  r.set_observer(observer);
  r.set_granularity(granularity);
  r.set_format(format);
  r.set_averaging_constant(f.averaging_constant);
  r.set_percentile(f.percentile);
  r.set_margin(f.margin);
  r.set_mse_grid(f.mse_grid);
  r.set_mse_max_shrink(f.mse_max_shrink);
  r.set_mse_norm(f.mse_norm);
  r.set_mse_patience(f.mse_patience);
  r.set_q_per_kv_group(f.q_per_kv_group);
  r.set_allow_missing(f.allow_missing);
  r.set_evaluate(f.evaluate);
  r.set_evaluate_kv_only(f.evaluate_kv_only);
  r.set_auto_per_session(f.auto_per_session);
  return r;
}

UploaderOptions MakeUploaderOptions(const Args& a) {
  UploaderOptions o;
  o.producer_id = a.producer;
  o.max_chunk_bytes = a.chunk_bytes;
  o.window = a.window;
  o.resume = a.resume;
  o.shared_memory = a.shm;
  return o;
}

Json PushJson(const PushSummary& p) {
  const double seconds = absl::ToDoubleSeconds(p.elapsed);
  return {{"files", p.files},
          {"tensors", p.tensors},
          {"chunks", p.upload.chunks},
          {"holdout_batches", p.holdout_batches},
          {"chunks_skipped", p.upload.chunks_skipped},
          {"chunks_sent", p.upload.chunks_sent},
          {"chunks_applied", p.upload.chunks_applied},
          {"chunks_duplicate", p.upload.chunks_duplicate},
          {"bytes", p.upload.bytes},
          {"reconnects", p.upload.reconnects},
          {"shared_memory", p.upload.shared_memory},
          {"seconds", seconds},
          {"mib_per_second", seconds > 0 ? static_cast<double>(p.upload.bytes) /
                                               seconds / (1 << 20)
                                         : 0.0},
          {"nonfinite_values", p.after ? p.after->nonfinite_values() : 0},
          {"nonfinite_heads",
           p.after ? NonFiniteHeadsJson(p.after->nonfinite_heads())
                   : Json::array()}};
}

std::string PushText(const PushSummary& p) {
  const Json j = PushJson(p);
  return absl::StrFormat(
      "pushed %u chunks (%.1f MiB) from %u files in %.2fs (%.1f MiB/s); "
      "%u applied, %u duplicates, %u skipped, %u reconnects%s\n",
      p.upload.chunks, p.upload.bytes / 1048576.0, p.files,
      j["seconds"].get<double>(), j["mib_per_second"].get<double>(),
      p.upload.chunks_applied, p.upload.chunks_duplicate,
      p.upload.chunks_skipped, p.upload.reconnects,
      p.upload.shared_memory ? "; by shared memory" : "") + NonFiniteText(p);
}

Json PatchJson(const PatchReport& r) {
  return {{"output_dir", r.output_dir},
          {"sharded", r.sharded},
          {"files_written", r.files_written},
          {"scale_tensors", r.scale_tensors},
          {"replaced_tensors", r.replaced_tensors},
          {"tensors_verified", r.tensors_verified},
          {"bytes_verified", r.bytes_verified},
          {"recovered", r.recovered},
          {"warnings", r.warnings}};
}

std::string PatchText(const PatchReport& r) {
  std::string out;
  if (!r.recovered.empty()) absl::StrAppend(&out, r.recovered, "\n");
  absl::StrAppend(&out, "patched ", r.output_dir, ": ", r.scale_tensors,
                  " scale tensors (", r.replaced_tensors, " replaced); wrote ",
                  absl::StrJoin(r.files_written, ", "), "; verified ",
                  r.tensors_verified, " original tensors (", r.bytes_verified,
                  " bytes) byte for byte\n");
  for (const std::string& w : r.warnings) {
    absl::StrAppend(&out, "warning: ", w, "\n");
  }
  return out;
}

absl::StatusOr<CommandResult> RunCreate(const Args& a) {
  KVCAL_ASSIGN_OR_RETURN(CalibrationClient client, Connect(a.connection));
  KVCAL_ASSIGN_OR_RETURN(
      v1::Session s,
      CreateSessionFromConfig(client, a.config, a.session, a.histograms,
                              a.holdout_budget_bytes, a.reject_non_finite));
  if (!a.json) {
    std::cout << absl::StrFormat(
        "session %s: %u layers, %u query heads, %u KV heads, head_dim %u, "
        "%u bins/octave, on %u worker(s)%s\n",
        s.session_id(), s.num_layers(), s.num_attention_heads(),
        s.num_key_value_heads(), s.head_dim(), s.histogram_bins_per_octave(),
        client.worker_count(),
        s.reject_non_finite() ? "; chunks with NaN or Inf are refused" : "");
  }
  return CommandResult{SessionJson(s)};
}

absl::StatusOr<CommandResult> RunPush(const Args& a) {
  KVCAL_ASSIGN_OR_RETURN(CalibrationClient client, Connect(a.connection));
  KVCAL_ASSIGN_OR_RETURN(
      PushSummary p,
      PushDump(client, a.session, a.dump_dir, MakeUploaderOptions(a),
               /*progress=*/true, a.holdout_batches));
  if (!a.json) std::cout << PushText(p);
  return CommandResult{PushJson(p)};
}

absl::StatusOr<CommandResult> RunStatus(const Args& a) {
  KVCAL_ASSIGN_OR_RETURN(CalibrationClient client, Connect(a.connection));
  std::vector<v1::Session> sessions;
  if (a.session.empty()) {
    KVCAL_ASSIGN_OR_RETURN(sessions, client.ListSessions());
  } else {
    KVCAL_ASSIGN_OR_RETURN(v1::Session s, client.GetSession(a.session));
    sessions.push_back(std::move(s));
  }
  Json list = Json::array();
  for (const v1::Session& s : sessions) {
    list.push_back(SessionJson(s));
    if (a.json) continue;
    std::cout << absl::StrFormat(
        "%s: %u layers x %u/%u heads x %u, %u chunks, %u values (%.1f MiB), "
        "%u non-finite, backend %s\n",
        s.session_id(), s.num_layers(), s.num_attention_heads(),
        s.num_key_value_heads(), s.head_dim(), s.chunks_applied(),
        s.values_ingested(), s.bytes_ingested() / 1048576.0,
        s.nonfinite_values(), s.backend());
    for (const v1::ProducerWatermark& p : s.producers()) {
      std::cout << "  producer " << p.producer_id() << ": watermark "
                << p.sequence() << "\n";
    }
  }
  if (!a.json && sessions.empty()) std::cout << "no sessions\n";
  return CommandResult{a.session.empty() ? Json{{"sessions", list}} : list[0]};
}

absl::StatusOr<CommandResult> RunFinalize(const Args& a) {
  KVCAL_ASSIGN_OR_RETURN(CalibrationClient client, Connect(a.connection));
  KVCAL_ASSIGN_OR_RETURN(v1::FinalizeRequest request,
                         MakeFinalizeRequest(a.finalize, a.session));
  KVCAL_ASSIGN_OR_RETURN(FinalizeSummary f,
                         FinalizeToFile(client, request, a.output));
  if (!a.json) {
    std::cout << FinalizeTable(f.response) << EvaluationTable(f.response)
              << "wrote " << a.output << " (" << f.scales.observer << ", per "
              << a.finalize.granularity << ", " << f.scales.metadata["format"]
              << ")\n";
  }
  Json result{{"output", a.output},
              {"observer", f.scales.observer},
              {"granularity", a.finalize.granularity},
              {"layers", FinalizeJson(f.response)},
              {"nonfinite_heads", NonFiniteHeadsJson(f.response.nonfinite_heads())},
              {"nonfinite_heads_total", f.response.nonfinite_heads_total()}};
  if (f.response.has_evaluation()) {
    result["evaluation"] = EvaluationJson(f.response.evaluation());
    Json candidates = Json::array();
    for (const v1::Evaluation& c : f.response.candidates()) {
      candidates.push_back(EvaluationJson(c));
    }
    if (!candidates.empty()) result["candidates"] = std::move(candidates);
  }
  return CommandResult{std::move(result)};
}

// A patch or an inspection with its progress on stderr, like push's; a run
// shorter than a second prints none.
absl::StatusOr<PatchReport> PatchWithProgress(PatchOptions options) {
  if (!options.on_lock_wait) {
    options.on_lock_wait = [&](const std::string& holder) {
      std::cerr << "kvcal: waiting up to "
                << absl::FormatDuration(options.lock_timeout) << " for "
                << options.checkpoint_dir << ", locked by " << holder << "\n";
    };
  }
  auto counters = std::make_shared<ProgressCounters>();
  ProgressReporter progress(
      "patch", {.unit = "", .quiet_for = absl::Seconds(1)}, counters);
  options.on_progress = [&](uint64_t done, uint64_t total) {
    counters->total_bytes = total;
    counters->bytes = done;
  };
  absl::StatusOr<PatchReport> report = PatchCheckpoint(options);
  progress.Finish();
  return report;
}

absl::StatusOr<InspectReport> InspectWithProgress(const std::string& dir,
                                                  const VllmLoadOptions& vllm) {
  auto counters = std::make_shared<ProgressCounters>();
  ProgressReporter progress(
      "inspect", {.unit = "files", .quiet_for = absl::Seconds(1)}, counters);
  absl::StatusOr<InspectReport> report = InspectCheckpoint(
      dir, vllm, [&](uint64_t files, uint64_t total_files, uint64_t bytes) {
        counters->total_items = total_files;
        counters->items = files;
        counters->total_bytes = bytes;  // the total is known at the end only
        counters->bytes = bytes;
      });
  progress.Finish();
  return report;
}

// An inspection's findings on stdout, its errors on stderr (each line as
// "kvcal inspect: error: ...").
void PrintInspect(const InspectReport& report, absl::string_view command) {
  std::cout << report.FindingsText() << std::flush;
  for (absl::string_view line :
       absl::StrSplit(report.ErrorsText(), '\n', absl::SkipEmpty())) {
    std::cerr << "kvcal " << command << ": " << line << "\n";
  }
}

absl::StatusOr<CommandResult> RunPatch(const Args& a) {
  KVCAL_ASSIGN_OR_RETURN(PatchTarget target, ParsePatchTarget(a.target));
  PatchOptions options{.checkpoint_dir = a.checkpoint,
                       .scales_path = a.scales,
                       .out_dir = a.out_dir,
                       .target = target,
                       .on_step = {},
                       .on_progress = {},
                       .lock_timeout = absl::Seconds(a.lock_timeout),
                       .on_lock_wait = {},
                       .lock = nullptr};
  KVCAL_ASSIGN_OR_RETURN(PatchReport report, PatchWithProgress(options));
  if (!a.json) std::cout << PatchText(report);
  return CommandResult{PatchJson(report)};
}

absl::StatusOr<CommandResult> RunInspect(const Args& a) {
  KVCAL_ASSIGN_OR_RETURN(VllmLoadOptions options, InspectOptions(a));
  KVCAL_ASSIGN_OR_RETURN(InspectReport report,
                         InspectWithProgress(a.checkpoint, options));
  if (!a.json) PrintInspect(report, "inspect");
  return CommandResult{report.ToJson(), report.ok() ? 0 : 1};
}

absl::StatusOr<CommandResult> RunCalibrate(Args a) {
  if (a.resume && a.session.empty()) {
    return absl::InvalidArgumentError(
        "--resume needs --session: the id of the run to continue");
  }
  KVCAL_ASSIGN_OR_RETURN(PatchTarget target, ParsePatchTarget(a.target));
  if (!a.output.empty()) KVCAL_RETURN_IF_ERROR(CheckOutputPath(a.output));
  // One writer per checkpoint, from the first read of config.json to the
  // patch's last rename.
  PatchOptions patch{.checkpoint_dir = a.checkpoint,
                     .scales_path = "",
                     .out_dir = a.out_dir,
                     .target = target,
                     .on_step = {},
                     .on_progress = {},
                     .lock_timeout = absl::Seconds(a.lock_timeout),
                     .on_lock_wait = {},
                     .lock = nullptr};
  KVCAL_ASSIGN_OR_RETURN(CheckpointLock lock, LockCheckpointForPatch(patch));
  patch.lock = &lock;
  KVCAL_ASSIGN_OR_RETURN(CalibrationClient client, Connect(a.connection));
  if (a.config.empty()) a.config = a.checkpoint + "/config.json";
  KVCAL_ASSIGN_OR_RETURN(
      v1::Session s,
      CreateSessionFromConfig(client, a.config, a.session, a.histograms,
                              /*holdout_budget_bytes=*/0,
                              a.reject_non_finite));
  if (!a.json) std::cout << "session " << s.session_id() << "\n";
  KVCAL_ASSIGN_OR_RETURN(PushSummary p,
                         PushDump(client, s.session_id(), a.dump_dir,
                                  MakeUploaderOptions(a), /*progress=*/true));
  if (!a.json) std::cout << PushText(p);
  KVCAL_ASSIGN_OR_RETURN(v1::FinalizeRequest request,
                         MakeFinalizeRequest(a.finalize, s.session_id()));
  if (a.output.empty())
    a.output = "kvcal-scales-" + s.session_id() + ".safetensors";
  KVCAL_ASSIGN_OR_RETURN(FinalizeSummary f,
                         FinalizeToFile(client, request, a.output));
  if (!a.json)
    std::cout << FinalizeTable(f.response) << "wrote " << a.output << "\n";
  patch.scales_path = a.output;
  KVCAL_ASSIGN_OR_RETURN(PatchReport report, PatchWithProgress(patch));
  if (!a.json) std::cout << PatchText(report);
  // A Quark model needs --kv-cache-dtype fp8 (the patch says so); predict
  // that run.
  VllmLoadOptions vllm;
  if (target == PatchTarget::kQuark) vllm.kv_cache_dtype = "fp8";
  KVCAL_ASSIGN_OR_RETURN(InspectReport inspect,
                         InspectWithProgress(report.output_dir, vllm));
  if (!a.json) PrintInspect(inspect, "calibrate");
  return CommandResult{Json{{"session", SessionJson(s)},
                            {"push", PushJson(p)},
                            {"scales", a.output},
                            {"layers", FinalizeJson(f.response)},
                            {"patch", PatchJson(report)},
                            {"inspect", inspect.ToJson()}},
                       inspect.ok() ? 0 : 1};
}

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
  for (const std::string& input : inputs) {
    if (SameFile(input, a.output)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "-o ", a.output, " is the input ", input,
          ", which the report would replace; write the report elsewhere"));
    }
  }
  KVCAL_ASSIGN_OR_RETURN(v1::Format format, ParseFormat(a.report_format));
  in.format = static_cast<Format>(format);
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
    std::ifstream f(path);
    if (!f) {
      return absl::NotFoundError(
          absl::StrCat("evaluation ", path, ": cannot open it"));
    }
    std::stringstream text;
    text << f.rdbuf();
    nlohmann::json j = nlohmann::json::parse(text.str(), nullptr,
                                             /*allow_exceptions=*/false);
    if (j.is_discarded()) {
      return absl::InvalidArgumentError(
          absl::StrCat("evaluation ", path, ": not valid JSON"));
    }
    in.evaluations.push_back({path, std::move(j)});
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

// The numeric flags' valid values (docs/producers.md has the defaults).
// A chunk is at most the largest message a worker accepts
// (--max-message-bytes, at most 1 GiB); below one row, every row is a chunk.
CLI::Validator ChunkBytes() {
  return cli::InRange(cli::IntRange{1, 1 << 30, ""});
}
// Chunks in flight per worker; with --shm also the shared-memory ring's
// slots.
const cli::IntRange kWindowRange{1, 1024, ""};
// The worker's rule (kernels/types.cc): 0 or a power of two up to 128.
CLI::Validator HistogramBins() {
  return cli::ZeroOrPowerOfTwo(128, "no histograms");
}

void AddJsonFlag(CLI::App* sub, Args& a) {
  sub->add_flag("--json", a.json, "machine-readable output on stdout");
}

void AddLockTimeout(CLI::App* sub, Args& a) {
  sub->add_option("--lock-timeout", a.lock_timeout,
                  "seconds to wait while another kvcal process writes the "
                  "checkpoint (0: refuse at once, naming it; at most a week)")
      ->check(cli::InRange(cli::RealRange{0, 604800, false, false, ""}))
      ->capture_default_str();
}

CLI::App* AddCreateCommand(CLI::App& app, Args& a) {
  CLI::App* sub = app.add_subcommand(
      "create",
      "create a session with the geometry of a Hugging Face config.json");
  AddConnection(sub, a.connection, &a.notices);
  sub->add_option("--config", a.config, "MODEL_DIR/config.json")->required();
  sub->add_option("--session", a.session,
                  "session id (default: the worker picks)");
  sub->add_option("--histograms", a.histograms,
                  "histogram bins per octave (power of two 1..128; 0 = none)")
      ->check(HistogramBins())
      ->capture_default_str();
  sub->add_option("--holdout-budget-bytes", a.holdout_budget_bytes,
                  "bytes of held-out batches the worker keeps for "
                  "finalize --evaluate (0 = its default, 64 MiB)")
      ->check(cli::InRange(cli::IntRange{
          0, std::numeric_limits<uint64_t>::max(), "0 = the worker's default"}));
  sub->add_flag("--reject-non-finite", a.reject_non_finite,
                "the workers refuse any chunk holding NaN or Inf "
                "(INVALID_ARGUMENT naming the tensor; nothing of it is "
                "applied) instead of counting such values and leaving them "
                "out of the statistics (the default)");
  AddJsonFlag(sub, a);
  return sub;
}

CLI::App* AddPushCommand(CLI::App& app, Args& a) {
  CLI::App* sub = app.add_subcommand(
      "push", "stream an activation dump directory into a session");
  AddConnection(sub, a.connection, &a.notices);
  sub->add_option("--session", a.session, "session id")->required();
  sub->add_option("--producer", a.producer,
                  "producer name (one per data-parallel rank)")
      ->capture_default_str();
  sub->add_option("--chunk-bytes", a.chunk_bytes,
                  "split tensors into chunks of at most this many bytes")
      ->check(ChunkBytes())
      ->capture_default_str();
  sub->add_option("--window", a.window, "chunks in flight per worker")
      ->check(cli::InRange(kWindowRange))
      ->capture_default_str();
  sub->add_flag("--resume", a.resume,
                "continue an interrupted push of the same dump: skip what the "
                "worker already applied");
  sub->add_flag("--shm", a.shm,
                "same-host shared memory: send chunks as references into a "
                "shared-memory ring the worker maps (in-band when the worker "
                "is on another host; docs/shared_memory.md)");
  sub->add_option("--holdout-batches", a.holdout_batches,
                  "send the last N batches of the dump as held out: the "
                  "worker keeps them for `finalize --evaluate` and "
                  "`--observer auto` instead of calibrating on them")
      ->check(cli::InRange(
          cli::IntRange{0, std::numeric_limits<uint64_t>::max(), ""}))
      ->capture_default_str();
  sub->add_option("DUMP_DIR", a.dump_dir, "directory of *.safetensors dumps")
      ->required();
  AddJsonFlag(sub, a);
  return sub;
}

CLI::App* AddStatusCommand(CLI::App& app, Args& a) {
  CLI::App* sub =
      app.add_subcommand("status", "show sessions and their counters");
  AddConnection(sub, a.connection, &a.notices);
  sub->add_option("--session", a.session, "one session (default: all)");
  AddJsonFlag(sub, a);
  return sub;
}

CLI::App* AddFinalizeCommand(CLI::App& app, Args& a) {
  CLI::App* sub = app.add_subcommand(
      "finalize", "compute scales and write them to a scales file");
  AddConnection(sub, a.connection, &a.notices);
  sub->add_option("--session", a.session, "session id")->required();
  AddFinalize(sub, a.finalize);
  sub->add_option("-o,--output", a.output, "scales.safetensors to write")
      ->required();
  AddJsonFlag(sub, a);
  return sub;
}

CLI::App* AddPatchCommand(CLI::App& app, Args& a) {
  CLI::App* sub = app.add_subcommand(
      "patch", "write a scales file into a checkpoint so vLLM loads it");
  sub->add_option("--checkpoint", a.checkpoint, "MODEL_DIR")->required();
  sub->add_option("--scales", a.scales, "scales.safetensors from finalize")
      ->required();
  sub->add_option(
      "--out", a.out_dir,
      "write a patched copy here (default: patch in place, crash-safe)");
  sub->add_option("--target", a.target, "compressed-tensors|modelopt|quark")
      ->check(Named(ParsePatchTarget, kPatchTargets))
      ->capture_default_str();
  AddLockTimeout(sub, a);
  AddJsonFlag(sub, a);
  return sub;
}

CLI::App* AddInspectCommand(CLI::App& app, Args& a) {
  CLI::App* sub = app.add_subcommand(
      "inspect",
      "check a checkpoint's KV-cache scales the way vLLM reads them");
  sub->add_option("MODEL_DIR", a.checkpoint, "checkpoint directory")
      ->required();
  sub->add_option("--kv-cache-dtype", a.kv_cache_dtype,
                  "the --kv-cache-dtype vLLM will run with (auto, fp8, ...)")
      ->capture_default_str();
  sub->add_option("--platform", a.platform,
                  "cuda, or rocm (fp8 e4m3fnuz hardware such as MI300)")
      ->check(Named(ParseVllmPlatform, "cuda, rocm"))
      ->capture_default_str();
  AddJsonFlag(sub, a);
  return sub;
}

CLI::App* AddCalibrateCommand(CLI::App& app, Args& a) {
  CLI::App* sub = app.add_subcommand(
      "calibrate", "create, push, finalize and patch in one go");
  AddConnection(sub, a.connection, &a.notices);
  sub->add_option("--checkpoint", a.checkpoint, "MODEL_DIR to patch")
      ->required();
  sub->add_option("--config", a.config,
                  "config.json (default: MODEL_DIR/config.json)");
  sub->add_option("--session", a.session,
                  "session id (default: the worker picks)");
  sub->add_option("--histograms", a.histograms,
                  "bins per octave (power of two 1..128; 0 = none)")
      ->check(HistogramBins())
      ->capture_default_str();
  sub->add_option("--producer", a.producer, "producer name")
      ->capture_default_str();
  sub->add_option("--chunk-bytes", a.chunk_bytes, "chunk size limit")
      ->check(ChunkBytes())
      ->capture_default_str();
  sub->add_flag("--shm", a.shm,
                "same-host shared memory for the push (see push --shm)");
  sub->add_flag("--resume", a.resume,
                "continue an interrupted run of the same --session and dump: "
                "the session is reused and the push skips what the workers "
                "already applied (see push --resume)");
  sub->add_flag("--reject-non-finite", a.reject_non_finite,
                "refuse chunks holding NaN or Inf (see create)");
  AddFinalize(sub, a.finalize);
  sub->add_option("-o,--output", a.output,
                  "scales file (default: ./kvcal-scales-SESSION.safetensors)");
  sub->add_option("--out", a.out_dir, "write a patched copy here");
  sub->add_option("--target", a.target, "compressed-tensors|modelopt|quark")
      ->check(Named(ParsePatchTarget, kPatchTargets))
      ->capture_default_str();
  AddLockTimeout(sub, a);
  sub->add_option("DUMP_DIR", a.dump_dir, "directory of *.safetensors dumps")
      ->required();
  AddJsonFlag(sub, a);
  return sub;
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
  sub->add_option("--format", a.report_format,
                  "fp8-e4m3fn|fp8-e4m3fnuz|fp8-e5m2|int8")
      ->check(Named(ParseFormat, CliNames(v1::Format_descriptor())))
      ->capture_default_str();
  sub->add_option("-o,--output", a.output, "report.html to write")->required();
  AddJsonFlag(sub, a);
  return sub;
}

CLI::App* AddDemoCommand(CLI::App& app, Args& a) {
  CLI::App* sub = app.add_subcommand(
      "demo", "start a local worker, calibrate a generated model end to end");
  sub->add_option("--dir", a.demo.dir,
                  "where to write (default: a new /tmp dir)");
  sub->add_option("--worker", a.demo.worker,
                  "kvcal-worker binary (default: next to kvcal, then PATH)");
  sub->add_option("--backend", a.demo.backend, "worker backend: auto|cpu|cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  AddJsonFlag(sub, a);
  return sub;
}

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
  for (const auto& command : commands) command.first->parse_complete_callback([] {});
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
