// The pure parts of the command-line plumbing: host:port parsing, PEM
// checks, range checks, typo suggestions and the usage-error line (what
// `kvcal` and `kvcal-worker` print is tested on the binaries in
// tests/client/cli_test.cc and tests/service/worker_cli_test.cc).
#include "util/cli.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "util/host_port.h"
#include "util/pem.h"
#include "util/strings.h"
#include "util/version.h"

namespace kvcal {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::StartsWith;

// ---------------------------------------------------------------- host:port

constexpr HostPortRules kDial{.default_port = kDefaultPort, .min_port = 1};
constexpr HostPortRules kListen{.default_port = -1, .min_port = 0};

TEST(HostPortTest, AcceptsHostPortAndBracketedIpv6) {
  struct Case {
    const char* text;
    const char* host;
    int port;
    bool defaulted;
    const char* canonical;
  };
  for (const Case& c : {
           Case{"127.0.0.1:50051", "127.0.0.1", 50051, false,
                "127.0.0.1:50051"},
           Case{"worker-0.kvcal.svc:1", "worker-0.kvcal.svc", 1, false,
                "worker-0.kvcal.svc:1"},
           Case{"localhost:65535", "localhost", 65535, false,
                "localhost:65535"},
           Case{"[::1]:7000", "::1", 7000, false, "[::1]:7000"},
           Case{"[fe80::1%eth0]:9", "fe80::1%eth0", 9, false,
                "[fe80::1%eth0]:9"},
           Case{"127.0.0.1", "127.0.0.1", 50051, true, "127.0.0.1:50051"},
           Case{"[::1]", "::1", 50051, true, "[::1]:50051"},
       }) {
    absl::StatusOr<HostPort> p = ParseHostPort(c.text, kDial);
    ASSERT_TRUE(p.ok()) << c.text << ": " << p.status();
    EXPECT_EQ(p->host, c.host) << c.text;
    EXPECT_EQ(p->port, c.port) << c.text;
    EXPECT_EQ(p->port_defaulted, c.defaulted) << c.text;
    EXPECT_EQ(p->ToString(), c.canonical) << c.text;
  }
}

TEST(HostPortTest, RefusesImpossibleAddressesSayingWhy) {
  struct Case {
    const char* text;
    HostPortRules rules;
    const char* message;
  };
  for (const Case& c : {
           // Not taken modulo 65536 (99999 used to serve on 34463).
           Case{"127.0.0.1:99999", kListen,
                "port 99999 is out of range: want 0..65535"},
           Case{"127.0.0.1:65536", kListen, "out of range: want 0..65535"},
           Case{"127.0.0.1:0", kDial, "port 0 is out of range: want 1..65535"},
           Case{"127.0.0.1:-1", kListen, "port '-1' is not a number"},
           Case{"host:abc", kDial, "port 'abc' is not a number: want 1..65535"},
           Case{"host:5x", kDial, "port '5x' is not a number"},
           Case{"host:", kDial, "no port after ':'"},
           Case{"127.0.0.1:99999999999999999999", kListen, "out of range"},
           Case{":50051", kListen, "no host before ':50051'"},
           Case{"127.0.0.1", kListen,
                "'127.0.0.1' has no port: want HOST:PORT, e.g. "
                "127.0.0.1:50051"},
           Case{"::1", kDial, "an IPv6 address goes in brackets"},
           Case{"::1:50051", kListen, "an IPv6 address goes in brackets"},
           Case{"[::1", kDial, "has no closing ']'"},
           Case{"[worker]:1", kDial, "in brackets is not an IPv6 address"},
           Case{"[::1]50051", kDial, "found '50051' after ']'"},
           Case{"a b:1", kDial, "is not a host name or address"},
           Case{"", kDial, "empty address"},
       }) {
    absl::StatusOr<HostPort> p = ParseHostPort(c.text, c.rules);
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << c.text;
    EXPECT_THAT(std::string(p.status().message()), HasSubstr(c.message))
        << c.text;
  }
}

TEST(HostPortTest, TargetSchemesAreGrpcs) {
  EXPECT_TRUE(HasTargetScheme("unix:/run/kvcal.sock"));
  EXPECT_TRUE(HasTargetScheme("ipv4:10.0.0.1:50051"));
  EXPECT_TRUE(HasTargetScheme("dns://8.8.8.8/name:50051"));
  EXPECT_FALSE(HasTargetScheme("dns:///name:50051"));  // kvcal's own form
  EXPECT_FALSE(HasTargetScheme("worker:50051"));
}

// ---------------------------------------------------------------- PEM

constexpr char kCert[] =
    "subject=/CN=x\n-----BEGIN CERTIFICATE-----\nMIIBszCCAVmgAwIBAgIU\n"
    "-----END CERTIFICATE-----\n";
constexpr char kKey[] =
    "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG\n"
    "-----END PRIVATE KEY-----\n";

TEST(PemTest, CertificatesAndKeysAreTold) {
  EXPECT_TRUE(CheckPem(kCert, PemKind::kCertificate).ok());
  EXPECT_TRUE(CheckPem(kKey, PemKind::kPrivateKey).ok());
  EXPECT_TRUE(CheckPem(std::string(kKey) + kCert, PemKind::kCertificate).ok());
  EXPECT_TRUE(CheckPem("-----BEGIN RSA PRIVATE KEY-----\nMIIE\n-----END RSA "
                       "PRIVATE KEY-----\n",
                       PemKind::kPrivateKey)
                  .ok());
  EXPECT_THAT(std::string(CheckPem(kKey, PemKind::kCertificate).message()),
              "not a PEM certificate (it holds a PRIVATE KEY)");
  EXPECT_THAT(std::string(CheckPem(kCert, PemKind::kPrivateKey).message()),
              "not a PEM private key (it holds a CERTIFICATE)");
  EXPECT_THAT(std::string(CheckPem("hello\n", PemKind::kCertificate).message()),
              "not a PEM certificate (no -----BEGIN line)");
  EXPECT_THAT(std::string(CheckPem("", PemKind::kCertificate).message()),
              HasSubstr("empty"));
  EXPECT_THAT(std::string(CheckPem(std::string("\x30\x82\x01\x00\x00", 5),
                                   PemKind::kCertificate)
                              .message()),
              HasSubstr("DER"));
  EXPECT_THAT(std::string(CheckPem("-----BEGIN CERTIFICATE-----\nMIIB\n",
                                   PemKind::kCertificate)
                              .message()),
              HasSubstr("without its END line"));
  EXPECT_THAT(std::string(CheckPem("-----BEGIN CERTIFICATE-----\n!!!!\n"
                                   "-----END CERTIFICATE-----\n",
                                   PemKind::kCertificate)
                              .message()),
              HasSubstr("not base64"));
  EXPECT_THAT(std::string(CheckPem("-----BEGIN ENCRYPTED PRIVATE KEY-----\nMI"
                                   "IE\n-----END ENCRYPTED PRIVATE KEY-----\n",
                                   PemKind::kPrivateKey)
                              .message()),
              HasSubstr("ENCRYPTED PRIVATE KEY"));
}

TEST(PemTest, ReadPemFileNamesTheFlagAndRefusesWhatIsNoFile) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() /
      ("kvcal-pem-test-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "ca.pem") << kCert;
  std::ofstream(dir / "ca.txt") << "not a certificate\n";
  absl::StatusOr<std::string> ok =
      ReadPemFile("--tls-ca", (dir / "ca.pem").string(), PemKind::kCertificate);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(*ok, kCert);
  const auto message = [](const std::string& path) {
    return std::string(ReadPemFile("--tls-ca", path, PemKind::kCertificate)
                           .status()
                           .message());
  };
  EXPECT_EQ(message((dir / "ca.txt").string()),
            "--tls-ca " + (dir / "ca.txt").string() +
                ": not a PEM certificate (no -----BEGIN line)");
  EXPECT_THAT(message("/dev/zero"), "--tls-ca /dev/zero: not a regular file");
  EXPECT_THAT(message(dir.string()), HasSubstr("a directory"));
  EXPECT_THAT(message((dir / "missing.pem").string()),
              HasSubstr("cannot read it: No such file or directory"));
  std::filesystem::remove_all(dir);
}

// ---------------------------------------------------------------- ranges

TEST(RangeTest, IntegersAreDecimalAndInRange) {
  const cli::IntRange window{1, 1024, ""};
  EXPECT_EQ(*cli::CheckInteger("16", window), "16");
  // CLI11 would read "010" as octal 8: the canonical text is decimal.
  EXPECT_EQ(*cli::CheckInteger("010", window), "10");
  EXPECT_EQ(std::string(cli::CheckInteger("0", window).status().message()),
            "0 is out of range: want 1..1024");
  EXPECT_EQ(std::string(cli::CheckInteger("-3", cli::IntRange{0, 1024,
                                                              "0 = one per "
                                                              "core"})
                            .status()
                            .message()),
            "-3 is out of range: want 0..1024 (0 = one per core)");
  for (const char* bad : {"abc", "1e3", "0x10", "", "+5", "1.0", " 5", "-"}) {
    EXPECT_THAT(std::string(cli::CheckInteger(bad, window).status().message()),
                HasSubstr("is not a whole number: want 1..1024"))
        << bad;
  }
  EXPECT_THAT(std::string(cli::CheckInteger("99999999999999999999999", window)
                              .status()
                              .message()),
              HasSubstr("out of range"));
  const cli::IntRange unlimited{0, std::numeric_limits<uint64_t>::max(),
                                "0 = unlimited"};
  EXPECT_EQ(*cli::CheckInteger("18446744073709551615", unlimited),
            "18446744073709551615");
  // An unsigned flag would wrap -1 to 2^64-1 (CLI11's conversion).
  EXPECT_EQ(std::string(cli::CheckInteger("-1", unlimited).status().message()),
            "-1 is out of range: want 0 or more (0 = unlimited)");
  EXPECT_EQ(*cli::CheckInteger("-5", cli::IntRange{-10, 10, ""}), "-5");
}

TEST(RangeTest, RealsAreFiniteAndInTheInterval) {
  const cli::RealRange percentile{0, 100, true, false,
                                  "the worker's default, 99.99"};
  EXPECT_EQ(cli::Describe(percentile),
            "(0, 100], or 0 for the worker's default, 99.99");
  EXPECT_TRUE(cli::CheckReal("99.9", percentile).ok());
  EXPECT_TRUE(cli::CheckReal("100", percentile).ok());
  EXPECT_TRUE(cli::CheckReal("0", percentile).ok());  // the default
  EXPECT_EQ(std::string(cli::CheckReal("101", percentile).status().message()),
            "101 is out of range: want (0, 100], or 0 for the worker's "
            "default, 99.99");
  EXPECT_FALSE(cli::CheckReal("-0.5", percentile).ok());
  for (const char* bad : {"nan", "inf", "-inf", "abc", "", " 1", "1,5"}) {
    EXPECT_THAT(std::string(cli::CheckReal(bad, percentile).status().message()),
                HasSubstr("is not a finite number"))
        << bad;
  }
  const cli::RealRange shrink{0, 1, true, true, ""};
  EXPECT_FALSE(cli::CheckReal("0", shrink).ok());  // no default: 0 is 0
  EXPECT_FALSE(cli::CheckReal("1", shrink).ok());
  EXPECT_TRUE(cli::CheckReal("1e-3", shrink).ok());
  const cli::RealRange positive{0, std::numeric_limits<double>::infinity(),
                                true, true, ""};
  EXPECT_EQ(cli::Describe(positive), "> 0");
  EXPECT_TRUE(cli::CheckReal("1e30", positive).ok());
}

TEST(RangeTest, ValidatorsNameTheValueAndRewriteItCanonically) {
  CLI::Validator bins = cli::ZeroOrPowerOfTwo(128, "no histograms");
  for (std::string ok : {"0", "1", "64", "128"}) {
    EXPECT_EQ(bins(ok), "") << ok;
  }
  std::string three = "3";
  EXPECT_EQ(bins(three),
            "3 is not a power of two 1..128, or 0 for no histograms");
  std::string big = "256";
  EXPECT_THAT(bins(big), HasSubstr("is not a power of two"));
  std::string missing = "--json";  // CLI11 took the next option as the value
  EXPECT_THAT(cli::InRange(cli::IntRange{1, 2, ""})(missing),
              "needs a value (found the option '--json' instead)");
}

TEST(AddressValidatorTest, ListenNeedsAPortAndServerDefaultsIt) {
  CLI::Validator listen = cli::ListenAddress();
  std::string a = "0.0.0.0:0";
  EXPECT_EQ(listen(a), "");
  std::string no_port = "0.0.0.0";
  EXPECT_THAT(listen(no_port), HasSubstr("has no port"));
  std::string too_big = "127.0.0.1:99999";
  EXPECT_THAT(listen(too_big), HasSubstr("out of range: want 0..65535"));
  std::string empty;
  EXPECT_THAT(listen(empty), HasSubstr("empty address"));
  EXPECT_EQ(cli::ListenAddress(/*allow_empty=*/true)(empty), "");
  std::string unix_socket = "unix:/run/kvcal.sock";
  EXPECT_EQ(listen(unix_socket), "");

  std::vector<std::string> notices;
  CLI::Validator server = cli::ServerAddress(&notices);
  std::string host = "127.0.0.1";
  EXPECT_EQ(server(host), "");
  EXPECT_EQ(host, "127.0.0.1:50051");
  std::string dns = "dns:///kvcal-worker.kvcal.svc";
  EXPECT_EQ(server(dns), "");
  EXPECT_EQ(dns, "dns:///kvcal-worker.kvcal.svc:50051");
  std::string given = "w:7000";
  EXPECT_EQ(server(given), "");
  EXPECT_EQ(given, "w:7000");
  ASSERT_EQ(notices.size(), 2u);  // once per address without a port
  EXPECT_EQ(notices[0],
            "--server 127.0.0.1 has no port: using 127.0.0.1:50051 (the "
            "default port)");
  std::string zero = "127.0.0.1:0";  // nothing to dial at port 0
  EXPECT_THAT(server(zero), HasSubstr("want 1..65535"));
  std::string file = "file:";
  EXPECT_THAT(server(file), HasSubstr("needs a path"));
}

// ---------------------------------------------------------------- typos

TEST(SuggestTest, EditDistanceCountsATranspositionOnce) {
  EXPECT_EQ(cli::EditDistance("calibrat", "calibrate"), 1u);
  EXPECT_EQ(cli::EditDistance("stauts", "status"), 1u);
  EXPECT_EQ(cli::EditDistance("kitten", "sitting"), 3u);
  EXPECT_EQ(cli::EditDistance("", "abc"), 3u);
  EXPECT_EQ(cli::EditDistance("same", "same"), 0u);
}

TEST(SuggestTest, ClosestWithinAThirdOrTheOnlyPrefix) {
  const std::vector<std::string> commands = {"create",    "push",   "status",
                                             "finalize",  "patch",  "inspect",
                                             "calibrate", "report", "demo"};
  EXPECT_EQ(cli::Suggest("calibrat", commands), "calibrate");
  EXPECT_EQ(cli::Suggest("stauts", commands), "status");
  EXPECT_EQ(cli::Suggest("finalise", commands), "finalize");
  EXPECT_EQ(cli::Suggest("cal", commands), "calibrate");  // the only prefix
  EXPECT_EQ(cli::Suggest("xyz", commands), "");
  EXPECT_EQ(cli::Suggest("p", commands), "");  // too short to guess
  const std::vector<std::string> flags = {"--chunk-bytes", "--window",
                                          "--session", "--server"};
  EXPECT_EQ(cli::Suggest("--chunk-byte", flags), "--chunk-bytes");
  EXPECT_EQ(cli::Suggest("-chunk-bytes", flags), "--chunk-bytes");
  EXPECT_EQ(cli::Suggest("--win", flags), "--window");
  EXPECT_EQ(cli::Suggest("--sesion", flags), "--session");
}

// ---------------------------------------------------------------- usage line

// A small command line like kvcal's: the usage error for `args`.
std::string UsageErrorFor(std::vector<std::string> args) {
  CLI::App app{"test", "kvcal"};
  app.require_subcommand(1);
  app.fallthrough();
  bool verbose = false;
  app.add_flag("--verbose", verbose);
  CLI::App* push = app.add_subcommand("push", "");
  CLI::App* calibrate = app.add_subcommand("calibrate", "");
  (void)calibrate;
  size_t window = 16;
  std::string session, output, dir;
  push->add_option("--window", window)
      ->check(cli::InRange(cli::IntRange{1, 1024, ""}));
  push->add_option("--session", session)->required();
  push->add_option("-o,--output", output);
  push->add_option("DIR", dir);
  std::vector<std::string> argv_strings = {"kvcal"};
  argv_strings.insert(argv_strings.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& s : argv_strings) argv.push_back(s.data());
  try {
    app.parse(static_cast<int>(argv.size()), argv.data());
  } catch (const CLI::ParseError& e) {
    return cli::UsageError(app, e, args);
  }
  return "parsed";
}

TEST(UsageErrorTest, OneLineNamingTheCommandAndWhatWasWrong) {
  EXPECT_EQ(UsageErrorFor({"calibrat"}),
            "kvcal: unknown subcommand 'calibrat'; did you mean 'calibrate'? "
            "(see 'kvcal --help')");
  EXPECT_EQ(UsageErrorFor({"frobnicate"}),
            "kvcal: unknown subcommand 'frobnicate'; the subcommands are "
            "push, calibrate (see 'kvcal --help')");
  EXPECT_EQ(UsageErrorFor({}),
            "kvcal: a subcommand is required: one of push, calibrate (see "
            "'kvcal --help')");
  EXPECT_EQ(UsageErrorFor({"push", "--session", "s", "--windw", "4"}),
            "kvcal push: unknown option '--windw'; did you mean '--window'? "
            "(see 'kvcal push --help')");
  EXPECT_EQ(UsageErrorFor({"push", "--session", "s", "--window", "0"}),
            "kvcal push: --window: 0 is out of range: want 1..1024 (see "
            "'kvcal push --help')");
  // A negative number is a value, not an unknown option.
  EXPECT_EQ(UsageErrorFor({"push", "--session", "s", "--window", "-3"}),
            "kvcal push: --window: -3 is out of range: want 1..1024 (see "
            "'kvcal push --help')");
  EXPECT_EQ(UsageErrorFor({"push", "--window", "4"}),
            "kvcal push: --session is required (see 'kvcal push --help')");
  EXPECT_EQ(UsageErrorFor({"push", "--session"}),
            "kvcal push: --session needs a value (see 'kvcal push --help')");
  EXPECT_THAT(UsageErrorFor({"push", "--session", "s", "a", "b"}),
              StartsWith("kvcal push: unexpected argument: b"));
  // Known options, including a short one with its value and the parent's
  // --verbose, are not reported as unknown.
  EXPECT_EQ(UsageErrorFor({"push", "-o", "x", "--verbose", "--window", "0",
                           "--session", "s"}),
            "kvcal push: --window: 0 is out of range: want 1..1024 (see "
            "'kvcal push --help')");
  EXPECT_EQ(UsageErrorFor({"push", "--session=s", "--window=2"}), "parsed");
}

TEST(UsageErrorTest, ParseExitsTwoForUsageErrorsAndZeroForVersion) {
  const auto parse = [](std::vector<std::string> args) {
    CLI::App app{"test", "kvcal-worker"};
    int threads = 0;
    app.add_option("--executor-threads", threads)
        ->check(cli::InRange(cli::IntRange{0, 1024, ""}));
    cli::AddVersionFlag(app);
    std::vector<char*> argv;
    for (std::string& s : args) argv.push_back(s.data());
    return cli::Parse(app, static_cast<int>(argv.size()), argv.data());
  };
  EXPECT_EQ(parse({"kvcal-worker", "--executor-threads", "-3"}),
            cli::kExitUsage);
  EXPECT_EQ(parse({"kvcal-worker", "--executor-thread", "3"}), cli::kExitUsage);
  EXPECT_EQ(parse({"kvcal-worker", "--version"}), cli::kExitOk);
  EXPECT_EQ(parse({"kvcal-worker", "--executor-threads", "3"}), std::nullopt);
}

TEST(VersionTest, VersionCommitAndBackends) {
  EXPECT_THAT(VersionLine("kvcal"),
              AllOf(StartsWith("kvcal " + std::string(Version()) + " (commit "),
                    HasSubstr("; backends: cpu")));
  EXPECT_FALSE(GitCommit().empty());
  EXPECT_THAT(std::string(Version()),
              ::testing::MatchesRegex(R"([0-9]+\.[0-9]+\.[0-9]+.*)"));
}

TEST(ShellQuoteTest, QuotesOnlyWhatTheShellWouldSplitOrExpand) {
  EXPECT_EQ(ShellQuote("/models/llama-3.1_8B"), "/models/llama-3.1_8B");
  EXPECT_EQ(ShellQuote("--target=modelopt"), "--target=modelopt");
  EXPECT_EQ(ShellQuote(""), "''");
  EXPECT_EQ(ShellQuote("my model"), "'my model'");
  EXPECT_EQ(ShellQuote("$HOME"), "'$HOME'");
  EXPECT_EQ(ShellQuote("it's"), "'it'\\''s'");
}

}  // namespace
}  // namespace kvcal
