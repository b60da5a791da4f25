#include "util/cli.h"

#include <algorithm>
#include <cmath>
#include <iostream>
#include <limits>
#include <regex>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "util/host_port.h"
#include "util/version.h"

namespace kvcal::cli {
namespace {

std::string Number(double v) {
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return absl::StrFormat("%g", v);
}

bool IsDigits(absl::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
    return absl::ascii_isdigit(static_cast<unsigned char>(c));
  });
}

// CLI11 hands an option the next argument as its value even when that is
// another option ("--listen= --backend cpu"): say so instead of judging
// "--backend" as an address or a number.
std::string OptionAsValue(const std::string& value) {
  if (absl::StartsWith(value, "--")) {
    return absl::StrCat("needs a value (found the option '", value,
                        "' instead)");
  }
  return "";
}

}  // namespace

size_t EditDistance(absl::string_view a, absl::string_view b) {
  // d[i][j]: distance between a[0..i) and b[0..j).
  std::vector<std::vector<size_t>> d(a.size() + 1,
                                     std::vector<size_t>(b.size() + 1, 0));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1,
                          d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[a.size()][b.size()];
}

std::string Suggest(absl::string_view word,
                    const std::vector<std::string>& candidates) {
  const size_t limit = std::max<size_t>(2, word.size() / 3);
  std::string best;
  size_t best_distance = limit + 1;
  for (const std::string& c : candidates) {
    const size_t d = EditDistance(word, c);
    if (d < best_distance) {
      best = c;
      best_distance = d;
    }
  }
  if (!best.empty()) return best;
  // A prefix of one candidate only ("cal" -> "calibrate"); the leading
  // dashes of an option do not count as characters.
  const absl::string_view bare = word.substr(word.find_first_not_of('-') ==
                                                    absl::string_view::npos
                                                ? word.size()
                                                : word.find_first_not_of('-'));
  if (bare.size() < 3) return "";
  std::string only;
  for (const std::string& c : candidates) {
    if (absl::StartsWith(c, word)) {
      if (!only.empty()) return "";
      only = c;
    }
  }
  return only;
}

std::string Describe(const IntRange& range) {
  std::string out =
      range.max >= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())
          ? absl::StrCat(range.min, " or more")
          : absl::StrCat(range.min, "..", range.max);
  if (!range.note.empty()) absl::StrAppend(&out, " (", range.note, ")");
  return out;
}

std::string Describe(const RealRange& range) {
  std::string out;
  if (std::isinf(range.max)) {
    out = absl::StrCat(range.min_open ? "> " : ">= ", Number(range.min));
  } else {
    out = absl::StrCat(range.min_open ? "(" : "[", Number(range.min), ", ",
                       Number(range.max), range.max_open ? ")" : "]");
  }
  if (!range.zero_means.empty()) {
    absl::StrAppend(&out, ", or 0 for ", range.zero_means);
  }
  return out;
}

absl::StatusOr<std::string> CheckInteger(absl::string_view text,
                                         const IntRange& range) {
  const bool negative = !text.empty() && text.front() == '-';
  const absl::string_view digits = negative ? text.substr(1) : text;
  if (!IsDigits(digits)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", text, "' is not a whole number: want ", Describe(range)));
  }
  const auto out_of_range = [&] {
    return absl::InvalidArgumentError(absl::StrCat(
        text, " is out of range: want ", Describe(range)));
  };
  if (negative) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(text, &v) || v < range.min) return out_of_range();
    if (v >= 0 && static_cast<uint64_t>(v) > range.max) return out_of_range();
    return absl::StrCat(v);
  }
  uint64_t v = 0;
  if (!absl::SimpleAtoi(digits, &v) || v > range.max) return out_of_range();
  if (range.min > 0 && v < static_cast<uint64_t>(range.min)) {
    return out_of_range();
  }
  return absl::StrCat(v);
}

