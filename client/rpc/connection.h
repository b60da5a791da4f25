// Channels to kvcal workers: TLS, the bearer token, message limits, and the
// one conversion from grpc::Status to absl::Status on the client side.
//
//   kvcal::ConnectionOptions options{.auth_token = "s3cret",
//                                    .tls_ca_file = "ca.pem"};
//   KVCAL_ASSIGN_OR_RETURN(auto channel,
//                          kvcal::MakeChannel("worker:50051", options));
//   grpc::ClientContext context;
//   kvcal::PrepareContext(context, options, absl::Seconds(30));
#ifndef KVCAL_CLIENT_RPC_CONNECTION_H_
#define KVCAL_CLIENT_RPC_CONNECTION_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "util/grpc_status.h"  // ToAbslStatus, for the callers of these channels

namespace kvcal {

struct ConnectionOptions {
  // Sent as `authorization: Bearer <token>` when non-empty.
  std::string auth_token;
  // PEM files; TLS when tls_ca_file is set (mutual TLS with cert and key).
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  // Largest message the client receives (Finalize responses, states).
  int max_receive_message_bytes = 256 << 20;
};

absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(
    const std::string& endpoint, const ConnectionOptions& options);

// Adds the token and, when `timeout` is finite, a deadline. With
// `wait_for_ready`, the call waits for a (re)connecting worker until then.
void PrepareContext(grpc::ClientContext& context,
                    const ConnectionOptions& options, absl::Duration timeout,
                    bool wait_for_ready = false);

// Reads the bearer token from a file (trailing whitespace trimmed).
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

// A failed call's message as a person reads it: "<address>: <cause>" for
// the connection failures gRPC describes at length ("127.0.0.1:1:
// connection refused (is a kvcal-worker listening there?)", a TLS handshake
// that failed and why, a name that does not resolve); any other message as
// it is. The CLI prints gRPC's full text with --verbose.
std::string CondenseConnectionError(absl::string_view message);

}  // namespace kvcal

#endif  // KVCAL_CLIENT_RPC_CONNECTION_H_
