#include "kernels/types.h"

#include <algorithm>
#include <bit>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "util/strings.h"

namespace kvcal {

absl::string_view RoleName(Role role) {
  switch (role) {
    case Role::kQ:
      return "Q";
    case Role::kK:
      return "K";
    case Role::kV:
      return "V";
  }
  return "?";
}

absl::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "f32";
    case DType::kF16:
      return "f16";
    case DType::kBf16:
      return "bf16";
  }
  return "?";
}

size_t DTypeSize(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

absl::Status Geometry::Validate() const {
  if (num_layers < 1 || num_layers > kMaxLayers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_layers must be in [1, ", kMaxLayers, "], got ", num_layers));
  }
  if (num_attention_heads < 1 || num_attention_heads > kMaxHeads) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_attention_heads must be in [1, ", kMaxHeads,
                     "], got ", num_attention_heads));
  }
  if (num_key_value_heads < 1 || num_key_value_heads > kMaxHeads) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_key_value_heads must be in [1, ", kMaxHeads,
                     "], got ", num_key_value_heads));
  }
  if (num_attention_heads % num_key_value_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_attention_heads (", num_attention_heads,
                     ") must be a multiple of num_key_value_heads (",
                     num_key_value_heads, ")"));
  }
  if (head_dim < 1 || head_dim > kMaxHeadDim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "head_dim must be in [1, ", kMaxHeadDim, "], got ", head_dim));
  }
  if (bins_per_octave != 0 &&
      (bins_per_octave > 128 || !std::has_single_bit(bins_per_octave))) {
    return absl::InvalidArgumentError(
        absl::StrCat("histogram_bins_per_octave must be 0 or a power of two "
                     "from 1 to 128, got ",
                     bins_per_octave));
  }
  if (role_mask == 0 || role_mask > 0b111) {
    return absl::InvalidArgumentError(
        absl::StrCat("role set must be a non-empty subset of {Q, K, V}, got "
                     "mask ",
                     role_mask));
  }
  return absl::OkStatus();
}

uint32_t Geometry::log2_bins_per_octave() const {
  return bins_per_octave == 0
             ? 0
             : static_cast<uint32_t>(std::countr_zero(bins_per_octave));
}

uint32_t Geometry::histogram_bins() const {
  if (!has_histograms()) return 0;
  return 2u + static_cast<uint32_t>(48u * bins_per_octave) + 1u;
}

std::vector<Role> Geometry::roles() const {
  std::vector<Role> out;
  for (Role role : kAllRoles) {
    if (collects(role)) out.push_back(role);
  }
  return out;
}

uint64_t Geometry::total_heads() const {
  uint64_t per_layer = 0;
  for (Role role : roles()) per_layer += heads(role);
  return per_layer * num_layers;
}

std::string Geometry::DebugString() const {
  std::vector<absl::string_view> names;
  for (Role role : roles()) names.push_back(RoleName(role));
  return absl::StrCat("layers=", num_layers, " q_heads=", num_attention_heads,
                      " kv_heads=", num_key_value_heads, " head_dim=", head_dim,
                      " bins_per_octave=", bins_per_octave,
                      " roles=", absl::StrJoin(names, ""));
}

namespace {

// a * b, or false on uint64 overflow.
bool CheckedMul(uint64_t a, uint64_t b, uint64_t* out) {
  return !__builtin_mul_overflow(a, b, out);
}

// The chunk's role, dtype and layout are values the enums define, its layer
// is in range and its role collected.
absl::Status CheckChunkKind(const Geometry& geometry, const ChunkView& chunk) {
  const uint32_t role_value = static_cast<uint32_t>(chunk.role);
  if (role_value < 1 || role_value > 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown role ", role_value));
  }
  const uint32_t dtype_value = static_cast<uint32_t>(chunk.dtype);
  if (dtype_value < 1 || dtype_value > 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown dtype ", dtype_value));
  }
  const uint32_t layout_value = static_cast<uint32_t>(chunk.layout);
  if (layout_value < 1 || layout_value > 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown layout ", layout_value));
  }
  if (chunk.layer >= geometry.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer ", chunk.layer, " is out of range: the session has ",
        geometry.num_layers, " layers"));
  }
  if (!geometry.collects(chunk.role)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "role ", RoleName(chunk.role), " is not collected by this session"));
  }
  return absl::OkStatus();
}

