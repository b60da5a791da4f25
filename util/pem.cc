#include "util/pem.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "util/file_io.h"

namespace kvcal {
namespace {

constexpr absl::string_view kBegin = "-----BEGIN ";
constexpr absl::string_view kEnd = "-----END ";
constexpr off_t kMaxPemBytes = 1 << 20;

bool LabelMatches(absl::string_view label, PemKind kind) {
  if (kind == PemKind::kCertificate) {
    return label == "CERTIFICATE" || label == "X509 CERTIFICATE" ||
           label == "TRUSTED CERTIFICATE";
  }
  return label == "PRIVATE KEY" || label == "RSA PRIVATE KEY" ||
         label == "EC PRIVATE KEY";
}

absl::string_view What(PemKind kind) {
  return kind == PemKind::kCertificate ? "a PEM certificate"
                                       : "a PEM private key";
}

}  // namespace

absl::Status CheckPem(absl::string_view text, PemKind kind) {
  const auto not_pem = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(
        "not ", What(kind), why.empty() ? "" : absl::StrCat(" (", why, ")")));
  };
  if (text.empty()) return not_pem("the file is empty");
  std::string other_label;
  for (size_t at = text.find(kBegin); at != absl::string_view::npos;
       at = text.find(kBegin, at + 1)) {
    const size_t label_begin = at + kBegin.size();
    const size_t label_end = text.find("-----", label_begin);
    if (label_end == absl::string_view::npos) break;
    const absl::string_view label =
        text.substr(label_begin, label_end - label_begin);
    const std::string end_line = absl::StrCat(kEnd, label, "-----");
    const size_t body_begin = label_end + 5;
    const size_t body_end = text.find(end_line, body_begin);
    if (body_end == absl::string_view::npos) {
      return not_pem(absl::StrCat("'", label, "' block without its END line"));
    }
    if (!LabelMatches(label, kind)) {
      if (other_label.empty()) other_label = std::string(label);
      continue;
    }
    const absl::string_view body = text.substr(body_begin, body_end - body_begin);
    if (absl::StrContains(body, "ENCRYPTED")) {
      return not_pem("an encrypted key: gRPC needs it without a passphrase");
    }
    std::string base64;
    for (char c : body) {
      if (!absl::ascii_isspace(static_cast<unsigned char>(c))) base64 += c;
    }
    std::string der;
    if (base64.empty() || !absl::Base64Unescape(base64, &der) || der.empty()) {
      return not_pem(absl::StrCat("the '", label, "' block is not base64"));
    }
    return absl::OkStatus();
  }
  if (!other_label.empty()) {
    return not_pem(absl::StrCat("it holds a ", other_label));
  }
  size_t binary = 0;
  for (char c : text.substr(0, 512)) {
    const unsigned char u = static_cast<unsigned char>(c);
    if (u == 0 || u >= 0x80 || (u < 0x20 && !absl::ascii_isspace(u))) {
      ++binary;
    }
  }
  return not_pem(binary > 0 ? "binary: a DER file? `openssl x509 -inform der` "
                              "converts a certificate"
                            : "no -----BEGIN line");
}

absl::StatusOr<std::string> ReadPemFile(absl::string_view flag,
                                        const std::string& path,
                                        PemKind kind) {
  const auto error = [&](absl::Status s) {
    return absl::Status(s.code(),
                        absl::StrCat(flag, " ", path, ": ", s.message()));
  };
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int e = errno;
    return error(absl::Status(
        e == ENOENT ? absl::StatusCode::kNotFound
                    : absl::StatusCode::kInvalidArgument,
        absl::StrCat("cannot read it: ", std::strerror(e))));
  }
  if (!S_ISREG(st.st_mode)) {
    return error(absl::InvalidArgumentError(
        S_ISDIR(st.st_mode) ? "a directory, not a PEM file"
                            : "not a regular file"));
  }
  if (st.st_size > kMaxPemBytes) {
    return error(absl::InvalidArgumentError(
        absl::StrCat(st.st_size, " bytes: too large for a PEM file (at most ",
                     kMaxPemBytes, ")")));
  }
  absl::StatusOr<std::string> text = ReadSmallFile(path);
  if (!text.ok()) return error(text.status());
  if (absl::Status s = CheckPem(*text, kind); !s.ok()) return error(s);
  return text;
}

}  // namespace kvcal
