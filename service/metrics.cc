#include "service/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "kernels/device_health.h"
#include "service/log.h"

namespace kvcal::service {

void Metrics::RecordIngest(uint64_t bytes, uint64_t values) {
  bytes_.fetch_add(bytes, std::memory_order_relaxed);
  values_.fetch_add(values, std::memory_order_relaxed);
  chunks_.fetch_add(1, std::memory_order_relaxed);
}

void Metrics::RecordDuplicate() { duplicates_.fetch_add(1); }

void Metrics::RecordReject(int code) {
  std::lock_guard<std::mutex> lock(mu_);
  ++rejects_[code];
}

void Metrics::RecordLatency(absl::string_view method, double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = latency_.find(method);
  if (it == latency_.end()) {
    it = latency_.emplace(std::string(method), Histogram()).first;
  }
  Histogram& h = it->second;
  for (size_t i = 0; i < kLatencyBuckets.size(); ++i) {
    if (seconds <= kLatencyBuckets[i]) ++h.buckets[i];
  }
  ++h.count;
  h.sum += seconds;
}

void Metrics::StreamOpened() { streams_.fetch_add(1); }
void Metrics::StreamClosed() { streams_.fetch_sub(1); }
void Metrics::SetInflightBytes(uint64_t bytes) { inflight_bytes_ = bytes; }

void Metrics::RecordPersistFailure(const std::string& error) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!error.empty()) ++persist_failures_;
  persist_error_ = error;
}

std::string Metrics::HealthDetail() const {
  std::string detail;
  if (const absl::Status device = DeviceHealth(); !device.ok()) {
    detail = absl::StrCat("GPU lost (restart the worker): ", device.message());
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (persist_error_.empty()) return detail;
  return absl::StrCat(detail, detail.empty() ? "" : "; ",
                      "state persistence failing: ", persist_error_);
}

void Metrics::SetSessionGauge(std::function<uint64_t()> active_sessions) {
  std::lock_guard<std::mutex> lock(mu_);
  active_sessions_ = std::move(active_sessions);
}

std::string Metrics::Render() const {
  std::string out;
  auto counter = [&](absl::string_view name, absl::string_view help,
                     uint64_t value) {
    absl::StrAppend(&out, "# HELP ", name, " ", help, "\n# TYPE ", name,
                    " counter\n", name, " ", value, "\n");
  };
  auto gauge = [&](absl::string_view name, absl::string_view help,
                   int64_t value) {
    absl::StrAppend(&out, "# HELP ", name, " ", help, "\n# TYPE ", name,
                    " gauge\n", name, " ", value, "\n");
  };
  counter("kvcal_ingest_bytes_total", "Activation bytes applied.",
          bytes_.load());
  counter("kvcal_ingest_values_total", "Activation values applied.",
          values_.load());
  counter("kvcal_ingest_chunks_total", "Chunks applied.", chunks_.load());
  counter("kvcal_ingest_duplicates_total", "Chunks acknowledged as duplicates.",
          duplicates_.load());
  gauge("kvcal_ingest_streams_active", "Open Ingest streams.", streams_.load());
  gauge("kvcal_ingest_inflight_bytes",
        "Bytes of received chunks not yet applied.",
        static_cast<int64_t>(inflight_bytes_.load()));
  std::lock_guard<std::mutex> lock(mu_);
  if (active_sessions_) {
    gauge("kvcal_sessions_active", "Sessions held by this worker.",
          static_cast<int64_t>(active_sessions_()));
  }
  counter("kvcal_state_persist_failures_total",
          "Failed writes of session state to --state-dir.", persist_failures_);
  gauge("kvcal_state_persist_healthy",
        "1 when the last state write round succeeded.",
        persist_error_.empty() ? 1 : 0);
  absl::StrAppend(&out,
                  "# HELP kvcal_rejects_total Requests rejected, by gRPC "
                  "status code.\n# TYPE kvcal_rejects_total counter\n");
  for (const auto& [code, n] : rejects_) {
    absl::StrAppend(&out, "kvcal_rejects_total{code=\"", code, "\"} ", n, "\n");
  }
  absl::StrAppend(&out,
                  "# HELP kvcal_rpc_latency_seconds RPC latency by method.\n"
                  "# TYPE kvcal_rpc_latency_seconds histogram\n");
  for (const auto& [method, h] : latency_) {
    for (size_t i = 0; i < kLatencyBuckets.size(); ++i) {
      absl::StrAppend(&out, "kvcal_rpc_latency_seconds_bucket{method=\"",
                      method, "\",le=\"", kLatencyBuckets[i], "\"} ",
                      h.buckets[i], "\n");
    }
    absl::StrAppend(&out, "kvcal_rpc_latency_seconds_bucket{method=\"", method,
                    "\",le=\"+Inf\"} ", h.count, "\n");
    absl::StrAppend(&out, "kvcal_rpc_latency_seconds_sum{method=\"", method,
                    "\"} ", h.sum, "\n");
    absl::StrAppend(&out, "kvcal_rpc_latency_seconds_count{method=\"", method,
                    "\"} ", h.count, "\n");
  }
  return out;
}

MetricsHttpServer::~MetricsHttpServer() { Stop(); }

absl::Status MetricsHttpServer::Start(const std::string& address) {
  const size_t colon = address.rfind(':');
  int port = 0;
  if (colon == std::string::npos ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 ||
      port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--metrics-listen must be host:port (IPv4), got '", address, "'"));
  }
  std::string host = address.substr(0, colon);
  if (host.empty() || host == "localhost") host = "127.0.0.1";
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics-listen host '", host, "' is not IPv4"));
  }
  listen_fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listen_fd_ < 0) return absl::InternalError("socket() failed");
  const int one = 1;
  setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  // SO_REUSEADDR only, never SO_REUSEPORT: a second worker on the same
  // metrics port fails here instead of sharing it.
  if (bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(listen_fd_, 16) != 0) {
    const int error = errno;
    close(listen_fd_);
    listen_fd_ = -1;
    if (error == EADDRINUSE) {
      return absl::UnavailableError(absl::StrCat(
          address, " (--metrics-listen) is in use (another kvcal-worker?)"));
    }
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on ", address, " for metrics: ", std::strerror(error)));
  }
  socklen_t len = sizeof(addr);
  getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  port_ = ntohs(addr.sin_port);
  thread_ = std::thread([this] { Serve(); });
  return absl::OkStatus();
}

