// Bearer-token authentication for kvcal.v1 RPCs (--auth-token-file).
//
// The token file has one token per line: `tenant:token`, or a bare token for
// tenant `default`; blank lines and lines starting with '#' are ignored.
//
//   KVCAL_ASSIGN_OR_RETURN(TokenAuthenticator auth,
//                          TokenAuthenticator::FromFile(path));
//   KVCAL_ASSIGN_OR_RETURN(std::string tenant,
//                          auth.Authenticate("Bearer s3cret"));
#ifndef KVCAL_SERVICE_AUTH_H_
#define KVCAL_SERVICE_AUTH_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvcal::service {

class TokenAuthenticator {
 public:
  static absl::StatusOr<TokenAuthenticator> FromFile(const std::string& path);
  static absl::StatusOr<TokenAuthenticator> FromText(absl::string_view text);

  // `authorization_header` is the metadata value ("Bearer <token>", scheme
  // case-insensitive). Returns the tenant, or Unauthenticated. Tokens are
  // compared in constant time and never appear in messages.
  absl::StatusOr<std::string> Authenticate(
      absl::string_view authorization_header) const;

 private:
  struct Entry {
    std::string tenant;
    std::string token;
  };
  std::vector<Entry> entries_;
};

}  // namespace kvcal::service

#endif  // KVCAL_SERVICE_AUTH_H_
