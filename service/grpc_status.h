// The one place that converts absl::Status to grpc::Status. The two code
// enums share numbers (static_asserts in grpc_status.cc), so conversion is a
// cast plus the message.
#ifndef KVCAL_SERVICE_GRPC_STATUS_H_
#define KVCAL_SERVICE_GRPC_STATUS_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace kvcal::service {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace kvcal::service

#endif  // KVCAL_SERVICE_GRPC_STATUS_H_
