// Non-finite values (NaN, +-Inf) of one chunk, per head, found before
// anything of the chunk is applied: what a session created with
// reject_non_finite checks each chunk with.
//
//   KVCAL_ASSIGN_OR_RETURN(kvcal::ChunkExtent extent,
//                          kvcal::ValidateChunk(geometry, chunk));
//   kvcal::ChunkNonFinite found = kvcal::CountNonFinite(chunk, extent);
//   if (found.total() > 0) {
//     return absl::InvalidArgumentError(kvcal::DescribeNonFinite(chunk,
//                                                                found));
//   }
//
// A value is NaN or Inf exactly when the engine counts it so
// (element_math.h: IsNonFinite, IsNan after decoding), for every dtype.
#ifndef KVCAL_KERNELS_NONFINITE_H_
#define KVCAL_KERNELS_NONFINITE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/types.h"

namespace kvcal {

struct NonFiniteCount {
  uint64_t nan = 0;
  uint64_t inf = 0;  // +Inf and -Inf
  uint64_t total() const { return nan + inf; }
};

// The counts of one chunk: heads[h] for the chunk's head h (the layer's head
// head_offset + h).
struct ChunkNonFinite {
  std::vector<NonFiniteCount> heads;
  uint64_t total() const;
};

// Adds the NaN and Inf values among elements [first, first + n) of a chunk
// of `extent` (canonical order, types.h ChunkExtent) to out.heads (sized
// extent.heads); `bytes` holds those n elements, element `first` first, in
// any alignment. For a backend that reads a chunk piece by piece.
void CountNonFiniteElements(DType dtype, const std::byte* bytes, uint64_t first,
                            uint64_t n, const ChunkExtent& extent,
                            ChunkNonFinite& out);

// Every element of a validated chunk (data or pieces; extent from
// ValidateChunk). One read pass; per-head counting only in the 64 KiB
// blocks that hold a non-finite value.
ChunkNonFinite CountNonFinite(const ChunkView& chunk,
                              const ChunkExtent& extent);

// "1536 non-finite values in layer 3 K: head 1 512 NaN 0 Inf, head 2 ..."
// naming at most `max_heads` heads ("and N more heads").
std::string DescribeNonFinite(const ChunkView& chunk,
                              const ChunkNonFinite& found,
                              size_t max_heads = 8);

}  // namespace kvcal

#endif  // KVCAL_KERNELS_NONFINITE_H_