absl::StatusOr<std::string> CheckReal(absl::string_view text,
                                      const RealRange& range) {
  double v = 0;
  // SimpleAtod skips surrounding spaces and reads "inf" and "nan"; neither
  // is a value any flag means.
  if (text.empty() || absl::ascii_isspace(static_cast<unsigned char>(
                          text.front())) ||
      !absl::SimpleAtod(text, &v) || !std::isfinite(v)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", text, "' is not a finite number: want ", Describe(range)));
  }
  if (v == 0 && !range.zero_means.empty()) return std::string(text);
  const bool above_min = range.min_open ? v > range.min : v >= range.min;
  const bool below_max = range.max_open ? v < range.max : v <= range.max;
  if (!above_min || !below_max) {
    return absl::InvalidArgumentError(
        absl::StrCat(text, " is out of range: want ", Describe(range)));
  }
  return std::string(text);
}

CLI::Validator InRange(IntRange range) {
  const std::string description = Describe(range);
  return CLI::Validator(
      [range = std::move(range)](std::string& value) -> std::string {
        if (std::string e = OptionAsValue(value); !e.empty()) return e;
        absl::StatusOr<std::string> canonical = CheckInteger(value, range);
        if (!canonical.ok()) return std::string(canonical.status().message());
        value = *std::move(canonical);
        return "";
      },
      description);
}

CLI::Validator InRange(RealRange range) {
  const std::string description = Describe(range);
  return CLI::Validator(
      [range = std::move(range)](std::string& value) -> std::string {
        if (std::string e = OptionAsValue(value); !e.empty()) return e;
        absl::StatusOr<std::string> checked = CheckReal(value, range);
        if (!checked.ok()) return std::string(checked.status().message());
        return "";
      },
      description);
}

CLI::Validator ZeroOrPowerOfTwo(uint32_t max, std::string zero_means) {
  const std::string description = absl::StrCat(
      "a power of two 1..", max, ", or 0 for ", zero_means);
  return CLI::Validator(
      [max, description](std::string& value) -> std::string {
        if (std::string e = OptionAsValue(value); !e.empty()) return e;
        absl::StatusOr<std::string> canonical =
            CheckInteger(value, IntRange{0, max, ""});
        uint64_t v = 0;
        if (canonical.ok() && absl::SimpleAtoi(*canonical, &v) &&
            (v & (v - 1)) == 0) {
          value = *std::move(canonical);
          return "";
        }
        return absl::StrCat(
            IsDigits(value) ? value : absl::StrCat("'", value, "'"),
            " is not ", description);
      },
      description);
}

CLI::Validator ListenAddress(bool allow_empty) {
  return CLI::Validator(
      [allow_empty](std::string& value) -> std::string {
        if (value.empty() && allow_empty) return "";
        if (std::string e = OptionAsValue(value); !e.empty()) return e;
        if (absl::StartsWith(value, "unix:") ||
            absl::StartsWith(value, "unix-abstract:")) {
          return "";
        }
        absl::StatusOr<HostPort> parsed =
            ParseHostPort(value, {.default_port = -1, .min_port = 0});
        if (!parsed.ok()) return std::string(parsed.status().message());
        value = parsed->ToString();
        return "";
      },
      "HOST:PORT (port 0..65535)");
}

CLI::Validator ServerAddress(std::vector<std::string>* notices) {
  return CLI::Validator(
      [notices](std::string& value) -> std::string {
        if (std::string e = OptionAsValue(value); !e.empty()) return e;
        constexpr absl::string_view kDns = "dns:///";
        constexpr absl::string_view kFile = "file:";
        if (absl::StartsWith(value, kFile)) {
          return value.size() > kFile.size()
                     ? ""
                     : "file: needs a path (file:PATH lists the workers)";
        }
        if (HasTargetScheme(value)) return "";
        const bool dns = absl::StartsWith(value, kDns);
        const std::string address =
            dns ? value.substr(kDns.size()) : value;
        absl::StatusOr<HostPort> parsed = ParseHostPort(
            address, {.default_port = kDefaultPort, .min_port = 1});
        if (!parsed.ok()) return std::string(parsed.status().message());
        const std::string full =
            absl::StrCat(dns ? kDns : "", parsed->ToString());
        if (parsed->port_defaulted && notices != nullptr) {
          notices->push_back(absl::StrCat("--server ", value,
                                          " has no port: using ", full,
                                          " (the default port)"));
        }
        value = full;
        return "";
      },
      "HOST[:PORT]");
}

