// kvcal-worker: the calibration worker process.
//
//   kvcal-worker --listen 127.0.0.1:50051 --backend auto
//
// SIGTERM or SIGINT: stop accepting, finish in-flight chunks, exit 0.
#include <pthread.h>

#include <csignal>
#include <cstdio>
#include <fstream>
#include <iostream>

#include "CLI/CLI.hpp"
#include "absl/debugging/failure_signal_handler.h"
#include "absl/debugging/symbolize.h"
#include "absl/strings/str_cat.h"
#include "service/log.h"
#include "service/worker.h"

namespace {

// Writes the bound port to `path` atomically (temp file + rename), so that a
// reader never sees a partial number.
bool WritePortFile(const std::string& path, int port) {
  const std::string temp = path + ".tmp";
  {
    std::ofstream out(temp, std::ios::trunc);
    if (!out) return false;
    out << port << "\n";
    if (!out.flush()) return false;
  }
  return std::rename(temp.c_str(), path.c_str()) == 0;
}

// The command line: the worker's options and what main itself uses.
struct Flags {
  kvcal::service::WorkerOptions options;
  std::string backend = "auto";
  std::string port_file;
  int shutdown_grace_ms = 10000;
  int snapshot_interval_ms = 10000;
};

void AddFlags(CLI::App& app, Flags& f) {
  app.add_option("--listen", f.options.listen,
                 "host:port to serve on (port 0 picks one)")
      ->capture_default_str();
  app.add_option("--worker-id", f.options.worker_id,
                 "stable identity clients shard layers by (default: the host "
                 "name, which is the pod name in a StatefulSet); "
                 "[A-Za-z0-9._-]{1,128}");
  app.add_option("--backend", f.backend,
                 "statistics backend: auto, cpu or cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  app.add_option("--device", f.options.device, "CUDA device ordinal")
      ->capture_default_str();
  app.add_option("--cpu-threads", f.options.cpu_threads,
                 "cpu backend: threads that one large chunk's statistics are "
                 "split over (0 = every core; chunks of different streams "
                 "run in parallel regardless)")
      ->check(CLI::Range(0, 1024))
      ->capture_default_str();
  app.add_option("--max-message-bytes", f.options.max_message_bytes,
                 "largest gRPC message accepted")
      ->check(CLI::Range(1 << 16, 1 << 30))
      ->capture_default_str();
  app.add_option("--max-sessions", f.options.max_sessions, "0 = unlimited")
      ->capture_default_str();
  app.add_option("--memory-budget-bytes", f.options.memory_budget_bytes,
                 "statistics memory for all sessions; 0 = unlimited")
      ->capture_default_str();
  app.add_option("--max-sessions-per-tenant", f.options.max_sessions_per_tenant,
                 "0 = unlimited")
      ->capture_default_str();
  app.add_option("--memory-budget-bytes-per-tenant",
                 f.options.memory_budget_bytes_per_tenant,
                 "statistics memory per tenant; 0 = unlimited")
      ->capture_default_str();
  app.add_option("--max-inflight-bytes", f.options.max_inflight_bytes,
                 "received but not yet applied chunk bytes before reads pause")
      ->capture_default_str();
  app.add_option("--executor-threads", f.options.executor_threads,
                 "threads applying chunks; 0 = one per core")
      ->capture_default_str();
  app.add_option("--auth-token-file", f.options.auth_token_file,
                 "file of 'tenant:token' or 'token' lines; RPCs then need "
                 "'authorization: Bearer <token>'");
  app.add_option("--tls-cert", f.options.tls_cert,
                 "PEM server certificate chain");
  app.add_option("--tls-key", f.options.tls_key, "PEM server private key");
  app.add_option("--tls-client-ca", f.options.tls_client_ca,
                 "PEM CA for client certificates (mutual TLS)");
  app.add_option("--metrics-listen", f.options.metrics_listen,
                 "host:port for Prometheus /metrics (off when empty)");
  app.add_option("--state-dir", f.options.state_dir,
                 "keep sessions durable in this directory (restored at start)");
  app.add_option("--snapshot-interval-ms", f.snapshot_interval_ms,
                 "how often changed sessions are written to --state-dir")
      ->check(CLI::Range(10, 3600000))
      ->capture_default_str();
  app.add_option("--shared-memory", f.options.shared_memory,
                 "accept same-host shared-memory regions from producers "
                 "(docs/shared_memory.md)")
      ->capture_default_str();
  app.add_option("--shared-memory-max-regions-per-tenant",
                 f.options.shared_memory_max_regions_per_tenant,
                 "registered regions per tenant; 0 = unlimited")
      ->capture_default_str();
  app.add_option("--shared-memory-max-bytes-per-tenant",
                 f.options.shared_memory_max_bytes_per_tenant,
                 "registered region bytes per tenant; 0 = unlimited")
      ->capture_default_str();
  app.add_option("--port-file", f.port_file,
                 "write the bound port here once serving");
  app.add_option("--shutdown-grace-ms", f.shutdown_grace_ms,
                 "how long in-flight RPCs may run after SIGTERM")
      ->capture_default_str();
}

}  // namespace

int main(int argc, char** argv) {
  // A crash prints its signal and a symbolized stack trace to stderr before
  // the process dies, so a worker log says where it went wrong.
  absl::InitializeSymbolizer(argv[0]);
  absl::InstallFailureSignalHandler(absl::FailureSignalHandlerOptions());
  kvcal::service::RetainFreedHeapMemory();
  Flags flags;
  CLI::App app{"kvcal-worker: gRPC calibration worker (kvcal.v1.Calibration)"};
  AddFlags(app, flags);
  CLI11_PARSE(app, argc, argv);

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

  auto worker = kvcal::service::Worker::Start(options);
  if (!worker.ok()) {
    std::cerr << "kvcal-worker: " << worker.status().message() << "\n";
    return 1;
  }
  if (!port_file.empty() && !WritePortFile(port_file, (*worker)->port())) {
    std::cerr << "kvcal-worker: cannot write --port-file " << port_file << "\n";
    return 1;
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
