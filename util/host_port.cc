#include "util/host_port.h"

#include <cstdint>
#include <fstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "util/strings.h"

namespace kvcal {
namespace {

std::string PortRange(const HostPortRules& rules) {
  return absl::StrCat(rules.min_port, "..65535");
}

// A host name or IPv4 address: letters, digits, '.', '-', '_'.
bool IsHostName(absl::string_view host) {
  return FirstNonIdentifierChar(host) == absl::string_view::npos;
}

// An IPv6 address, optionally with a zone ("fe80::1%eth0"): hex digits,
// ':' and '.' (an embedded IPv4), at least two colons.
bool IsIpv6(absl::string_view host) {
  const size_t zone = host.find('%');
  const absl::string_view address = host.substr(0, zone);
  int colons = 0;
  for (char c : address) {
    if (c == ':') {
      ++colons;
    } else if (!absl::ascii_isxdigit(static_cast<unsigned char>(c)) &&
               c != '.') {
      return false;
    }
  }
  if (zone != absl::string_view::npos &&
      (zone + 1 == host.size() || !IsHostName(host.substr(zone + 1)))) {
    return false;
  }
  return colons >= 2;
}

absl::StatusOr<int> ParsePort(absl::string_view text,
                              const HostPortRules& rules) {
  if (text.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("no port after ':': want a port in ", PortRange(rules)));
  }
  uint64_t port = 0;
  for (char c : text) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "port '", text, "' is not a number: want ", PortRange(rules)));
    }
  }
  if (text.size() > 6 || !absl::SimpleAtoi(text, &port) || port > 65535 ||
      port < static_cast<uint64_t>(rules.min_port)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "port ", text, " is out of range: want ", PortRange(rules)));
  }
  return static_cast<int>(port);
}

}  // namespace

bool HasTargetScheme(absl::string_view target) {
  if (absl::StartsWith(target, "dns:///")) return false;
  for (absl::string_view scheme : {"unix:", "unix-abstract:", "ipv4:", "ipv6:",
                                   "vsock:", "xds:", "dns:"}) {
    if (absl::StartsWith(target, scheme)) return true;
  }
  return false;
}

std::string HostPort::ToString() const {
  if (host.find(':') != std::string::npos) {
    return absl::StrCat("[", host, "]:", port);
  }
  return absl::StrCat(host, ":", port);
}

absl::StatusOr<HostPort> ParseHostPort(absl::string_view text,
                                       const HostPortRules& rules) {
  const std::string want =
      rules.default_port >= 0 ? "HOST or HOST:PORT" : "HOST:PORT";
  if (text.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("empty address: want ", want));
  }
  HostPort out;
  absl::string_view port_text;
  bool has_port = false;
  if (text.front() == '[') {
    const size_t close = text.find(']');
    if (close == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", text, "' has no closing ']'"));
    }
    out.host = std::string(text.substr(1, close - 1));
    if (!IsIpv6(out.host)) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", out.host, "' in brackets is not an IPv6 address"));
    }
    const absl::string_view rest = text.substr(close + 1);
    if (!rest.empty()) {
      if (rest.front() != ':') {
        return absl::InvalidArgumentError(absl::StrCat(
            "'", text, "': want [IPv6]:PORT, found '", rest, "' after ']'"));
      }
      has_port = true;
      port_text = rest.substr(1);
    }
  } else {
    const size_t colon = text.rfind(':');
    if (colon != absl::string_view::npos &&
        text.find(':') != colon) {  // two or more colons: bare IPv6
      return absl::InvalidArgumentError(
          absl::StrCat("'", text,
                       "': an IPv6 address goes in brackets, followed by the "
                       "port, e.g. [::1]:",
                       kDefaultPort));
    }
    if (colon != absl::string_view::npos) {
      has_port = true;
      port_text = text.substr(colon + 1);
      out.host = std::string(text.substr(0, colon));
    } else {
      out.host = std::string(text);
    }
    if (out.host.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "no host before ':", port_text, "': want ", want,
          " (0.0.0.0 is every IPv4 interface, 127.0.0.1 this machine only)"));
    }
    if (!IsHostName(out.host)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "'", out.host,
          "' is not a host name or address (letters, digits, '.', '-', '_')"));
    }
  }
  if (has_port) {
    absl::StatusOr<int> port = ParsePort(port_text, rules);
    if (!port.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", text, "': ", port.status().message()));
    }
    out.port = *port;
  } else if (rules.default_port >= 0) {
    out.port = rules.default_port;
    out.port_defaulted = true;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("'", text, "' has no port: want ", want, ", e.g. ",
                     HostPort{out.host, kDefaultPort, false}.ToString()));
  }
  return out;
}

std::string HostBootId() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  return std::string(absl::StripAsciiWhitespace(id));
}

}  // namespace kvcal
