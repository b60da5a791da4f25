// Progress of a long command on stderr: a redrawn bar (bytes, items, rate,
// ETA) on a terminal, a plain line every few seconds otherwise.
//
//   auto counters = std::make_shared<kvcal::ProgressCounters>();
//   kvcal::ProgressReporter progress("patch", {.total_bytes = n}, counters);
//   ... counters->bytes += written; ...
//   progress.Finish();
//
// `kvcal push` reports an upload's UploadCounters; `kvcal patch` the bytes
// staged and verified; `kvcal inspect` the shards read.
#ifndef KVCAL_CLIENT_RPC_PROGRESS_H_
#define KVCAL_CLIENT_RPC_PROGRESS_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/time/time.h"
#include "client/rpc/uploader.h"

namespace kvcal {

// What a reporter reads; written by the worker thread of the command.
struct ProgressCounters {
  std::atomic<uint64_t> bytes{0};
  std::atomic<uint64_t> items{0};
  // 0: the reporter's ProgressOptions totals.
  std::atomic<uint64_t> total_bytes{0};
  std::atomic<uint64_t> total_items{0};
};

struct ProgressOptions {
  uint64_t total_bytes = 0;
  uint64_t total_items = 0;
  // "chunks", "files", ...; empty: the line shows no item count.
  std::string unit;
  // Nothing is printed before this much time has passed, and no final line
  // if nothing was: a command that is quick stays quiet.
  absl::Duration quiet_for = absl::ZeroDuration();
};

class ProgressReporter {
 public:
  // Reads `sample` (bytes, items, and an optional suffix) from its thread;
  // non-zero totals in a sample replace the options' (totals learnt late).
  struct Sample {
    uint64_t bytes = 0;
    uint64_t items = 0;
    std::string suffix;
    uint64_t total_bytes = 0;
    uint64_t total_items = 0;
  };
  ProgressReporter(std::string label, ProgressOptions options,
                   std::function<Sample()> sample);
  ProgressReporter(std::string label, ProgressOptions options,
                   std::shared_ptr<const ProgressCounters> counters);
  // An upload: bytes and chunks acked, reconnects as the suffix.
  ProgressReporter(std::string label, uint64_t total_bytes,
                   uint64_t total_chunks,
                   std::shared_ptr<const UploadCounters> counters);
  ProgressReporter(const ProgressReporter&) = delete;
  ProgressReporter& operator=(const ProgressReporter&) = delete;
  ~ProgressReporter();

  // Stops the reporter and prints the final line. Idempotent.
  void Finish();

  // One progress line (exposed for tests); `unit` empty: no item count.
  static std::string Line(const std::string& label, uint64_t bytes,
                          uint64_t total_bytes, uint64_t items,
                          uint64_t total_items, absl::Duration elapsed,
                          bool bar, const std::string& unit = "chunks");

 private:
  void Print(bool final);

  std::string label_;
  ProgressOptions options_;
  std::function<Sample()> sample_;
  bool tty_;
  absl::Time start_;
  bool printed_ = false;  // guarded by mu_
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

}  // namespace kvcal

#endif  // KVCAL_CLIENT_RPC_PROGRESS_H_
