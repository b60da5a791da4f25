// Unit tests of the worker's pieces: token parsing, session ids, the
// registry's limits, proto conversion defaults, and an in-process worker's
// drain.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <condition_variable>
#include <future>
#include <mutex>
#include <string>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/device_health.h"
#include "kvcal/v1/calibration.grpc.pb.h"
#include "service/auth.h"
#include "service/metrics.h"
#include "service/proto_convert.h"
#include "service/session_registry.h"
#include "service/worker.h"
#include "tests/wait_until.h"
#include "util/status_macros.h"

namespace kvcal::service {
namespace {

using ::kvcal::testing::WaitUntil;
using ::testing::HasSubstr;

TEST(TokenAuthenticatorTest, ParsesTenantsAndBareTokens) {
  auto auth = TokenAuthenticator::FromText("# comment\n\nteam:abc\nxyz\n");
  ASSERT_TRUE(auth.ok()) << auth.status();
  EXPECT_EQ(*auth->Authenticate("Bearer abc"), "team");
  EXPECT_EQ(*auth->Authenticate("BEARER xyz"), "default");
  EXPECT_EQ(auth->Authenticate("Bearer ab").status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(auth->Authenticate("abc").status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_FALSE(TokenAuthenticator::FromText("team:\n").ok());
  EXPECT_FALSE(TokenAuthenticator::FromText("\n# only comments\n").ok());
  // The message never repeats the presented token.
  EXPECT_THAT(
      std::string(auth->Authenticate("Bearer leaked").status().message()),
      ::testing::Not(HasSubstr("leaked")));
}

TEST(SessionIdTest, Validation) {
  EXPECT_TRUE(ValidateSessionId("a-Z_0.9", false).ok());
  EXPECT_TRUE(ValidateSessionId("", true).ok());
  EXPECT_FALSE(ValidateSessionId("", false).ok());
  EXPECT_FALSE(ValidateSessionId("a/b", false).ok());
  EXPECT_TRUE(ValidateSessionId(std::string(128, 'x'), false).ok());
  EXPECT_FALSE(ValidateSessionId(std::string(129, 'x'), false).ok());
}

TEST(SessionRegistryTest, LimitsAreResourceExhausted) {
  RegistryOptions options;
  options.session.backend = BackendKind::kCpu;
  options.max_sessions = 1;
  SessionRegistry registry(options);
  Geometry g{2, 4, 2, 8, 0, 0b111};
  ASSERT_TRUE(registry.Create("t", "a", g).ok());
  auto second = registry.Create("t", "b", g);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(second.status().message()),
              HasSubstr("--max-sessions"));

  RegistryOptions budget;
  budget.session.backend = BackendKind::kCpu;
  budget.memory_budget_bytes = EstimateStateBytes(g) + 1;
  SessionRegistry small(budget);
  ASSERT_TRUE(small.Create("t", "a", g).ok());
  Geometry with_histograms = g;
  with_histograms.bins_per_octave = 128;
  EXPECT_EQ(small.Create("t", "b", with_histograms).status().code(),
            absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(small.Delete("t", "a").ok());
  EXPECT_TRUE(small.Create("t", "b", g).ok()) << "deleting frees the budget";
}

// Building a session (backend allocation, a snapshot's statistics) happens
// without the registry's lock: while a large ImportState is being built,
// other sessions' ingest, Get and CreateSession go on. The import is held
// inside the build by the test seam until the rest has finished, so a
// registry that still held its lock there would deadlock this test (it then
// fails on the 60 s guard below instead of hanging).
TEST(SessionRegistryTest, ImportBuildsOutsideTheRegistryLock) {
  std::mutex mu;
  std::condition_variable cv;
  bool building = false;
  bool release = false;
  RegistryOptions options;
  options.session.backend = BackendKind::kCpu;
  options.on_build = [&](absl::string_view id) {
    if (id != "big") return;
    std::unique_lock<std::mutex> lock(mu);
    building = true;
    cv.notify_all();
    cv.wait(lock, [&] { return release; });
  };
  SessionRegistry registry(options);
  const Geometry g{2, 4, 2, 8, 0, 0b111};
  auto flowing = registry.Create("t", "flowing", g);
  ASSERT_TRUE(flowing.ok()) << flowing.status();
  const Geometry big_geometry{32, 32, 8, 128, 64, 0b111};
  RegistryOptions source_options;
  source_options.session.backend = BackendKind::kCpu;
  SessionRegistry source(source_options);
  auto big = source.Create("t", "big", big_geometry);
  ASSERT_TRUE(big.ok()) << big.status();
  auto snapshot = (*big)->Export();
  ASSERT_TRUE(snapshot.ok()) << snapshot.status();

  auto import = std::async(std::launch::async, [&] {
    return registry.Import("t", "big", *snapshot, "import-1").status();
  });
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return building; });
  }
  auto others = std::async(std::launch::async, [&]() -> absl::Status {
    std::vector<float> values(4 * 2 * 8, 1.5f);
    ChunkView chunk;
    chunk.layer = 1;
    chunk.role = Role::kK;
    chunk.dtype = DType::kF32;
    chunk.layout = Layout::kTokensHeadsDim;
    chunk.shape = {4, 2, 8};
    chunk.data = absl::Span<const std::byte>(
        reinterpret_cast<const std::byte*>(values.data()),
        values.size() * sizeof(float));
    for (uint64_t seq = 1; seq <= 3; ++seq) {
      KVCAL_ASSIGN_OR_RETURN(std::shared_ptr<Session> s,
                             registry.Get("t", "flowing"));
      KVCAL_ASSIGN_OR_RETURN(IngestOutcome outcome, s->Ingest("p", seq, chunk));
      if (!outcome.applied) return absl::InternalError("chunk not applied");
    }
    KVCAL_RETURN_IF_ERROR(registry.Create("u", "other-tenant", g).status());
    // The session being built is not there yet, and not half there.
    if (registry.Get("t", "big").status().code() !=
        absl::StatusCode::kNotFound) {
      return absl::InternalError("a session under construction is visible");
    }
    return absl::OkStatus();
  });
  const bool done =
      others.wait_for(std::chrono::seconds(60)) == std::future_status::ready;
  {
    std::lock_guard<std::mutex> lock(mu);
    release = true;
  }
  cv.notify_all();
  ASSERT_TRUE(done) << "ingest stalled behind the import's build";
  EXPECT_TRUE(others.get().ok());
  ASSERT_TRUE(import.get().ok());
  auto imported = registry.Get("t", "big");
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_EQ((*imported)->geometry(), big_geometry);
  EXPECT_EQ(registry.size(), 3u);
  EXPECT_EQ(registry.state_bytes(),
            EstimateStateBytes(g) * 2 + EstimateStateBytes(big_geometry))
      << "the reservation is replaced by the session's own bytes";
}

TEST(SessionRegistryTest, TenantsAreIsolatedAndLimitedSeparately) {
  RegistryOptions options;
  options.session.backend = BackendKind::kCpu;
  options.max_sessions_per_tenant = 1;
  SessionRegistry registry(options);
  Geometry g{2, 4, 2, 8, 0, 0b111};
  ASSERT_TRUE(registry.Create("a", "shared-name", g).ok());
  // Another tenant has its own namespace: same id, no conflict, no leak.
  Geometry other = g;
  other.head_dim = 16;
  ASSERT_TRUE(registry.Create("b", "shared-name", other).ok());
  EXPECT_EQ(registry.Get("a", "shared-name").value()->geometry().head_dim, 8u);
  EXPECT_EQ(registry.Get("b", "shared-name").value()->geometry().head_dim, 16u);
  EXPECT_EQ(registry.Get("c", "shared-name").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(registry.List("a").size(), 1u);
  EXPECT_EQ(registry.List("c").size(), 0u);
  EXPECT_EQ(registry.ListAll().size(), 2u);
  EXPECT_EQ(registry.Delete("c", "shared-name").code(),
            absl::StatusCode::kNotFound);
  auto second = registry.Create("a", "another", g);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(second.status().message()),
              HasSubstr("--max-sessions-per-tenant"));
  EXPECT_TRUE(registry.Create("c", "another", g).ok());
}

TEST(TokenAuthenticatorTest, RejectsBadTenantNames) {
  EXPECT_FALSE(TokenAuthenticator::FromText("a b:token\n").ok());
  EXPECT_FALSE(TokenAuthenticator::FromText("x~y:token\n").ok());
  EXPECT_TRUE(TokenAuthenticator::FromText("team.a-1_b:token\n").ok());
}

TEST(ProtoConvertTest, FinalizeDefaultsAndRanges) {
  kvcal::v1::FinalizeRequest request;
  auto options = ScaleOptionsFromProto(request);
  ASSERT_TRUE(options.ok());
  EXPECT_EQ(options->observer, Observer::kStaticMinMax);
  EXPECT_EQ(options->granularity, Granularity::kPerTensor);
  EXPECT_EQ(options->format, Format::kFp8E4m3fn);
  EXPECT_FLOAT_EQ(options->averaging_constant, 0.01f);
  EXPECT_DOUBLE_EQ(options->percentile, 99.99);
  EXPECT_EQ(options->mse_grid, 100u);
  EXPECT_FLOAT_EQ(options->mse_max_shrink, 0.2f);
  EXPECT_FLOAT_EQ(options->mse_norm, 2.4f);
  EXPECT_EQ(options->mse_patience, 5u);
  request.set_mse_max_shrink(1.0f);
  EXPECT_THAT(std::string(ScaleOptionsFromProto(request).status().message()),
              HasSubstr("mse_max_shrink"));
  request.set_mse_max_shrink(0);
  request.set_margin(-1.0f);
  EXPECT_THAT(std::string(ScaleOptionsFromProto(request).status().message()),
              HasSubstr("margin"));
  request.set_margin(0);
  request.set_format(static_cast<kvcal::v1::Format>(5));
  EXPECT_THAT(std::string(ScaleOptionsFromProto(request).status().message()),
              HasSubstr("format"));
}

// Once SIGTERM's drain has begun, new calls get UNAVAILABLE at once: clients
// polling GetSession cannot keep the worker in its grace period, and a new
// Ingest stream is not accepted.
TEST(WorkerDrainTest, NewCallsAreRefusedOnceDraining) {
  WorkerOptions options;
  options.listen = "127.0.0.1:0";
  options.backend = BackendKind::kCpu;
  options.executor_threads = 2;
  auto worker = Worker::Start(options);
  ASSERT_TRUE(worker.ok()) << worker.status();
  auto stub = kvcal::v1::Calibration::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string((*worker)->port()),
                          grpc::InsecureChannelCredentials()));
  {
    grpc::ClientContext context;
    kvcal::v1::ListSessionsResponse list;
    ASSERT_TRUE(stub->ListSessions(&context, {}, &list).ok());
  }
  (*worker)->service().DrainStreams();
  {
    grpc::ClientContext context;
    kvcal::v1::ListSessionsResponse list;
    const grpc::Status status = stub->ListSessions(&context, {}, &list);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
    EXPECT_THAT(status.error_message(), HasSubstr("shutting down"));
  }
  {
    grpc::ClientContext context;
    kvcal::v1::GetSessionRequest request;
    request.set_session_id("s");
    kvcal::v1::Session session;
    EXPECT_EQ(stub->GetSession(&context, request, &session).error_code(),
              grpc::StatusCode::UNAVAILABLE);
  }
  {
    grpc::ClientContext context;
    auto stream = stub->Ingest(&context);
    kvcal::v1::IngestResponse response;
    EXPECT_FALSE(stream->Read(&response));
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
  }
  // Nothing is in flight, so Shutdown returns without waiting out its grace
  // period: an hour, which no test run outlives. (The 10-minute wait below
  // only keeps a broken Shutdown from hanging the suite.)
  auto shutdown = std::async(
      std::launch::async, [&] { (*worker)->Shutdown(std::chrono::hours(1)); });
  EXPECT_EQ(shutdown.wait_for(std::chrono::minutes(10)),
            std::future_status::ready)
      << "Shutdown waited for its grace period with nothing in flight";
}

