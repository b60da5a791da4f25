// Pieces every part of the report shares: the roles, the engine's enums
// spelled through the one names table (proto/names.h), the JSON aliases and
// the smallest loss difference the recommendation acts on.
#ifndef KVCAL_CLIENT_REPORT_COMMON_H_
#define KVCAL_CLIENT_REPORT_COMMON_H_

#include <string>

#include "kernels/scale_math.h"
#include "nlohmann/json.hpp"
#include "proto/names.h"
#include "proto/wire_enums.h"

namespace kvcal::report {

using Json = nlohmann::json;
using OrderedJson = nlohmann::ordered_json;

inline constexpr Role kRoles[3] = {Role::kQ, Role::kK, Role::kV};
inline constexpr const char* kRoleNames[3] = {"q", "k", "v"};

inline std::string ObserverName(Observer observer) {
  return CanonicalName(ToWire(observer));
}
inline std::string FormatName(Format format) {
  return CanonicalName(ToWire(format));
}

}  // namespace kvcal::report

#endif  // KVCAL_CLIENT_REPORT_COMMON_H_
