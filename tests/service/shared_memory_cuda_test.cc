// CUDA IPC shared memory against a real `kvcal-worker --backend cuda`: this
// test process allocates device memory, shares it with cudaIpcGetMemHandle,
// registers it and sends chunks that reference it; the scales equal those
// of the same data in-band. Label gpu: skips without a device.
#include <cuda_runtime.h>

#include <cstring>
#include <random>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvcal/v1/calibration.grpc.pb.h"
#include "tests/service/rpc_helpers.h"
#include "tests/service/worker_process.h"

namespace kvcal {
namespace {

namespace pb = ::kvcal::v1;
using ::kvcal::testing::WorkerProcess;
using ::testing::HasSubstr;

constexpr uint32_t kHeads = 4;
constexpr uint32_t kHeadDim = 64;
constexpr uint64_t kTokens = 96;

struct StreamResult {
  std::vector<pb::IngestResponse> responses;
  grpc::Status status;
};

StreamResult IngestAll(pb::Calibration::Stub* stub,
                       const std::vector<pb::IngestRequest>& chunks) {
  grpc::ClientContext context;
  auto stream = stub->Ingest(&context);
  StreamResult result;
  for (const pb::IngestRequest& chunk : chunks) {
    if (!stream->Write(chunk)) break;
    pb::IngestResponse response;
    if (!stream->Read(&response)) break;
    result.responses.push_back(response);
  }
  stream->WritesDone();
  result.status = stream->Finish();
  return result;
}

std::vector<float> Scales(pb::Calibration::Stub* stub, const std::string& id) {
  grpc::ClientContext context;
  pb::FinalizeRequest request;
  request.set_session_id(id);
  request.set_granularity(pb::GRANULARITY_PER_HEAD);
  request.set_allow_missing(true);
  pb::FinalizeResponse response;
  grpc::Status status = stub->Finalize(&context, request, &response);
  EXPECT_TRUE(status.ok()) << status.error_message();
  std::vector<float> out;
  for (const auto& layer : response.layers()) {
    for (const auto* role : {&layer.q(), &layer.k(), &layer.v()}) {
      out.insert(out.end(), role->scale().begin(), role->scale().end());
      out.insert(out.end(), role->absmax().begin(), role->absmax().end());
      out.push_back(static_cast<float>(role->count()));
    }
  }
  return out;
}

TEST(SharedMemoryCudaTest, ChunksInCudaIpcMemoryEqualInBand) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    (void)cudaGetLastError();
    GTEST_SKIP() << "no CUDA device present";
  }
  const size_t values = kTokens * kHeads * kHeadDim;
  std::vector<float> host(values * 3);
  std::mt19937_64 rng(3);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  for (float& x : host) x = normal(rng);
  void* device = nullptr;
  ASSERT_EQ(cudaMalloc(&device, host.size() * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(device, host.data(), host.size() * sizeof(float),
                       cudaMemcpyHostToDevice),
            cudaSuccess);
  cudaIpcMemHandle_t handle{};
  ASSERT_EQ(cudaIpcGetMemHandle(&handle, device), cudaSuccess);

  WorkerProcess worker({"--backend", "cuda"});
  ASSERT_TRUE(worker.ok()) << worker.error();
  auto stub = pb::Calibration::NewStub(worker.Channel());
  for (const std::string id : {"inband", "ipc"}) {
    grpc::ClientContext context;
    pb::Session session;
    ASSERT_TRUE(stub->CreateSession(&context,
                                    kvcal::testing::CreateSessionRequest(
                                        id, {1, kHeads, kHeads, kHeadDim, 16}),
                                    &session)
                    .ok());
    EXPECT_EQ(session.backend(), "cuda");
  }
  pb::SharedMemoryRegion region;
  {
    grpc::ClientContext context;
    pb::RegisterSharedMemoryRequest request;
    request.set_kind(pb::SHARED_MEMORY_KIND_CUDA_IPC);
    request.set_cuda_ipc_handle(&handle, sizeof(handle));
    request.set_device(0);
    request.set_byte_size(host.size() * sizeof(float));
    grpc::Status status =
        stub->RegisterSharedMemory(&context, request, &region);
    ASSERT_TRUE(status.ok()) << status.error_message() << worker.ReadLog();
  }
  std::vector<pb::IngestRequest> inband, ipc;
  for (int r = 0; r < 3; ++r) {
    pb::IngestRequest chunk;
    chunk.set_session_id("inband");
    chunk.set_producer_id("p");
    chunk.set_sequence(r + 1);
    chunk.set_layer(0);
    chunk.set_role(static_cast<pb::Role>(r + 1));
    chunk.set_dtype(pb::DTYPE_F32);
    chunk.set_layout(pb::LAYOUT_TOKENS_HEADS_DIM);
    for (uint64_t d : {kTokens, uint64_t{kHeads}, uint64_t{kHeadDim}}) {
      chunk.add_shape(d);
    }
    chunk.set_data(host.data() + r * values, values * sizeof(float));
    inband.push_back(chunk);
    chunk.clear_data();
    chunk.set_session_id("ipc");
    chunk.mutable_shared_memory()->set_region_id(region.region_id());
    chunk.mutable_shared_memory()->set_offset(r * values * sizeof(float));
    chunk.mutable_shared_memory()->set_byte_size(values * sizeof(float));
    ipc.push_back(chunk);
  }
  StreamResult a = IngestAll(stub.get(), inband);
  ASSERT_TRUE(a.status.ok()) << a.status.error_message();
  StreamResult b = IngestAll(stub.get(), ipc);
  ASSERT_TRUE(b.status.ok()) << b.status.error_message() << worker.ReadLog();
  ASSERT_EQ(b.responses.size(), 3u);
  EXPECT_EQ(Scales(stub.get(), "ipc"), Scales(stub.get(), "inband"));

  // Past the end: INVALID_ARGUMENT like a host region.
  pb::IngestRequest past = ipc[0];
  past.set_sequence(4);
  past.mutable_shared_memory()->set_offset(host.size() * sizeof(float));
  StreamResult c = IngestAll(stub.get(), {past});
  EXPECT_EQ(c.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(c.status.error_message(), HasSubstr("is outside"));
  {
    grpc::ClientContext context;
    pb::UnregisterSharedMemoryRequest request;
    request.set_region_id(region.region_id());
    pb::UnregisterSharedMemoryResponse response;
    ASSERT_TRUE(
        stub->UnregisterSharedMemory(&context, request, &response).ok());
  }
  ASSERT_EQ(cudaFree(device), cudaSuccess);
}

}  // namespace
}  // namespace kvcal
