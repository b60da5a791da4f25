// The uploader and the sharding client against real kvcal-worker processes.
#include "client/rpc/uploader.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <vector>

#include "client/checkpoint/activation_dump.h"
#include "client/checkpoint/demo_model.h"
#include "client/rpc/calibration_client.h"
#include "client/rpc/calibration_job.h"
#include "client/rpc/local_worker.h"
#include "client/rpc/sharding.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/test_util.h"
#include "tests/service/rpc_helpers.h"
#include "tests/test_certs.h"

namespace kvcal {
namespace {

using ::kvcal::testing::TempDir;
using ::testing::HasSubstr;

std::string WorkerPath() {
  if (const char* env = std::getenv("KVCAL_TEST_WORKER")) return env;
  return KVCAL_WORKER_PATH;
}

std::unique_ptr<LocalWorker> StartWorker(std::vector<std::string> extra = {},
                                         std::string listen = "127.0.0.1:0") {
  LocalWorker::Options options;
  options.binary = WorkerPath();
  options.listen = std::move(listen);
  // Workers on one host share its name, the default id: give each its own.
  static int started = 0;
  if (std::find(extra.begin(), extra.end(), "--worker-id") == extra.end()) {
    extra.push_back("--worker-id");
    extra.push_back("test-w" + std::to_string(started++));
  }
  options.extra_args = std::move(extra);
  auto worker = LocalWorker::Start(options);
  EXPECT_TRUE(worker.ok()) << worker.status();
  return worker.ok() ? *std::move(worker) : nullptr;
}

int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

// The scales of every (layer, role) under several finalize settings, for
// exact comparison.
using AllScales = std::vector<std::vector<float>>;

AllScales Scales(CalibrationClient& client, const std::string& session) {
  AllScales all;
  for (auto [granularity, observer] :
       {std::pair{v1::GRANULARITY_PER_HEAD, v1::OBSERVER_MSE},
        std::pair{v1::GRANULARITY_PER_TENSOR, v1::OBSERVER_STATIC_MINMAX},
        std::pair{v1::GRANULARITY_PER_HEAD, v1::OBSERVER_MINMAX_EMA},
        std::pair{v1::GRANULARITY_PER_TENSOR, v1::OBSERVER_PERCENTILE}}) {
    v1::FinalizeRequest request;
    request.set_session_id(session);
    request.set_granularity(granularity);
    request.set_observer(observer);
    auto response = client.Finalize(request);
    EXPECT_TRUE(response.ok()) << response.status();
    if (!response.ok()) return {};
    for (const v1::LayerScales& l : response->layers()) {
      for (const v1::RoleScales* r : {&l.q(), &l.k(), &l.v()}) {
        all.emplace_back(r->scale().begin(), r->scale().end());
        all.emplace_back(r->absmax().begin(), r->absmax().end());
        all.push_back({static_cast<float>(r->count())});
      }
    }
  }
  return all;
}

class UploaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_.geometry = {.num_layers = 4,
                       .num_attention_heads = 8,
                       .num_key_value_heads = 2,
                       .head_dim = 32};
    ASSERT_TRUE(
        WriteDemoDumps(dir_ / "dumps", model_, {.batches = 3, .tokens = 64})
            .ok());
    auto dump = ActivationDump::Open(dir_ / "dumps");
    ASSERT_TRUE(dump.ok()) << dump.status();
    dump_.emplace(*std::move(dump));
    for (const DumpTensor& t : dump_->tensors()) {
      chunks_.push_back(t.View());
    }
  }

  // The model's geometry with `head_dim`, 64 histogram bins per octave.
  v1::CreateSessionRequest Request(const std::string& id,
                                   uint32_t head_dim) const {
    return kvcal::testing::CreateSessionRequest(
        id, {model_.geometry.num_layers, model_.geometry.num_attention_heads,
             model_.geometry.num_key_value_heads, head_dim, 64});
  }

  v1::Session Create(CalibrationClient& client, const std::string& id) {
    auto session = client.CreateSession(Request(id, model_.geometry.head_dim));
    EXPECT_TRUE(session.ok()) << session.status();
    return session.ok() ? *session : v1::Session();
  }

