// The client's channels against a worker whose connection handshake is slow:
// a proxy on loopback holds every byte for 300 ms each way, so TCP connects
// at once but the worker's HTTP/2 SETTINGS arrive late (as from a loaded
// worker, a sanitizer build or a distant host). A fail-fast call on a fresh
// channel must still succeed: the channel arguments once set gRPC's minimum
// connect timeout to 100 ms, and every such connection timed out ("connection
// attempt timed out before receiving SETTINGS frame").
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "client/rpc/calibration_client.h"
#include "client/rpc/local_worker.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcal {
namespace {

std::string WorkerPath() {
  if (const char* env = std::getenv("KVCAL_TEST_WORKER")) return env;
  return KVCAL_WORKER_PATH;
}

// Forwards loopback connections to `target_port`, delaying every chunk of
// bytes by `delay` in both directions.
class DelayingProxy {
 public:
  DelayingProxy(int target_port, std::chrono::milliseconds delay)
      : target_port_(target_port), delay_(delay) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    ::listen(listen_fd_, 16);
    socklen_t len = sizeof(addr);
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    accept_thread_ = std::thread([this] { AcceptLoop(); });
  }
  ~DelayingProxy() {
    stopping_ = true;
    ::shutdown(listen_fd_, SHUT_RDWR);
    ::close(listen_fd_);
    accept_thread_.join();
    for (std::thread& t : pumps_) t.join();
    for (int fd : fds_) ::close(fd);
  }
  int port() const { return port_; }

 private:
  void AcceptLoop() {
    while (!stopping_) {
      const int client = ::accept(listen_fd_, nullptr, nullptr);
      if (client < 0) return;
      const int server = ::socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      addr.sin_port = htons(static_cast<uint16_t>(target_port_));
      if (::connect(server, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) !=
          0) {
        ::close(client);
        ::close(server);
        continue;
      }
      fds_.push_back(client);
      fds_.push_back(server);
      pumps_.emplace_back([this, client, server] { Pump(client, server); });
      pumps_.emplace_back([this, client, server] { Pump(server, client); });
    }
  }
  void Pump(int from, int to) {
    char buf[65536];
    while (!stopping_) {
      pollfd p{from, POLLIN, 0};
      if (::poll(&p, 1, 100) <= 0) continue;
      const ssize_t n = ::recv(from, buf, sizeof(buf), 0);
      if (n <= 0) break;
      std::this_thread::sleep_for(delay_);
      if (::send(to, buf, static_cast<size_t>(n), MSG_NOSIGNAL) != n) break;
    }
    ::shutdown(to, SHUT_WR);
  }

  const int target_port_;
  const std::chrono::milliseconds delay_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::thread accept_thread_;
  std::vector<std::thread> pumps_;  // only the accept thread adds
  std::vector<int> fds_;
};

TEST(ConnectionTest, SlowHandshakeStillConnectsOnAFailFastCall) {
  LocalWorker::Options options;
  options.binary = WorkerPath();
  options.extra_args = {"--worker-id", "slow"};
  auto worker = LocalWorker::Start(options);
  ASSERT_TRUE(worker.ok()) << worker.status();
  DelayingProxy proxy((*worker)->port(), std::chrono::milliseconds(300));
  // Connect asks every worker its id (GetWorkerInfo) on a fresh channel.
  auto client = CalibrationClient::Connect(
      {"127.0.0.1:" + std::to_string(proxy.port())}, ConnectionOptions());
  ASSERT_TRUE(client.ok()) << client.status();
  // A fail-fast call (no wait_for_ready) on the client's channel: an
  // unknown session is NOT_FOUND from the worker, never UNAVAILABLE.
  EXPECT_EQ(client->GetSession("none").status().code(),
            absl::StatusCode::kNotFound)
      << client->GetSession("none").status();
}

}  // namespace
}  // namespace kvcal
