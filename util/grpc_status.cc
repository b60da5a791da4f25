#include "util/grpc_status.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace kvcal {

#define KVCAL_SAME_CODE(absl_code, grpc_code)                      \
  static_assert(static_cast<int>(absl::StatusCode::absl_code) ==   \
                    static_cast<int>(grpc::StatusCode::grpc_code), \
                #absl_code " and " #grpc_code " must share a number")
KVCAL_SAME_CODE(kOk, OK);
KVCAL_SAME_CODE(kCancelled, CANCELLED);
KVCAL_SAME_CODE(kUnknown, UNKNOWN);
KVCAL_SAME_CODE(kInvalidArgument, INVALID_ARGUMENT);
KVCAL_SAME_CODE(kDeadlineExceeded, DEADLINE_EXCEEDED);
KVCAL_SAME_CODE(kNotFound, NOT_FOUND);
KVCAL_SAME_CODE(kAlreadyExists, ALREADY_EXISTS);
KVCAL_SAME_CODE(kPermissionDenied, PERMISSION_DENIED);
KVCAL_SAME_CODE(kResourceExhausted, RESOURCE_EXHAUSTED);
KVCAL_SAME_CODE(kFailedPrecondition, FAILED_PRECONDITION);
KVCAL_SAME_CODE(kAborted, ABORTED);
KVCAL_SAME_CODE(kOutOfRange, OUT_OF_RANGE);
KVCAL_SAME_CODE(kUnimplemented, UNIMPLEMENTED);
KVCAL_SAME_CODE(kInternal, INTERNAL);
KVCAL_SAME_CODE(kUnavailable, UNAVAILABLE);
KVCAL_SAME_CODE(kDataLoss, DATA_LOSS);
KVCAL_SAME_CODE(kUnauthenticated, UNAUTHENTICATED);
#undef KVCAL_SAME_CODE

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::string(status.message()));
}

absl::Status ToAbslStatus(const grpc::Status& status, absl::string_view what) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      what.empty()
                          ? status.error_message()
                          : absl::StrCat(what, ": ", status.error_message()));
}

}  // namespace kvcal
