// Inner loops of the CPU backend: one pass over a contiguous run of values of
// one head that updates min, max, counts, moments, the |x| histogram and the
// exact tail together. A portable scalar version and an AVX2 version (chosen
// at run time when the CPU has AVX2 and F16C) compute identical min, max,
// counts, histograms and tails; the double sums differ only by rounding.
#ifndef KVCAL_KERNELS_CPU_RUN_KERNELS_H_
#define KVCAL_KERNELS_CPU_RUN_KERNELS_H_

#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/types.h"

namespace kvcal::cpu {

// Keeps the kTailCapacity largest values offered, as a min-heap.
class TailKeeper {
 public:
  // Starts from `sorted_descending` (a HeadStatistics::tail).
  explicit TailKeeper(const std::vector<float>& sorted_descending);
  // A value must be greater than this to change the tail (-1 while the tail
  // is not full, so that every |x| >= 0 enters).
  float threshold() const { return threshold_; }
  void Offer(float abs_value);
  // Writes the kept values, sorted descending.
  void StoreSortedDescending(std::vector<float>* out);

 private:
  std::vector<float> heap_;  // min-heap under std::greater
  float threshold_ = -1.0f;
};

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

// Adds `runs` runs of `length` values of type `dtype` to `acc`; run r starts
// `r * stride` elements after `data`. One call covers every run of one head
// in a chunk, so per-call set-up and reductions are paid once per head, and
// the implementation can prefetch the next runs of a strided layout.
using RunFn = void (*)(const void* data, size_t runs, size_t length,
                       size_t stride, RunAccumulator& acc);

RunFn ScalarRunFn(DType dtype);
// nullptr when this build or this CPU has no AVX2/F16C.
RunFn Avx2RunFn(DType dtype);
// The fastest available implementation.
RunFn BestRunFn(DType dtype);

}  // namespace kvcal::cpu

#endif  // KVCAL_KERNELS_CPU_RUN_KERNELS_H_
