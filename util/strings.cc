#include "util/strings.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace kvcal {

std::string ShapeString(absl::Span<const uint64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ","), "]");
}

}  // namespace kvcal
