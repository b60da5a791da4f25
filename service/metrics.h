// Worker metrics and their Prometheus text exposition (--metrics-listen).
//
//   Metrics metrics;
//   metrics.RecordIngest(bytes, values);
//   MetricsHttpServer http(&metrics);
//   KVCAL_RETURN_IF_ERROR(http.Start("127.0.0.1:9090"));  // GET /metrics
#ifndef KVCAL_SERVICE_METRICS_H_
#define KVCAL_SERVICE_METRICS_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvcal::service {

class Metrics {
 public:
  static constexpr std::array<double, 12> kLatencyBuckets = {
      0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
      0.05,   0.1,   0.25,   0.5,   1.0,  5.0};

  void RecordIngest(uint64_t bytes, uint64_t values);
  void RecordDuplicate();
  // A request rejected with gRPC status code `code`.
  void RecordReject(int code);
  void RecordLatency(absl::string_view method, double seconds);
  void StreamOpened();
  void StreamClosed();
  void SetInflightBytes(uint64_t bytes);
  // A failed state write (non-empty error) or a successful round (empty).
  void RecordPersistFailure(const std::string& error);
  // Empty when healthy, else why the worker is degraded.
  std::string HealthDetail() const;
  // Gauges read at exposition time.
  void SetSessionGauge(std::function<uint64_t()> active_sessions);

  uint64_t active_streams() const { return streams_.load(); }

  // Prometheus text exposition format 0.0.4.
  std::string Render() const;

 private:
  struct Histogram {
    std::array<uint64_t, kLatencyBuckets.size()> buckets{};
    uint64_t count = 0;
    double sum = 0.0;
  };
  std::atomic<uint64_t> bytes_{0};
  std::atomic<uint64_t> values_{0};
  std::atomic<uint64_t> chunks_{0};
  std::atomic<uint64_t> duplicates_{0};
  std::atomic<int64_t> streams_{0};
  std::atomic<uint64_t> inflight_bytes_{0};
  mutable std::mutex mu_;
  std::map<int, uint64_t> rejects_;                        // guarded by mu_
  std::map<std::string, Histogram, std::less<>> latency_;  // guarded by mu_
  std::function<uint64_t()> active_sessions_;              // guarded by mu_
  uint64_t persist_failures_ = 0;                          // guarded by mu_
  std::string persist_error_;                              // guarded by mu_
};

// A minimal HTTP/1.0 server answering GET /metrics (and /healthz) on one
// thread. Not for anything but a Prometheus scraper.
class MetricsHttpServer {
 public:
  explicit MetricsHttpServer(const Metrics* metrics) : metrics_(metrics) {}
  ~MetricsHttpServer();
  // `address` is host:port; port 0 picks a free one (see port()).
  absl::Status Start(const std::string& address);
  void Stop();
  int port() const { return port_; }

 private:
  void Serve();
  const Metrics* metrics_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace kvcal::service

#endif  // KVCAL_SERVICE_METRICS_H_
