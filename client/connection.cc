#include "client/connection.h"

#include <chrono>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "client/safetensors.h"
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
    if (!options.tls_ca_file.empty()) {
      KVCAL_ASSIGN_OR_RETURN(ssl.pem_root_certs,
                             ReadSmallFile(options.tls_ca_file));
    }
    if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
      return absl::InvalidArgumentError(
          "--tls-cert and --tls-key go together (mutual TLS)");
    }
    if (!options.tls_cert_file.empty()) {
      KVCAL_ASSIGN_OR_RETURN(ssl.pem_cert_chain,
                             ReadSmallFile(options.tls_cert_file));
      KVCAL_ASSIGN_OR_RETURN(ssl.pem_private_key,
                             ReadSmallFile(options.tls_key_file));
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
  KVCAL_ASSIGN_OR_RETURN(std::string token, ReadSmallFile(path));
  absl::StripAsciiWhitespace(&token);
  if (token.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": empty token"));
  }
  return token;
}

}  // namespace kvcal
