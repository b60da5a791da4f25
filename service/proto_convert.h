// The one file that converts between kvcal.v1 proto messages and the engine's
// and sessions' own types. Handlers call these and nothing else touches both.
#ifndef KVCAL_SERVICE_PROTO_CONVERT_H_
#define KVCAL_SERVICE_PROTO_CONVERT_H_

#include "absl/status/statusor.h"
#include "kernels/scale_math.h"
#include "kernels/types.h"
#include "kvcal/v1/calibration.pb.h"
#include "service/session.h"

namespace kvcal::service {

// Geometry of a CreateSessionRequest (roles resolved as a set; empty = QKV).
// Does not validate ranges (Geometry::Validate does).
absl::StatusOr<Geometry> GeometryFromProto(
    const kvcal::v1::CreateSessionRequest& request);

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
void ScaleResultToProto(const ScaleResult& result,
                        kvcal::v1::FinalizeResponse* out);

void SnapshotToProto(const std::string& session_id,
                     const SessionSnapshot& snapshot,
                     kvcal::v1::SessionState* out);
absl::StatusOr<SessionSnapshot> SnapshotFromProto(
    const kvcal::v1::SessionState& state);

}  // namespace kvcal::service

#endif  // KVCAL_SERVICE_PROTO_CONVERT_H_