  CalibrationClient Connect(const std::vector<std::string>& endpoints,
                            ConnectionOptions options = {}) {
    auto client = CalibrationClient::Connect(endpoints, options);
    EXPECT_TRUE(client.ok()) << client.status();
    return *std::move(client);
  }

  // As a supervisor restoring a worker would: exports `session` from the
  // worker, kills it, starts a new one on `listen` and imports the state
  // there, retrying while the new worker comes up.
  void RestartWithImportedState(CalibrationClient& client,
                                std::unique_ptr<LocalWorker>& worker,
                                const std::string& listen,
                                const std::string& session) {
    grpc::ClientContext export_context;
    v1::ExportStateRequest export_request;
    export_request.set_session_id(session);
    v1::SessionState state;
    EXPECT_TRUE(client.stub(0)
                    .ExportState(&export_context, export_request, &state)
                    .ok());
    worker->Kill();
    worker = StartWorker({}, listen);
    EXPECT_NE(worker, nullptr);
    auto fresh = CalibrationClient::Connect({listen}, {});
    v1::ImportStateRequest import_request;
    import_request.set_session_id(session);
    *import_request.mutable_state() = state;
    import_request.set_import_id("restore-1");
    grpc::Status s;
    for (int attempt = 0; attempt < 50; ++attempt) {
      grpc::ClientContext import_context;
      import_context.set_wait_for_ready(true);
      v1::Session restored;
      s = fresh->stub(0).ImportState(&import_context, import_request,
                                     &restored);
      if (s.error_code() != grpc::StatusCode::UNAVAILABLE) break;
      absl::SleepFor(absl::Milliseconds(50));
    }
    EXPECT_TRUE(s.ok()) << s.error_message();
  }

  // Uploads into a fresh session `id` without interruption.
  AllScales Reference(CalibrationClient& client, const std::string& id) {
    Create(client, id);
    auto result = client.Upload(id, chunks_, {});
    EXPECT_TRUE(result.ok()) << result.status();
    return Scales(client, id);
  }

  TempDir dir_;
  DemoModelOptions model_;
  std::optional<ActivationDump> dump_;
  std::vector<ChunkView> chunks_;
};

TEST_F(UploaderTest, StreamCutMidWayResumesWithTheSameScales) {
  auto worker = StartWorker();
  ASSERT_NE(worker, nullptr);
  CalibrationClient client = Connect({worker->address()});
  const AllScales reference = Reference(client, "reference");
  ASSERT_FALSE(reference.empty());

  Create(client, "cut");
  UploaderOptions options;
  options.session_id = "cut";
  options.producer_id = "rank0";
  options.max_chunk_bytes = 4096;  // many chunks, each tensor split
  options.window = 8;
  options.initial_backoff = absl::Milliseconds(10);
  int cuts = 0;
  int acks = 0;
  options.on_ack = [&](uint64_t) {
    // Cut the stream three times, at different depths (counted in
    // acknowledgements, so resends count too).
    ++acks;
    if (acks == 7 || acks == 40 || acks == 41) {
      ++cuts;
      return false;
    }
    return true;
  };
  Uploader uploader(client.channel(0), {}, options);
  auto result = uploader.Upload(chunks_);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(cuts, 3);
  EXPECT_EQ(result->reconnects, 3u);
  EXPECT_GT(result->chunks, chunks_.size());
  EXPECT_GE(result->chunks_sent, result->chunks);
  // Chunks applied but cut before their acknowledgement are not resent.
  EXPECT_LE(result->chunks_applied, result->chunks);
  auto session = client.GetSession("cut");
  ASSERT_TRUE(session.ok());
  auto ref_session = client.GetSession("reference");
  ASSERT_TRUE(ref_session.ok());
  // Exactly once: the same values, and the watermark at the last chunk.
  EXPECT_EQ(session->values_ingested(), ref_session->values_ingested());
  EXPECT_EQ(session->bytes_ingested(), ref_session->bytes_ingested());
  ASSERT_EQ(session->producers_size(), 1);
  EXPECT_EQ(session->producers(0).sequence(), result->chunks);
  EXPECT_EQ(Scales(client, "cut"), reference);
}

