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
#include "kernels/statistics.h"

namespace kvcal {

// Numbers match the wire enums (kvcal.v1).
enum class Observer : uint32_t {
  kStaticMinMax = 1,
  kMinMaxEma = 2,
  kMemorylessMinMax = 3,
  kMse = 4,
  kPercentile = 5,
};
enum class Granularity : uint32_t { kPerTensor = 1, kPerHead = 2 };
enum class Format : uint32_t {
  kFp8E4m3fn = 1,
  kFp8E4m3fnuz = 2,
  kFp8E5m2 = 3,
  kInt8 = 4,
};
// The spellings of these values (names users type and files record) live
// in one table: proto/kvcal/v1/calibration.proto, read through proto/names.h.

// Largest magnitude of the format: 448, 240, 57344, 127.
float FormatMax(Format format);
// Smallest normal magnitude: 2^-6, 2^-7, 2^-14; 0 for int8 (no subnormals).
float FormatMinNormal(Format format);

// Rounds q (already within [-FormatMax, FormatMax]) to the nearest value of
// the format, ties to even.
float RoundToFormat(float q, Format format);

// Fake quantization: clamp(x / scale) rounded to the format, times scale,
// all in float32 as torch does it.
float FakeQuantize(float x, float scale, Format format);

// scale = range * margin / FormatMax, FLT_EPSILON when that is 0.
float ScaleFromRange(float range, float margin, Format format);

struct ScaleOptions {
  Observer observer = Observer::kStaticMinMax;
  Granularity granularity = Granularity::kPerTensor;
  Format format = Format::kFp8E4m3fn;
  float averaging_constant = 0.01f;
  double percentile = 99.99;
  float margin = 1.0f;
  uint32_t mse_grid = 100;
  float mse_max_shrink = 0.20f;
  float mse_norm = 2.4f;
  uint32_t mse_patience = 5;
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
// was seen, or when MSE/percentile is asked of statistics without histograms.
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

// Building blocks, exposed for tests.
//
// The range (max(|min|, |max|) after clamping min <= 0 <= max) of a set of
// heads under the min-max observers (static, EMA, memoryless).
float MinMaxRange(std::span<const HeadStatistics* const> heads,
                  Observer observer, float averaging_constant);
// The p-th percentile of |x| over a set of heads (nearest rank).
float PercentileRange(std::span<const HeadStatistics* const> heads,
                      double percentile, uint32_t log2_bins_per_octave);
// The MSE-optimal shrunk range over a set of heads.
float MseRange(std::span<const HeadStatistics* const> heads,
               const ScaleOptions& options, uint32_t log2_bins_per_octave);

}  // namespace kvcal

#endif  // KVCAL_KERNELS_SCALE_MATH_H_
