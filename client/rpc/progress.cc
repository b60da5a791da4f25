#include "client/rpc/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvcal {

ProgressReporter::ProgressReporter(std::string label, ProgressOptions options,
                                   std::function<Sample()> sample)
    : label_(std::move(label)),
      options_(std::move(options)),
      sample_(std::move(sample)),
      tty_(::isatty(STDERR_FILENO) == 1),
      start_(absl::Now()) {
  thread_ = std::thread([this] {
    const absl::Duration period =
        tty_ ? absl::Milliseconds(200) : absl::Seconds(5);
    std::unique_lock<std::mutex> lock(mu_);
    while (!cv_.wait_for(lock, absl::ToChronoMilliseconds(period),
                         [this] { return done_; })) {
      if (absl::Now() - start_ < options_.quiet_for) continue;
      lock.unlock();
      Print(/*final=*/false);
      lock.lock();
      printed_ = true;
    }
  });
}

ProgressReporter::ProgressReporter(
    std::string label, ProgressOptions options,
    std::shared_ptr<const ProgressCounters> counters)
    : ProgressReporter(std::move(label), std::move(options),
                       [counters = std::move(counters)] {
                         return Sample{counters->bytes.load(),
                                       counters->items.load(), "",
                                       counters->total_bytes.load(),
                                       counters->total_items.load()};
                       }) {}

ProgressReporter::ProgressReporter(
    std::string label, uint64_t total_bytes, uint64_t total_chunks,
    std::shared_ptr<const UploadCounters> counters)
    : ProgressReporter(
          std::move(label),
          ProgressOptions{.total_bytes = total_bytes,
                          .total_items = total_chunks,
                          .unit = "chunks",
                          .quiet_for = absl::ZeroDuration()},
          [counters = std::move(counters)] {
            const uint64_t reconnects = counters->reconnects.load();
            return Sample{
                counters->bytes_acked.load(), counters->chunks_acked.load(),
                reconnects > 0 ? absl::StrCat(", ", reconnects, " reconnects")
                               : ""};
          }) {}

ProgressReporter::~ProgressReporter() { Finish(); }

void ProgressReporter::Finish() {
  bool quiet = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return;
    done_ = true;
  }
  cv_.notify_all();
  thread_.join();
  {
    std::lock_guard<std::mutex> lock(mu_);
    quiet = !printed_ && absl::Now() - start_ < options_.quiet_for;
  }
  if (!quiet) Print(/*final=*/true);
}

std::string ProgressReporter::Line(const std::string& label, uint64_t bytes,
                                   uint64_t total_bytes, uint64_t items,
                                   uint64_t total_items, absl::Duration elapsed,
                                   bool bar, const std::string& unit) {
  const double mib = 1024.0 * 1024.0;
  const double seconds = std::max(absl::ToDoubleSeconds(elapsed), 1e-3);
  const double rate = static_cast<double>(bytes) / seconds;
  const double fraction =
      total_bytes == 0
          ? 1.0
          : static_cast<double>(bytes) / static_cast<double>(total_bytes);
  std::string eta = "-";
  if (rate > 0 && bytes < total_bytes) {
    eta = absl::StrFormat("%.0fs",
                          static_cast<double>(total_bytes - bytes) / rate);
  }
  std::string out = label;
  if (bar) {
    const int width = 24;
    const int filled = static_cast<int>(fraction * width);
    absl::StrAppend(&out, " [", std::string(filled, '#'),
                    std::string(width - filled, '.'), "]");
  }
  absl::StrAppend(&out,
                  absl::StrFormat(" %3.0f%% %.1f/%.1f MiB", 100.0 * fraction,
                                  bytes / mib, total_bytes / mib));
  if (!unit.empty()) {
    absl::StrAppend(&out,
                    absl::StrFormat(", %u/%u %s", items, total_items, unit));
  }
  absl::StrAppend(&out,
                  absl::StrFormat(", %.1f MiB/s, ETA %s", rate / mib, eta));
  return out;
}

void ProgressReporter::Print(bool final) {
  const Sample now = sample_();
  const std::string line = Line(
      label_, now.bytes,
      now.total_bytes != 0 ? now.total_bytes : options_.total_bytes, now.items,
      now.total_items != 0 ? now.total_items : options_.total_items,
      absl::Now() - start_, tty_, options_.unit);
  if (tty_) {
    std::fprintf(stderr, "\r\033[K%s%s%s", line.c_str(), now.suffix.c_str(),
                 final ? "\n" : "");
  } else {
    std::fprintf(stderr, "%s%s\n", line.c_str(), now.suffix.c_str());
  }
  std::fflush(stderr);
}

}  // namespace kvcal