TEST_F(UploaderTest, WorkerRestartedWithStateImportedResumes) {
  const int port = FreePort();
  const std::string listen = "127.0.0.1:" + std::to_string(port);
  auto reference_worker = StartWorker();
  ASSERT_NE(reference_worker, nullptr);
  CalibrationClient reference_client = Connect({reference_worker->address()});
  const AllScales reference = Reference(reference_client, "job");

  auto worker = StartWorker({}, listen);
  ASSERT_NE(worker, nullptr);
  CalibrationClient client = Connect({listen});
  Create(client, "job");
  UploaderOptions options;
  options.session_id = "job";
  options.max_chunk_bytes = 8192;
  options.window = 4;
  options.initial_backoff = absl::Milliseconds(20);
  bool restarted = false;
  options.on_ack = [&](uint64_t sequence) {
    if (sequence != 20 || restarted) return true;
    restarted = true;
    // Snapshot the worker, crash it, and bring up a new one on the same port
    // with the snapshot imported, as a supervisor restoring a worker would.
    RestartWithImportedState(client, worker, listen, "job");
    return true;  // the stream to the dead worker breaks by itself
  };
  Uploader uploader(client.channel(0), {}, options);
  auto result = uploader.Upload(chunks_);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_TRUE(restarted);
  EXPECT_GE(result->reconnects, 1u);
  auto session = client.GetSession("job");
  ASSERT_TRUE(session.ok()) << session.status();
  auto ref_session = reference_client.GetSession("job");
  ASSERT_TRUE(ref_session.ok());
  EXPECT_EQ(session->values_ingested(), ref_session->values_ingested());
  EXPECT_EQ(Scales(client, "job"), reference);
}

TEST_F(UploaderTest, ShardingOverOneTwoThreeWorkersGivesIdenticalScales) {
  std::vector<std::unique_ptr<LocalWorker>> workers;
  for (int i = 0; i < 3; ++i) {
    workers.push_back(StartWorker());
    ASSERT_NE(workers.back(), nullptr);
  }
  std::vector<AllScales> results;
  for (size_t n = 1; n <= 3; ++n) {
    std::vector<std::string> endpoints;
    for (size_t i = 0; i < n; ++i) endpoints.push_back(workers[i]->address());
    CalibrationClient client = Connect(endpoints);
    const std::string id = "shard-" + std::to_string(n);
    Create(client, id);
    UploaderOptions options;
    options.max_chunk_bytes = 16384;
    auto result = client.Upload(id, chunks_, options);
    ASSERT_TRUE(result.ok()) << result.status();
    if (n > 1) {
      // Each worker holds only its own layers.
      size_t holding = 0;
      for (size_t i = 0; i < n; ++i) {
        grpc::ClientContext context;
        v1::GetSessionRequest request;
        request.set_session_id(id);
        v1::Session s;
        ASSERT_TRUE(client.stub(i).GetSession(&context, request, &s).ok());
        EXPECT_EQ(s.shard_map().worker_ids_size(), static_cast<int>(n));
        holding += s.values_ingested() > 0;
      }
      EXPECT_GE(holding, 2u);
    }
    results.push_back(Scales(client, id));
    ASSERT_FALSE(results.back().empty());
  }
  EXPECT_EQ(results[1], results[0]);
  EXPECT_EQ(results[2], results[0]);
}

TEST_F(UploaderTest, SecondPushOfAProducerNeedsResumeAndSkipsApplied) {
  auto worker = StartWorker();
  ASSERT_NE(worker, nullptr);
  CalibrationClient client = Connect({worker->address()});
  Create(client, "again");
  UploaderOptions options;
  options.producer_id = "p";
  ASSERT_TRUE(client.Upload("again", chunks_, options).ok());
  auto before = client.GetSession("again");
  ASSERT_TRUE(before.ok());
  EXPECT_THAT(client.Upload("again", chunks_, options).status().message(),
              HasSubstr("already has"));
  options.resume = true;
  auto resumed = client.Upload("again", chunks_, options);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_EQ(resumed->chunks_skipped, resumed->chunks);
  EXPECT_EQ(resumed->chunks_sent, 0u);
  auto after = client.GetSession("again");
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->values_ingested(), before->values_ingested());
}

