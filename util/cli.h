// Command-line plumbing shared by `kvcal` and `kvcal-worker` (CLI11): the
// exit codes, range checks for numeric flags, address checks, --version,
// and usage errors as one line on stderr with a typo suggestion.
//
//   CLI::App app{"...", "kvcal-worker"};
//   app.add_option("--window", window)->check(cli::InRange({1, 1024}));
//   app.add_option("--listen", listen)->check(cli::ListenAddress());
//   cli::AddVersionFlag(app);
//   if (std::optional<int> exit = cli::Parse(app, argc, argv)) return *exit;
//
// A usage error is printed as
//   kvcal push: --chunk-bytes: 0 is out of range: want 1..1073741824 (see 'kvcal push --help')
// and exits kExitUsage; --help and --version print on stdout and exit 0.
#ifndef KVCAL_UTIL_CLI_H_
#define KVCAL_UTIL_CLI_H_

#include <cstdint>
#include <optional>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/statusor.h"

namespace kvcal::cli {

// The exit codes of both binaries (client/README.md "Exit codes").
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;  // the command ran and failed
inline constexpr int kExitUsage = 2;    // the command line is wrong

// Edit distance with adjacent transpositions counted as one edit (optimal
// string alignment): "calibrat" -> "calibrate" 1, "stauts" -> "status" 1.
size_t EditDistance(absl::string_view a, absl::string_view b);

// What `word` was probably meant to be: the closest candidate within
// max(2, |word| / 3) edits (the first of equals), else the only candidate
// that starts with `word` when it has 3+ characters, else "".
std::string Suggest(absl::string_view word,
                    const std::vector<std::string>& candidates);

// An integer flag's valid values: min..max, `note` says what a special
// value means ("0 = unlimited").
struct IntRange {
  int64_t min = 0;
  uint64_t max = 0;
  std::string note;
};

// A real-valued flag's valid values: an interval (max may be infinity),
// and, when zero_means is set, 0 as well (the flags where 0 asks the
// worker for its default).
struct RealRange {
  double min = 0;
  double max = 0;
  bool min_open = false;
  bool max_open = false;
  std::string zero_means;  // "the worker's default, 0.01"
};

// "1..1073741824 (0 = unlimited)", "(0, 1], or 0 for the worker's default".
std::string Describe(const IntRange& range);
std::string Describe(const RealRange& range);

// The value in canonical form ("010" -> "10": CLI11 would read a leading 0
// as octal), or InvalidArgument: "'abc' is not a whole number: want 1..16",
// "0 is out of range: want 1..16". Only decimal digits with an optional
// '-' are whole numbers; reals must be finite.
absl::StatusOr<std::string> CheckInteger(absl::string_view text,
                                         const IntRange& range);
absl::StatusOr<std::string> CheckReal(absl::string_view text,
                                      const RealRange& range);

// CLI11 validators around the checks above; CLI11 prefixes the flag name.
CLI::Validator InRange(IntRange range);
CLI::Validator InRange(RealRange range);
// 0 or a power of two up to `max` (histogram bins per octave).
CLI::Validator ZeroOrPowerOfTwo(uint32_t max, std::string zero_means);

// A listening address: HOST:PORT with a port 0..65535 (util/host_port.h),
// or a gRPC "unix:" / "unix-abstract:" address; empty only when
// `allow_empty` (an optional listener that is off).
CLI::Validator ListenAddress(bool allow_empty = false);

// A worker to dial: HOST[:PORT] (no port: kDefaultPort), dns:///HOST[:PORT],
// file:PATH, or another gRPC target scheme (unix:, ipv4:, ...), which is
// passed on as it is. A missing port is filled in and a line saying so is
// appended to `notices` (print them once parsing succeeded).
CLI::Validator ServerAddress(std::vector<std::string>* notices);

// Adds --version: prints VersionLine(app name) on stdout and exits 0.
void AddVersionFlag(CLI::App& app);

// The one-line message for a parse error of `app` given `args` (argv
// without argv[0]): "kvcal push: unknown option '--chunk-byte'; did you mean
// '--chunk-bytes'? (see 'kvcal push --help')".
std::string UsageError(CLI::App& app, const CLI::ParseError& error,
                       const std::vector<std::string>& args);

// Parses argv. nullopt: go on. Otherwise the process should exit with the
// returned code: 0 after --help or --version (printed on stdout), kExitUsage
// after a usage error (printed on stderr as one line).
std::optional<int> Parse(CLI::App& app, int argc, char** argv);

}  // namespace kvcal::cli

#endif  // KVCAL_UTIL_CLI_H_
