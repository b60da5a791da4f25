#include "service/worker.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <cstdlib>
#include <cstring>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kernels/backend_factory.h"
#include "kernels/cuda_ipc.h"
#include "kernels/device_health.h"
#include "service/log.h"
#include "service/shard_map.h"
#include "util/file_io.h"
#include "util/host_port.h"
#include "util/pem.h"
#include "util/status_macros.h"

namespace kvcal::service {
namespace {

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> Credentials(
    const WorkerOptions& options) {
  if (options.tls_cert.empty() && options.tls_key.empty()) {
    if (!options.tls_client_ca.empty()) {
      return absl::InvalidArgumentError(
          "--tls-client-ca needs --tls-cert and --tls-key");
    }
    return grpc::InsecureServerCredentials();
  }
  if (options.tls_cert.empty() || options.tls_key.empty()) {
    return absl::InvalidArgumentError(
        "TLS needs both --tls-cert and --tls-key");
  }
  grpc::SslServerCredentialsOptions ssl;
  // Checked here (util/pem.h), so that a wrong file is one line naming
  // the flag instead of gRPC's handshaker errors.
  KVCAL_ASSIGN_OR_RETURN(
      std::string cert,
      ReadPemFile("--tls-cert", options.tls_cert, PemKind::kCertificate));
  KVCAL_ASSIGN_OR_RETURN(
      std::string key,
      ReadPemFile("--tls-key", options.tls_key, PemKind::kPrivateKey));
  ssl.pem_key_cert_pairs.push_back({key, cert});
  if (!options.tls_client_ca.empty()) {
    KVCAL_ASSIGN_OR_RETURN(ssl.pem_root_certs,
                           ReadPemFile("--tls-client-ca", options.tls_client_ca,
                                       PemKind::kCertificate));
    ssl.client_certificate_request =
        GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(ssl);
}

}  // namespace

namespace {

// The service's options from the worker's (auth and the backend's parts
// are set by Start).
ServiceOptions ServiceOptionsFor(const WorkerOptions& options) {
  ServiceOptions service_options;
  service_options.registry.session.backend = options.backend;
  service_options.registry.session.backend_options.device = options.device;
  service_options.registry.session.backend_options.cpu_threads =
      options.cpu_threads;
  service_options.registry.max_sessions = options.max_sessions;
  service_options.registry.memory_budget_bytes = options.memory_budget_bytes;
  service_options.registry.max_sessions_per_tenant =
      options.max_sessions_per_tenant;
  service_options.registry.memory_budget_bytes_per_tenant =
      options.memory_budget_bytes_per_tenant;
  service_options.executor_threads =
      options.executor_threads > 0
          ? options.executor_threads
          : std::max(2, static_cast<int>(std::thread::hardware_concurrency()));
  service_options.max_inflight_bytes = options.max_inflight_bytes;
  service_options.shared_memory.enabled = options.shared_memory;
  service_options.shared_memory.max_regions_per_tenant =
      options.shared_memory_max_regions_per_tenant;
  service_options.shared_memory.max_bytes_per_tenant =
      options.shared_memory_max_bytes_per_tenant;
  service_options.shared_memory.host_id = HostBootId();
  return service_options;
}

// --worker-id, or the host name; checked.
absl::StatusOr<std::string> ResolveWorkerId(const WorkerOptions& options) {
  std::string id = options.worker_id;
  if (id.empty()) {
    char host[256] = {};
    if (gethostname(host, sizeof(host) - 1) != 0 || host[0] == '\0') {
      return absl::FailedPreconditionError(
          "cannot read the host name for the worker id; pass --worker-id");
    }
    id = host;
  }
  if (absl::Status s = ValidateWorkerId(id); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--worker-id: ", s.message(),
        options.worker_id.empty() ? " (it defaults to the host name)" : ""));
  }
  return id;
}

// Whether another process listens on `address` (HOST:PORT; `flag` names
// where it came from): binds a socket there the way the worker's listener
// will, without SO_REUSEPORT and with SO_REUSEADDR (so that connections a
// previous worker left in TIME_WAIT do not count). The error is one line:
// "127.0.0.1:50051 is in use (another kvcal-worker?)". Port 0, "unix:"
// addresses and names that do not resolve are left to the listener.
absl::Status CheckPortFree(const std::string& address, absl::string_view flag) {
  if (address.empty() || absl::StartsWith(address, "unix:") ||
      absl::StartsWith(address, "unix-abstract:")) {
    return absl::OkStatus();
  }
  absl::StatusOr<HostPort> parsed =
      ParseHostPort(address, {.default_port = -1, .min_port = 0});
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": ", parsed.status().message()));
  }
  if (parsed->port == 0) return absl::OkStatus();
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(parsed->port);
  if (getaddrinfo(parsed->host.c_str(), port.c_str(), &hints, &found) != 0) {
    return absl::OkStatus();
  }
  bool in_use = false;
  for (addrinfo* a = found; a != nullptr && !in_use; a = a->ai_next) {
    FileDescriptor fd(socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (fd.get() < 0) continue;
    const int one = 1, zero = 0;
    setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (a->ai_family == AF_INET6) {  // [::] is dual-stack in gRPC too
      setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
    }
    in_use =
        bind(fd.get(), a->ai_addr, a->ai_addrlen) != 0 && errno == EADDRINUSE;
  }
  freeaddrinfo(found);
  if (in_use) {
    return absl::UnavailableError(absl::StrCat(
        address, flag == "--listen" ? "" : absl::StrCat(" (", flag, ")"),
        " is in use (another kvcal-worker?)"));
  }
  return absl::OkStatus();
}

