// Scale math: from accumulated statistics to FP8/INT8 quantization scales,
// per tensor or per head, under each observer (docs/observers.md).
//
//   kvcal::ScaleOptions options;
//   options.observer = kvcal::Observer::kMse;
//   options.granularity = kvcal::Granularity::kPerHead;
//   KVCAL_ASSIGN_OR_RETURN(kvcal::ScaleResult result,
//                          kvcal::ComputeScales(stats, options));
//   float k_scale_head0 = result.layers[0].role(kvcal::Role::kK)->scale[0];
//
// Every returned scale is finite and > 0 (a zero range gives FLT_EPSILON).
//
// MSE, as kvcal computes it: llm-compressor searches the shrink factor on the
// raw values of each batch; kvcal has no raw values after the fact, so it
// evaluates the same error sum over all calibration data using each head's
// 256 exactly kept largest |x| (exact error) plus the |x| histogram less
// those values (each bin's error integrated over the bin, the values taken
// as spread evenly over it), at every step of the grid: no early stop,
// mse_patience is accepted but unused (docs/observers.md).
#ifndef KVCAL_KERNELS_SCALE_MATH_H_
#define KVCAL_KERNELS_SCALE_MATH_H_

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/number_format.h"
#include "kernels/observers/observer.h"
#include "kernels/statistics.h"

namespace kvcal {

enum class Granularity : uint32_t { kPerTensor = 1, kPerHead = 2 };

// The observer's parameters (format, averaging_constant, percentile, mse_*)
// come from ObserverParameters (kernels/observers/observer.h).
struct ScaleOptions : ObserverParameters {
  Observer observer = Observer::kStaticMinMax;
  Granularity granularity = Granularity::kPerTensor;
  float margin = 1.0f;
  bool q_per_kv_group = false;
  bool allow_missing = false;
  // Only these layers (empty = all): a sharding client asks each worker for
  // the layers it holds. Every listed layer must exist.
  std::vector<uint32_t> layers;

  // Ranges: docs/wire-contract.md "Finalize"; InvalidArgument names it.
  absl::Status Validate() const;
};

struct RoleScales {
  // One entry per tensor or per head (per KV group for Q with
  // q_per_kv_group); empty when allow_missing and a head had no data.
  std::vector<float> scale;
  std::vector<float> absmax;
  uint64_t count = 0;      // finite values
  uint64_t nonfinite = 0;  // NaN and Inf values
};

struct LayerScales {
  uint32_t layer = 0;
  // Indexed by RoleIndex; empty for roles the session does not collect.
  std::array<std::optional<RoleScales>, 3> roles;
  const std::optional<RoleScales>& role(Role r) const {
    return roles[RoleIndex(r)];
  }
};

struct ScaleResult {
  // The selected layers (ScaleOptions::layers), ascending.
  std::vector<LayerScales> layers;
};

// The whole Finalize computation. FailedPrecondition when (layer, role, head)
// triples have no finite value (unless allow_missing), when nothing at all
// was seen, or when an observer that needs histograms (mse, percentile) is
// asked of statistics without them.
absl::StatusOr<ScaleResult> ComputeScales(const SessionStatistics& stats,
                                          const ScaleOptions& options);

// What quantizing a set of heads with one scale costs, estimated from their
// statistics the way MSE evaluates its error (exact kept tail, the rest
// integrated per histogram bin): the relative RMS error
// sqrt(sum (FakeQuantize(x) - x)^2 / sum x^2), and the shares of values
// that saturate (|x| > scale * FormatMax beyond float32 rounding) and that
// fall into the format's subnormals (0 < |x| < scale * FormatMinNormal).
// All zero when the heads have no histograms or no values.
struct QuantizationEstimate {
  double relative_rms_error = 0.0;
  double saturated_share = 0.0;
  double subnormal_share = 0.0;
};
QuantizationEstimate EstimateQuantization(
    std::span<const HeadStatistics* const> heads, float scale, Format format,
    uint32_t log2_bins_per_octave);

}  // namespace kvcal

#endif  // KVCAL_KERNELS_SCALE_MATH_H_
