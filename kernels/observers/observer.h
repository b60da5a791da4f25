// An observer turns the statistics of a set of heads (one head, or every head
// of a role for per-tensor scales) into a range; the scale is range * margin
// / FormatMax (scale_math.h). docs/observers.md defines each one.
//
// One observer, one file in this folder: its range function and its
// definition, registered by
//
//   KVCAL_DEFINE_OBSERVER(percentile) = {Observer::kPercentile, "percentile",
//                                        /*needs_histograms=*/true, &Range};
//
// where the name in parentheses is the file's name without ".cc" (the build
// lists the folder's files: kernels/CMakeLists.txt) and the quoted name is
// the proto value's canonical_name (proto/kvcal/v1/calibration.proto; a test,
// tests/service/observer_table_test.cc, holds the two tables together).
#ifndef KVCAL_KERNELS_OBSERVERS_OBSERVER_H_
#define KVCAL_KERNELS_OBSERVERS_OBSERVER_H_

#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "kernels/head_values.h"
#include "kernels/number_format.h"

namespace kvcal {

// What observers take besides the statistics (FinalizeRequest's fields;
// ranges in docs/wire-contract.md "Finalize").
struct ObserverParameters {
  Format format = Format::kFp8E4m3fn;
  float averaging_constant = 0.01f;
  double percentile = 99.99;
  uint32_t mse_grid = 100;
  float mse_max_shrink = 0.20f;
  float mse_norm = 2.4f;
  uint32_t mse_patience = 5;

  // Every parameter is checked, whichever observer is chosen;
  // InvalidArgument names the first out of range.
  absl::Status Validate() const;
};

// Numbers match the wire enum (kvcal.v1.Observer). OBSERVER_AUTO is the
// service's (service/finalize_evaluation.h), not the engine's.
enum class Observer : uint32_t {
  kStaticMinMax = 1,
  kMinMaxEma = 2,
  kMemorylessMinMax = 3,
  kMse = 4,
  kPercentile = 5,
};

struct ObserverDefinition {
  Observer id;
  const char* name;  // the proto value's canonical_name
  // True when the range reads the |x| histograms (a session created with
  // histogram_bins_per_octave = 0 cannot use it).
  bool needs_histograms;
  // The range of a set of heads, every head with finite values.
  float (*range)(HeadSpan heads, const ObserverParameters& parameters,
                 uint32_t log2_bins_per_octave);
};

// The definition of `id`; nullptr when the engine has no such observer.
const ObserverDefinition* FindObserver(Observer id);

// Every observer of this folder, by ascending id.
std::span<const ObserverDefinition* const> Observers();

}  // namespace kvcal

// Defines the observer of the file `stem`.cc (see the top of this file).
#define KVCAL_DEFINE_OBSERVER(stem)              \
  namespace kvcal::observer_files {              \
  extern const ::kvcal::ObserverDefinition stem; \
  }                                              \
  const ::kvcal::ObserverDefinition kvcal::observer_files::stem

#endif  // KVCAL_KERNELS_OBSERVERS_OBSERVER_H_
