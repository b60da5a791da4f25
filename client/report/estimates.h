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
  std::string label;  // the canonical name, plus the percentile
  std::string cli;    // `kvcal finalize --observer`
  const char* color;
};
// The observers the report compares: every row of the proto's observer table
// (proto/names.h ObserverTable(), simplest first) at its defaults, and
// percentile also at 99.9, the setting that clips by design.
const std::vector<ObserverChoice>& ReportObservers();

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

// Every (observer, variant) of ReportObservers() x kVariants that ComputeScales
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
