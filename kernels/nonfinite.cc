#include "kernels/nonfinite.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvcal {
namespace {

constexpr size_t kBlockBytes = size_t{64} << 10;

// Bits of one element: |x| is bits & abs_mask; NaN above exponent_mask, Inf
// at it (f16's exponent 0x1f, bf16's and f32's 0xff).
template <typename Bits>
struct Format {
  Bits abs_mask;
  Bits exponent_mask;
};

template <typename Bits>
Bits Load(const std::byte* p, uint64_t i) {
  Bits v;
  std::memcpy(&v, p + i * sizeof(Bits), sizeof(Bits));
  return v;
}

template <typename Bits>
bool AnyNonFinite(const std::byte* p, uint64_t n, Format<Bits> f) {
  Bits largest = 0;  // of |x|'s bits: a max reduction the compiler vectorizes
  for (uint64_t i = 0; i < n; ++i) {
    largest = std::max<Bits>(largest, Load<Bits>(p, i) & f.abs_mask);
  }
  return largest >= f.exponent_mask;
}

template <typename Bits>
void Count(const std::byte* p, uint64_t first, uint64_t n,
           const ChunkExtent& extent, Format<Bits> f, ChunkNonFinite& out) {
  if (!AnyNonFinite(p, n, f)) return;
  for (uint64_t i = 0; i < n; ++i) {
    const Bits a = Load<Bits>(p, i) & f.abs_mask;
    if (a < f.exponent_mask) continue;
    const uint64_t h = ((first + i) / extent.inner) % extent.heads;
    if (a > f.exponent_mask) {
      ++out.heads[h].nan;
    } else {
      ++out.heads[h].inf;
    }
  }
}

}  // namespace

uint64_t ChunkNonFinite::total() const {
  uint64_t n = 0;
  for (const NonFiniteCount& c : heads) n += c.total();
  return n;
}

void CountNonFiniteElements(DType dtype, const std::byte* bytes,
                            uint64_t first, uint64_t n,
                            const ChunkExtent& extent, ChunkNonFinite& out) {
  if (out.heads.size() < extent.heads) out.heads.resize(extent.heads);
  switch (dtype) {
    case DType::kF32:
      Count<uint32_t>(bytes, first, n, extent, {0x7fffffffu, 0x7f800000u},
                      out);
      return;
    case DType::kF16:
      Count<uint16_t>(bytes, first, n, extent, {0x7fff, 0x7c00}, out);
      return;
    case DType::kBf16:
      Count<uint16_t>(bytes, first, n, extent, {0x7fff, 0x7f80}, out);
      return;
  }
}

ChunkNonFinite CountNonFinite(const ChunkView& chunk,
                              const ChunkExtent& extent) {
  ChunkNonFinite out;
  out.heads.resize(extent.heads);
  const size_t element = DTypeSize(chunk.dtype);
  const uint64_t elements = extent.elements();
  const uint64_t per_block = kBlockBytes / element;
  if (chunk.pieces.empty()) {
    const std::byte* data = chunk.data.data();
    for (uint64_t e = 0; e < elements; e += per_block) {
      const uint64_t n = std::min(per_block, elements - e);
      CountNonFiniteElements(chunk.dtype, data + e * element, e, n, extent,
                             out);
    }
    return out;
  }
  // Pieces (receive buffers) may split a value: copy block by block.
  std::vector<std::byte> block(
      std::min<uint64_t>(kBlockBytes, elements * element));
  for (uint64_t e = 0; e < elements; e += per_block) {
    const uint64_t n = std::min(per_block, elements - e);
    chunk.CopyBytes(e * element, n * element, block.data());
    CountNonFiniteElements(chunk.dtype, block.data(), e, n, extent, out);
  }
  return out;
}

std::string DescribeNonFinite(const ChunkView& chunk,
                              const ChunkNonFinite& found, size_t max_heads) {
  uint64_t nan = 0, inf = 0, heads = 0;
  for (const NonFiniteCount& c : found.heads) {
    nan += c.nan;
    inf += c.inf;
    if (c.total() > 0) ++heads;
  }
  std::string out =
      absl::StrCat(nan + inf, " non-finite values (", nan, " NaN, ", inf,
                   " Inf) in layer ", chunk.layer, " ", RoleName(chunk.role));
  size_t named = 0;
  for (size_t h = 0; h < found.heads.size(); ++h) {
    const NonFiniteCount& c = found.heads[h];
    if (c.total() == 0) continue;
    if (named == max_heads) {
      absl::StrAppend(&out, ", and ", heads - named, " more heads");
      break;
    }
    absl::StrAppend(&out, named == 0 ? ": " : ", ", "head ",
                    chunk.head_offset + h, " (", c.nan, " NaN, ", c.inf,
                    " Inf)");
    ++named;
  }
  return out;
}

}  // namespace kvcal
