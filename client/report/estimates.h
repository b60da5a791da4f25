// What the engine estimates from a session's statistics for every observer
// and granularity the report compares: the scales Finalize would compute
// (ComputeScales) and, from the histograms, each role's quantization error,
// saturation and subnormal shares (EstimateQuantization).
#ifndef KVCAL_CLIENT_REPORT_ESTIMATES_H_
#define KVCAL_CLIENT_REPORT_ESTIMATES_H_

#include <string>
#include <vector>

#include "kernels/scale_math.h"
#include "kernels/statistics.h"

namespace kvcal::report {

struct ObserverChoice {
  Observer observer;
  double percentile;  // 0 = the default
  const char* label;  // llm-compressor's name, plus the percentile
  const char* cli;    // `kvcal finalize --observer`
  const char* color;
};
inline constexpr ObserverChoice kObservers[] = {
    {Observer::kStaticMinMax, 0, "static_minmax", "static-minmax", "#d62728"},
    {Observer::kMinMaxEma, 0, "minmax (EMA)", "minmax-ema", "#ff7f0e"},
    {Observer::kMemorylessMinMax, 0, "memoryless_minmax", "memoryless-minmax",
     "#8c564b"},
    {Observer::kMse, 0, "mse", "mse", "#1f77b4"},
    {Observer::kPercentile, 99.99, "percentile 99.99", "percentile", "#2ca02c"},
    {Observer::kPercentile, 99.9, "percentile 99.9", "percentile", "#9467bd"},
};

struct Variant {
  Granularity granularity;
  bool q_per_kv_group;
  const char* label;
};
inline constexpr Variant kVariants[] = {
    {Granularity::kPerTensor, false, "tensor"},
    {Granularity::kPerHead, false, "head (q per query head)"},
    {Granularity::kPerHead, true, "head (q per KV group)"},
};

struct RoleFigures {
  double mean_error = 0.0;  // mean over heads of the relative RMS error
  double max_error = 0.0;
  double saturated = 0.0;  // share of the role's values
  double subnormal = 0.0;
};

struct Estimate {
  const ObserverChoice* observer;
  const Variant* variant;
  ScaleResult scales;
  RoleFigures roles[3];
  double kv_error = 0.0;  // mean of K's and V's mean errors
};

// Every (observer, variant) of kObservers x kVariants that ComputeScales
// accepts for `stats`; the others are named in `skipped` with the reason.
// Error figures only where the session has histograms.
std::vector<Estimate> EstimateObservers(const SessionStatistics& stats,
                                        Format format,
                                        std::vector<std::string>& skipped);

// Per (layer, head) values of one role from a scale result (an empty row
// where the layer has none).
std::vector<std::vector<double>> ScaleMatrix(const ScaleResult& result,
                                             Role role);

}  // namespace kvcal::report

#endif  // KVCAL_CLIENT_REPORT_ESTIMATES_H_