void MetricsHttpServer::Stop() {
  stopping_ = true;
  if (thread_.joinable()) thread_.join();
  if (listen_fd_ >= 0) close(listen_fd_);
  listen_fd_ = -1;
}

void MetricsHttpServer::Serve() {
  while (!stopping_) {
    pollfd pfd{listen_fd_, POLLIN, 0};
    if (poll(&pfd, 1, 200) <= 0) continue;
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    timeval timeout{2, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
    char request[1024];
    const ssize_t n = recv(fd, request, sizeof(request) - 1, 0);
    std::string status = "200 OK";
    std::string body;
    if (n > 0) {
      request[n] = '\0';
      if (std::strncmp(request, "GET /metrics", 12) == 0) {
        body = metrics_->Render();
      } else if (std::strncmp(request, "GET /healthz", 12) == 0) {
        const std::string detail = metrics_->HealthDetail();
        body =
            detail.empty() ? "ok\n" : absl::StrCat("degraded: ", detail, "\n");
      } else {
        status = "404 Not Found";
        body = "try /metrics\n";
      }
    }
    const std::string response = absl::StrCat(
        "HTTP/1.0 ", status,
        "\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: ",
        body.size(), "\r\nConnection: close\r\n\r\n", body);
    size_t sent = 0;
    while (sent < response.size()) {
      const ssize_t w = send(fd, response.data() + sent, response.size() - sent,
                             MSG_NOSIGNAL);
      if (w <= 0) break;
      sent += static_cast<size_t>(w);
    }
    close(fd);
  }
}

}  // namespace kvcal::service
