// The one place that converts between absl::Status and grpc::Status, both
// ways (the worker answers with grpc::Status, the clients return
// absl::Status). The two code enums share numbers (static_asserts in
// grpc_status.cc), so conversion is a cast plus the message.
#ifndef KVCAL_UTIL_GRPC_STATUS_H_
#define KVCAL_UTIL_GRPC_STATUS_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvcal {

grpc::Status ToGrpcStatus(const absl::Status& status);
// The call's status as absl::Status; a non-empty `what` prefixes the message
// ("Finalize on w1 (host:port): <the worker's message>").
absl::Status ToAbslStatus(const grpc::Status& status,
                          absl::string_view what = "");

}  // namespace kvcal

#endif  // KVCAL_UTIL_GRPC_STATUS_H_
