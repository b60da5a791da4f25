#include "service/log.h"

#include <chrono>
#include <cstdio>
#include <ctime>
#include <mutex>

namespace kvcal::service {

void WriteLogLine(LogLevel level, const char* file, int line,
                  const std::string& message) {
  static std::mutex mu;
  const auto now = std::chrono::system_clock::now();
  const std::time_t seconds = std::chrono::system_clock::to_time_t(now);
  const auto millis = std::chrono::duration_cast<std::chrono::milliseconds>(
                          now.time_since_epoch())
                          .count() %
                      1000;
  std::tm tm;
  gmtime_r(&seconds, &tm);
  char stamp[32];
  std::strftime(stamp, sizeof(stamp), "%Y-%m-%dT%H:%M:%S", &tm);
  const char* name = level == LogLevel::kINFO      ? "I"
                     : level == LogLevel::kWARNING ? "W"
                                                   : "E";
  const char* base = file;
  for (const char* p = file; *p != '\0'; ++p) {
    if (*p == '/') base = p + 1;
  }
  std::lock_guard<std::mutex> lock(mu);
  std::fprintf(stderr, "%s %s.%03dZ %s:%d] %s\n", name, stamp,
               static_cast<int>(millis), base, line, message.c_str());
  std::fflush(stderr);
}

}  // namespace kvcal::service
