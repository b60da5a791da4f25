// Small text helpers every layer uses for messages.
#ifndef KVCAL_UTIL_STRINGS_H_
#define KVCAL_UTIL_STRINGS_H_

#include <cstdint>
#include <string>

#include "absl/types/span.h"

namespace kvcal {

// "[4,2,64]": how messages print a tensor shape.
std::string ShapeString(absl::Span<const uint64_t> shape);

}  // namespace kvcal

#endif  // KVCAL_UTIL_STRINGS_H_