// The shape's head count, once its rank fits the layout, its last dim is
// head_dim and its heads (from head_offset) fit the role's.
absl::StatusOr<uint64_t> ChunkHeads(const Geometry& geometry,
                                    const ChunkView& chunk,
                                    const std::string& shape_text) {
  const auto& shape = chunk.shape;
  if (chunk.layout == Layout::kHeadsTokensDim) {
    if (shape.size() != 4) {
      return absl::InvalidArgumentError(
          absl::StrCat("layout HEADS_TOKENS_DIM needs rank 4 [batch, heads, "
                       "tokens, head_dim], got shape ",
                       shape_text));
    }
  } else if (shape.size() < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("layout TOKENS_HEADS_DIM needs rank >= 2 [..., heads, "
                     "head_dim], got shape ",
                     shape_text));
  }
  if (shape.back() != geometry.head_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("last dim of shape ", shape_text, " is ", shape.back(),
                     ", the session's head_dim is ", geometry.head_dim));
  }
  const uint64_t heads = chunk.layout == Layout::kHeadsTokensDim
                             ? shape[1]
                             : shape[shape.size() - 2];
  const uint32_t role_heads = geometry.heads(chunk.role);
  if (heads == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("shape ", shape_text, " has zero heads"));
  }
  if (heads > role_heads ||
      static_cast<uint64_t>(chunk.head_offset) + heads > role_heads) {
    return absl::InvalidArgumentError(absl::StrCat(
        "heads [", chunk.head_offset, ", ", chunk.head_offset + heads,
        ") of shape ", shape_text, " exceed the ", role_heads, " ",
        RoleName(chunk.role), " heads of the session"));
  }
  return heads;
}

// The bytes the shape needs in the chunk's dtype; an error on overflow.
absl::StatusOr<uint64_t> ShapeBytes(const ChunkView& chunk,
                                    const std::string& shape_text) {
  const auto& shape = chunk.shape;
  // A zero dimension makes the product 0 whatever the other dimensions are,
  // so the overflow check must not depend on where the zero stands.
  const bool empty =
      std::find(shape.begin(), shape.end(), uint64_t{0}) != shape.end();
  uint64_t elements = empty ? 0 : 1;
  for (uint64_t dim : shape) {
    if (empty) break;
    if (!CheckedMul(elements, dim, &elements)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "element count of shape ", shape_text, " overflows 64 bits"));
    }
  }
  uint64_t bytes = 0;
  if (!CheckedMul(elements, DTypeSize(chunk.dtype), &bytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("byte count of shape ", shape_text, " overflows 64 bits"));
  }
  return bytes;
}

}  // namespace

absl::StatusOr<ChunkExtent> ValidateChunk(const Geometry& geometry,
                                          const ChunkView& chunk) {
  if (absl::Status s = CheckChunkKind(geometry, chunk); !s.ok()) return s;
  const auto& shape = chunk.shape;
  const std::string shape_text = ShapeString(shape);
  absl::StatusOr<uint64_t> heads = ChunkHeads(geometry, chunk, shape_text);
  if (!heads.ok()) return heads.status();
  absl::StatusOr<uint64_t> expected_bytes = ShapeBytes(chunk, shape_text);
  if (!expected_bytes.ok()) return expected_bytes.status();
  if (chunk.byte_size() != *expected_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data is ", chunk.byte_size(), " bytes, shape ", shape_text, " ",
        DTypeName(chunk.dtype), " needs ", *expected_bytes));
  }
  ChunkExtent extent;
  extent.heads = static_cast<uint32_t>(*heads);
  if (chunk.layout == Layout::kHeadsTokensDim) {
    extent.outer = shape[0];
    extent.inner = shape[2] * shape[3];
  } else {
    uint64_t tokens = 1;
    for (size_t i = 0; i + 2 < shape.size(); ++i) tokens *= shape[i];
    extent.outer = tokens;
    extent.inner = shape.back();
  }
  return extent;
}

uint64_t ChunkView::byte_size() const {
  if (pieces.empty()) return data.size();
  uint64_t total = 0;
  for (const absl::Span<const std::byte>& piece : pieces) total += piece.size();
  return total;
}

void ChunkView::CopyBytes(uint64_t offset, size_t n, void* out) const {
  if (n == 0) return;
  auto* dst = static_cast<std::byte*>(out);
  if (pieces.empty()) {
    std::memcpy(dst, data.data() + offset, n);
    return;
  }
  for (const absl::Span<const std::byte>& piece : pieces) {
    if (n == 0) return;
    if (offset >= piece.size()) {
      offset -= piece.size();
      continue;
    }
    const size_t take = std::min<uint64_t>(n, piece.size() - offset);
    std::memcpy(dst, piece.data() + offset, take);
    dst += take;
    n -= take;
    offset = 0;
  }
}

}  // namespace kvcal
