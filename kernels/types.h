// Value types of the statistics engine: what a session collects (Geometry)
// and one chunk of activations (ChunkView), plus the validation that every
// backend and the service share.
//
//   kvcal::Geometry geometry{.num_layers = 32, .num_attention_heads = 32,
//                            .num_key_value_heads = 8, .head_dim = 128,
//                            .bins_per_octave = 64};
//   KVCAL_RETURN_IF_ERROR(geometry.Validate());
//   kvcal::ChunkView chunk{{.layer = 3, .role = kvcal::Role::kK,
//                           .dtype = kvcal::DType::kBf16,
//                           .layout = kvcal::Layout::kTokensHeadsDim,
//                           .shape = {512, 8, 128}, .head_offset = 0,
//                           .batch = 0},
//                          bytes, {}};
//   KVCAL_ASSIGN_OR_RETURN(kvcal::ChunkExtent extent,
//                          kvcal::ValidateChunk(geometry, chunk));
#ifndef KVCAL_KERNELS_TYPES_H_
#define KVCAL_KERNELS_TYPES_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace kvcal {

// Numbers match the wire enums (kvcal.v1) so conversion is a cast after a
// range check.
enum class Role : uint32_t { kQ = 1, kK = 2, kV = 3 };
enum class DType : uint32_t { kF32 = 1, kF16 = 2, kBf16 = 3 };
enum class Layout : uint32_t { kTokensHeadsDim = 1, kHeadsTokensDim = 2 };

inline constexpr std::array<Role, 3> kAllRoles = {Role::kQ, Role::kK, Role::kV};

// 0 for Q, 1 for K, 2 for V.
inline constexpr int RoleIndex(Role role) { return static_cast<int>(role) - 1; }
absl::string_view RoleName(Role role);     // "Q", "K", "V"
absl::string_view DTypeName(DType dtype);  // "f32", "f16", "bf16"
size_t DTypeSize(DType dtype);             // 4, 2, 2

// Limits from docs/wire-contract.md "Sessions".
inline constexpr uint32_t kMaxLayers = 4096;
inline constexpr uint32_t kMaxHeads = 1024;
inline constexpr uint32_t kMaxHeadDim = 1024;

// What a session collects.
struct Geometry {
  uint32_t num_layers = 0;
  uint32_t num_attention_heads = 0;
  uint32_t num_key_value_heads = 0;
  uint32_t head_dim = 0;
  // 0 = no histograms (and no exact tail values); else a power of two 1..128.
  uint32_t bins_per_octave = 0;
  // Bit RoleIndex(r) set when role r is collected. 0 is invalid.
  uint32_t role_mask = 0b111;

  absl::Status Validate() const;
  bool collects(Role role) const { return (role_mask >> RoleIndex(role)) & 1u; }
  uint32_t heads(Role role) const {
    return role == Role::kQ ? num_attention_heads : num_key_value_heads;
  }
  bool has_histograms() const { return bins_per_octave != 0; }
  // log2(bins_per_octave); only meaningful when has_histograms().
  uint32_t log2_bins_per_octave() const;
  // Number of histogram bins per head (0 without histograms).
  uint32_t histogram_bins() const;
  // Collected roles, in the order Q, K, V.
  std::vector<Role> roles() const;
  // Total (layer, role, head) triples collected.
  uint64_t total_heads() const;
  std::string DebugString() const;

  friend bool operator==(const Geometry&, const Geometry&) = default;
};

// What a chunk of activations is, apart from its bytes: where it belongs
// (layer, role, the producer's batch) and how its values lie (dtype, layout,
// shape). A ChunkView, a held-out chunk (service) and a dumped tensor
// (client) are each one of these plus their bytes.
// Layout kTokensHeadsDim: shape [..., heads, head_dim] (rank >= 2; a rank-2
// shape is one token). Layout kHeadsTokensDim: shape [batch, heads, tokens,
// head_dim]. The chunk carries heads [head_offset, head_offset + heads).
struct ChunkHeader {
  uint32_t layer = 0;
  Role role = Role::kQ;
  DType dtype = DType::kF32;
  Layout layout = Layout::kTokensHeadsDim;
  std::vector<uint64_t> shape;
  uint32_t head_offset = 0;
  uint64_t batch = 0;

  friend bool operator==(const ChunkHeader&, const ChunkHeader&) = default;
};

// One chunk of activations, not owned. Its bytes (row-major, little-endian)
// are `data`, or, when `pieces` is not empty, the pieces one after the other
// (a message as it arrived, in several receive buffers; `data` is then
// empty). A value may straddle two pieces.
struct ChunkView : ChunkHeader {
  absl::Span<const std::byte> data;
  std::vector<absl::Span<const std::byte>> pieces;

  // Bytes of the chunk: data.size() or the sum of the pieces.
  uint64_t byte_size() const;
  // Copies bytes [offset, offset + n) of the chunk to `out`; the range must
  // be within byte_size().
  void CopyBytes(uint64_t offset, size_t n, void* out) const;
};

// A validated chunk in one canonical form for both layouts: element (o, h, i)
// with o < outer, h < heads, i < inner sits at index (o * heads + h) * inner +
// i. For kTokensHeadsDim outer = tokens and inner = head_dim; for
// kHeadsTokensDim outer = batch and inner = tokens * head_dim. Every element
// of head h belongs to the layer's head head_offset + h.
struct ChunkExtent {
  uint64_t outer = 0;
  uint32_t heads = 0;
  uint64_t inner = 0;
  uint64_t elements() const { return outer * heads * inner; }
};

// Checks `chunk` against `geometry` (docs/wire-contract.md "Ingest"): role
// collected, layer in range, rank and head_dim, heads + head_offset within
// the role's head count, no element-count overflow, and data size ==
// prod(shape) x element size. Messages name what was wrong; callers prefix
// the chunk's identity (sequence, producer).
absl::StatusOr<ChunkExtent> ValidateChunk(const Geometry& geometry,
                                          const ChunkView& chunk);

}  // namespace kvcal

#endif  // KVCAL_KERNELS_TYPES_H_
