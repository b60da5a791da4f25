// Status propagation macros for absl::Status / absl::StatusOr.
//
// The Abseil shipped with Debian 12 has no public status macros, so kvcal
// defines its own, once, here:
//
//   absl::StatusOr<int> ParseCount(absl::string_view text);
//   absl::Status Use(absl::string_view text) {
//     KVCAL_ASSIGN_OR_RETURN(int count, ParseCount(text));
//     KVCAL_RETURN_IF_ERROR(Check(count));
//     return absl::OkStatus();
//   }
#ifndef KVCAL_UTIL_STATUS_MACROS_H_
#define KVCAL_UTIL_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define KVCAL_STATUS_CONCAT_INNER_(a, b) a##b
#define KVCAL_STATUS_CONCAT_(a, b) KVCAL_STATUS_CONCAT_INNER_(a, b)

// Returns from the enclosing function when `expr` yields a non-OK status.
#define KVCAL_RETURN_IF_ERROR(expr)                \
  do {                                             \
    ::absl::Status kvcal_status_ = (expr);         \
    if (!kvcal_status_.ok()) return kvcal_status_; \
  } while (false)

// Evaluates `rexpr` (an absl::StatusOr<T>); on error returns its status,
// otherwise moves the value into `lhs` (which may be a declaration).
#define KVCAL_ASSIGN_OR_RETURN(lhs, rexpr) \
  KVCAL_ASSIGN_OR_RETURN_IMPL_(            \
      KVCAL_STATUS_CONCAT_(kvcal_statusor_, __LINE__), lhs, rexpr)

#define KVCAL_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                 \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()

#endif  // KVCAL_UTIL_STATUS_MACROS_H_