// The gRPC server of `service` on options.listen (its port in `port`), or
// null when it cannot listen.
std::unique_ptr<grpc::Server> BuildServer(
    const WorkerOptions& options,
    const std::shared_ptr<grpc::ServerCredentials>& credentials,
    CalibrationService* service, int* port) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, credentials, port);
  // A worker owns its port: without this gRPC sets SO_REUSEPORT, and a
  // second worker on the same port would start too and get half of the
  // connections (sessions "not found" on every other call).
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  // Clients ping every 30 s while a call is open (client/rpc/connection.cc) to
  // notice a vanished worker; accept pings every 10 s even without data so
  // that a waiting stream is never cut for "too many pings". The worker
  // also pings idle clients so that a producer host that vanished frees its
  // stream.
  builder.AddChannelArgument(
      GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 10000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 60000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 20000);
  builder.SetMaxSendMessageSize(options.max_message_bytes);
  // The health and reflection services are synchronous; their pollers wake
  // this often, which bounds how long Shutdown waits for them.
  builder.SetSyncServerOption(
      grpc::ServerBuilder::SyncServerOption::CQ_TIMEOUT_MSEC, 100);
  builder.RegisterService(service);
  return builder.BuildAndStart();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Worker>> Worker::Start(
    const WorkerOptions& options) {
  // Before anything is logged, restored or written: a second worker on a
  // taken port stops here with one line (and never touches --state-dir).
  KVCAL_RETURN_IF_ERROR(CheckPortFree(options.listen, "--listen"));
  KVCAL_RETURN_IF_ERROR(
      CheckPortFree(options.metrics_listen, "--metrics-listen"));
  KVCAL_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                         Credentials(options));
  std::unique_ptr<Worker> worker(new Worker());
  ServiceOptions service_options = ServiceOptionsFor(options);
  if (!options.auth_token_file.empty()) {
    KVCAL_ASSIGN_OR_RETURN(service_options.auth, TokenAuthenticator::FromFile(
                                                     options.auth_token_file));
  }

  // The backend decision is ResolveBackend's (kernels/backend.h), the same
  // one every session's CreateBackend makes; here it is checked and logged.
  BackendOptions backend_options;
  backend_options.device = options.device;
  KVCAL_ASSIGN_OR_RETURN(const BackendChoice choice,
                         ResolveBackend(options.backend, backend_options));
  worker->backend_name_ = choice.kind == BackendKind::kCuda ? "cuda" : "cpu";
  if (choice.kind == BackendKind::kCuda) {
    // CUDA IPC regions: chunks the CUDA backend reads in device memory.
    service_options.shared_memory.open_cuda_ipc = CudaIpcMemory::Open;
  }
  KVCAL_LOG(INFO) << "backend: " << choice.description;

  KVCAL_ASSIGN_OR_RETURN(worker->worker_id_, ResolveWorkerId(options));
  KVCAL_LOG(INFO) << "worker id: " << worker->worker_id_;
  service_options.worker_id = worker->worker_id_;
  service_options.backend_name = worker->backend_name_;
  worker->service_ = std::make_unique<CalibrationService>(service_options);
  KVCAL_RETURN_IF_ERROR(worker->StartPersister(options));
  worker->server_ =
      BuildServer(options, credentials, worker->service_.get(), &worker->port_);
  if (worker->server_ == nullptr || worker->port_ == 0) {
    // Taken since the check above (two workers starting at once)?
    KVCAL_RETURN_IF_ERROR(CheckPortFree(options.listen, "--listen"));
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", options.listen));
  }
  if (!options.metrics_listen.empty()) {
    worker->metrics_http_ =
        std::make_unique<MetricsHttpServer>(&worker->service_->metrics());
    KVCAL_RETURN_IF_ERROR(worker->metrics_http_->Start(options.metrics_listen));
    KVCAL_LOG(INFO) << "metrics on " << options.metrics_listen << " (port "
                    << worker->metrics_http_->port() << ") at /metrics";
  }
  grpc::HealthCheckServiceInterface* health =
      worker->server_->GetHealthCheckService();
  health->SetServingStatus(true);
  health->SetServingStatus("kvcal.v1.Calibration", true);
  worker->health_thread_ =
      std::thread([w = worker.get()] { w->WatchDevice(); });
  KVCAL_LOG(INFO) << "serving kvcal.v1.Calibration on " << options.listen
                  << " (port " << worker->port_ << ")"
                  << (service_options.auth ? ", bearer tokens required" : "")
                  << (options.tls_cert.empty() ? "" : ", TLS")
                  << (options.tls_client_ca.empty() ? ""
                                                    : " with client certs");
  return worker;
}

