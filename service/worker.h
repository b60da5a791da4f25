// A running kvcal worker: the gRPC server with the Calibration service, the
// standard health service, server reflection, and optional metrics endpoint.
// kvcal-worker's main() is a thin flag parser around this; benchmarks start
// one in-process.
//
//   WorkerOptions options;
//   options.listen = "127.0.0.1:0";
//   KVCAL_ASSIGN_OR_RETURN(std::unique_ptr<Worker> worker,
//                          Worker::Start(options));
//   std::cout << worker->port();
//   worker->Shutdown(std::chrono::seconds(10));
#ifndef KVCAL_SERVICE_WORKER_H_
#define KVCAL_SERVICE_WORKER_H_

#include <grpcpp/server.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "service/calibration_service.h"
#include "service/session_persister.h"

namespace kvcal::service {

struct WorkerOptions {
  std::string listen = "127.0.0.1:50051";
  // Stable identity that clients shard by; empty = the host name.
  std::string worker_id;
  BackendKind backend = BackendKind::kAuto;
  int device = 0;
  // CPU backend: threads one chunk's statistics may use (0 = every core).
  // One: a chunk is accumulated faster than one stream delivers it, chunks
  // of different streams run in parallel on the executor, and splitting a
  // chunk takes cores from gRPC (kvcal_bench_ingest, --cpu-threads).
  int cpu_threads = 1;
  int max_message_bytes = 64 << 20;
  uint64_t max_sessions = 0;
  uint64_t memory_budget_bytes = 0;
  uint64_t max_sessions_per_tenant = 0;
  uint64_t memory_budget_bytes_per_tenant = 0;
  std::string auth_token_file;
  std::string tls_cert;
  std::string tls_key;
  std::string tls_client_ca;
  std::string metrics_listen;
  int executor_threads = 0;  // 0 = hardware concurrency
  uint64_t max_inflight_bytes = 256ull << 20;
  // Durable sessions: restored at start, written every snapshot_interval
  // when changed, on DeleteSession and on Shutdown. Empty = off.
  std::string state_dir;
  std::chrono::milliseconds snapshot_interval{10000};
  // Same-host shared memory (docs/shared_memory.md).
  bool shared_memory = true;
  uint64_t shared_memory_max_regions_per_tenant = 64;
  uint64_t shared_memory_max_bytes_per_tenant = 0;
};

// Makes the process's allocator keep freed memory for reuse instead of
// handing it back to the kernel at once (glibc: M_TRIM_THRESHOLD 128 MiB,
// M_MMAP_THRESHOLD 32 MiB). gRPC allocates a fresh receive buffer for every
// read and frees it once the chunk is applied; with glibc's defaults the
// heap top is trimmed after each and the next read faults its pages in
// again: ~500 minor faults per 4 MiB chunk in kvcal_bench_ingest, ~40 with
// this. Up to 128 MiB of freed memory may stay with the process per malloc
// arena. Process-wide, so main() calls it (kvcal-worker, the benchmarks),
// never the library. Leaves the allocator alone when MALLOC_TRIM_THRESHOLD_,
// MALLOC_MMAP_THRESHOLD_ or a GLIBC_TUNABLES malloc setting is in the
// environment (the operator's choice wins); a no-op without glibc.
void RetainFreedHeapMemory();

class Worker {
 public:
  static absl::StatusOr<std::unique_ptr<Worker>> Start(
      const WorkerOptions& options);
  ~Worker();

  int port() const { return port_; }
  int metrics_port() const { return metrics_http_ ? metrics_http_->port() : 0; }
  // "cpu" or "cuda": what BackendKind::kAuto resolved to.
  const std::string& backend_name() const { return backend_name_; }
  const std::string& worker_id() const { return worker_id_; }
  CalibrationService& service() { return *service_; }

  // Health is SERVING once started, NOT_SERVING from Shutdown on, and
  // NOT_SERVING as soon as DeviceHealth() reports a lost GPU (checked every
  // 200 ms), so that an orchestrator restarts the worker.
  //
  // Stops accepting RPCs, marks health NOT_SERVING, lets in-flight RPCs end
  // within `grace` (then cancels them), and finishes queued chunk work.
  void Shutdown(std::chrono::milliseconds grace);

 private:
  Worker() = default;
  // With --state-dir: restores its sessions and starts snapshotting.
  absl::Status StartPersister(const WorkerOptions& options);
  void WatchDevice();  // health_thread_
  void StopWatchingDevice();
  std::unique_ptr<CalibrationService> service_;
  std::unique_ptr<SessionPersister> persister_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<MetricsHttpServer> metrics_http_;
  std::string backend_name_;
  std::string worker_id_;
  int port_ = 0;
  bool shut_down_ = false;
  std::thread health_thread_;
  std::mutex health_mu_;
  std::condition_variable health_cv_;
  bool stop_health_ = false;  // guarded by health_mu_
};

}  // namespace kvcal::service

#endif  // KVCAL_SERVICE_WORKER_H_
