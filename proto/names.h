// The spellings of kvcal's enum values, read from the one table in
// proto/kvcal/v1/calibration.proto (the (canonical_name), (cli_name) and
// (alias) options on each enum value). The CLI, the worker's messages, the
// scales file, the patcher and the Python package all spell names through it.
//
// Parsing is case-insensitive and treats '-' and '_' alike, so
// `--observer minmax`, `--observer minmax-ema` and `--observer MINMAX_EMA`
// all name OBSERVER_MINMAX_EMA; `static_minmax` (what config.json records)
// and `static-minmax` (what the CLI prints) both name the static observer.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/descriptor.h"
#include "kvcal/v1/calibration.pb.h"

namespace kvcal {

// The canonical name of `number` in `type` ("static_minmax", "head",
// "float8_e4m3fn", "q"); the proto value name when the value has none.
std::string CanonicalName(const google::protobuf::EnumDescriptor* type,
                          int number);
// How the CLI prints it ("static-minmax", "fp8-e4m3fn"): the cli_name
// option, else the canonical name.
std::string CliName(const google::protobuf::EnumDescriptor* type, int number);
// Every value but UNSPECIFIED as the CLI prints them: "a, b, c".
std::string CliNames(const google::protobuf::EnumDescriptor* type);
// Any spelling of a value (canonical, CLI, alias or the proto value name, in
// any case, '-' or '_'); InvalidArgument naming `what`, the spelling and
// the accepted CLI names otherwise. UNSPECIFIED is never a match.
absl::StatusOr<int> ParseName(const google::protobuf::EnumDescriptor* type,
                              absl::string_view what,
                              absl::string_view spelling);

// One row of the proto's observer table: the options on an Observer value.
struct ObserverRow {
  v1::Observer value;
  std::string name;   // canonical ("static_minmax")
  std::string cli;    // as the CLI prints it ("static-minmax")
  std::string label;  // as the report prints it ("static min-max")
  bool needs_histograms = false;
  int simplicity = 0;  // 1 = the simplest
};
// Every observer but auto (simplicity 0), the simplest first: the list the
// worker's auto evaluates and every client derives its own from.
const std::vector<ObserverRow>& ObserverTable();

// Typed forms for the enums users name.
absl::StatusOr<v1::Observer> ParseObserver(absl::string_view spelling);
absl::StatusOr<v1::Granularity> ParseGranularity(absl::string_view spelling);
absl::StatusOr<v1::Format> ParseFormat(absl::string_view spelling);
absl::StatusOr<v1::Role> ParseRole(absl::string_view spelling);

template <typename Enum>
std::string CanonicalName(Enum value) {
  return CanonicalName(google::protobuf::GetEnumDescriptor<Enum>(),
                       static_cast<int>(value));
}
template <typename Enum>
std::string CliName(Enum value) {
  return CliName(google::protobuf::GetEnumDescriptor<Enum>(),
                 static_cast<int>(value));
}

}  // namespace kvcal
