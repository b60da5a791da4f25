#include "client/rpc/connection.h"

#include <sys/stat.h>

#include <chrono>
#include <regex>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "client/checkpoint/safetensors.h"
#include "util/pem.h"
#include "util/status_macros.h"

namespace kvcal {

static_assert(static_cast<int>(absl::StatusCode::kUnavailable) ==
              static_cast<int>(grpc::StatusCode::UNAVAILABLE));
static_assert(static_cast<int>(absl::StatusCode::kUnauthenticated) ==
              static_cast<int>(grpc::StatusCode::UNAUTHENTICATED));
static_assert(static_cast<int>(absl::StatusCode::kFailedPrecondition) ==
              static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION));
static_assert(static_cast<int>(absl::StatusCode::kInvalidArgument) ==
              static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
static_assert(static_cast<int>(absl::StatusCode::kResourceExhausted) ==
              static_cast<int>(grpc::StatusCode::RESOURCE_EXHAUSTED));

absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(
    const std::string& endpoint, const ConnectionOptions& options) {
  if (endpoint.empty()) {
    return absl::InvalidArgumentError("empty server address (want host:port)");
  }
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  if (!options.tls_ca_file.empty() || !options.tls_cert_file.empty()) {
    grpc::SslCredentialsOptions ssl;
    // Checked before gRPC sees them (util/pem.h): a wrong file is one line
    // naming the flag, not the handshaker's internals.
    if (!options.tls_ca_file.empty()) {
      KVCAL_ASSIGN_OR_RETURN(
          ssl.pem_root_certs,
          ReadPemFile("--tls-ca", options.tls_ca_file, PemKind::kCertificate));
    }
    if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
      return absl::InvalidArgumentError(
          "--tls-cert and --tls-key go together (mutual TLS)");
    }
    if (!options.tls_cert_file.empty()) {
      KVCAL_ASSIGN_OR_RETURN(ssl.pem_cert_chain,
                             ReadPemFile("--tls-cert", options.tls_cert_file,
                                         PemKind::kCertificate));
      KVCAL_ASSIGN_OR_RETURN(
          ssl.pem_private_key,
          ReadPemFile("--tls-key", options.tls_key_file, PemKind::kPrivateKey));
    }
    credentials = grpc::SslCredentials(ssl);
  } else {
    credentials = grpc::InsecureChannelCredentials();
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_receive_message_bytes);
  args.SetMaxSendMessageSize(-1);
  // A restarted worker should be found again in well under a second: retry
  // a refused connection after 100 ms, backing off to 1 s. Not
  // GRPC_ARG_MIN_RECONNECT_BACKOFF_MS: gRPC takes it as the time a single
  // connection attempt may take (doc/connection-backoff.md's
  // MIN_CONNECT_TIMEOUT, 20 s by default); set to 100 ms it failed every
  // connection whose TCP + HTTP/2 (+ TLS) handshake took longer: a worker
  // under load, a sanitizer build, a link with 50 ms of latency.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  // While a call is open, ping every 30 s and give up on the connection
  // after 20 s without an answer, pinging even when no data flows: a worker
  // host that vanished without a reset would otherwise leave a stream that
  // waits for acknowledgements forever. The worker accepts pings this often
  // (worker.cc).
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 30000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 20000);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  return grpc::CreateCustomChannel(endpoint, credentials, args);
}

void PrepareContext(grpc::ClientContext& context,
                    const ConnectionOptions& options, absl::Duration timeout,
                    bool wait_for_ready) {
  if (!options.auth_token.empty()) {
    context.AddMetadata("authorization", "Bearer " + options.auth_token);
  }
  if (timeout != absl::InfiniteDuration()) {
    context.set_deadline(std::chrono::system_clock::now() +
                         absl::ToChronoMilliseconds(timeout));
  }
  context.set_wait_for_ready(wait_for_ready);
}

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  // A regular file of a token's size: `/dev/zero` or a directory is an
  // error, not a hang.
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 &&
      (!S_ISREG(st.st_mode) || st.st_size > (64 << 10))) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ",
                     S_ISREG(st.st_mode) ? "too large for a token file"
                                         : "not a regular file"));
  }
  KVCAL_ASSIGN_OR_RETURN(std::string token, ReadSmallFile(path));
  absl::StripAsciiWhitespace(&token);
  if (token.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": empty token"));
  }
  return token;
}

namespace {

struct Cause {
  const char* pattern;  // in gRPC's message (case-sensitive)
  const char* says;     // what a person reads instead
};

// gRPC 1.51's words for the ways a connection fails, most specific first,
// and what they mean for a kvcal user.
constexpr Cause kCauses[] = {
    {"certificate verify failed",
     "TLS: the worker's certificate is not signed by the CA in --tls-ca, or "
     "does not name this address"},
    {"CERTIFICATE_VERIFY_FAILED",
     "TLS: the worker's certificate is not signed by the CA in --tls-ca, or "
     "does not name this address"},
    {"wrong version number",
     "TLS handshake failed: the worker does not speak TLS (leave out "
     "--tls-ca)"},
    {"WRONG_VERSION_NUMBER",
     "TLS handshake failed: the worker does not speak TLS (leave out "
     "--tls-ca)"},
    {"certificate required",
     "TLS: the worker wants a client certificate (--tls-cert and --tls-key)"},
    {"Ssl handshake failed", "TLS handshake failed"},
    {"Connection refused",
     "connection refused (is a kvcal-worker listening "
     "there?)"},
    {"Domain name not found", "cannot resolve the host name"},
    {"DNS resolution failed", "cannot resolve the host name"},
    {"Connection timed out", "connection timed out"},
    {"No route to host", "no route to host"},
    {"Network is unreachable", "network is unreachable"},
    {"Socket closed",
     "the worker closed the connection during the handshake (does it want "
     "TLS, --tls-ca, or a client certificate, --tls-cert and --tls-key?)"},
    {"Connection reset by peer",
     "the connection was reset (did the worker stop or restart?)"},
    {"No such file or directory", "no such socket"},
    {"Deadline Exceeded",
     "no answer before the deadline (is a kvcal-worker listening there?)"},
};

}  // namespace

std::string CondenseConnectionError(absl::string_view message) {
  const Cause* cause = nullptr;
  for (const Cause& c : kCauses) {
    if (c.says == absl::string_view("no such socket") &&
        !absl::StrContains(message, "unix:")) {
      continue;  // a file the worker could not open is its own message
    }
    if (absl::StrContains(message, c.pattern)) {
      cause = &c;
      break;
    }
  }
  if (cause == nullptr) return std::string(message);
  // The address as the user gave it: the endpoint the call was for
  // ("GetSession on w1 (host:port): ...", "ListSessions on host:port: ..."),
  // else the one gRPC tried ("ipv4:127.0.0.1:50051: ..."), else the name DNS
  // could not find.
  const std::string text(message);
  std::smatch m;
  static const std::regex on_named(R"( on \S+ \((\S+?)\): )");
  static const std::regex on(R"( on (\S+?): )");
  static const std::regex tried(R"((?:ipv4|ipv6|unix):(\S+?): )");
  static const std::regex dns(R"(DNS resolution failed for (\S+?):? )");
  std::string address;
  if (std::regex_search(text, m, on_named) || std::regex_search(text, m, on) ||
      std::regex_search(text, m, tried) || std::regex_search(text, m, dns)) {
    address = absl::StrReplaceAll(m[1].str(), {{"%5B", "["}, {"%5D", "]"}});
  }
  if (address.empty()) return text;
  return absl::StrCat(address, ": ", cause->says);
}

}  // namespace kvcal
