// kvcal-worker's command line as an operator meets it: a worker owns its
// port (a second one on a taken port exits with one line and the first
// keeps serving every call), impossible numbers are usage errors naming the
// flag and the range (exit 2), a TLS file that is not PEM is one line, and
// --version says what was built.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvcal/v1/calibration.grpc.pb.h"
#include "tests/run_process.h"
#include "tests/service/worker_process.h"

namespace kvcal {
namespace {

using ::testing::HasSubstr;
using ::testing::SizeIs;
using ::testing::StartsWith;
using testing::ProcessResult;
using testing::RunProcess;
using testing::WorkerProcess;

std::string WorkerPath() {
  const char* path = std::getenv("KVCAL_WORKER_PATH");
  return path != nullptr && *path != '\0' ? path : KVCAL_WORKER_PATH;
}

ProcessResult RunWorker(std::vector<std::string> args) {
  args.insert(args.begin(), WorkerPath());
  return RunProcess(std::move(args), std::chrono::seconds(60));
}

// A channel of its own (distinct channel arguments: gRPC shares a
// connection between channels whose arguments are equal), so that each call
// below is a new TCP connection the kernel hands to whoever listens.
std::unique_ptr<v1::Calibration::Stub> FreshStub(const std::string& address,
                                                 int n) {
  grpc::ChannelArguments args;
  args.SetInt("kvcal.test.connection", n);
  return v1::Calibration::NewStub(grpc::CreateCustomChannel(
      address, grpc::InsecureChannelCredentials(), args));
}

// A TCP listener on 127.0.0.1 (port 0: any), as another program holding
// the port; with `reuse_port` as an older kvcal-worker did (gRPC's default
// SO_REUSEPORT), which a new worker must not share the port with either.
class Listener {
 public:
  explicit Listener(bool reuse_port) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    const int one = 1;
    if (reuse_port) setsockopt(fd_, SOL_SOCKET, SO_REUSEPORT, &one, sizeof(one));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    listen(fd_, 4);
    socklen_t len = sizeof(addr);
    getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
  }
  ~Listener() { close(fd_); }
  int port() const { return port_; }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }

 private:
  int fd_ = -1;
  int port_ = 0;
};

TEST(WorkerCliTest, ASecondWorkerOnTheSamePortExitsAndTheFirstKeepsServing) {
  WorkerProcess first({"--metrics-listen", "127.0.0.1:0"});
  ASSERT_TRUE(first.ok()) << first.error();
  const std::string state_dir = (first.dir() / "second-state").string();
  const ProcessResult second =
      RunWorker({"--listen", first.address(), "--backend", "cpu",
                 "--state-dir", state_dir});
  EXPECT_EQ(second.exit_code, 1) << second.err;
  // One line, and nothing before it: the second worker stopped before it
  // logged, restored or wrote anything.
  EXPECT_THAT(second.ErrLines(), SizeIs(1)) << second.err;
  EXPECT_EQ(second.err, "kvcal-worker: " + first.address() +
                            " is in use (another kvcal-worker?)\n");
  EXPECT_FALSE(std::filesystem::exists(state_dir));

  // Every call, each on a new connection, reaches the first worker: the
  // session it created is found 20 times out of 20.
  {
    auto stub = FreshStub(first.address(), 0);
    grpc::ClientContext context;
    v1::CreateSessionRequest request;
    request.set_session_id("owned-port");
    request.set_num_layers(2);
    request.set_num_attention_heads(4);
    request.set_num_key_value_heads(2);
    request.set_head_dim(8);
    v1::Session session;
    ASSERT_TRUE(stub->CreateSession(&context, request, &session).ok());
  }
  int found = 0;
  for (int i = 1; i <= 20; ++i) {
    auto stub = FreshStub(first.address(), i);
    grpc::ClientContext context;
    v1::GetSessionRequest request;
    request.set_session_id("owned-port");
    v1::Session session;
    const grpc::Status status = stub->GetSession(&context, request, &session);
    if (status.ok() && session.session_id() == "owned-port") ++found;
  }
  EXPECT_EQ(found, 20);
}

TEST(WorkerCliTest, APortHeldByAnotherProgramIsInUseEvenWithSoReusePort) {
  for (bool reuse_port : {false, true}) {
    Listener other(reuse_port);
    const ProcessResult r =
        RunWorker({"--listen", other.address(), "--backend", "cpu"});
    EXPECT_EQ(r.exit_code, 1) << r.err;
    EXPECT_EQ(r.err, "kvcal-worker: " + other.address() +
                         " is in use (another kvcal-worker?)\n");
  }
}