absl::Status Worker::StartPersister(const WorkerOptions& options) {
  if (options.state_dir.empty()) {
    KVCAL_LOG(INFO) << "no --state-dir: sessions live in memory only; a "
                       "worker crash loses them";
    return absl::OkStatus();
  }
  persister_ = std::make_unique<SessionPersister>(
      &service_->registry(), &service_->metrics(),
      StateStore(options.state_dir), options.snapshot_interval);
  KVCAL_RETURN_IF_ERROR(persister_->Restore());
  service_->set_persister(persister_.get());
  persister_->Start();
  KVCAL_LOG(INFO) << "durable sessions in " << options.state_dir << " (every "
                  << options.snapshot_interval.count() << " ms when changed)";
  return absl::OkStatus();
}

void Worker::WatchDevice() {
  std::unique_lock<std::mutex> lock(health_mu_);
  while (!stop_health_) {
    const absl::Status health = DeviceHealth();
    if (!health.ok()) {
      // Nothing in this process can use the GPU any more; sessions on it
      // answer UNAVAILABLE. NOT_SERVING makes Kubernetes restart the worker
      // (producers resume from their watermarks).
      KVCAL_LOG(ERROR) << "device lost, reporting NOT_SERVING: "
                       << health.message();
      grpc::HealthCheckServiceInterface* service =
          server_->GetHealthCheckService();
      service->SetServingStatus(false);
      return;
    }
    health_cv_.wait_for(lock, std::chrono::milliseconds(200));
  }
}

void Worker::StopWatchingDevice() {
  {
    std::lock_guard<std::mutex> lock(health_mu_);
    stop_health_ = true;
  }
  health_cv_.notify_all();
  if (health_thread_.joinable()) health_thread_.join();
}

void Worker::Shutdown(std::chrono::milliseconds grace) {
  if (shut_down_) return;
  shut_down_ = true;
  StopWatchingDevice();
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  health->SetServingStatus(false);
  service_->DrainStreams();
  // Our own RPCs end first: drained streams finish once their received
  // chunks are applied, unary calls once their work is done. Waiting for
  // them here (bounded by `grace`) lets Shutdown cancel only what is left
  // instead of idling until the deadline on transport-level bookkeeping.
  const auto deadline = std::chrono::steady_clock::now() + grace;
  while (service_->InFlightRpcs() > 0 &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  server_->Shutdown(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(100));
  server_->Wait();
  if (persister_) {
    persister_->Stop();
    absl::Status saved = persister_->SaveAll();
    if (saved.ok()) {
      KVCAL_LOG(INFO) << "all sessions written to the state dir";
    } else {
      KVCAL_LOG(ERROR) << "final state write failed: " << saved.message();
    }
  }
  if (metrics_http_) metrics_http_->Stop();
}

Worker::~Worker() {
  if (server_ != nullptr) Shutdown(std::chrono::milliseconds(0));
  StopWatchingDevice();
}

void RetainFreedHeapMemory() {
#if defined(__GLIBC__)
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  if (std::getenv("MALLOC_TRIM_THRESHOLD_") != nullptr ||
      std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr ||
      (tunables != nullptr && std::strstr(tunables, "malloc.") != nullptr)) {
    return;
  }
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 128 << 20);
#endif
}

}  // namespace kvcal::service
