// Small text helpers every layer uses for messages.
#ifndef KVCAL_UTIL_STRINGS_H_
#define KVCAL_UTIL_STRINGS_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace kvcal {

// "[4,2,64]": how messages print a tensor shape.
std::string ShapeString(absl::Span<const uint64_t> shape);

// The characters of kvcal's identifiers (session, worker and producer ids,
// shared-memory names, host names): [A-Za-z0-9._-], ASCII only.
bool IsIdentifierChar(char c);

// The position of the first character of `text` outside [A-Za-z0-9._-],
// or absl::string_view::npos when there is none.
size_t FirstNonIdentifierChar(absl::string_view text);

}  // namespace kvcal

#endif  // KVCAL_UTIL_STRINGS_H_