TEST(WorkerCliTest, ATakenMetricsPortIsInUseToo) {
  Listener other(/*reuse_port=*/true);
  const ProcessResult r =
      RunWorker({"--listen", "127.0.0.1:0", "--backend", "cpu",
                 "--metrics-listen", other.address()});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_EQ(r.err, "kvcal-worker: " + other.address() +
                       " (--metrics-listen) is in use (another "
                       "kvcal-worker?)\n");
}

TEST(WorkerCliTest, ImpossibleNumbersAreUsageErrorsNamingFlagAndRange) {
  struct Case {
    std::vector<std::string> args;
    std::string message;  // after "kvcal-worker: "
  };
  const std::vector<Case> cases = {
      {{"--listen", "127.0.0.1:99999"},
       "--listen: '127.0.0.1:99999': port 99999 is out of range: want "
       "0..65535"},
      {{"--executor-threads", "-3"},
       "--executor-threads: -3 is out of range: want 0..1024 (0 = one per "
       "core)"},
      {{"--listen", "127.0.0.1"}, "--listen: '127.0.0.1' has no port"},
      {{"--listen", ""}, "--listen: empty address"},
      {{"--listen", "::1:50051"},
       "--listen: '::1:50051': an IPv6 address goes in brackets, followed by "
       "the port, e.g. [::1]:50051"},
      {{"--cpu-threads", "4096"}, "--cpu-threads: 4096 is out of range"},
      {{"--max-inflight-bytes", "0"},
       "--max-inflight-bytes: 0 is out of range: want 1 or more"},
      {{"--max-message-bytes", "100"},
       "--max-message-bytes: 100 is out of range: want 65536..1073741824"},
      {{"--max-sessions", "-1"},
       "--max-sessions: -1 is out of range: want 0 or more (0 = unlimited)"},
      {{"--memory-budget-bytes", "1GiB"},
       "--memory-budget-bytes: '1GiB' is not a whole number"},
      {{"--device", "-1"}, "--device: -1 is out of range: want 0..255"},
      {{"--snapshot-interval-ms", "0"},
       "--snapshot-interval-ms: 0 is out of range: want 10..3600000"},
      {{"--shutdown-grace-ms", "-5"}, "--shutdown-grace-ms: -5 is out of range"},
      {{"--metrics-listen", "[::1]:9090"},
       "--metrics-listen: '[::1]' is not an IPv4 address"},
      {{"--worker-id", "a/b"}, "--worker-id: worker id 'a/b' must match"},
      {{"--lisen", "127.0.0.1:0"},
       "unknown option '--lisen'; did you mean '--listen'?"},
      {{"--tls-cert", "x.pem"}, "--tls-cert requires --tls-key"},
      {{"--listen"}, "--listen needs a value"},
  };
  for (const Case& c : cases) {
    const ProcessResult r = RunWorker(c.args);
    EXPECT_EQ(r.exit_code, 2) << c.args[0] << ": " << r.err;
    EXPECT_THAT(r.ErrLines(), SizeIs(1)) << r.err;
    EXPECT_THAT(r.err, StartsWith("kvcal-worker: " + c.message)) << r.err;
    EXPECT_THAT(r.err, HasSubstr("(see 'kvcal-worker --help')"));
    EXPECT_EQ(r.out, "");
  }
}

TEST(WorkerCliTest, ATlsFileThatIsNotPemIsOneLine) {
  WorkerProcess scratch;  // for its directory
  ASSERT_TRUE(scratch.ok()) << scratch.error();
  const std::string not_pem = (scratch.dir() / "cert.txt").string();
  std::ofstream(not_pem) << "this is no certificate\n";
  const ProcessResult r =
      RunWorker({"--listen", "127.0.0.1:0", "--backend", "cpu", "--tls-cert",
                 not_pem, "--tls-key", not_pem});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_EQ(r.err, "kvcal-worker: --tls-cert " + not_pem +
                       ": not a PEM certificate (no -----BEGIN line)\n");
}

TEST(WorkerCliTest, VersionSaysVersionCommitAndBackends) {
  const ProcessResult r = RunWorker({"--version"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_THAT(r.out, StartsWith("kvcal-worker "));
  EXPECT_THAT(r.out, HasSubstr(" (commit "));
  EXPECT_THAT(r.out, HasSubstr("; backends: cpu"));
  EXPECT_EQ(r.err, "");
}

}  // namespace
}  // namespace kvcal
