// kvcal-worker: the calibration worker process.
//
//   kvcal-worker --listen 127.0.0.1:50051 --backend auto
//
// Exit codes: 0 after a clean stop (and for --help, --version), 1 when the
// worker cannot start (a port in use, unreadable TLS files, ...), 2 for a
// usage error (an unknown flag, a missing value, a number out of range).
//
// SIGTERM or SIGINT: stop accepting, finish in-flight chunks, exit 0.
#include <arpa/inet.h>
#include <pthread.h>

#include <csignal>
#include <cstdio>
#include <iostream>
#include <limits>
#include <optional>

#include "CLI/CLI.hpp"
#include "absl/debugging/failure_signal_handler.h"
#include "absl/debugging/symbolize.h"
#include "absl/strings/str_cat.h"
#include "kernels/backend_factory.h"
#include "service/log.h"
#include "service/shard_map.h"
#include "service/worker.h"
#include "util/cli.h"
#include "util/file_io.h"

namespace {

// The command line: the worker's options and what main itself uses.
struct Flags {
  kvcal::service::WorkerOptions options;
  std::string backend = "auto";
  std::string port_file;
  int shutdown_grace_ms = 10000;
  int snapshot_interval_ms = 10000;
};

using kvcal::cli::InRange;
using kvcal::cli::IntRange;
constexpr uint64_t kU64 = std::numeric_limits<uint64_t>::max();
constexpr uint64_t kI64 = std::numeric_limits<int64_t>::max();

// Every numeric flag is checked at parse time (kvcal::cli::InRange): a
// value outside its meaning is a usage error naming the flag and the range.

// Where and as whom the worker serves, and on which backend.
void AddServingFlags(CLI::App& app, Flags& f) {
  app.add_option("--listen", f.options.listen,
                 "host:port to serve on (port 0 picks one)")
      ->check(kvcal::cli::ListenAddress())
      ->capture_default_str();
  app.add_option("--worker-id", f.options.worker_id,
                 "stable identity clients shard layers by (default: the host "
                 "name, which is the pod name in a StatefulSet); "
                 "[A-Za-z0-9._-]{1,128}")
      ->check(CLI::Validator(
          [](std::string& id) -> std::string {
            return std::string(kvcal::service::ValidateWorkerId(id).message());
          },
          "ID"));
  app.add_option("--backend", f.backend,
                 "statistics backend: auto, cpu or cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  app.add_option("--device", f.options.device, "CUDA device ordinal")
      ->check(InRange(IntRange{0, 255, ""}))
      ->capture_default_str();
  app.add_option("--cpu-threads", f.options.cpu_threads,
                 "cpu backend: threads that one large chunk's statistics are "
                 "split over (0 = every core; chunks of different streams "
                 "run in parallel regardless)")
      ->check(InRange(IntRange{0, 1024, "0 = every core"}))
      ->capture_default_str();
}

// Sizes, counts and budgets.
void AddLimitFlags(CLI::App& app, Flags& f) {
  app.add_option("--max-message-bytes", f.options.max_message_bytes,
                 "largest gRPC message accepted")
      ->check(InRange(IntRange{1 << 16, 1 << 30, ""}))
      ->capture_default_str();
  app.add_option("--max-sessions", f.options.max_sessions, "0 = unlimited")
      ->check(InRange(IntRange{0, kU64, "0 = unlimited"}))
      ->capture_default_str();
  app.add_option("--memory-budget-bytes", f.options.memory_budget_bytes,
                 "statistics memory for all sessions; 0 = unlimited")
      ->check(InRange(IntRange{0, kU64, "0 = unlimited"}))
      ->capture_default_str();
  app.add_option("--max-sessions-per-tenant", f.options.max_sessions_per_tenant,
                 "0 = unlimited")
      ->check(InRange(IntRange{0, kU64, "0 = unlimited"}))
      ->capture_default_str();
  app.add_option("--memory-budget-bytes-per-tenant",
                 f.options.memory_budget_bytes_per_tenant,
                 "statistics memory per tenant; 0 = unlimited")
      ->check(InRange(IntRange{0, kU64, "0 = unlimited"}))
      ->capture_default_str();
  // Compared as int64 with the bytes in flight: at least one byte (0 would
  // never read a chunk), at most INT64_MAX.
  app.add_option("--max-inflight-bytes", f.options.max_inflight_bytes,
                 "received but not yet applied chunk bytes before reads pause")
      ->check(InRange(IntRange{1, kI64, ""}))
      ->capture_default_str();
  app.add_option("--executor-threads", f.options.executor_threads,
                 "threads applying chunks; 0 = one per core")
      ->check(InRange(IntRange{0, 1024, "0 = one per core"}))
      ->capture_default_str();
}

// The metrics endpoint (service/metrics.cc) binds IPv4 only: '' when
// `address` is empty, localhost or an IPv4 address, else why not.
std::string CheckMetricsHost(const std::string& address) {
  const std::string host = address.substr(0, address.rfind(':'));
  in_addr ignored{};
  if (address.empty() || host == "localhost" ||
      inet_pton(AF_INET, host.c_str(), &ignored) == 1) {
    return "";
  }
  return "'" + host +
         "' is not an IPv4 address (the metrics endpoint serves IPv4: "
         "0.0.0.0 for every interface, 127.0.0.1 for this host only)";
}

// Tokens, TLS and the metrics endpoint.
void AddSecurityFlags(CLI::App& app, Flags& f) {
  app.add_option("--auth-token-file", f.options.auth_token_file,
                 "file of 'tenant:token' or 'token' lines; RPCs then need "
                 "'authorization: Bearer <token>'");
  CLI::Option* tls_cert = app.add_option("--tls-cert", f.options.tls_cert,
                                         "PEM server certificate chain");
  CLI::Option* tls_key =
      app.add_option("--tls-key", f.options.tls_key, "PEM server private key");
  tls_cert->needs(tls_key);
  tls_key->needs(tls_cert);
  app.add_option("--tls-client-ca", f.options.tls_client_ca,
                 "PEM CA for client certificates (mutual TLS)")
      ->needs(tls_cert);
  app.add_option("--metrics-listen", f.options.metrics_listen,
                 "host:port for Prometheus /metrics (off when empty)")
      ->check(kvcal::cli::ListenAddress(/*allow_empty=*/true))
      ->check(CLI::Validator(
          [](std::string& address) { return CheckMetricsHost(address); },
          "IPv4"));
}

// Durability, shared memory and the process's own life.
void AddStateFlags(CLI::App& app, Flags& f) {
  app.add_option("--state-dir", f.options.state_dir,
                 "keep sessions durable in this directory (restored at start)");
  app.add_option("--snapshot-interval-ms", f.snapshot_interval_ms,
                 "how often changed sessions are written to --state-dir")
      ->check(InRange(IntRange{10, 3600000, ""}))
      ->capture_default_str();
  app.add_option("--shared-memory", f.options.shared_memory,
                 "accept same-host shared-memory regions from producers "
                 "(docs/shared_memory.md)")
      ->capture_default_str();
  app.add_option("--shared-memory-max-regions-per-tenant",
                 f.options.shared_memory_max_regions_per_tenant,
                 "registered regions per tenant; 0 = unlimited")
      ->check(InRange(IntRange{0, kU64, "0 = unlimited"}))
      ->capture_default_str();
  app.add_option("--shared-memory-max-bytes-per-tenant",
                 f.options.shared_memory_max_bytes_per_tenant,
                 "registered region bytes per tenant; 0 = unlimited")
      ->check(InRange(IntRange{0, kU64, "0 = unlimited"}))
      ->capture_default_str();
  app.add_option("--port-file", f.port_file,
                 "write the bound port here once serving");
  app.add_option("--shutdown-grace-ms", f.shutdown_grace_ms,
                 "how long in-flight RPCs may run after SIGTERM")
      ->check(InRange(IntRange{0, 3600000, ""}))
      ->capture_default_str();
}

void AddFlags(CLI::App& app, Flags& f) {
  AddServingFlags(app, f);
  AddLimitFlags(app, f);
  AddSecurityFlags(app, f);
  AddStateFlags(app, f);
  kvcal::cli::AddVersionFlag(app);
}

}  // namespace

int main(int argc, char** argv) {
  // A crash prints its signal and a symbolized stack trace to stderr before
  // the process dies, so a worker log says where it went wrong.
  absl::InitializeSymbolizer(argv[0]);
  absl::InstallFailureSignalHandler(absl::FailureSignalHandlerOptions());
  kvcal::service::RetainFreedHeapMemory();
  Flags flags;
  CLI::App app{"kvcal-worker: gRPC calibration worker (kvcal.v1.Calibration)",
               "kvcal-worker"};
  AddFlags(app, flags);
  // A usage error: one line on stderr, exit 2 (kvcal::cli::kExitUsage).
  if (std::optional<int> exit = kvcal::cli::Parse(app, argc, argv)) {
    return *exit;
  }

  kvcal::service::WorkerOptions& options = flags.options;
  const std::string& port_file = flags.port_file;
  const int shutdown_grace_ms = flags.shutdown_grace_ms;
  options.snapshot_interval =
      std::chrono::milliseconds(flags.snapshot_interval_ms);
  auto kind = kvcal::ParseBackendKind(flags.backend);
  options.backend = *kind;

  // Block the stop signals in every thread; main waits for them below.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  std::signal(SIGPIPE, SIG_IGN);

  if (!port_file.empty()) {
    // A port file that cannot be written is refused before serving.
    if (absl::Status s = kvcal::CheckOutputPath(port_file); !s.ok()) {
      std::cerr << "kvcal-worker: --port-file: " << s.message() << "\n";
      return kvcal::cli::kExitFailure;
    }
  }
  auto worker = kvcal::service::Worker::Start(options);
  if (!worker.ok()) {
    std::cerr << "kvcal-worker: " << worker.status().message() << "\n";
    return kvcal::cli::kExitFailure;
  }
  if (!port_file.empty()) {
    // A reader never sees a partial number (util/file_io.h).
    const absl::Status written = kvcal::WriteOutputFile(
        port_file, absl::StrCat((*worker)->port(), "\n"));
    if (!written.ok()) {
      std::cerr << "kvcal-worker: --port-file: " << written.message() << "\n";
      return kvcal::cli::kExitFailure;
    }
  }
  int signal = 0;
  sigwait(&signals, &signal);
  KVCAL_LOG(INFO) << "received " << (signal == SIGTERM ? "SIGTERM" : "SIGINT")
                  << "; draining (grace " << shutdown_grace_ms << " ms)";
  (*worker)->Shutdown(std::chrono::milliseconds(shutdown_grace_ms));
  worker->reset();
  KVCAL_LOG(INFO) << "stopped";
  return 0;
}