void AddVersionFlag(CLI::App& app) {
  const std::string name = app.get_name();
  app.set_version_flag(
      "--version", [name] { return VersionLine(name); },
      "print the version, the git commit and the backends of this build");
}

namespace {

// What a command accepts: its options' names with dashes ("--window",
// "-o") and, for each, whether it takes a value. A subcommand that falls
// through also accepts its parent's options.
struct KnownOptions {
  std::vector<std::string> names;
  std::vector<bool> takes_value;

  void Add(const CLI::App& app) {
    for (const CLI::Option* opt : app.get_options()) {
      const bool value = opt->get_items_expected_min() > 0;
      for (const std::string& l : opt->get_lnames()) {
        names.push_back("--" + l);
        takes_value.push_back(value);
      }
      for (const std::string& s : opt->get_snames()) {
        names.push_back("-" + s);
        takes_value.push_back(value);
      }
    }
    if (app.get_fallthrough() && app.get_parent() != nullptr) {
      Add(*app.get_parent());
    }
  }
  // -1: unknown.
  int Find(const std::string& name) const {
    const auto it = std::find(names.begin(), names.end(), name);
    return it == names.end() ? -1 : static_cast<int>(it - names.begin());
  }
};

bool LooksLikeNumber(const std::string& token) {
  double ignored = 0;
  return absl::SimpleAtod(token, &ignored);
}

// The first option in `args` that `command` does not know, or "".
std::string FirstUnknownOption(const CLI::App& command,
                               const std::vector<std::string>& args) {
  KnownOptions known;
  known.Add(command);
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& token = args[i];
    if (token == "--") break;
    if (token.size() < 2 || token[0] != '-' || LooksLikeNumber(token)) {
      continue;
    }
    std::string name = token.substr(0, token.find('='));
    if (name[1] != '-' && name.size() > 2) {
      // "-ovalue" is -o with a value; "-chunk-bytes" is a long name with a
      // dash missing, reported as it is.
      if (known.Find(name.substr(0, 2)) >= 0) continue;
    }
    const int index = known.Find(name);
    if (index < 0) return name;
    if (known.takes_value[index] && name == token) ++i;  // skip its value
  }
  return "";
}

// "kvcal push" for a parse error inside push, "kvcal" otherwise; and the
// arguments after the command's name.
struct Located {
  CLI::App* command = nullptr;
  std::string path;
  std::vector<std::string> args;
  std::string unknown_subcommand;
};

Located Locate(CLI::App& app, const std::vector<std::string>& args) {
  Located at{&app, app.get_name(), args, ""};
  const std::vector<CLI::App*> subs = app.get_subcommands({});
  if (subs.empty()) return at;
  KnownOptions top;
  top.Add(app);
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& token = args[i];
    if (!token.empty() && token[0] == '-') {
      const int index = top.Find(token.substr(0, token.find('=')));
      if (index >= 0 && top.takes_value[index] &&
          token.find('=') == std::string::npos) {
        ++i;
      }
      continue;
    }
    for (CLI::App* sub : subs) {
      if (sub->check_name(token)) {
        at.command = sub;
        at.path = absl::StrCat(app.get_name(), " ", sub->get_name());
        at.args.assign(args.begin() + static_cast<std::ptrdiff_t>(i) + 1,
                       args.end());
        return at;
      }
    }
    at.unknown_subcommand = token;
    return at;
  }
  return at;
}

