#include "util/strings.h"

#include <algorithm>
#include <iterator>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace kvcal {

bool IsIdentifierChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
         (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
}

size_t FirstNonIdentifierChar(absl::string_view text) {
  for (size_t i = 0; i < text.size(); ++i) {
    if (!IsIdentifierChar(text[i])) return i;
  }
  return absl::string_view::npos;
}

std::string ShapeString(absl::Span<const uint64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ","), "]");
}

std::string IdList(absl::Span<const std::string> ids) {
  return absl::StrCat("[", absl::StrJoin(ids, ", "), "]");
}

std::string DescribeWorkerSetChange(absl::Span<const std::string> session_ids,
                                    absl::Span<const std::string> other_ids) {
  std::vector<std::string> a(session_ids.begin(), session_ids.end());
  std::vector<std::string> b(other_ids.begin(), other_ids.end());
  std::sort(a.begin(), a.end());
  std::sort(b.begin(), b.end());
  std::vector<std::string> added, missing;
  std::set_difference(b.begin(), b.end(), a.begin(), a.end(),
                      std::back_inserter(added));
  std::set_difference(a.begin(), a.end(), b.begin(), b.end(),
                      std::back_inserter(missing));
  std::vector<std::string> parts;
  if (!added.empty()) parts.push_back(absl::StrCat("added ", IdList(added)));
  if (!missing.empty()) {
    parts.push_back(absl::StrCat("missing ", IdList(missing)));
  }
  if (parts.empty()) parts.push_back("same ids, different layer owners");
  return absl::StrJoin(parts, ", ");
}

std::string ShellQuote(const std::string& word) {
  if (!word.empty() &&
      word.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUV"
                             "WXYZ0123456789_-./=:,+@%") == std::string::npos) {
    return word;
  }
  std::string quoted = "'";
  for (char c : word) {
    if (c == '\'') {
      quoted += "'\\''";
    } else {
      quoted += c;
    }
  }
  return quoted + "'";
}

}  // namespace kvcal
