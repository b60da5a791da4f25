// Which worker holds which layer: rendezvous (highest-random-weight) hashing
// on (session, layer, worker id). Every client (C++, Python, others) uses
// this rule, so it is spelled out in docs/wire-contract.md "Sharding" and
// pinned by tests/data/shard_vectors.json, which the C++ and the Python tests
// both check.
//
//   std::vector<std::string> ids = {"kvcal-worker-0", "kvcal-worker-1"};
//   size_t owner = kvcal::LayerOwner("run7", /*layer=*/3, ids);  // index in
//   ids
//
// Adding a worker moves only the layers the new worker wins (about 1/(n+1)
// of them); removing one moves only its own. The address of a worker never
// matters.
#ifndef KVCAL_CLIENT_RPC_SHARDING_H_
#define KVCAL_CLIENT_RPC_SHARDING_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "util/hash.h"  // Fnv1a64, SplitMix64

namespace kvcal {

// SplitMix64(Fnv1a64(session ++ 0x00 ++ le32(layer) ++ worker_id)).
uint64_t RendezvousScore(absl::string_view session_id, uint32_t layer,
                         absl::string_view worker_id);

// Index in `worker_ids` of the worker with the highest score; ties go to the
// bytewise smaller id. `worker_ids` must not be empty.
size_t LayerOwner(absl::string_view session_id, uint32_t layer,
                  absl::Span<const std::string> worker_ids);

// LayerOwner of layers 0..num_layers-1.
std::vector<uint32_t> LayerOwners(absl::string_view session_id,
                                  uint32_t num_layers,
                                  absl::Span<const std::string> worker_ids);

}  // namespace kvcal

#endif  // KVCAL_CLIENT_RPC_SHARDING_H_
