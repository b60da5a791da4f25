// A local-statistics push's messages: the tensors of a dump's calibration
// batches accumulated in the client's process with the worker's engine
// (kernels/local_statistics.h), one partial-statistics message per group of
// batches (docs/local-statistics.md). Its own library, kvcal_local_partials,
// because it links the engine's backends, which kvcal_rpc must not.
//
//   UploaderOptions options;
//   options.local_statistics_batches = 64;
//   options.build_partials = kvcal::BuildPartials;
//   client.Upload(session_id, tensors, options);
#ifndef KVCAL_CLIENT_RPC_LOCAL_PARTIALS_H_
#define KVCAL_CLIENT_RPC_LOCAL_PARTIALS_H_

#include <cstdint>
#include <set>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/rpc/uploader.h"
#include "kernels/types.h"

namespace kvcal {

// The tensors of `tensors` not in `holdout_batches`, accumulated with a CPU
// engine of `geometry` (and the worker's ingest checks: a refused tensor is
// InvalidArgument naming its batch, layer and role) into one PartialUpload
// per `batches_per_partial` distinct batch numbers, in ascending batch
// order. Deterministic, so a resumed push makes the same messages.
absl::StatusOr<std::vector<PartialUpload>> BuildPartials(
    const Geometry& geometry, bool reject_non_finite,
    absl::Span<const ChunkView> tensors,
    const std::set<uint64_t>& holdout_batches, uint64_t batches_per_partial);

}  // namespace kvcal

#endif  // KVCAL_CLIENT_RPC_LOCAL_PARTIALS_H_