// grpc.health.v1.Health/Check for the whole server: the serialized
// HealthCheckResponse ("\x08\x01" SERVING, "\x08\x02" NOT_SERVING).
std::string HealthCheck(const std::shared_ptr<grpc::Channel>& channel) {
  grpc::GenericStub generic(channel);
  grpc::ClientContext context;
  grpc::Slice empty("", 0);
  grpc::ByteBuffer request(&empty, 1);
  grpc::ByteBuffer response;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  grpc::Status status;
  generic.UnaryCall(&context, "/grpc.health.v1.Health/Check",
                    grpc::StubOptions(), &request, &response,
                    [&](grpc::Status s) {
                      std::lock_guard<std::mutex> lock(mu);
                      status = s;
                      done = true;
                      cv.notify_one();
                    });
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return done; });
  if (!status.ok()) return "error: " + status.error_message();
  std::vector<grpc::Slice> slices;
  if (!response.Dump(&slices).ok()) return "error: dump";
  std::string bytes;
  for (auto& slice : slices) {
    bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  return bytes;
}

// A lost GPU (simulated: ReportDeviceLost is what the CUDA backend calls on
// a sticky error) turns the worker NOT_SERVING so that Kubernetes restarts
// it; /healthz says why; new sessions under --backend auto get the CPU.
TEST(WorkerHealthTest, DeviceLossMakesTheWorkerNotServing) {
  ResetDeviceHealthForTesting();
  WorkerOptions options;
  options.listen = "127.0.0.1:0";
  options.backend = BackendKind::kAuto;
  options.executor_threads = 2;
  auto worker = Worker::Start(options);
  ASSERT_TRUE(worker.ok()) << worker.status();
  auto channel =
      grpc::CreateChannel("127.0.0.1:" + std::to_string((*worker)->port()),
                          grpc::InsecureChannelCredentials());
  ASSERT_EQ(HealthCheck(channel), std::string("\x08\x01", 2)) << "SERVING";

  ReportDeviceLost(absl::InternalError(
      "CUDA error cudaErrorIllegalAddress (simulated) from a kernel"));
  std::string health;
  WaitUntil(
      [&] {
        return (health = HealthCheck(channel)) == std::string("\x08\x02", 2);
      },
      std::chrono::seconds(10), std::chrono::milliseconds(50));
  EXPECT_EQ(health, std::string("\x08\x02", 2)) << "NOT_SERVING";
  EXPECT_THAT((*worker)->service().metrics().HealthDetail(),
              HasSubstr("GPU lost"));

  // The worker still answers, and new sessions work on the CPU backend.
  auto stub = kvcal::v1::Calibration::NewStub(channel);
  grpc::ClientContext context;
  kvcal::v1::CreateSessionRequest request;
  request.set_session_id("after-loss");
  request.set_num_layers(1);
  request.set_num_attention_heads(2);
  request.set_num_key_value_heads(1);
  request.set_head_dim(8);
  kvcal::v1::Session session;
  const grpc::Status created = stub->CreateSession(&context, request, &session);
  EXPECT_TRUE(created.ok()) << created.error_message();
  (*worker)->Shutdown(std::chrono::milliseconds(1000));
  ResetDeviceHealthForTesting();
}

