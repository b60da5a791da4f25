// host:port as kvcal's command lines and clients take them: one parser for
// the worker's --listen and --metrics-listen, the CLI's --server and the
// client library's endpoint lists, so that every one of them refuses the
// same impossible addresses with the same words.
//
//   KVCAL_ASSIGN_OR_RETURN(kvcal::HostPort a,
//                          kvcal::ParseHostPort("[::1]", {.default_port =
//                                                kvcal::kDefaultPort}));
//   a.ToString();  // "[::1]:50051", a.port_defaulted == true
#ifndef KVCAL_UTIL_HOST_PORT_H_
#define KVCAL_UTIL_HOST_PORT_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvcal {

// The worker's port when an address names none (kvcal-worker's --listen
// default is 127.0.0.1:50051).
inline constexpr int kDefaultPort = 50051;

struct HostPortRules {
  // Used when the text has no port; -1: a port is required.
  int default_port = -1;
  // 0 for a listening address (port 0 picks a free one), 1 for one to dial.
  int min_port = 0;
};

struct HostPort {
  std::string host;  // without brackets: "::1", "127.0.0.1", "worker-0"
  int port = 0;
  bool port_defaulted = false;  // the text had no port
  // "host:port", IPv6 in brackets: "[::1]:50051".
  std::string ToString() const;
};

// "host:port", "[v6]:port", and, with a default port, "host" and "[v6]".
// InvalidArgument, saying what was wrong and what is wanted, for: an empty
// text or host, a port that is not a decimal number in min_port..65535
// ("99999" is not taken modulo 65536), an IPv6 address without brackets
// ("::1:50051" is ambiguous), brackets around something that is not IPv6,
// and spaces or other characters no host name has.
absl::StatusOr<HostPort> ParseHostPort(absl::string_view text,
                                       const HostPortRules& rules);

// A gRPC target with a scheme other than host:port ("unix:/run/w.sock",
// "ipv4:10.0.0.1:50051", "dns://8.8.8.8/name:50051"), which clients pass on
// to gRPC as it is. "dns:///" (kvcal's every-address form) is not one.
bool HasTargetScheme(absl::string_view target);

// This host's identity for same-host checks (shared memory: the producer
// sends it, the worker compares it with its own): the kernel's boot id,
// /proc/sys/kernel/random/boot_id, "" when unknown.
std::string HostBootId();

}  // namespace kvcal

#endif  // KVCAL_UTIL_HOST_PORT_H_
