// Inner loops of the CPU backend: one pass over the runs of a chunk that
// updates, per head, min, max, counts, moments, the |x| histogram and the
// exact tail together. Three versions: portable scalar, AVX2 (+F16C, FMA)
// and AVX-512 (F, BW, VL, DQ), chosen at run time from what the CPU has,
// capped by the environment variable KVCAL_CPU_ISA=scalar|avx2|avx512. All
// three give the same bits for every statistic, the double sums included:
// run_kernels_internal.h defines the order of the sums that they share.
//
// Both layouts of a chunk are rows of head runs (types.h ChunkExtent: element
// (o, h, i) at (o * heads + h) * inner + i), so one kernel walks either in
// memory order:
//
//   std::vector<kvcal::cpu::RunAccumulator> accs(extent.heads);
//   kvcal::cpu::BestLoops(dtype).rows(data, extent.outer,
//                                     extent.heads * extent.inner,
//                                     extent.heads, extent.inner, accs.data());
#ifndef KVCAL_KERNELS_CPU_RUN_KERNELS_H_
#define KVCAL_KERNELS_CPU_RUN_KERNELS_H_

#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/element_math.h"
#include "kernels/types.h"

namespace kvcal::cpu {

// Keeps the kTailCapacity largest values offered. Offers above the threshold
// are appended to a buffer; when it is full, a selection keeps the
// kTailCapacity largest and the threshold rises to the smallest of them. A
// fresh tail (a chunk's first values all enter) costs an append per value
// and a selection per kBufferCapacity - kTailCapacity of them, where a heap
// paid a pop and a push per value.
class TailKeeper {
 public:
  // Starts from `sorted_descending` (a HeadStatistics::tail).
  explicit TailKeeper(const std::vector<float>& sorted_descending);
  // A value must be greater than this to be kept (-1 while fewer than
  // kTailCapacity were offered, so that every |x| >= 0 enters). It never
  // falls; between selections it may lie below the kept values' smallest.
  float threshold() const { return threshold_; }
  void Offer(float abs_value) {
    if (!(abs_value > threshold_)) return;
    values_.push_back(abs_value);
    changed_ = true;
    if (values_.size() == kBufferCapacity) Select();
  }
  // Writes the kept values, sorted descending.
  void StoreSortedDescending(std::vector<float>* out);

 private:
  static constexpr size_t kBufferCapacity = 4 * kTailCapacity;
  // Keeps the kTailCapacity largest of values_ and raises the threshold.
  void Select();

  std::vector<float> values_;  // sorted descending until changed_
  float threshold_ = -1.0f;
  bool changed_ = false;
};

// What one head saw. min and max are canonical (-0.0 counts as +0.0).
struct RunAccumulator {
  float min = std::numeric_limits<float>::infinity();
  float max = -std::numeric_limits<float>::infinity();
  uint64_t finite = 0;
  uint64_t nan = 0;
  uint64_t inf = 0;
  double sum = 0.0;
  double sum_squares = 0.0;
  uint64_t* histogram = nullptr;  // null: no histogram
  uint32_t log2_bins_per_octave = 0;
  TailKeeper* tail = nullptr;  // null: no tail
};

// Adds `rows` rows of `heads` runs of `length` values of one dtype: the run of
// row r and head h starts (r * stride + h * length) elements after `data`
// and goes to accs[h]. Every accumulator must agree on whether it has a
// histogram (all with the same resolution) and on whether it has a tail.
// The walk follows memory order: rows one after the other, the heads of a row
// in turn, with each head's vector state parked between its runs.
using RowsFn = void (*)(const void* data, size_t rows, size_t stride,
                        size_t heads, size_t length, RunAccumulator* accs);

// rows x heads runs of `length` values at `data`: the run of row r and span
// head j starts (r * stride + j * length) elements after `data` and goes to
// accs[head + j].
struct RowSpan {
  const void* data;
  size_t rows;
  size_t stride;
  size_t head;
  size_t heads;
  size_t length;
};
// Adds `count` spans, in order, to accs[0, heads): for a chunk that arrived
// in pieces. The 16-bit loops keep one state per head over all the spans
// (what they would keep over one call), the others call their RowsFn per
// span; every ISA gives the same bits.
using SpansFn = void (*)(const RowSpan* spans, size_t count, size_t heads,
                         RunAccumulator* accs);

// The loops of one instruction set for one dtype; both null when this build
// or this CPU lacks the instruction set.
struct Loops {
  RowsFn rows = nullptr;
  SpansFn spans = nullptr;
};
Loops ScalarLoops(DType dtype);
// Needs AVX2, F16C and FMA.
Loops Avx2Loops(DType dtype);
// Needs AVX-512 F/BW/VL/DQ (and AVX2: f32 uses the AVX2 loops, as its double
// sums need the same order on both).
Loops Avx512Loops(DType dtype);

// Instruction sets of the inner loops, narrowest first.
enum class CpuIsa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };
absl::string_view CpuIsaName(CpuIsa isa);
absl::StatusOr<CpuIsa> ParseCpuIsa(absl::string_view text);
// The widest instruction set that this build and this CPU support.
CpuIsa SupportedCpuIsa();
// SupportedCpuIsa(), capped by KVCAL_CPU_ISA when set (read once; an unknown
// value is ignored with a message on stderr).
CpuIsa ActiveCpuIsa();
// The loops of `isa` (null when this build or CPU lacks it).
Loops LoopsFor(CpuIsa isa, DType dtype);
// LoopsFor(ActiveCpuIsa(), dtype).
Loops BestLoops(DType dtype);

}  // namespace kvcal::cpu

#endif  // KVCAL_KERNELS_CPU_RUN_KERNELS_H_