TEST(ShardMapTest, ValidatesIdsOrderAndOwners) {
  EXPECT_TRUE(ValidateShardMap({{"a", "b"}, {0, 1, 1}}, 3).ok());
  EXPECT_TRUE(ValidateShardMap({}, 3).ok());  // no map: one worker
  EXPECT_THAT(ValidateShardMap({{"b", "a"}, {0, 1, 1}}, 3).message(),
              HasSubstr("sorted and unique"));
  EXPECT_THAT(ValidateShardMap({{"a", "a"}, {0, 1, 1}}, 3).message(),
              HasSubstr("sorted and unique"));
  EXPECT_THAT(ValidateShardMap({{"a", "b"}, {0, 1}}, 3).message(),
              HasSubstr("2 layer owners; the session has 3 layers"));
  EXPECT_THAT(ValidateShardMap({{"a", "b"}, {0, 2, 1}}, 3).message(),
              HasSubstr("layer 1 owner index 2"));
  EXPECT_THAT(ValidateShardMap({{"a b"}, {0}}, 1).message(),
              HasSubstr("[A-Za-z0-9._-]{1,128}"));
  EXPECT_FALSE(ValidateWorkerId("").ok());
  EXPECT_TRUE(ValidateWorkerId("kvcal-worker-12.kvcal").ok());
}

