#include "client/rpc/sharding.h"

namespace kvcal {

uint64_t RendezvousScore(absl::string_view session_id, uint32_t layer,
                         absl::string_view worker_id) {
  std::string key(session_id);
  key.push_back('\0');
  for (int i = 0; i < 4; ++i)
    key.push_back(static_cast<char>(layer >> (8 * i)));
  key.append(worker_id.data(), worker_id.size());
  return SplitMix64(Fnv1a64(key));
}

size_t LayerOwner(absl::string_view session_id, uint32_t layer,
                  absl::Span<const std::string> worker_ids) {
  size_t best = 0;
  uint64_t best_score = 0;
  for (size_t i = 0; i < worker_ids.size(); ++i) {
    const uint64_t score = RendezvousScore(session_id, layer, worker_ids[i]);
    if (i == 0 || score > best_score ||
        (score == best_score && worker_ids[i] < worker_ids[best])) {
      best = i;
      best_score = score;
    }
  }
  return best;
}

std::vector<uint32_t> LayerOwners(absl::string_view session_id,
                                  uint32_t num_layers,
                                  absl::Span<const std::string> worker_ids) {
  std::vector<uint32_t> owners(num_layers);
  for (uint32_t l = 0; l < num_layers; ++l) {
    owners[l] = static_cast<uint32_t>(LayerOwner(session_id, l, worker_ids));
  }
  return owners;
}

}  // namespace kvcal
