// The flags several `kvcal` subcommands share (the connection, finalize's
// options, --json, --lock-timeout, the numeric ranges) and the requests and
// options they turn into.
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/cli/kvcal_cli.h"
#include "client/rpc/connection.h"
#include "client/rpc/local_partials.h"
#include "kernels/scale_math.h"
#include "proto/names.h"
#include "util/cli.h"
#include "util/status_macros.h"

namespace kvcal {

void AddConnection(CLI::App* app, ConnectionArgs& c,
                   std::vector<std::string>* notices, bool required) {
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

namespace {

// --NAME VALUE, written into `r` by `set` (one of its setters) when read.
template <typename T>
CLI::Option* AddRequestOption(CLI::App* app, const std::string& name,
                              v1::FinalizeRequest& r,
                              void (v1::FinalizeRequest::*set)(T),
                              std::string help) {
  return app->add_option_function<T>(
      name, [&r, set](const T& value) { (r.*set)(value); }, std::move(help));
}

// --NAME, setting `set` (a bool field of `r`) when given.
void AddRequestFlag(CLI::App* app, const std::string& name,
                    v1::FinalizeRequest& r,
                    void (v1::FinalizeRequest::*set)(bool), std::string help) {
  app->add_flag_function(
      name, [&r, set](int64_t count) { (r.*set)(count > 0); }, std::move(help));
}

// The observers' numeric options. 0 = the worker's default; the defaults
// live in ScaleOptions, the valid ranges in ScaleOptions::Validate
// (kernels/scale_math.cc): checked here too, so that a wrong value is a usage
// error before anything is sent.
void AddObserverNumbers(CLI::App* app, v1::FinalizeRequest& r) {
  using R = v1::FinalizeRequest;
  const ScaleOptions d;
  const auto worker_default = [](auto value) {
    return absl::StrCat("the worker's default, ", value);
  };
  constexpr double kInf = std::numeric_limits<double>::infinity();
  constexpr uint64_t kU32 = std::numeric_limits<uint32_t>::max();
  AddRequestOption(
      app, "--averaging-constant", r, &R::set_averaging_constant,
      absl::StrCat("minmax-ema constant (0 = ", d.averaging_constant, ")"))
      ->check(cli::InRange(cli::RealRange{
          0, 1, true, false, worker_default(d.averaging_constant)}));
  AddRequestOption(app, "--percentile", r, &R::set_percentile,
                   absl::StrCat("percentile p (0 = ", d.percentile, ")"))
      ->check(cli::InRange(
          cli::RealRange{0, 100, true, false, worker_default(d.percentile)}));
  AddRequestOption(app, "--margin", r, &R::set_margin,
                   absl::StrCat("multiplies every range (0 = ", d.margin, ")"))
      ->check(cli::InRange(
          cli::RealRange{0, kInf, true, true, worker_default(d.margin)}));
  AddRequestOption(app, "--mse-grid", r, &R::set_mse_grid,
                   absl::StrCat("MSE grid (0 = ", d.mse_grid, ")"))
      ->check(cli::InRange(cli::IntRange{
          0, kU32, absl::StrCat("0 = ", worker_default(d.mse_grid))}));
  AddRequestOption(app, "--mse-max-shrink", r, &R::set_mse_max_shrink,
                   absl::StrCat("MSE max shrink (0 = ", d.mse_max_shrink, ")"))
      ->check(cli::InRange(
          cli::RealRange{0, 1, true, true, worker_default(d.mse_max_shrink)}));
  AddRequestOption(app, "--mse-norm", r, &R::set_mse_norm,
                   absl::StrCat("MSE error norm (0 = ", d.mse_norm, ")"))
      ->check(cli::InRange(
          cli::RealRange{0, kInf, true, true, worker_default(d.mse_norm)}));
  AddRequestOption(app, "--mse-patience", r, &R::set_mse_patience,
                   "accepted for llm-compressor compatibility; the MSE search "
                   "covers the whole grid")
      ->check(cli::InRange(cli::IntRange{
          0, kU32, absl::StrCat("0 = ", worker_default(d.mse_patience))}));
}

}  // namespace

void AddFinalize(CLI::App* app, FinalizeArgs& f) {
  using R = v1::FinalizeRequest;
  // Spellings from the one names table (proto/names.h): config.json's
  // "minmax", "static_minmax", "attn_head" are accepted as well.
  app->add_option("--observer", f.observer,
                  CliNames(v1::Observer_descriptor()) +
                      " (or the name config.json records); auto: every "
                      "observer, judged on the held-out batches")
      ->check(Named(ParseObserver, CliNames(v1::Observer_descriptor())))
      ->capture_default_str();
  AddRequestFlag(app, "--evaluate", f.request, &R::set_evaluate,
                 "also measure the scales' FP8 attention error on the "
                 "session's held-out batches (push --holdout-batches)");
  AddRequestFlag(app, "--evaluate-kv-only", f.request, &R::set_evaluate_kv_only,
                 "evaluate with Q unquantized (FP8 KV cache, bf16 query)");
  AddRequestFlag(app, "--auto-per-session", f.request, &R::set_auto_per_session,
                 "observer auto: one observer for every layer (default: the "
                 "best per layer)");
  app->add_option("--granularity", f.granularity,
                  CliNames(v1::Granularity_descriptor()))
      ->check(Named(ParseGranularity, CliNames(v1::Granularity_descriptor())))
      ->capture_default_str();
  app->add_option("--format", f.format, CliNames(v1::Format_descriptor()))
      ->check(Named(ParseFormat, CliNames(v1::Format_descriptor())))
      ->capture_default_str();
  AddObserverNumbers(app, f.request);
  AddRequestFlag(app, "--q-per-kv-group", f.request, &R::set_q_per_kv_group,
                 "per head: reduce Q scales to one per KV group (max); not for "
                 "vLLM 0.34 checkpoints, which reduce q themselves");
  AddRequestFlag(
      app, "--allow-missing", f.request, &R::set_allow_missing,
      "roles with heads that saw no data get no scale instead of an error");
}

absl::StatusOr<CalibrationClient> Connect(const ConnectionArgs& c) {
  ConnectionOptions options;
  if (!c.auth_token_file.empty()) {
    absl::StatusOr<std::string> token = ReadTokenFile(c.auth_token_file);
    if (!token.ok()) {
      return absl::Status(
          token.status().code(),
          absl::StrCat("--auth-token-file: ", token.status().message()));
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
  v1::FinalizeRequest r = f.request;
  r.set_session_id(session);
  KVCAL_ASSIGN_OR_RETURN(v1::Observer observer, ParseObserver(f.observer));
  KVCAL_ASSIGN_OR_RETURN(v1::Granularity granularity,
                         ParseGranularity(f.granularity));
  KVCAL_ASSIGN_OR_RETURN(v1::Format format, ParseFormat(f.format));
  r.set_observer(observer);
  r.set_granularity(granularity);
  r.set_format(format);
  return r;
}

UploaderOptions MakeUploaderOptions(const Args& a) {
  UploaderOptions o;
  o.producer_id = a.producer;
  o.max_chunk_bytes = a.chunk_bytes;
  o.window = a.window;
  o.resume = a.resume;
  o.shared_memory = a.shm;
  if (a.local_statistics) {
    o.local_statistics_batches =
        a.flush_batches == 0 ? 64 : a.flush_batches;  // as the Python producer
    o.build_partials = BuildPartials;
  }
  return o;
}

void AddLocalStatisticsFlags(CLI::App* sub, Args& a) {
  CLI::Option* local = sub->add_flag(
      "--local-statistics", a.local_statistics,
      "accumulate the statistics here, with the worker's engine, and send "
      "them instead of the activations: one message per --flush-batches "
      "batches per worker (held-out batches still go as chunks; "
      "docs/local-statistics.md)");
  sub->add_option("--flush-batches", a.flush_batches,
                  "with --local-statistics: batches per statistics message "
                  "(default 64)")
      ->check(cli::InRange(
          cli::IntRange{1, std::numeric_limits<uint64_t>::max(), ""}))
      ->needs(local);
}

PatchOptions MakePatchOptions(const Args& a, PatchTarget target,
                              std::string scales_path) {
  return PatchOptions{.checkpoint_dir = a.checkpoint,
                      .scales_path = std::move(scales_path),
                      .out_dir = a.out_dir,
                      .target = target,
                      .on_step = {},
                      .on_progress = {},
                      .lock_timeout = absl::Seconds(a.lock_timeout),
                      .on_lock_wait = {},
                      .lock = nullptr};
}

// The numeric flags' valid values (docs/producers.md has the defaults).
// A chunk is at most the largest message a worker accepts
// (--max-message-bytes, at most 1 GiB); below one row, every row is a chunk.
CLI::Validator ChunkBytes() {
  return cli::InRange(cli::IntRange{1, 1 << 30, ""});
}

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

}  // namespace kvcal
