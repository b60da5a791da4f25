// Starts a real kvcal-worker process on a loopback port for integration
// tests, and stops it with SIGTERM (or SIGKILL) at the end.
//
//   WorkerProcess worker({"--backend", "cpu"});
//   ASSERT_TRUE(worker.ok()) << worker.error();
//   auto stub = kvcal::v1::Calibration::NewStub(worker.Channel());
#ifndef KVCAL_TESTS_SERVICE_WORKER_PROCESS_H_
#define KVCAL_TESTS_SERVICE_WORKER_PROCESS_H_

#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "tests/wait_until.h"

namespace kvcal::testing {

class WorkerProcess {
 public:
  // `listen` is host:port; port 0 picks a free one (a restarted worker can
  // take the port of the one it replaces).
  explicit WorkerProcess(std::vector<std::string> extra_args = {},
                         std::string listen = "127.0.0.1:0") {
    dir_ = std::filesystem::temp_directory_path() /
           ("kvcal-worker-test-" + std::to_string(getpid()) + "-" +
            std::to_string(counter_++));
    std::filesystem::create_directories(dir_);
    const std::string port_file = (dir_ / "port").string();
    const std::string log_file = (dir_ / "worker.log").string();
    // KVCAL_WORKER_PATH in the environment overrides the build's path (a
    // GPU bundle runs the tests far from the build directory).
    const char* worker_path = std::getenv("KVCAL_WORKER_PATH");
    std::vector<std::string> args = {
        worker_path != nullptr && *worker_path != '\0' ? worker_path
                                                       : KVCAL_WORKER_PATH,
        "--listen", listen, "--port-file", port_file};
    if (std::find(extra_args.begin(), extra_args.end(), "--backend") ==
        extra_args.end()) {
      args.push_back("--backend");
      args.push_back("cpu");
    }
    args.insert(args.end(), extra_args.begin(), extra_args.end());
    pid_ = fork();
    if (pid_ == 0) {
      FILE* log = std::freopen(log_file.c_str(), "w", stderr);
      (void)log;
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    bool exited = false;
    const bool started = WaitUntil(
        [&] {
          std::ifstream in(port_file);
          if (in >> port_ && port_ > 0) return true;
          int status = 0;
          exited = waitpid(pid_, &status, WNOHANG) == pid_;
          return exited;
        },
        std::chrono::seconds(20));
    if (exited) {
      error_ = "worker exited during start-up: " + ReadLog();
      pid_ = -1;
    } else if (!started) {
      error_ = "worker did not write its port file in time: " + ReadLog();
    }
  }

  // The worker's log goes with its directory; when a test has failed, it
  // is printed first (a sanitizer report or an error in the worker is often
  // the reason, and CI keeps nothing else). A suite's shared worker is
  // destroyed in TearDownTestSuite, outside any test, where HasFailure()
  // sees none of the suite's failures: count the process's failed tests too.
  ~WorkerProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (::testing::Test::HasFailure() ||
        ::testing::UnitTest::GetInstance()->failed_test_count() > 0) {
      std::string log = ReadLog();
      constexpr size_t kTail = 16 << 10;
      if (log.size() > kTail) log = "[...]\n" + log.substr(log.size() - kTail);
      std::fprintf(stderr, "--- log of the worker in %s ---\n%s--- end ---\n",
                   dir_.c_str(), log.c_str());
    }
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }

  bool ok() const { return error_.empty() && port_ > 0; }
  const std::string& error() const { return error_; }
  int port() const { return port_; }
  pid_t pid() const { return pid_; }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  const std::filesystem::path& dir() const { return dir_; }
  std::string ReadLog() const {
    std::ifstream in(dir_ / "worker.log");
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  // Waits until the log holds `text` (an event the worker logs); false after
  // `timeout`.
  bool WaitForLog(const std::string& text, std::chrono::milliseconds timeout =
                                               std::chrono::seconds(10)) {
    return WaitUntil([&] { return ReadLog().find(text) != std::string::npos; },
                     timeout, std::chrono::milliseconds(10));
  }

  std::shared_ptr<grpc::Channel> Channel(
      std::shared_ptr<grpc::ChannelCredentials> credentials =
          grpc::InsecureChannelCredentials()) const {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(256 << 20);
    args.SetMaxSendMessageSize(256 << 20);
    return grpc::CreateCustomChannel(address(), credentials, args);
  }

  // Sends `sig` and waits up to `timeout` for the exit; returns the exit
  // status as waitpid reports it, or -1 on timeout.
  int SignalAndWait(int sig, std::chrono::seconds timeout) {
    if (pid_ <= 0) return -1;
    kill(pid_, sig);
    int status = 0;
    if (!WaitUntil([&] { return waitpid(pid_, &status, WNOHANG) == pid_; },
                   timeout)) {
      return -1;
    }
    pid_ = -1;
    return status;
  }

 private:
  static inline int counter_ = 0;
  std::filesystem::path dir_;
  pid_t pid_ = -1;
  int port_ = 0;
  std::string error_;
};

}  // namespace kvcal::testing

#endif  // KVCAL_TESTS_SERVICE_WORKER_PROCESS_H_