std::string SubcommandNames(const CLI::App& app) {
  std::vector<std::string> names;
  for (const CLI::App* sub : app.get_subcommands({})) {
    names.push_back(sub->get_name());
  }
  return absl::StrJoin(names, ", ");
}

// CLI11's own wording, where it is not plain enough.
std::string Reword(const CLI::ParseError& error) {
  std::string message = error.what();
  std::smatch m;
  static const std::regex missing_value(R"(^(\S+): \d+ required .* missing$)");
  if (std::regex_match(message, m, missing_value)) {
    return absl::StrCat(m[1].str(), " needs a value");
  }
  static const std::regex expected(
      R"(^Expected (?:exactly|at least) \d+ arguments? to (\S+), got 0$)");
  if (std::regex_match(message, m, expected)) {
    return absl::StrCat(m[1].str(), " needs a value");
  }
  static const std::regex conversion(R"(^Could not convert: (\S+) = (.*)$)");
  if (std::regex_match(message, m, conversion)) {
    return absl::StrCat(m[1].str(), ": '", m[2].str(),
                        "' is not a valid value");
  }
  static const std::regex extras(
      R"(^The following arguments? (?:was|were) not expected: (.*)$)");
  if (std::regex_match(message, m, extras)) {
    return absl::StrCat("unexpected argument: ", m[1].str());
  }
  return message;
}

}  // namespace

std::string UsageError(CLI::App& app, const CLI::ParseError& error,
                       const std::vector<std::string>& args) {
  const Located at = Locate(app, args);
  const std::string help = absl::StrCat(" (see '", at.path, " --help')");
  if (!at.unknown_subcommand.empty()) {
    std::vector<std::string> names;
    for (const CLI::App* sub : app.get_subcommands({})) {
      names.push_back(sub->get_name());
    }
    const std::string guess = Suggest(at.unknown_subcommand, names);
    return absl::StrCat(
        at.path, ": unknown subcommand '", at.unknown_subcommand, "'",
        guess.empty() ? absl::StrCat("; the subcommands are ",
                                     SubcommandNames(app))
                      : absl::StrCat("; did you mean '", guess, "'?"),
        help);
  }
  const std::string unknown = FirstUnknownOption(*at.command, at.args);
  if (!unknown.empty()) {
    KnownOptions known;
    known.Add(*at.command);
    const std::string guess = Suggest(unknown, known.names);
    return absl::StrCat(at.path, ": unknown option '", unknown, "'",
                        guess.empty()
                            ? std::string()
                            : absl::StrCat("; did you mean '", guess, "'?"),
                        help);
  }
  if (at.command == &app && !app.get_subcommands({}).empty() &&
      error.get_name() == "RequiredError" &&
      absl::StartsWith(error.what(), "A subcommand")) {
    return absl::StrCat(at.path, ": a subcommand is required: one of ",
                        SubcommandNames(app), help);
  }
  std::string message = Reword(error);
  // "--server is required": say that its environment variable would do.
  static const std::regex required(R"(^(\S+) is required$)");
  std::smatch m;
  if (std::regex_match(message, m, required)) {
    const CLI::Option* opt = at.command->get_option_no_throw(m[1].str());
    if (opt != nullptr && !opt->get_envname().empty()) {
      absl::StrAppend(&message, " (or set ", opt->get_envname(), ")");
    }
  }
  return absl::StrCat(at.path, ": ", message, help);
}

std::optional<int> Parse(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& done) {  // --help, --help-all, --version
    return app.exit(done);
  } catch (const CLI::ParseError& error) {
    std::vector<std::string> args(argv + 1, argv + argc);
    std::string message = UsageError(app, error, args);
    std::replace(message.begin(), message.end(), '\n', ' ');
    std::cerr << message << "\n";
    return kExitUsage;
  }
  return std::nullopt;
}

}  // namespace kvcal::cli