// Over two workers, a producer that has chunks on one of them is refused
// without resume before anything reaches the other (each worker's uploader
// would otherwise push its own layers first); resume then finishes with the
// scales of one whole push.
TEST_F(UploaderTest, PushWithoutResumeOverTwoWorkersChangesNothing) {
  std::vector<std::unique_ptr<LocalWorker>> workers;
  for (int i = 0; i < 2; ++i) {
    workers.push_back(StartWorker());
    ASSERT_NE(workers.back(), nullptr);
  }
  CalibrationClient client =
      Connect({workers[0]->address(), workers[1]->address()});
  const std::string id = "two-again";
  Create(client, id);
  UploaderOptions options;
  options.producer_id = "p";
  // The first worker's layers only, as if the push had died after them.
  std::vector<ChunkView> first;
  for (const ChunkView& c : chunks_) {
    if (client.WorkerFor(id, c.layer) == 0) first.push_back(c);
  }
  ASSERT_FALSE(first.empty());
  ASSERT_LT(first.size(), chunks_.size());
  ASSERT_TRUE(client.Upload(id, first, options).ok());
  auto values_on = [&](size_t i) {
    grpc::ClientContext context;
    v1::GetSessionRequest request;
    request.set_session_id(id);
    v1::Session s;
    EXPECT_TRUE(client.stub(i).GetSession(&context, request, &s).ok());
    return s.values_ingested();
  };
  const uint64_t on_first = values_on(0);
  ASSERT_GT(on_first, 0u);
  ASSERT_EQ(values_on(1), 0u);

  auto refused = client.Upload(id, chunks_, options);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(), HasSubstr("already has"));
  EXPECT_EQ(values_on(0), on_first);
  EXPECT_EQ(values_on(1), 0u);  // nothing went to the other worker

  options.resume = true;
  auto resumed = client.Upload(id, chunks_, options);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_GT(resumed->chunks_skipped, 0u);
  EXPECT_GT(values_on(1), 0u);

  CalibrationClient one = Connect({workers[0]->address()});
  Create(one, "whole");
  ASSERT_TRUE(one.Upload("whole", chunks_, {}).ok());
  EXPECT_EQ(Scales(client, id), Scales(one, "whole"));
}

TEST_F(UploaderTest, BearerTokenIsSentAndRequired) {
  const std::string token_file = dir_ / "token";
  std::ofstream(token_file) << "s3cret\n";
  auto worker = StartWorker({"--auth-token-file", token_file});
  ASSERT_NE(worker, nullptr);
  CalibrationClient anonymous = Connect({worker->address()});
  v1::CreateSessionRequest request;
  request.set_num_layers(1);
  request.set_num_attention_heads(1);
  request.set_num_key_value_heads(1);
  request.set_head_dim(8);
  EXPECT_EQ(anonymous.CreateSession(request).status().code(),
            absl::StatusCode::kUnauthenticated);
  ConnectionOptions with_token;
  with_token.auth_token = "s3cret";
  CalibrationClient client = Connect({worker->address()}, with_token);
  Create(client, "authed");
  auto result = client.Upload("authed", chunks_, {});
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->chunks_applied, result->chunks);
}

