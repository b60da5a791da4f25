#include "util/strings.h"

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

}  // namespace kvcal
