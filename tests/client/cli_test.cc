// The kvcal command as a user meets it when something is wrong: usage
// errors are one line on stderr and exit 2 (impossible numbers naming the
// flag and the range, typos with a suggestion), failures exit 1 with one
// line naming the address and the cause (gRPC's own words behind
// --verbose), `--server HOST` dials port 50051 and says so, `inspect` keeps
// its findings on stdout and its errors on stderr, and --version says what
// was built.
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "client/checkpoint/demo_model.h"
#include "client/checkpoint/scales_file.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/run_process.h"
#include "tests/service/worker_process.h"
#include "tests/test_certs.h"

namespace kvcal {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using testing::ProcessResult;
using testing::RunProcess;
using ::testing::SizeIs;
using ::testing::StartsWith;
using testing::WorkerProcess;

constexpr char kNowhere[] = "127.0.0.1:1";  // nothing listens on port 1

// kvcal with `args`, without KVCAL_SERVER or KVCAL_AUTH_TOKEN_FILE from the
// environment deciding anything (unless `server_env` sets KVCAL_SERVER).
ProcessResult Kvcal(std::vector<std::string> args,
                    const std::string& server_env = "") {
  args.insert(args.begin(), KVCAL_CLI_PATH);
  return RunProcess(std::move(args), std::chrono::seconds(120),
                    {"KVCAL_SERVER=" + server_env, "KVCAL_AUTH_TOKEN_FILE="});
}

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("kvcal-cli-test-" + std::to_string(getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string Path(const std::string& name) const {
    return (dir_ / name).string();
  }

  std::filesystem::path dir_;
};

TEST_F(CliTest, ImpossibleNumbersAreUsageErrorsNamingFlagAndRange) {
  const std::string dumps = Path("dumps");
  std::filesystem::create_directories(dumps);
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"push", "--server", kNowhere, "--session", "s", "--chunk-bytes", "0",
        dumps},
       "kvcal push: --chunk-bytes: 0 is out of range: want 1..1073741824"},
      {{"push", "--server", kNowhere, "--session", "s", "--window", "0", dumps},
       "kvcal push: --window: 0 is out of range: want 1..1024"},
      {{"push", "--server", kNowhere, "--session", "s", "--chunk-bytes", "-1",
        dumps},
       "kvcal push: --chunk-bytes: -1 is out of range"},
      {{"push", "--server", kNowhere, "--session", "s", "--holdout-batches",
        "two", dumps},
       "kvcal push: --holdout-batches: 'two' is not a whole number"},
      {{"calibrate", "--server", kNowhere, "--checkpoint", "m", "--chunk-bytes",
        "0", dumps},
       "kvcal calibrate: --chunk-bytes: 0 is out of range"},
      {{"create", "--server", kNowhere, "--config", "c.json", "--histograms",
        "3"},
       "kvcal create: --histograms: 3 is not a power of two 1..128, or 0 for "
       "no histograms"},
      {{"create", "--server", kNowhere, "--config", "c.json",
        "--holdout-budget-bytes", "-1"},
       "kvcal create: --holdout-budget-bytes: -1 is out of range"},
      {{"finalize", "--server", kNowhere, "--session", "s", "-o", "x",
        "--percentile", "101"},
       "kvcal finalize: --percentile: 101 is out of range: want (0, 100], or "
       "0 for the worker's default, 99.99"},
      {{"finalize", "--server", kNowhere, "--session", "s", "-o", "x",
        "--averaging-constant", "2"},
       "kvcal finalize: --averaging-constant: 2 is out of range: want (0, 1]"},
      {{"finalize", "--server", kNowhere, "--session", "s", "-o", "x",
        "--margin", "nan"},
       "kvcal finalize: --margin: 'nan' is not a finite number"},
      {{"finalize", "--server", kNowhere, "--session", "s", "-o", "x",
        "--mse-max-shrink", "1"},
       "kvcal finalize: --mse-max-shrink: 1 is out of range: want (0, 1)"},
      {{"status", "--server", "127.0.0.1:99999"},
       "kvcal status: --server: '127.0.0.1:99999': port 99999 is out of "
       "range: want 1..65535"},
      {{"status", "--server", "worker:abc"},
       "kvcal status: --server: 'worker:abc': port 'abc' is not a number"},
      {{"status", "--server", ":50051"},
       "kvcal status: --server: no host before ':50051'"},
      {{"status", "--server", "::1"},
       "kvcal status: --server: '::1': an IPv6 address goes in brackets"},
      {{"status", "--server", kNowhere, "--tls-cert", "c.pem"},
       "kvcal status: --tls-cert requires --tls-key"},
      {{"report", "--session", "s", "-o", "r.html"},
       "kvcal report: --session requires --server"},
      {{"demo", "--backend", "gpu"}, "kvcal demo: --backend: gpu not in"},
      {{"push", "--server", kNowhere, "--session"},
       "kvcal push: --session needs a value"},
  };
  for (const Case& c : cases) {
    const ProcessResult r = Kvcal(c.args);
    EXPECT_EQ(r.exit_code, 2) << c.message << "\n" << r.err;
    EXPECT_THAT(r.ErrLines(), SizeIs(1)) << r.err;
    EXPECT_THAT(r.err, StartsWith(c.message));
    EXPECT_THAT(r.err, HasSubstr(" --help')\n"));
    EXPECT_EQ(r.out, "");
  }
}

