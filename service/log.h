// Minimal structured logging to stderr for the worker (Debian 12's Abseil
// predates absl/log).
//
//   KVCAL_LOG(INFO) << "listening on " << address;
#ifndef KVCAL_SERVICE_LOG_H_
#define KVCAL_SERVICE_LOG_H_

#include <sstream>
#include <string>

namespace kvcal::service {

enum class LogLevel { kINFO, kWARNING, kERROR };

// Writes one line, atomically with respect to other log lines.
void WriteLogLine(LogLevel level, const char* file, int line,
                  const std::string& message);

class LogMessage {
 public:
  LogMessage(LogLevel level, const char* file, int line)
      : level_(level), file_(file), line_(line) {}
  ~LogMessage() { WriteLogLine(level_, file_, line_, stream_.str()); }
  std::ostream& stream() { return stream_; }

 private:
  LogLevel level_;
  const char* file_;
  int line_;
  std::ostringstream stream_;
};

}  // namespace kvcal::service

#define KVCAL_LOG(level)                                                       \
  ::kvcal::service::LogMessage(::kvcal::service::LogLevel::k##level, __FILE__, \
                               __LINE__)                                       \
      .stream()

#endif  // KVCAL_SERVICE_LOG_H_