// The client library over TLS and mutual TLS against a worker started with
// the matching flags: the same scales as over plaintext; a client without
// the CA, or without a certificate where one is required, fails clearly.
TEST_F(UploaderTest, TlsAndMutualTlsUploadGiveTheSameScales) {
  const std::filesystem::path certs = dir_ / "certs";
  ASSERT_TRUE(kvcal::testing::MakeTestCertificates(certs)) << "openssl failed";
  auto plain_worker = StartWorker();
  ASSERT_NE(plain_worker, nullptr);
  CalibrationClient plain = Connect({plain_worker->address()});
  const AllScales want = Reference(plain, "s");
  ASSERT_FALSE(want.empty());

  const std::string server_pem = (certs / "server.pem").string();
  const std::string server_key = (certs / "server.key").string();
  ConnectionOptions tls;
  tls.tls_ca_file = (certs / "ca.pem").string();
  {
    auto worker =
        StartWorker({"--tls-cert", server_pem, "--tls-key", server_key});
    ASSERT_NE(worker, nullptr);
    CalibrationClient client = Connect({worker->address()}, tls);
    EXPECT_EQ(Reference(client, "s"), want);
  }
  {
    auto worker =
        StartWorker({"--tls-cert", server_pem, "--tls-key", server_key,
                     "--tls-client-ca", (certs / "ca.pem").string()});
    ASSERT_NE(worker, nullptr);
    ConnectionOptions mutual = tls;
    mutual.tls_cert_file = (certs / "client.pem").string();
    mutual.tls_key_file = (certs / "client.key").string();
    CalibrationClient client = Connect({worker->address()}, mutual);
    EXPECT_EQ(Reference(client, "s"), want);
    // Only the CA: the worker asks for a client certificate and gets none.
    CalibrationClient anonymous = Connect({worker->address()}, tls);
    EXPECT_EQ(anonymous.GetSession("s").status().code(),
              absl::StatusCode::kUnavailable);
  }
  // A certificate without its key is refused before any connection.
  ConnectionOptions half = tls;
  half.tls_cert_file = (certs / "client.pem").string();
  EXPECT_THAT(CalibrationClient::Connect({plain_worker->address()}, half)
                  .status()
                  .message(),
              HasSubstr("--tls-cert and --tls-key go together"));
  // A missing CA file is named.
  ConnectionOptions missing;
  missing.tls_ca_file = dir_ / "no-such-ca.pem";
  EXPECT_THAT(CalibrationClient::Connect({plain_worker->address()}, missing)
                  .status()
                  .message(),
              HasSubstr("no-such-ca.pem"));
}

// A chunk the worker rejects ends the upload with the worker's own code and
// message, at once: not retried, not turned into CANCELLED or UNAVAILABLE.
TEST_F(UploaderTest, RejectedChunkReturnsTheWorkersErrorAtOnce) {
  auto worker = StartWorker();
  ASSERT_NE(worker, nullptr);
  CalibrationClient client = Connect({worker->address()});
  // Every chunk has the wrong head_dim for this session.
  ASSERT_TRUE(
      client.CreateSession(Request("small", model_.geometry.head_dim / 2))
          .ok());
  UploaderOptions options;
  options.counters = std::make_shared<UploadCounters>();
  auto result = client.Upload("small", chunks_, options);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument)
      << result.status();
  EXPECT_THAT(result.status().message(), HasSubstr("head_dim"));
  EXPECT_EQ(options.counters->reconnects.load(), 0u) << "retried a bad chunk";
}