TEST_F(CliTest, UnknownNamesAreUsageErrorsWithAGuess) {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"finalize", "--server", kNowhere, "--session", "s", "-o", "x",
        "--observer", "msee"},
       "kvcal finalize: --observer: unknown observer 'msee' (static-minmax, "
       "minmax-ema, memoryless-minmax, mse, percentile, auto); did you mean "
       "'mse'?"},
      {{"finalize", "--server", kNowhere, "--session", "s", "-o", "x",
        "--granularity", "heads"},
       "kvcal finalize: --granularity: unknown granularity 'heads' (tensor, "
       "head); did you mean 'head'?"},
      {{"patch", "--checkpoint", "m", "--scales", "s", "--target", "modelop"},
       "kvcal patch: --target: unknown target 'modelop' (compressed-tensors, "
       "modelopt or quark); did you mean 'modelopt'?"},
      {{"inspect", "m", "--platform", "amd"},
       "kvcal inspect: --platform: unknown platform 'amd' (cuda or rocm)"},
      {{"report", "--scales", "s", "-o", "r.html", "--format", "fp9"},
       "kvcal report: --format: unknown format 'fp9'"},
  };
  for (const Case& c : cases) {
    const ProcessResult r = Kvcal(c.args);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_THAT(r.ErrLines(), SizeIs(1)) << r.err;
    EXPECT_THAT(r.err, StartsWith(c.message));
  }
  // Every spelling config.json records is still a name.
  const ProcessResult r =
      Kvcal({"finalize", "--server", kNowhere, "--session", "s", "-o", "x",
             "--observer", "static_minmax", "--granularity", "attn_head"});
  EXPECT_EQ(r.exit_code, 1) << r.err;  // parsed; nothing listens on port 1
}

TEST_F(CliTest, TyposGetASuggestion) {
  ProcessResult r = Kvcal({"calibrat"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.err,
            "kvcal: unknown subcommand 'calibrat'; did you mean 'calibrate'? "
            "(see 'kvcal --help')\n");
  r = Kvcal({"push", "--server", kNowhere, "--session", "s", "--chunk-byte",
             "5", Path("d")});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.err,
            "kvcal push: unknown option '--chunk-byte'; did you mean "
            "'--chunk-bytes'? (see 'kvcal push --help')\n");
  r = Kvcal({});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, StartsWith("kvcal: a subcommand is required: one of "
                                "create, push, status"));
  r = Kvcal({"status", "--help"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_THAT(r.out, HasSubstr("--server"));
}

TEST_F(CliTest, ServerWithoutAPortDialsTheDefaultPortAndSaysSo) {
  // A worker on 50051 when the port is free; otherwise whatever holds it
  // answers (or does not), and the message still names :50051. This is the
  // only test that dials 127.0.0.1:50051, so no other test's status can meet
  // this worker starting or stopping. --server and KVCAL_SERVER alike, the
  // notice said once.
  WorkerProcess worker({}, "127.0.0.1:50051");
  for (const bool from_env : {false, true}) {
    SCOPED_TRACE(from_env ? "KVCAL_SERVER" : "--server");
    const ProcessResult r = from_env
                                ? Kvcal({"status"}, "127.0.0.1")
                                : Kvcal({"status", "--server", "127.0.0.1"});
    EXPECT_THAT(r.err,
                StartsWith("kvcal: --server 127.0.0.1 has no port: using "
                           "127.0.0.1:50051 (the default port)\n"));
    if (worker.ok()) {
      EXPECT_EQ(r.exit_code, 0) << r.err;
      EXPECT_THAT(r.ErrLines(), SizeIs(1)) << r.err;  // the notice, once
      EXPECT_EQ(r.out, "no sessions\n");
    } else {
      EXPECT_THAT(r.err, HasSubstr("127.0.0.1:50051"));
    }
  }
}

TEST_F(CliTest, KvcalServerFromTheEnvironmentIsCheckedOnlyWhereItIsUsed) {
  // A bad KVCAL_SERVER does not stop a command that takes no --server.
  ProcessResult r = Kvcal({"inspect", Path("missing-model")}, "worker:abc");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, StartsWith("kvcal inspect: cannot open "));
  // Where it is used it is checked like --server (its missing port:
  // ServerWithoutAPortDialsTheDefaultPortAndSaysSo).
  r = Kvcal({"status"}, "worker:abc");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, StartsWith("kvcal status: --server: 'worker:abc': port "
                                "'abc' is not a number"));
  r = Kvcal({"status"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.err,
            "kvcal status: --server is required (or set KVCAL_SERVER) (see "
            "'kvcal status --help')\n");
  // Brackets stay: [::1] is an IPv6 address without a port.
  r = Kvcal({"status", "--server", "[::1]"});
  EXPECT_THAT(r.err, StartsWith("kvcal: --server [::1] has no port: using "
                                "[::1]:50051 (the default port)\n"));
}

