// Starts a kvcal-worker process on loopback and stops it: for `kvcal demo`
// and for tests that talk to a real worker.
//
//   KVCAL_ASSIGN_OR_RETURN(std::string binary, kvcal::FindWorkerBinary());
//   KVCAL_ASSIGN_OR_RETURN(auto worker, kvcal::LocalWorker::Start({.binary =
//   binary}));
//   ... connect to worker->address() ...
//   KVCAL_RETURN_IF_ERROR(worker->Stop());  // SIGTERM, then wait
//
// The worker is asked to write its bound port to a file (--port-file); Start
// returns once it has.
#ifndef KVCAL_CLIENT_RPC_LOCAL_WORKER_H_
#define KVCAL_CLIENT_RPC_LOCAL_WORKER_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace kvcal {

// kvcal-worker next to this executable (../service/kvcal-worker, then the
// same directory), then on PATH.
absl::StatusOr<std::string> FindWorkerBinary();

class LocalWorker {
 public:
  struct Options {
    std::string binary;
    // "127.0.0.1:0" picks a free port.
    std::string listen = "127.0.0.1:0";
    std::string backend = "cpu";
    std::vector<std::string> extra_args;
    absl::Duration startup_timeout = absl::Seconds(30);
  };

  [[nodiscard]] static absl::StatusOr<std::unique_ptr<LocalWorker>> Start(
      Options options);
  LocalWorker(const LocalWorker&) = delete;
  LocalWorker& operator=(const LocalWorker&) = delete;
  // Kills the worker if it still runs.
  ~LocalWorker();

  int port() const { return port_; }
  std::string address() const;
  // The executable it runs (Options::binary).
  const std::string& binary() const { return binary_; }
  const std::string& log_path() const { return log_path_; }
  pid_t pid() const { return pid_; }

  // SIGTERM, then wait up to `grace` (SIGKILL after). Ok when it exited 0.
  absl::Status Stop(absl::Duration grace = absl::Seconds(20));
  // SIGKILL and reap, as a crash would end it.
  void Kill();

 private:
  LocalWorker() = default;

  pid_t pid_ = -1;
  int port_ = 0;
  std::string binary_;
  std::string dir_;
  std::string log_path_;
};

}  // namespace kvcal

#endif  // KVCAL_CLIENT_RPC_LOCAL_WORKER_H_