// Against a worker with --state-dir, Upload returns once every chunk is
// durable, not merely acknowledged; a worker that never writes its state is
// a clear DEADLINE_EXCEEDED after durable_timeout.
TEST_F(UploaderTest, UploadWaitsUntilTheChunksAreDurable) {
  const std::string state_dir = dir_ / "state";
  {
    auto worker = StartWorker(
        {"--state-dir", state_dir, "--snapshot-interval-ms", "300"});
    ASSERT_NE(worker, nullptr);
    CalibrationClient client = Connect({worker->address()});
    Create(client, "durable");
    auto result = client.Upload("durable", chunks_, {});
    ASSERT_TRUE(result.ok()) << result.status();
    auto session = client.GetSession("durable");
    ASSERT_TRUE(session.ok()) << session.status();
    EXPECT_TRUE(session->persistent());
    ASSERT_EQ(session->producers_size(), 1);
    EXPECT_EQ(session->producers(0).durable_sequence(), result->chunks);
  }
  {
    // Snapshots an hour apart: nothing becomes durable within the timeout.
    auto worker = StartWorker({"--state-dir", state_dir + "-slow",
                               "--snapshot-interval-ms", "3600000"});
    ASSERT_NE(worker, nullptr);
    auto channel = MakeChannel(worker->address(), {});
    ASSERT_TRUE(channel.ok());
    CalibrationClient client = Connect({worker->address()});
    Create(client, "slow");
    UploaderOptions options;
    options.session_id = "slow";
    options.durable_timeout = absl::Milliseconds(500);
    Uploader uploader(*channel, {}, options);
    auto result = uploader.Upload(chunks_);
    EXPECT_EQ(result.status().code(), absl::StatusCode::kDeadlineExceeded)
        << result.status();
    EXPECT_THAT(result.status().message(), HasSubstr("durable"));
    // Without a state dir there is nothing to wait for.
    auto plain = StartWorker();
    ASSERT_NE(plain, nullptr);
    CalibrationClient plain_client = Connect({plain->address()});
    Create(plain_client, "plain");
    auto session = plain_client.GetSession("plain");
    ASSERT_TRUE(session.ok());
    EXPECT_FALSE(session->persistent());
    // An upload there returns once acknowledged, even with a durability
    // timeout it could never meet if it waited.
    auto plain_channel = MakeChannel(plain->address(), {});
    ASSERT_TRUE(plain_channel.ok());
    UploaderOptions plain_options;
    plain_options.session_id = "plain";
    plain_options.durable_timeout = absl::Milliseconds(1);
    Uploader plain_uploader(*plain_channel, {}, plain_options);
    auto uploaded = plain_uploader.Upload(chunks_);
    ASSERT_TRUE(uploaded.ok()) << uploaded.status();
    EXPECT_EQ(uploaded->chunks_applied, uploaded->chunks);
    EXPECT_GT(uploaded->chunks, 0u);
  }
}