TEST_F(CliTest, ConnectionErrorsAreOneLineAndVerboseHasGrpcsWords) {
  ProcessResult r = Kvcal({"status", "--server", kNowhere});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.err,
            "kvcal status: 127.0.0.1:1: connection refused (is a kvcal-worker "
            "listening there?)\n");
  r = Kvcal({"status", "--server", kNowhere, "--verbose"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("failed to connect to all addresses"));
}

TEST_F(CliTest, TlsProblemsAreOneLineNamingTheAddressAndTheCause) {
  ASSERT_TRUE(testing::MakeTestCertificates(Path("certs")));
  ASSERT_TRUE(testing::MakeTestCertificates(Path("other")));
  const std::string not_pem = Path("ca.txt");
  std::ofstream(not_pem) << "not a certificate\n";

  ProcessResult r =
      Kvcal({"status", "--server", kNowhere, "--tls-ca", not_pem});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.err, "kvcal status: --tls-ca " + not_pem +
                       ": not a PEM certificate (no -----BEGIN line)\n");
  r = Kvcal({"status", "--server", kNowhere, "--tls-ca", Path("certs/ca.key")});
  EXPECT_EQ(r.err, "kvcal status: --tls-ca " + Path("certs/ca.key") +
                       ": not a PEM certificate (it holds a PRIVATE KEY)\n");

  WorkerProcess tls({"--tls-cert", Path("certs/server.pem"), "--tls-key",
                     Path("certs/server.key")});
  ASSERT_TRUE(tls.ok()) << tls.error();
  // A CA that did not sign the worker's certificate.
  r = Kvcal(
      {"status", "--server", tls.address(), "--tls-ca", Path("other/ca.pem")});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.err, "kvcal status: " + tls.address() +
                       ": TLS: the worker's certificate is not signed by the "
                       "CA in --tls-ca, or does not name this address\n");
  r = Kvcal({"status", "--server", tls.address(), "--tls-ca",
             Path("other/ca.pem"), "--verbose"});
  EXPECT_THAT(r.err, HasSubstr("Ssl handshake failed"));
  // Plaintext to a TLS worker, TLS to a plaintext one.
  r = Kvcal({"status", "--server", tls.address()});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.ErrLines(), SizeIs(1)) << r.err;
  EXPECT_THAT(r.err, StartsWith("kvcal status: " + tls.address() +
                                ": the worker closed the connection"));
  WorkerProcess plain;
  ASSERT_TRUE(plain.ok()) << plain.error();
  r = Kvcal({"status", "--server", plain.address(), "--tls-ca",
             Path("certs/ca.pem")});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.err, "kvcal status: " + plain.address() +
                       ": TLS handshake failed: the worker does not speak TLS "
                       "(leave out --tls-ca)\n");
  // The right CA works.
  r = Kvcal(
      {"status", "--server", tls.address(), "--tls-ca", Path("certs/ca.pem")});
  EXPECT_EQ(r.exit_code, 0) << r.err;
}

TEST_F(CliTest, AuthTokenFileProblemsNameTheFlag) {
  ProcessResult r = Kvcal(
      {"status", "--server", kNowhere, "--auth-token-file", Path("missing")});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, StartsWith("kvcal status: --auth-token-file: "));
  EXPECT_THAT(r.err, HasSubstr("No such file or directory"));
  r = Kvcal({"status", "--server", kNowhere, "--auth-token-file", "/dev/zero"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.err,
            "kvcal status: --auth-token-file: /dev/zero: not a regular file\n");
}

