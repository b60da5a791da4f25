#include "client/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvcal {

ProgressReporter::ProgressReporter(
    std::string label, uint64_t total_bytes, uint64_t total_chunks,
    std::shared_ptr<const UploadCounters> counters)
    : label_(std::move(label)),
      total_bytes_(total_bytes),
      total_chunks_(total_chunks),
      counters_(std::move(counters)),
      tty_(::isatty(STDERR_FILENO) == 1),
      start_(absl::Now()) {
  thread_ = std::thread([this] {
    const absl::Duration period =
        tty_ ? absl::Milliseconds(200) : absl::Seconds(5);
    std::unique_lock<std::mutex> lock(mu_);
    while (!cv_.wait_for(lock, absl::ToChronoMilliseconds(period),
                         [this] { return done_; })) {
      Print(/*final=*/false);
    }
  });
}

ProgressReporter::~ProgressReporter() { Finish(); }

void ProgressReporter::Finish() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return;
    done_ = true;
  }
  cv_.notify_all();
  thread_.join();
  Print(/*final=*/true);
}

std::string ProgressReporter::Line(const std::string& label, uint64_t bytes,
                                   uint64_t total_bytes, uint64_t chunks,
                                   uint64_t total_chunks,
                                   absl::Duration elapsed, bool bar) {
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
  absl::StrAppend(
      &out, absl::StrFormat(" %3.0f%% %.1f/%.1f MiB, %u/%u chunks, %.1f MiB/s, "
                            "ETA %s",
                            100.0 * fraction, bytes / mib, total_bytes / mib,
                            chunks, total_chunks, rate / mib, eta));
  return out;
}

void ProgressReporter::Print(bool final) {
  const std::string line = Line(label_, counters_->bytes_acked.load(),
                                total_bytes_, counters_->chunks_acked.load(),
                                total_chunks_, absl::Now() - start_, tty_);
  const uint64_t reconnects = counters_->reconnects.load();
  const std::string extra =
      reconnects > 0 ? absl::StrCat(", ", reconnects, " reconnects") : "";
  if (tty_) {
    std::fprintf(stderr, "\r\033[K%s%s%s", line.c_str(), extra.c_str(),
                 final ? "\n" : "");
  } else {
    std::fprintf(stderr, "%s%s\n", line.c_str(), extra.c_str());
  }
  std::fflush(stderr);
}

}  // namespace kvcal