// Two workers that report the same id cannot shard: refused when the client
// connects, naming both addresses.
TEST_F(UploaderTest, TwoWorkersWithTheSameIdAreRefused) {
  auto a = StartWorker({"--worker-id", "same"});
  auto b = StartWorker({"--worker-id", "same"});
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  auto client = CalibrationClient::Connect({a->address(), b->address()}, {});
  ASSERT_FALSE(client.ok());
  EXPECT_EQ(client.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(client.status().message(),
              HasSubstr("both report worker id 'same'"));
  // The same worker listed twice is the same mistake.
  client = CalibrationClient::Connect({a->address(), a->address()}, {});
  EXPECT_EQ(client.status().code(), absl::StatusCode::kFailedPrecondition);
}

// Every worker records the session's shard map; a client with another worker
// set is refused before anything is sent, naming what changed, and so is a
// chunk or Finalize that reaches a worker not owning its layer.
TEST_F(UploaderTest, ADifferentWorkerSetOrTheWrongWorkerIsRefused) {
  auto a = StartWorker({"--worker-id", "a"});
  auto b = StartWorker({"--worker-id", "b"});
  auto c = StartWorker({"--worker-id", "c"});
  ASSERT_TRUE(a && b && c);
  // Given in another order: ids, not positions, decide.
  CalibrationClient two = Connect({b->address() + "," + a->address()});
  EXPECT_EQ(two.worker_ids(), (std::vector<std::string>{"a", "b"}));
  const v1::Session created = Create(two, "set");
  EXPECT_EQ(created.shard_map().worker_ids_size(), 2);
  EXPECT_EQ(created.shard_map().layer_owners_size(),
            static_cast<int>(model_.geometry.num_layers));

  CalibrationClient three = Connect({a->address(), b->address(), c->address()});
  auto upload = three.Upload("set", chunks_, {});
  EXPECT_EQ(upload.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(upload.status().message(), HasSubstr("added [c]"));
  v1::FinalizeRequest finalize;
  finalize.set_session_id("set");
  EXPECT_THAT(three.Finalize(finalize).status().message(),
              HasSubstr("added [c]"));
  auto recreate = three.CreateSession(Request("set", model_.geometry.head_dim));
  EXPECT_EQ(recreate.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(recreate.status().message(), HasSubstr("added [c]"));
  CalibrationClient one = Connect({a->address()});
  EXPECT_THAT(one.GetSession("set").status().message(),
              HasSubstr("sharded over workers [a, b]"));

  // A layer of worker b pushed straight to worker a.
  uint32_t b_layer = 0;
  while (LayerOwner("set", b_layer, two.worker_ids()) != 1) ++b_layer;
  std::vector<ChunkView> b_chunks;
  for (const ChunkView& chunk : chunks_) {
    if (chunk.layer == b_layer) b_chunks.push_back(chunk);
  }
  UploaderOptions options;
  options.session_id = "set";
  Uploader wrong(one.channel(0), {}, options);
  auto result = wrong.Upload(b_chunks);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(
      result.status().message(),
      HasSubstr(absl::StrCat("layer ", b_layer,
                             " of session 'set' belongs to worker 'b'")));
  options.shard_worker_ids = {"a", "b", "c"};
  Uploader stale(one.channel(0), {}, options);
  EXPECT_THAT(stale.Upload(b_chunks).status().message(),
              HasSubstr("added [c]"));
  grpc::ClientContext context;
  finalize.add_layers(b_layer);
  v1::FinalizeResponse response;
  const grpc::Status status =
      one.stub(0).Finalize(&context, finalize, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(), HasSubstr("belongs to worker 'b'"));
  // Nothing of it was applied.
  auto session = two.GetSession("set");
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_EQ(session->values_ingested(), 0u);
}

// A worker that restarts under a new address (a rescheduled pod) with its
// state dir is found again by its id while the upload reconnects: no user
// action, and the scales are those of an uninterrupted run.
TEST_F(UploaderTest, WorkerRestartedUnderANewAddressIsFollowedByItsId) {
  auto reference_worker = StartWorker();
  ASSERT_NE(reference_worker, nullptr);
  CalibrationClient reference_client = Connect({reference_worker->address()});
  const AllScales reference = Reference(reference_client, "moved");

  auto a = StartWorker({"--worker-id", "a", "--state-dir", dir_ / "a",
                        "--snapshot-interval-ms", "100"});
  auto b = StartWorker({"--worker-id", "b", "--state-dir", dir_ / "b",
                        "--snapshot-interval-ms", "100"});
  ASSERT_TRUE(a && b);
  const std::string list = dir_ / "workers.txt";
  std::ofstream(list) << a->address() << "\n" << b->address() << "\n";
  CalibrationClient client = Connect({"file:" + list});
  Create(client, "moved");
  const std::string old_b = b->address();
  std::atomic<bool> restarted{false};
  UploaderOptions options;
  options.max_chunk_bytes = 4096;
  options.window = 2;
  options.initial_backoff = absl::Milliseconds(20);
  options.on_ack = [&](uint64_t sequence) {
    if (sequence < 5 || restarted.exchange(true)) return true;
    b->Kill();  // SIGKILL: what was not yet snapshotted is lost
    b = StartWorker({"--worker-id", "b", "--state-dir", dir_ / "b",
                     "--snapshot-interval-ms", "100"});
    EXPECT_NE(b, nullptr);
    std::ofstream(list) << a->address() << "\n" << b->address() << "\n";
    return true;
  };
  auto result = client.Upload("moved", chunks_, options);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_TRUE(restarted);
  ASSERT_NE(b, nullptr);
  EXPECT_NE(b->address(), old_b);
  EXPECT_EQ(client.endpoint(1), b->address());
  EXPECT_EQ(Scales(client, "moved"), reference);
  // The restarted worker restored the session's shard map from its state
  // dir along with the statistics.
  grpc::ClientContext context;
  v1::GetSessionRequest request;
  request.set_session_id("moved");
  v1::Session restored;
  ASSERT_TRUE(client.stub(1).GetSession(&context, request, &restored).ok());
  EXPECT_EQ(restored.worker_id(), "b");
  EXPECT_EQ(restored.shard_map().worker_ids_size(), 2);
}

// Same-host shared memory: chunks by reference give the same scales as
// in-band, exactly once through stream cuts and into a durable worker.
TEST_F(UploaderTest, SharedMemoryUploadEqualsInBandThroughCuts) {
  auto worker = StartWorker(
      {"--state-dir", dir_ / "shm-state", "--snapshot-interval-ms", "50"});
  ASSERT_NE(worker, nullptr);
  CalibrationClient client = Connect({worker->address()});
  const AllScales reference = Reference(client, "reference");
  ASSERT_FALSE(reference.empty());

  Create(client, "shm");
  UploaderOptions options;
  options.session_id = "shm";
  options.producer_id = "rank0";
  options.max_chunk_bytes = 4096;
  options.window = 4;  // slots are reused many times over
  options.initial_backoff = absl::Milliseconds(10);
  options.shared_memory = true;
  int acks = 0;
  options.on_ack = [&](uint64_t) {
    ++acks;
    return acks != 9 && acks != 30;
  };
  Uploader uploader(client.channel(0), {}, options);
  auto result = uploader.Upload(chunks_);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_TRUE(result->shared_memory) << result->shared_memory_fallback;
  EXPECT_EQ(result->reconnects, 2u);
  auto session = client.GetSession("shm");
  ASSERT_TRUE(session.ok());
  auto ref_session = client.GetSession("reference");
  ASSERT_TRUE(ref_session.ok());
  EXPECT_EQ(session->values_ingested(), ref_session->values_ingested());
  EXPECT_EQ(session->bytes_ingested(), ref_session->bytes_ingested());
  ASSERT_EQ(session->producers_size(), 1);
  EXPECT_EQ(session->producers(0).sequence(), result->chunks);
  // Upload returned only once every chunk was durable.
  EXPECT_EQ(session->producers(0).durable_sequence(), result->chunks);
  EXPECT_EQ(Scales(client, "shm"), reference);
  // The ring is unregistered once the upload is done.
  grpc::ClientContext context;
  v1::ListSharedMemoryResponse list;
  ASSERT_TRUE(client.stub(0).ListSharedMemory(&context, {}, &list).ok());
  EXPECT_EQ(list.regions_size(), 0);
}

TEST_F(UploaderTest, SharedMemoryReRegistersWithARestartedWorker) {
  const int port = FreePort();
  const std::string listen = "127.0.0.1:" + std::to_string(port);
  auto reference_worker = StartWorker();
  ASSERT_NE(reference_worker, nullptr);
  CalibrationClient reference_client = Connect({reference_worker->address()});
  const AllScales reference = Reference(reference_client, "job");

  auto worker = StartWorker({}, listen);
  ASSERT_NE(worker, nullptr);
  CalibrationClient client = Connect({listen});
  Create(client, "job");
  UploaderOptions options;
  options.session_id = "job";
  options.max_chunk_bytes = 8192;
  options.window = 4;
  options.initial_backoff = absl::Milliseconds(20);
  options.shared_memory = true;
  bool restarted = false;
  options.on_ack = [&](uint64_t sequence) {
    if (sequence != 20 || restarted) return true;
    restarted = true;
    // The new worker gets the session's state but has never heard of the
    // producer's region.
    RestartWithImportedState(client, worker, listen, "job");
    return true;
  };
  Uploader uploader(client.channel(0), {}, options);
  auto result = uploader.Upload(chunks_);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_TRUE(restarted);
  EXPECT_TRUE(result->shared_memory) << result->shared_memory_fallback;
  EXPECT_GE(result->reconnects, 1u);
  EXPECT_EQ(Scales(client, "job"), reference);
}

TEST_F(UploaderTest, SharedMemoryFallsBackInBandWhenTheWorkerCannotUseIt) {
  // A worker with shared memory off answers RegisterSharedMemory as one on
  // another host does (FAILED_PRECONDITION): the chunks go in-band.
  auto worker = StartWorker({"--shared-memory", "false"});
  ASSERT_NE(worker, nullptr);
  CalibrationClient client = Connect({worker->address()});
  const AllScales reference = Reference(client, "reference");
  Create(client, "fallback");
  UploaderOptions options;
  options.shared_memory = true;
  options.max_chunk_bytes = 8192;
  auto result = client.Upload("fallback", chunks_, options);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_FALSE(result->shared_memory);
  EXPECT_THAT(result->shared_memory_fallback,
              HasSubstr("the worker is not on the producer's host"));
  EXPECT_EQ(result->chunks_applied, result->chunks);
  EXPECT_EQ(Scales(client, "fallback"), reference);
}

}  // namespace
}  // namespace kvcal