TEST_F(CliTest, InspectFindingsGoToStdoutAndErrorsToStderr) {
  // Nothing to read: one line on stderr, nothing on stdout.
  ProcessResult r = Kvcal({"inspect", Path("missing-model")});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.out, "");
  EXPECT_THAT(r.ErrLines(), SizeIs(1)) << r.err;
  EXPECT_THAT(r.err, StartsWith("kvcal inspect: cannot open "));

  // A checkpoint without scales: the table on stdout, the errors on stderr.
  DemoModelOptions two_layers;
  two_layers.geometry.num_layers = 2;
  ASSERT_TRUE(WriteDemoCheckpoint(Path("model"), two_layers).ok());
  r = Kvcal({"inspect", Path("model")});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.out, HasSubstr("layer  q_scale vLLM uses"));
  EXPECT_THAT(r.out, Not(HasSubstr("error")));
  EXPECT_THAT(r.out, Not(HasSubstr("FAILED")));
  EXPECT_THAT(r.err, HasSubstr("kvcal inspect: error: no q/k/v scales found"));
  EXPECT_THAT(r.err, HasSubstr("kvcal inspect: FAILED\n"));
}

TEST_F(CliTest, PatchForAnNvfp4CacheAndInspectWhatVllmDoesWithIt) {
  // A ModelOpt FP8 model FlashInfer can serve (head size 128) and per-tensor
  // scales.
  const std::string model = Path("model");
  ASSERT_TRUE(WriteDemoCheckpoint(
                  model, DemoModelOptions{.geometry = {.num_layers = 2,
                                                       .num_attention_heads = 2,
                                                       .num_key_value_heads = 1,
                                                       .head_dim = 128},
                                          .intermediate_size = 16,
                                          .vocab_size = 32})
                  .ok());
  nlohmann::ordered_json config;
  std::ifstream(model + "/config.json") >> config;
  config["quantization_config"] = {{"quant_method", "modelopt"},
                                   {"quant_algo", "FP8"}};
  std::ofstream(model + "/config.json") << config.dump(2);
  CalibratedScales scales;
  scales.metadata["format"] = "float8_e4m3fn";
  for (uint32_t l = 0; l < 2; ++l)
    scales.layers[l] = {{{0.5f}, {0.25f}, {0.125f}}};
  ASSERT_TRUE(WriteScalesFile(Path("s.safetensors"), scales).ok());

  // The checkpoint cannot declare 4over6: a usage error naming the flag.
  ProcessResult r =
      Kvcal({"patch", "--checkpoint", model, "--scales", Path("s.safetensors"),
             "--target", "modelopt", "--kv-cache-dtype", "nvfp4_4over6"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("--kv-cache-dtype"));
  // compressed-tensors cannot declare NVFP4: vLLM's rule, named.
  r = Kvcal({"patch", "--checkpoint", model, "--scales", Path("s.safetensors"),
             "--kv-cache-dtype", "nvfp4"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("validate_kv_cache_scheme"));

  r = Kvcal({"patch", "--checkpoint", model, "--scales", Path("s.safetensors"),
             "--target", "modelopt", "--kv-cache-dtype", "nvfp4"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("warning: nvfp4 cache: each block of 16"));

  // --kv-cache-dtype auto: the checkpoint's nvfp4 cache, k/v as global
  // scales, served by FlashInfer.
  r = Kvcal({"inspect", model});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("--kv-cache-dtype auto): modelopt, KV cache "
                               "nvfp4; starts on FLASHINFER only"));
  // The table: q, k, v as written (columns 23 wide, two apart).
  EXPECT_THAT(r.out, HasSubstr("    1  0.5" + std::string(22, ' ') + "0.25" +
                               std::string(21, ' ') + "0.125"));
  EXPECT_THAT(r.out, HasSubstr("\nOK\n"));
  r = Kvcal({"inspect", "--kv-cache-dtype", "nvfp4_4over6", model});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("KV cache nvfp4_4over6; starts on FLASHINFER "
                               "trtllm-gen only"));
  r = Kvcal(
      {"inspect", "--kv-cache-dtype", "nvfp4", "--platform", "rocm", model});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("will not start: --kv-cache-dtype nvfp4 on "
                               "ROCm"));
}

TEST_F(CliTest, VersionSaysVersionCommitAndBackends) {
  const ProcessResult r = Kvcal({"--version"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_THAT(r.out, StartsWith("kvcal "));
  EXPECT_THAT(r.out, HasSubstr(" (commit "));
  EXPECT_THAT(r.out, HasSubstr("; backends: cpu"));
  EXPECT_EQ(r.err, "");
}

}  // namespace
}  // namespace kvcal
