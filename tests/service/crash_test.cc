// Crash test (issue "Reliability"): a worker with --state-dir is killed with
// SIGKILL at random points while the client library streams into it, and
// restarted on the same port and state dir; the Uploader reconnects, reads
// the restored watermark and resends what the restored state lacks. The
// final statistics must be bit-identical to an uninterrupted run, in 5
// seeded runs.
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <random>
#include <thread>

#include "client/rpc/connection.h"
#include "client/rpc/uploader.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvcal/v1/calibration.grpc.pb.h"
#include "tests/service/worker_process.h"
#include "tests/wait_until.h"

namespace kvcal {
namespace {

namespace pb = ::kvcal::v1;
using ::kvcal::testing::WaitUntil;
using ::kvcal::testing::WorkerProcess;

constexpr uint32_t kLayers = 3;
constexpr uint32_t kQHeads = 4;
constexpr uint32_t kKvHeads = 2;
constexpr uint32_t kHeadDim = 32;
constexpr int kBatches = 6;
constexpr uint64_t kTokens = 96;

struct Workload {
  std::vector<std::vector<float>> buffers;
  std::vector<ChunkView> tensors;
};

// Heavy-tailed data, one tensor per (batch, layer, role).
Workload MakeWorkload(uint64_t seed) {
  Workload w;
  std::mt19937_64 rng(seed);
  std::student_t_distribution<float> t(3.0f);
  for (int b = 0; b < kBatches; ++b) {
    for (uint32_t layer = 0; layer < kLayers; ++layer) {
      for (Role role : kAllRoles) {
        const uint32_t heads = role == Role::kQ ? kQHeads : kKvHeads;
        std::vector<float> values(kTokens * heads * kHeadDim);
        for (float& x : values) x = t(rng) * (1.0f + layer);
        w.buffers.push_back(std::move(values));
      }
    }
  }
  size_t i = 0;
  for (int b = 0; b < kBatches; ++b) {
    for (uint32_t layer = 0; layer < kLayers; ++layer) {
      for (Role role : kAllRoles) {
        const uint32_t heads = role == Role::kQ ? kQHeads : kKvHeads;
        ChunkView view;
        view.layer = layer;
        view.role = role;
        view.dtype = DType::kF32;
        view.layout = Layout::kTokensHeadsDim;
        view.shape = {kTokens, heads, kHeadDim};
        view.batch = static_cast<uint64_t>(b);
        const std::vector<float>& data = w.buffers[i++];
        view.data = absl::Span<const std::byte>(
            reinterpret_cast<const std::byte*>(data.data()),
            data.size() * sizeof(float));
        w.tensors.push_back(view);
      }
    }
  }
  return w;
}

pb::CreateSessionRequest CreateRequest() {
  pb::CreateSessionRequest r;
  r.set_session_id("crash");
  r.set_num_layers(kLayers);
  r.set_num_attention_heads(kQHeads);
  r.set_num_key_value_heads(kKvHeads);
  r.set_head_dim(kHeadDim);
  r.set_histogram_bins_per_octave(16);
  return r;
}

struct Outcome {
  pb::SessionState state;
  std::vector<std::string> finalized;  // serialized FinalizeResponses
  UploadResult upload;
};

UploaderOptions Options() {
  UploaderOptions options;
  options.session_id = "crash";
  options.producer_id = "rank0";
  options.max_chunk_bytes = 8 << 10;  // many small chunks: more kill points
  options.window = 8;
  options.max_attempts = 200;
  options.initial_backoff = absl::Milliseconds(20);
  options.max_backoff = absl::Milliseconds(200);
  options.rpc_timeout = absl::Seconds(20);
  return options;
}

Outcome Collect(const std::string& address) {
  Outcome out;
  auto stub = pb::Calibration::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  {
    grpc::ClientContext context;
    pb::ExportStateRequest request;
    request.set_session_id("crash");
    EXPECT_TRUE(stub->ExportState(&context, request, &out.state).ok());
  }
  for (pb::Observer observer :
       {pb::OBSERVER_STATIC_MINMAX, pb::OBSERVER_MINMAX_EMA,
        pb::OBSERVER_MEMORYLESS_MINMAX, pb::OBSERVER_PERCENTILE,
        pb::OBSERVER_MSE}) {
    grpc::ClientContext context;
    pb::FinalizeRequest request;
    request.set_session_id("crash");
    request.set_observer(observer);
    request.set_granularity(pb::GRANULARITY_PER_HEAD);
    pb::FinalizeResponse response;
    grpc::Status status = stub->Finalize(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    out.finalized.push_back(response.SerializeAsString());
  }
  return out;
}

bool CreateSession(const std::string& address) {
  auto stub = pb::Calibration::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  pb::Session session;
  return stub->CreateSession(&context, CreateRequest(), &session).ok();
}

Outcome Uninterrupted(const Workload& workload) {
  WorkerProcess worker;
  EXPECT_TRUE(worker.ok()) << worker.error();
  EXPECT_TRUE(CreateSession(worker.address()));
  auto channel = MakeChannel(worker.address(), ConnectionOptions());
  EXPECT_TRUE(channel.ok());
  Uploader uploader(*channel, ConnectionOptions(), Options());
  absl::StatusOr<UploadResult> result = uploader.Upload(workload.tensors);
  EXPECT_TRUE(result.ok()) << result.status();
  Outcome out = Collect(worker.address());
  if (result.ok()) out.upload = *result;
  return out;
}

class CrashTest : public ::testing::TestWithParam<uint64_t> {};

TEST_P(CrashTest, SigkillDuringIngestGivesBitIdenticalScales) {
  const uint64_t seed = GetParam();
  const Workload workload = MakeWorkload(seed);
  const Outcome reference = Uninterrupted(workload);

  const auto dir =
      std::filesystem::temp_directory_path() /
      ("kvcal-crash-" + std::to_string(getpid()) + "-" + std::to_string(seed));
  std::filesystem::remove_all(dir);
  const std::vector<std::string> args = {"--state-dir", dir.string(),
                                         "--snapshot-interval-ms", "20"};
  auto worker = std::make_unique<WorkerProcess>(args);
  ASSERT_TRUE(worker->ok()) << worker->error();
  const std::string address = worker->address();
  ASSERT_TRUE(CreateSession(address));
  // The session itself must be on disk before the first kill.
  const auto file = dir / "crash.kvstate";
  ASSERT_TRUE(WaitUntil([&] { return std::filesystem::exists(file); },
                        std::chrono::seconds(5),
                        std::chrono::milliseconds(10)));

  // Kill points: after a seeded number of acknowledged chunks, so that every
  // run is killed mid-ingest however fast the machine is.
  const uint64_t total_chunks = Uninterrupted(workload).upload.chunks;
  ASSERT_GT(total_chunks, 40u);
  std::mt19937_64 rng(seed * 7919);
  std::vector<uint64_t> kill_at;
  for (int i = 0; i < 3; ++i)
    kill_at.push_back(5 + rng() % (total_chunks - 10));
  std::sort(kill_at.begin(), kill_at.end());

  auto counters = std::make_shared<UploadCounters>();
  std::atomic<bool> done{false};
  absl::StatusOr<UploadResult> result;
  std::thread producer([&] {
    auto channel = MakeChannel(address, ConnectionOptions());
    UploaderOptions options = Options();
    options.counters = counters;
    Uploader uploader(*channel, ConnectionOptions(), options);
    result = uploader.Upload(workload.tensors);
    done = true;
  });

  int kills = 0;
  for (uint64_t target : kill_at) {
    while (!done && counters->chunks_acked.load() < target) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    if (done) break;
    ASSERT_NE(worker->SignalAndWait(SIGKILL, std::chrono::seconds(10)), -1);
    ++kills;
    worker.reset();
    worker = std::make_unique<WorkerProcess>(args, address);
    ASSERT_TRUE(worker->ok()) << worker->error();
  }
  producer.join();
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_GE(kills, 1) << "the run must be interrupted at least once";
  std::printf(
      "seed %llu: %d kills, %llu reconnects, %llu chunks sent for "
      "%llu chunks\n",
      static_cast<unsigned long long>(seed), kills,
      static_cast<unsigned long long>(result->reconnects),
      static_cast<unsigned long long>(result->chunks_sent),
      static_cast<unsigned long long>(result->chunks));

  const Outcome crashed = Collect(address);
  EXPECT_EQ(crashed.state.statistics(), reference.state.statistics())
      << "statistics must be bit-identical to the uninterrupted run";
  EXPECT_EQ(crashed.state.values_ingested(), reference.state.values_ingested());
  EXPECT_EQ(crashed.state.chunks_applied(), reference.state.chunks_applied());
  ASSERT_EQ(crashed.finalized.size(), reference.finalized.size());
  for (size_t i = 0; i < crashed.finalized.size(); ++i) {
    EXPECT_EQ(crashed.finalized[i], reference.finalized[i]) << "observer " << i;
  }
  worker.reset();
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(FiveSeeds, CrashTest,
                         ::testing::Values(1u, 2u, 3u, 4u, 5u));

}  // namespace
}  // namespace kvcal