TEST(ShardMapTest, SessionAdoptsOneMapAndChecksChunksAgainstIt) {
  Geometry g{3, 4, 2, 8, 0, 0b111};
  SessionRegistry registry({});
  const ShardMap map{{"a", "b"}, {0, 1, 1}};
  auto session = registry.Create("t", "s", g, map);
  ASSERT_TRUE(session.ok()) << session.status();
  // Creating it again: the same map is fine, another set is refused.
  EXPECT_TRUE(registry.Create("t", "s", g, map).ok());
  EXPECT_TRUE(registry.Create("t", "s", g, {}).ok());
  absl::Status other =
      registry.Create("t", "s", g, {{"a", "b", "c"}, {0, 1, 2}}).status();
  EXPECT_EQ(other.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(other.message(), HasSubstr("added [c]"));

  const std::vector<uint32_t> layer1 = {1};
  EXPECT_TRUE((*session)->CheckShard({"a", "b"}, layer1, "b").ok());
  EXPECT_TRUE((*session)->CheckShard({}, layer1, "b").ok());
  absl::Status wrong = (*session)->CheckShard({}, layer1, "a");
  EXPECT_EQ(wrong.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(wrong.message(), HasSubstr("layer 1 of session 's' belongs to "
                                         "worker 'b', not to this worker 'a'"));
  EXPECT_THAT((*session)->CheckShard({"a"}, layer1, "b").message(),
              HasSubstr("missing [b]"));
  // Finalize of every layer on one worker of two.
  EXPECT_THAT((*session)->CheckShard({}, {}, "a").message(),
              HasSubstr("layer 1"));
  // The map travels with the session's state.
  auto snapshot = (*session)->Export();
  ASSERT_TRUE(snapshot.ok());
  EXPECT_EQ(snapshot->shard_map, map);
  kvcal::v1::SessionState state;
  SnapshotToProto("s", *snapshot, &state);
  auto parsed = SnapshotFromProto(state);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->shard_map, map);
}

}  // namespace
}  // namespace kvcal::service
