// A fixed set of threads that run scheduled tasks in FIFO order. The worker
// runs chunk application, Finalize, ExportState and ImportState here, so gRPC
// reactions never block on the statistics backend.
//
//   Executor executor(4);
//   executor.Schedule([] { ApplyChunk(); });
#ifndef KVCAL_SERVICE_EXECUTOR_H_
#define KVCAL_SERVICE_EXECUTOR_H_

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kvcal::service {

class Executor {
 public:
  explicit Executor(int threads);
  // Runs every task already scheduled, then joins the threads.
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  void Schedule(std::function<void()> task);

 private:
  void Loop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace kvcal::service

#endif  // KVCAL_SERVICE_EXECUTOR_H_
