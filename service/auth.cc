#include "service/auth.h"

#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace kvcal::service {
namespace {

// Compares without an early exit on the first difference.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  const size_t n = std::max(a.size(), b.size());
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? a[i] : 0;
    const unsigned char y = i < b.size() ? b[i] : 0;
    diff |= x ^ y;
  }
  return diff == 0;
}

}  // namespace

absl::StatusOr<TokenAuthenticator> TokenAuthenticator::FromFile(
    const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot read auth token file ", path));
  }
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<TokenAuthenticator> auth = FromText(text.str());
  if (!auth.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", auth.status().message()));
  }
  return auth;
}

absl::StatusOr<TokenAuthenticator> TokenAuthenticator::FromText(
    absl::string_view text) {
  TokenAuthenticator auth;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    Entry entry;
    const size_t colon = line.find(':');
    if (colon == absl::string_view::npos) {
      entry.tenant = "default";
      entry.token = std::string(line);
    } else {
      entry.tenant = std::string(line.substr(0, colon));
      entry.token = std::string(line.substr(colon + 1));
    }
    if (entry.tenant.empty() || entry.token.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "line ", line_number, ": expected 'tenant:token' or 'token'"));
    }
    if (entry.tenant.size() > 64 ||
        entry.tenant.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklm"
                                       "nopqrstuvwxyz0123456789._-") !=
            std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("line ", line_number,
                       ": tenant names are 1 to 64 of A-Z a-z 0-9 . _ -"));
    }
    auth.entries_.push_back(std::move(entry));
  }
  if (auth.entries_.empty()) {
    return absl::InvalidArgumentError("no tokens");
  }
  return auth;
}

absl::StatusOr<std::string> TokenAuthenticator::Authenticate(
    absl::string_view header) const {
  constexpr absl::string_view kScheme = "bearer ";
  if (header.size() < kScheme.size() ||
      !absl::EqualsIgnoreCase(header.substr(0, kScheme.size()), kScheme)) {
    return absl::UnauthenticatedError(
        "missing 'authorization: Bearer <token>' metadata");
  }
  const absl::string_view token =
      absl::StripAsciiWhitespace(header.substr(kScheme.size()));
  const std::string* tenant = nullptr;
  for (const Entry& entry : entries_) {
    // Check every entry so that timing does not reveal which one matched.
    if (ConstantTimeEquals(token, entry.token) && tenant == nullptr) {
      tenant = &entry.tenant;
    }
  }
  if (tenant == nullptr) return absl::UnauthenticatedError("invalid token");
  return *tenant;
}

}  // namespace kvcal::service
