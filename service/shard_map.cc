#include "service/shard_map.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "util/strings.h"

namespace kvcal::service {
absl::Status ValidateWorkerId(absl::string_view id) {
  const bool ok = !id.empty() && id.size() <= 128 &&
                  FirstNonIdentifierChar(id) == absl::string_view::npos;
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("worker id '", id, "' must match [A-Za-z0-9._-]{1,128}"));
}

absl::Status ValidateShardMap(const ShardMap& map, uint32_t num_layers) {
  if (map.empty()) {
    if (!map.layer_owners.empty()) {
      return absl::InvalidArgumentError(
          "shard map has layer owners but no worker ids");
    }
    return absl::OkStatus();
  }
  for (size_t i = 0; i < map.worker_ids.size(); ++i) {
    if (absl::Status s = ValidateWorkerId(map.worker_ids[i]); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("shard map: ", s.message()));
    }
    if (i > 0 && !(map.worker_ids[i - 1] < map.worker_ids[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("shard map worker ids must be sorted and unique; got ",
                       IdList(map.worker_ids)));
    }
  }
  if (map.layer_owners.size() != num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard map has ", map.layer_owners.size(),
                     " layer owners; the session has ", num_layers, " layers"));
  }
  for (size_t l = 0; l < map.layer_owners.size(); ++l) {
    if (map.layer_owners[l] >= map.worker_ids.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shard map: layer ", l, " owner index ", map.layer_owners[l],
          " is beyond its ", map.worker_ids.size(), " workers"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckWorkerSet(absl::string_view session_id, const ShardMap& map,
                            absl::Span<const std::string> client_ids) {
  if (map.empty() || client_ids.empty()) return absl::OkStatus();
  if (std::equal(map.worker_ids.begin(), map.worker_ids.end(),
                 client_ids.begin(), client_ids.end())) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "session '", session_id, "' is sharded over workers ",
      IdList(map.worker_ids), "; the client's worker set is ",
      IdList(client_ids), " (",
      DescribeWorkerSetChange(map.worker_ids, client_ids),
      "); use the session's workers, or a new session for the new set"));
}

absl::Status CheckLayerOwner(absl::string_view session_id, const ShardMap& map,
                             uint32_t layer, absl::string_view worker_id) {
  if (map.empty() || layer >= map.layer_owners.size()) return absl::OkStatus();
  const std::string& owner = map.worker_ids[map.layer_owners[layer]];
  if (owner == worker_id) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "layer ", layer, " of session '", session_id, "' belongs to worker '",
      owner, "', not to this worker '", worker_id, "' (session workers ",
      IdList(map.worker_ids), ")"));
}

}  // namespace kvcal::service
