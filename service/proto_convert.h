// The one file that converts between kvcal.v1 proto messages and the engine's
// and sessions' own types. Handlers call these and nothing else touches both.
#ifndef KVCAL_SERVICE_PROTO_CONVERT_H_
#define KVCAL_SERVICE_PROTO_CONVERT_H_

#include "absl/status/statusor.h"
#include "kernels/scale_math.h"
#include "kernels/types.h"
#include "kvcal/v1/calibration.pb.h"
#include "service/session.h"
#include "service/shared_memory.h"

namespace kvcal::service {

// A view of the request's chunk; it borrows request.data().
ChunkView ChunkFromProto(const kvcal::v1::IngestRequest& request);

// Finalize parameters with 0/UNSPECIFIED replaced by the defaults, validated.
absl::StatusOr<ScaleOptions> ScaleOptionsFromProto(
    const kvcal::v1::FinalizeRequest& request);

// ScaleOptionsFromProto plus evaluate / kv-only / OBSERVER_AUTO and its
// flags. With OBSERVER_AUTO, `scale.observer` is left at the default.
absl::StatusOr<EvaluatedFinalizeOptions> EvaluatedFinalizeOptionsFromProto(
    const kvcal::v1::FinalizeRequest& request);
// Scales (ScaleResultToProto), evaluation and candidates.
void EvaluatedFinalizeToProto(const EvaluatedFinalize& result,
                              kvcal::v1::FinalizeResponse* out);

ShardMap ShardMapFromProto(const kvcal::v1::ShardMap& map);
void ShardMapToProto(const ShardMap& map, kvcal::v1::ShardMap* out);

void SessionInfoToProto(const SessionInfo& info, kvcal::v1::Session* out);
// Session.nonfinite_heads / FinalizeResponse.nonfinite_heads.
void NonFiniteHeadsToProto(
    const NonFiniteHeads& heads,
    google::protobuf::RepeatedPtrField<kvcal::v1::NonFiniteHead>* out);
// Writes every option of `options` into `out` (the resolved request that
// FinalizeResponse echoes); session_id, layers and shard ids are left as
// they are.
void ScaleOptionsToProto(const ScaleOptions& options,
                         kvcal::v1::FinalizeRequest* out);
// FinalizeResponse.resolved: `request` with every option as the worker used
// it. With OBSERVER_AUTO the observer (and granularity) is the chosen one
// when a single one serves every layer, else stays OBSERVER_AUTO.
void ResolvedFinalizeToProto(const kvcal::v1::FinalizeRequest& request,
                             const EvaluatedFinalizeOptions& options,
                             const EvaluatedFinalize& result,
                             kvcal::v1::FinalizeRequest* out);
void ScaleResultToProto(const ScaleResult& result,
                        kvcal::v1::FinalizeResponse* out);

void SnapshotToProto(const std::string& session_id,
                     const SessionSnapshot& snapshot,
                     kvcal::v1::SessionState* out);
absl::StatusOr<SessionSnapshot> SnapshotFromProto(
    const kvcal::v1::SessionState& state);

// RegisterSharedMemoryRequest: InvalidArgument for an unknown kind.
absl::StatusOr<SharedMemoryRegistration> SharedMemoryRegistrationFromProto(
    const kvcal::v1::RegisterSharedMemoryRequest& request);
void SharedMemoryRegionToProto(const SharedMemoryRegionInfo& info,
                               kvcal::v1::SharedMemoryRegion* out);

}  // namespace kvcal::service

#endif  // KVCAL_SERVICE_PROTO_CONVERT_H_
