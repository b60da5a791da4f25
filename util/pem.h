// PEM files as the TLS flags of kvcal and kvcal-worker take them: read with
// limits (a regular file of at most 1 MiB, so `--tls-ca /dev/zero` is an
// error, not a hang) and checked before gRPC sees them, so that a wrong file
// is one line naming the flag ("--tls-ca ca.der: not a PEM certificate")
// instead of gRPC's handshaker internals.
//
//   KVCAL_ASSIGN_OR_RETURN(std::string ca,
//       kvcal::ReadPemFile("--tls-ca", path, kvcal::PemKind::kCertificate));
#ifndef KVCAL_UTIL_PEM_H_
#define KVCAL_UTIL_PEM_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvcal {

enum class PemKind { kCertificate, kPrivateKey };

// OK when `text` holds at least one PEM block of `kind` ("CERTIFICATE";
// "PRIVATE KEY", "RSA PRIVATE KEY", "EC PRIVATE KEY") whose body is base64.
// InvalidArgument otherwise, saying what it is instead where that is clear
// ("it holds a PRIVATE KEY", "binary (DER?)", "an encrypted key").
absl::Status CheckPem(absl::string_view text, PemKind kind);

// The file's text, or InvalidArgument/NotFound: "FLAG PATH: <why>".
absl::StatusOr<std::string> ReadPemFile(absl::string_view flag,
                                        const std::string& path, PemKind kind);

}  // namespace kvcal

#endif  // KVCAL_UTIL_PEM_H_
