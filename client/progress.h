// Progress of an upload on stderr: a redrawn bar (bytes, chunks, rate, ETA)
// on a terminal, a plain line every few seconds otherwise.
//
//   auto counters = std::make_shared<kvcal::UploadCounters>();
//   kvcal::ProgressReporter progress("push", total_bytes, total_chunks,
//   counters);
//   ... upload with options.counters = counters ...
//   progress.Finish();
#ifndef KVCAL_CLIENT_PROGRESS_H_
#define KVCAL_CLIENT_PROGRESS_H_

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/time/time.h"
#include "client/uploader.h"

namespace kvcal {

class ProgressReporter {
 public:
  ProgressReporter(std::string label, uint64_t total_bytes,
                   uint64_t total_chunks,
                   std::shared_ptr<const UploadCounters> counters);
  ProgressReporter(const ProgressReporter&) = delete;
  ProgressReporter& operator=(const ProgressReporter&) = delete;
  ~ProgressReporter();

  // Stops the reporter and prints the final line. Idempotent.
  void Finish();

  // One progress line (exposed for tests).
  static std::string Line(const std::string& label, uint64_t bytes,
                          uint64_t total_bytes, uint64_t chunks,
                          uint64_t total_chunks, absl::Duration elapsed,
                          bool bar);

 private:
  void Print(bool final);

  std::string label_;
  uint64_t total_bytes_;
  uint64_t total_chunks_;
  std::shared_ptr<const UploadCounters> counters_;
  bool tty_;
  absl::Time start_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

}  // namespace kvcal

#endif  // KVCAL_CLIENT_PROGRESS_H_
