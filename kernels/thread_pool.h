// A fixed pool of worker threads with a blocking ParallelFor, used by the CPU
// backend to spread the heads of a large chunk over cores.
//
//   kvcal::ThreadPool& pool = kvcal::ThreadPool::Shared();
//   pool.ParallelFor(num_heads, [&](size_t head) { Process(head); });
//
// The calling thread takes part in the work, so nested or concurrent calls
// from many threads cannot deadlock.
#ifndef KVCAL_KERNELS_THREAD_POOL_H_
#define KVCAL_KERNELS_THREAD_POOL_H_

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kvcal {

class ThreadPool {
 public:
  // `threads` workers besides the callers (0 = hardware concurrency - 1).
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // The process-wide pool.
  static ThreadPool& Shared();

  int workers() const { return static_cast<int>(workers_.size()); }

  // Calls fn(i) for every i in [0, n), returns when all calls returned.
  void ParallelFor(size_t n, const std::function<void(size_t)>& fn);

 private:
  void WorkerLoop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace kvcal

#endif  // KVCAL_KERNELS_THREAD_POOL_H_
