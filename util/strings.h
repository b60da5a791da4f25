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

// "[a, b, c]": how messages print a list of worker ids.
std::string IdList(absl::Span<const std::string> ids);

// How a set of worker ids differs from a session's: "added [e], missing
// [c]" (either part left out when empty), or "same ids, different layer
// owners". The worker's and the client's worker-set refusals both say it.
std::string DescribeWorkerSetChange(absl::Span<const std::string> session_ids,
                                    absl::Span<const std::string> other_ids);

// A word of a shell command, single-quoted when it holds anything but
// [A-Za-z0-9_-./=:,+@%] (or is empty): what commands kvcal prints for the
// user to run say.
std::string ShellQuote(const std::string& word);

}  // namespace kvcal

#endif  // KVCAL_UTIL_STRINGS_H_
