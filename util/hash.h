// The two non-cryptographic hashes of the tree: FNV-1a 64 (the state files'
// and the serialized statistics' checksum, and the sharding key) and
// SplitMix64's finaliser (sharding's mixing step). Both are pinned by
// published test vectors (tests/data/shard_vectors.json).
#ifndef KVCAL_UTIL_HASH_H_
#define KVCAL_UTIL_HASH_H_

#include <cstdint>

#include "absl/strings/string_view.h"

namespace kvcal {

// FNV-1a, 64 bits: offset basis 0xcbf29ce484222325, prime 0x100000001b3.
uint64_t Fnv1a64(absl::string_view bytes);

// The first output of SplitMix64 seeded with `seed`: z = seed +
// 0x9e3779b97f4a7c15, then the three xor-shift-multiply rounds.
uint64_t SplitMix64(uint64_t seed);

}  // namespace kvcal

#endif  // KVCAL_UTIL_HASH_H_
