#include "proto/names.h"

#include <algorithm>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"

namespace kvcal {
namespace {

using google::protobuf::EnumDescriptor;
using google::protobuf::EnumValueDescriptor;

std::string Normalized(absl::string_view spelling) {
  return absl::StrReplaceAll(absl::AsciiStrToLower(spelling), {{"-", "_"}});
}

// Every spelling of one value: canonical, CLI, aliases, the proto name.
std::vector<std::string> Spellings(const EnumValueDescriptor* value) {
  const google::protobuf::EnumValueOptions& options = value->options();
  std::vector<std::string> out = {options.GetExtension(v1::canonical_name),
                                  options.GetExtension(v1::cli_name),
                                  value->name()};
  for (int i = 0; i < options.ExtensionSize(v1::alias); ++i) {
    out.push_back(options.GetExtension(v1::alias, i));
  }
  return out;
}

}  // namespace

const std::vector<ObserverRow>& ObserverTable() {
  static const std::vector<ObserverRow>* const table = [] {
    auto* rows = new std::vector<ObserverRow>();
    const EnumDescriptor* type = v1::Observer_descriptor();
    for (int i = 0; i < type->value_count(); ++i) {
      const EnumValueDescriptor* value = type->value(i);
      const google::protobuf::EnumValueOptions& options = value->options();
      const int simplicity = options.GetExtension(v1::simplicity);
      if (simplicity <= 0) continue;  // UNSPECIFIED, auto
      ObserverRow row{static_cast<v1::Observer>(value->number()),
                      CanonicalName(type, value->number()),
                      CliName(type, value->number()),
                      options.GetExtension(v1::label),
                      options.GetExtension(v1::needs_histograms),
                      simplicity};
      if (row.label.empty()) row.label = row.name;
      rows->push_back(std::move(row));
    }
    std::stable_sort(rows->begin(), rows->end(),
                     [](const ObserverRow& a, const ObserverRow& b) {
                       return a.simplicity < b.simplicity;
                     });
    return rows;
  }();
  return *table;
}

std::string CanonicalName(const EnumDescriptor* type, int number) {
  const EnumValueDescriptor* value = type->FindValueByNumber(number);
  if (value == nullptr) return absl::StrCat(type->name(), "(", number, ")");
  const std::string& name = value->options().GetExtension(v1::canonical_name);
  return name.empty() ? value->name() : name;
}

std::string CliName(const EnumDescriptor* type, int number) {
  const EnumValueDescriptor* value = type->FindValueByNumber(number);
  if (value == nullptr) return CanonicalName(type, number);
  const std::string& name = value->options().GetExtension(v1::cli_name);
  return name.empty() ? CanonicalName(type, number) : name;
}

std::string CliNames(const EnumDescriptor* type) {
  std::vector<std::string> names;
  for (int i = 0; i < type->value_count(); ++i) {
    if (type->value(i)->number() == 0) continue;  // UNSPECIFIED
    names.push_back(CliName(type, type->value(i)->number()));
  }
  return absl::StrJoin(names, ", ");
}

absl::StatusOr<int> ParseName(const EnumDescriptor* type,
                              absl::string_view what,
                              absl::string_view spelling) {
  const std::string wanted = Normalized(spelling);
  if (!wanted.empty()) {
    for (int i = 0; i < type->value_count(); ++i) {
      const EnumValueDescriptor* value = type->value(i);
      if (value->number() == 0) continue;
      for (const std::string& s : Spellings(value)) {
        if (!s.empty() && Normalized(s) == wanted) return value->number();
      }
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown ", what, " '", spelling, "' (", CliNames(type), ")"));
}

absl::StatusOr<v1::Observer> ParseObserver(absl::string_view spelling) {
  absl::StatusOr<int> n =
      ParseName(v1::Observer_descriptor(), "observer", spelling);
  if (!n.ok()) return n.status();
  return static_cast<v1::Observer>(*n);
}

absl::StatusOr<v1::Granularity> ParseGranularity(absl::string_view spelling) {
  absl::StatusOr<int> n =
      ParseName(v1::Granularity_descriptor(), "granularity", spelling);
  if (!n.ok()) return n.status();
  return static_cast<v1::Granularity>(*n);
}

absl::StatusOr<v1::Format> ParseFormat(absl::string_view spelling) {
  absl::StatusOr<int> n =
      ParseName(v1::Format_descriptor(), "format", spelling);
  if (!n.ok()) return n.status();
  return static_cast<v1::Format>(*n);
}

absl::StatusOr<v1::Role> ParseRole(absl::string_view spelling) {
  absl::StatusOr<int> n = ParseName(v1::Role_descriptor(), "role", spelling);
  if (!n.ok()) return n.status();
  return static_cast<v1::Role>(*n);
}

}  // namespace kvcal
