// Host-side statistics of one calibration session: per (layer, role, head)
// running min/max, counts, moments, an optional |x| histogram, the exactly
// kept largest |x| values, and per-batch min/max. Every backend can produce
// and absorb this value type; the scale math reads it.
//
//   kvcal::SessionStatistics stats(geometry);
//   stats.head(/*layer=*/0, kvcal::Role::kK, /*head=*/3).Add(0.5f, batch);
//   KVCAL_RETURN_IF_ERROR(stats.Merge(other));
//   std::string bytes = stats.Serialize();
//   KVCAL_ASSIGN_OR_RETURN(auto copy,
//                          kvcal::SessionStatistics::Deserialize(bytes));
//
// All statistics are order-independent: min, max, counts, histograms, tails
// and batch extrema exactly; the double sums up to rounding. So merging the
// states of several workers equals one state that saw every chunk.
//
// Serialized format, version 1 (all integers and floats little-endian):
//   u32 magic 0x5343564b ("KVCS")   u32 version (1)
//   u32 num_layers  u32 num_attention_heads  u32 num_key_value_heads
//   u32 head_dim    u32 bins_per_octave      u32 role_mask
//   then for each layer, each collected role (Q, K, V order), each head:
//     f32 min  f32 max  u64 finite  u64 nan  u64 inf  f64 sum  f64 sum_sq
//     u32 n_bins, then n_bins x (u32 bin, u64 count), bins strictly ascending,
//         counts > 0 (only with histograms)
//     u32 n_tail, then n_tail x f32, strictly non-increasing (only with
//         histograms; n_tail <= 256)
//     u32 n_batches, then n_batches x (u64 batch, f32 min, f32 max), batches
//         strictly ascending
//   u64 FNV-1a 64 of every byte before it.
// Deserialize checks every count, range, ordering and the checksum.
#ifndef KVCAL_KERNELS_STATISTICS_H_
#define KVCAL_KERNELS_STATISTICS_H_

#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/types.h"

namespace kvcal {

struct MinMax {
  float min = std::numeric_limits<float>::infinity();
  float max = -std::numeric_limits<float>::infinity();
  void Add(float x) {
    if (x < min) min = x;
    if (x > max) max = x;
  }
  void Merge(const MinMax& other) {
    if (other.min < min) min = other.min;
    if (other.max > max) max = other.max;
  }
  friend bool operator==(const MinMax&, const MinMax&) = default;
};

struct HeadStatistics {
  float min = std::numeric_limits<float>::infinity();
  float max = -std::numeric_limits<float>::infinity();
  uint64_t finite_count = 0;
  uint64_t nan_count = 0;
  uint64_t inf_count = 0;
  double sum = 0.0;
  double sum_squares = 0.0;
  // Counts of |x| per bin (element_math.h), sized Geometry::histogram_bins().
  std::vector<uint64_t> histogram;
  // The up to kTailCapacity largest finite |x|, sorted descending. Kept only
  // with histograms.
  std::vector<float> tail;
  // Min and max of finite values per calibration batch that had any.
  std::map<uint64_t, MinMax> batches;

  uint64_t nonfinite_count() const { return nan_count + inf_count; }
  float absmax() const;
  // Adds one value of calibration batch `batch` (slow reference path).
  void Add(float x, uint64_t batch, uint32_t log2_bins_per_octave);
  // Adds everything `other` saw. Both must have the same histogram size.
  void Merge(const HeadStatistics& other);
  // Inserts |x| values into the tail, keeping the kTailCapacity largest.
  void MergeTail(const float* values, size_t n);

  friend bool operator==(const HeadStatistics&,
                         const HeadStatistics&) = default;
};

class SessionStatistics {
 public:
  // `geometry` must be valid (Geometry::Validate()).
  explicit SessionStatistics(const Geometry& geometry);

  const Geometry& geometry() const { return geometry_; }

  HeadStatistics& head(uint32_t layer, Role role, uint32_t head) {
    return heads_[Index(layer, role, head)];
  }
  const HeadStatistics& head(uint32_t layer, Role role, uint32_t head) const {
    return heads_[Index(layer, role, head)];
  }
  // Index of (layer, role, head) in the flat head array; the role must be
  // collected. Layer-major, then role (Q, K, V), then head.
  size_t Index(uint32_t layer, Role role, uint32_t head) const {
    return static_cast<size_t>(layer) * heads_per_layer_ +
           role_offset_[RoleIndex(role)] + head;
  }
  size_t num_heads_total() const { return heads_.size(); }
  std::vector<HeadStatistics>& heads() { return heads_; }
  const std::vector<HeadStatistics>& heads() const { return heads_; }

  // Adds `other`'s statistics. Geometry (including histogram resolution and
  // roles) must be identical; otherwise InvalidArgument and nothing changes.
  absl::Status Merge(const SessionStatistics& other);
  void Reset();

  std::string Serialize() const;
  static absl::StatusOr<SessionStatistics> Deserialize(absl::string_view bytes);

  // Total finite / non-finite values over every head.
  uint64_t finite_values() const;
  uint64_t nonfinite_values() const;

  friend bool operator==(const SessionStatistics&,
                         const SessionStatistics&) = default;

 private:
  Geometry geometry_;
  size_t heads_per_layer_ = 0;
  std::array<size_t, 3> role_offset_ = {0, 0, 0};
  std::vector<HeadStatistics> heads_;
};

// The non-finite values of one (layer, role, head).
struct NonFiniteHead {
  uint32_t layer = 0;
  Role role = Role::kQ;
  uint32_t head = 0;
  uint64_t nan = 0;
  uint64_t inf = 0;  // +Inf and -Inf
  friend bool operator==(const NonFiniteHead&, const NonFiniteHead&) = default;
};

struct NonFiniteHeads {
  // The first `limit` heads with any, ordered by layer, role (Q, K, V), head.
  std::vector<NonFiniteHead> heads;
  // Heads with any (listed or not).
  uint64_t total_heads = 0;
};

// The heads of `layers` (empty = every layer; each must exist) that saw NaN
// or Inf values.
NonFiniteHeads FindNonFiniteHeads(const SessionStatistics& stats,
                                  const std::vector<uint32_t>& layers,
                                  size_t limit);

// Bytes of statistics state a session of `geometry` needs, excluding the
// per-batch extrema that grow with the number of batches (what the worker's
// memory budget counts per session, on every backend).
size_t EstimateStateBytes(const Geometry& geometry);

}  // namespace kvcal

#endif  // KVCAL_KERNELS_STATISTICS_H_
