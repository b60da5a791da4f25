#include "client/report/evaluation.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/report/common.h"
#include "util/status_macros.h"

namespace kvcal::report {
namespace {

absl::StatusOr<std::vector<std::vector<double>>> Matrix(
    const Json& j, const std::string& where) {
  if (!j.is_array()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, " is not a [layers][heads] array"));
  }
  std::vector<std::vector<double>> out;
  for (const Json& row : j) {
    if (!row.is_array()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " is not a [layers][heads] array"));
    }
    std::vector<double> r;
    for (const Json& v : row) {
      r.push_back(v.is_number() ? v.get<double>()
                                : std::numeric_limits<double>::quiet_NaN());
    }
    out.push_back(std::move(r));
  }
  return out;
}

// Mean and largest finite entry of `m` (either may be null).
void FiniteMeanAndMax(const std::vector<std::vector<double>>& m, double* mean,
                      double* worst) {
  double sum = 0.0, n = 0.0, w = 0.0;
  for (const auto& r : m) {
    for (double v : r) {
      if (!std::isfinite(v)) continue;
      sum += v;
      n += 1;
      w = std::max(w, v);
    }
  }
  if (mean) *mean = n > 0 ? sum / n : 0.0;
  if (worst) *worst = w;
}

// The perplexities and nll deltas of the reference, calibrated and
// scale-1.0 runs.
absl::Status ReadRuns(const Json& runs, const std::string& name,
                      EvaluationRow& row) {
  for (const char* run : {"reference", "calibrated", "ones"}) {
    if (!runs.contains(run) || !runs.at(run).contains("nll")) {
      return absl::InvalidArgumentError(
          absl::StrCat("evaluation ", name, ": runs.", run, ".nll is missing"));
    }
  }
  const double reference = runs.at("reference").at("nll").get<double>();
  row.delta_nll = runs.at("calibrated").at("nll").get<double>() - reference;
  row.delta_nll_ones = runs.at("ones").at("nll").get<double>() - reference;
  row.perplexity = std::exp(runs.at("calibrated").at("nll").get<double>());
  row.reference_perplexity = std::exp(reference);
  return absl::OkStatus();
}

