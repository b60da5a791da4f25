// A session's shard map as the worker records it: the worker ids of the
// session's worker set and the owner of every layer (proto ShardMap). The
// worker never computes ownership (clients do, by rendezvous hashing;
// client/rpc/sharding.h); it checks chunks and Finalize requests against the
// map it was given at CreateSession and keeps it in its state dir.
//
//   KVCAL_RETURN_IF_ERROR(ValidateShardMap(map, geometry.num_layers));
//   KVCAL_RETURN_IF_ERROR(CheckWorkerSet("run7", map, request_ids));
//   KVCAL_RETURN_IF_ERROR(CheckLayerOwner("run7", map, layer, "kvcal-worker-2"));
#ifndef KVCAL_SERVICE_SHARD_MAP_H_
#define KVCAL_SERVICE_SHARD_MAP_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "util/strings.h"  // DescribeWorkerSetChange, IdList

namespace kvcal::service {

struct ShardMap {
  std::vector<std::string> worker_ids;  // sorted bytewise, unique
  std::vector<uint32_t> layer_owners;   // index into worker_ids, per layer
  bool empty() const { return worker_ids.empty(); }
  friend bool operator==(const ShardMap&, const ShardMap&) = default;
};

// [A-Za-z0-9._-]{1,128} (a host name or pod name fits).
absl::Status ValidateWorkerId(absl::string_view id);

// Ids valid, sorted and unique; one owner per layer, each an index into ids.
absl::Status ValidateShardMap(const ShardMap& map, uint32_t num_layers);

// FailedPrecondition when a non-empty `client_ids` differs from the map's
// worker set (naming what changed). An empty map or empty client_ids pass.
absl::Status CheckWorkerSet(absl::string_view session_id, const ShardMap& map,
                            absl::Span<const std::string> client_ids);

// FailedPrecondition naming the owner when `layer` belongs to another worker
// than `worker_id`. An empty map passes.
absl::Status CheckLayerOwner(absl::string_view session_id, const ShardMap& map,
                             uint32_t layer, absl::string_view worker_id);

}  // namespace kvcal::service

#endif  // KVCAL_SERVICE_SHARD_MAP_H_