// Per role: |x| maxima and scales, and over the quantized roles the worst
// saturation (calibrated and scale 1.0) and the mean subnormal share.
absl::Status ReadShares(const Json& j, const std::string& name,
                        EvaluationRow& row) {
  const Json& saturation = j.at("saturation");
  const Json& saturation_ones = j.at("saturation_ones");
  const Json& subnormal = j.at("subnormal");
  const Json& absmax = j.at("absmax");
  double sub_sum = 0.0;
  int sub_n = 0;
  for (int r = 0; r < 3; ++r) {
    const std::string role = kRoleNames[r];
    const bool quantized = !(row.kv_only && r == 0);
    for (const Json* m : {&saturation, &saturation_ones, &subnormal, &absmax}) {
      if (!m->contains(role)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "evaluation ", name, ": no '", role, "' in a share map"));
      }
    }
    KVCAL_ASSIGN_OR_RETURN(auto sat,
                           Matrix(saturation.at(role), name + ": saturation"));
    KVCAL_ASSIGN_OR_RETURN(auto sat1, Matrix(saturation_ones.at(role),
                                             name + ": saturation_ones"));
    KVCAL_ASSIGN_OR_RETURN(auto sub,
                           Matrix(subnormal.at(role), name + ": subnormal"));
    KVCAL_ASSIGN_OR_RETURN(row.absmax[r],
                           Matrix(absmax.at(role), name + ": absmax"));
    if (j.contains("scales") && j["scales"].contains(role)) {
      KVCAL_ASSIGN_OR_RETURN(row.scale[r],
                             Matrix(j["scales"][role], name + ": scales"));
    }
    if (!quantized) continue;
    double worst = 0.0, worst1 = 0.0, mean = 0.0;
    FiniteMeanAndMax(sat, nullptr, &worst);
    FiniteMeanAndMax(sat1, nullptr, &worst1);
    FiniteMeanAndMax(sub, &mean, nullptr);
    row.saturated = std::max(row.saturated, worst);
    row.saturated_ones = std::max(row.saturated_ones, worst1);
    sub_sum += mean;
    ++sub_n;
  }
  row.subnormal = sub_n ? sub_sum / sub_n : 0.0;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<EvaluationRow> ParseEvaluation(const EvaluationInput& in) {
  const Json& j = in.result;
  const auto field = [&](const char* name) -> absl::StatusOr<const Json*> {
    if (!j.is_object() || !j.contains(name)) {
      return absl::InvalidArgumentError(
          absl::StrCat("evaluation ", in.name, ": no field '", name,
                       "' (expected kvcal.torch.evaluate's to_json output)"));
    }
    return &j.at(name);
  };
  EvaluationRow row;
  row.name = in.name;
  try {
    KVCAL_ASSIGN_OR_RETURN(const Json* version,
                           field("kvcal_evaluation_version"));
    if (*version != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("evaluation ", in.name, ": kvcal_evaluation_version ",
                       version->dump(), " is not supported (1)"));
    }
    KVCAL_ASSIGN_OR_RETURN(const Json* granularity, field("granularity"));
    KVCAL_ASSIGN_OR_RETURN(const Json* observer, field("observer"));
    KVCAL_ASSIGN_OR_RETURN(const Json* kv_only, field("kv_only"));
    KVCAL_ASSIGN_OR_RETURN(const Json* q_group, field("q_per_kv_group"));
    KVCAL_ASSIGN_OR_RETURN(const Json* runs, field("runs"));
    KVCAL_ASSIGN_OR_RETURN(const Json* error, field("attention_error"));
    KVCAL_ASSIGN_OR_RETURN(const Json* error_ones,
                           field("attention_error_ones"));
    for (const char* share :
         {"saturation", "saturation_ones", "subnormal", "absmax"}) {
      KVCAL_RETURN_IF_ERROR(field(share).status());
    }
    row.granularity = granularity->get<std::string>();
    row.observer = observer->get<std::string>();
    row.kv_only = kv_only->get<bool>();
    row.q_per_kv_group = q_group->get<bool>();
    row.label = j.contains("label") && j["label"].is_string() &&
                        !j["label"].get<std::string>().empty()
                    ? j["label"].get<std::string>()
                    : row.observer;
    KVCAL_RETURN_IF_ERROR(ReadRuns(*runs, in.name, row));
    KVCAL_ASSIGN_OR_RETURN(auto err,
                           Matrix(*error, in.name + ": attention_error"));
    KVCAL_ASSIGN_OR_RETURN(
        auto err1, Matrix(*error_ones, in.name + ": attention_error_ones"));
    FiniteMeanAndMax(err, &row.attention_mean, &row.attention_worst);
    for (const std::vector<double>& layer : err) {
      double mean = 0.0;
      FiniteMeanAndMax({layer}, &mean, nullptr);
      row.layer_attention.push_back(mean);
    }
    if (j.contains("kv_format")) {
      row.kv_format = j["kv_format"].get<std::string>();
      if (row.kv_format != "fp8" && row.kv_format != "nvfp4" &&
          row.kv_format != "nvfp4_4over6") {
        return absl::InvalidArgumentError(
            absl::StrCat("evaluation ", in.name, ": kv_format '", row.kv_format,
                         "' is not fp8, nvfp4 or nvfp4_4over6"));
      }
    }
    FiniteMeanAndMax(err1, &row.attention_ones_mean, nullptr);
    KVCAL_RETURN_IF_ERROR(ReadShares(j, in.name, row));
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("evaluation ", in.name, ": ", e.what()));
  }
  return row;
}

absl::StatusOr<std::vector<EvaluationRow>> ParseEvaluations(
    const std::vector<EvaluationInput>& inputs,
    const std::optional<SessionStatistics>& statistics) {
  std::vector<EvaluationRow> evaluations;
  for (const EvaluationInput& e : inputs) {
    KVCAL_ASSIGN_OR_RETURN(EvaluationRow row, ParseEvaluation(e));
    if (statistics) {
      const Geometry& g = statistics->geometry();
      for (int r = 0; r < 3; ++r) {
        if (row.absmax[r].size() != g.num_layers) {
          return absl::InvalidArgumentError(absl::StrCat(
              "evaluation ", e.name, ": absmax.", kRoleNames[r], " has ",
              row.absmax[r].size(), " layers, the session ", g.num_layers));
        }
      }
    }
    evaluations.push_back(std::move(row));
  }
  return evaluations;
}

}  // namespace kvcal::report
