// CUDA-only cases of kvcal_backend_cuda_test (label `gpu`; every test skips
// with a message when no device is present): out-of-memory injected through
// FailNthCudaAllocationForTesting, the checked device-data entry point, and
// device selection without touching device 0. The typed suite in
// backend_test.cc covers what both backends do.
#include "kernels/cuda/cuda_backend.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/device_health.h"
#include "tests/kernels/test_util.h"

namespace kvcal {
namespace {

using ::kvcal::testing::ChunkBuilder;
using ::kvcal::testing::ElementIndex;
using ::kvcal::testing::ExpectMatchesReference;
using ::kvcal::testing::ExpectStatesEqual;
using ::kvcal::testing::IsOk;
using ::kvcal::testing::Reference;
using ::kvcal::testing::Rng;
using ::kvcal::testing::StatusIs;
using ::testing::HasSubstr;

Geometry TestGeometry(uint32_t bins_per_octave = 16) {
  Geometry g;
  g.num_layers = 2;
  g.num_attention_heads = 4;
  g.num_key_value_heads = 2;
  g.head_dim = 64;
  g.bins_per_octave = bins_per_octave;
  return g;
}

std::unique_ptr<ChunkBuilder> NormalChunk(Rng& rng, std::vector<uint64_t> shape,
                                          uint64_t batch = 0,
                                          DType dtype = DType::kF32) {
  auto chunk = std::make_unique<ChunkBuilder>(dtype, Layout::kTokensHeadsDim,
                                              std::move(shape), 0, batch);
  chunk->Fill([&rng](const ElementIndex& at) {
    return static_cast<float>(rng.Normal() * (1.0 + at.head));
  });
  return chunk;
}

// Device memory holding a copy of a chunk's data.
class DeviceCopy {
 public:
  explicit DeviceCopy(const ChunkBuilder& chunk, size_t extra_bytes = 0) {
    bytes_ = chunk.data().size() + extra_bytes;
    EXPECT_EQ(cudaMalloc(&ptr_, bytes_), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(ptr_, chunk.data().data(), chunk.data().size(),
                         cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  ~DeviceCopy() { (void)cudaFree(ptr_); }
  DeviceCopy(const DeviceCopy&) = delete;
  DeviceCopy& operator=(const DeviceCopy&) = delete;
  unsigned char* get() const { return static_cast<unsigned char*>(ptr_); }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

ChunkView WithData(ChunkView view, const void* data, size_t bytes) {
  view.data =
      absl::Span<const std::byte>(static_cast<const std::byte*>(data), bytes);
  return view;
}

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) {
      GTEST_SKIP() << "no CUDA device present (" << CudaDeviceDescription(0)
                   << "): skipping the CUDA backend tests";
    }
  }
  void TearDown() override { FailNthCudaAllocationForTesting(0); }

  static std::unique_ptr<CudaStatisticsBackend> Make(
      const Geometry& g, const BackendOptions& options = {}) {
    auto backend = CreateCudaStatisticsBackend(g, options);
    EXPECT_THAT(backend, IsOk());
    return backend.ok() ? std::move(backend).value() : nullptr;
  }
};

// One failed allocation (here: another session's) must not break a healthy
// session on the same thread: the runtime's last error is cleared, nothing
// is poisoned, and the failed creation is RESOURCE_EXHAUSTED.
TEST_F(CudaBackendTest, AnotherSessionsOutOfMemoryLeavesThisOneWorking) {
  Rng rng(101);
  const Geometry g = TestGeometry();
  auto healthy = Make(g);
  ASSERT_NE(healthy, nullptr);
  auto a = NormalChunk(rng, {100, 4, 64}, 1);
  ASSERT_THAT(healthy->Accumulate(a->view(0, Role::kQ)), IsOk());
  for (int n : {1, 2, 5}) {
    FailNthCudaAllocationForTesting(n);
    EXPECT_THAT(CreateCudaStatisticsBackend(g),
                StatusIs(absl::StatusCode::kResourceExhausted,
                         HasSubstr("cudaErrorMemoryAllocation")))
        << "allocation " << n;
    EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess);
  }
  auto b = NormalChunk(rng, {50, 2, 64}, 2);
  ASSERT_THAT(healthy->Accumulate(b->view(1, Role::kK)), IsOk());
  Reference ref(g);
  ref.Add(*a, 0, Role::kQ);
  ref.Add(*b, 1, Role::kK);
  auto snapshot = healthy->Snapshot();
  ASSERT_THAT(snapshot, IsOk());
  ExpectMatchesReference(ref, *snapshot);
  EXPECT_THAT(DeviceHealth(), IsOk());
}

// Out of memory inside a session (the staging ring on first use, the batch
// table growing, a Merge that needs more batch rows): RESOURCE_EXHAUSTED,
// nothing applied, and the same call succeeds once memory is there.
TEST_F(CudaBackendTest, OutOfMemoryInsideASessionIsRetryable) {
  Rng rng(102);
  const Geometry g = TestGeometry();
  auto backend = Make(g);
  ASSERT_NE(backend, nullptr);
  Reference ref(g);
  std::vector<std::unique_ptr<ChunkBuilder>> chunks;

  chunks.push_back(NormalChunk(rng, {30, 4, 64}, 0));
  FailNthCudaAllocationForTesting(1);  // the first pinned staging slot
  EXPECT_THAT(backend->Accumulate(chunks.back()->view(0, Role::kQ)),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("")));
  ASSERT_THAT(backend->Accumulate(chunks.back()->view(0, Role::kQ)), IsOk());
  ref.Add(*chunks.back(), 0, Role::kQ);

  // Batches 1..15 fill the 16 preallocated rows; batch 16 grows the table.
  for (uint64_t batch = 1; batch < 16; ++batch) {
    chunks.push_back(NormalChunk(rng, {3, 2, 64}, batch));
    ASSERT_THAT(backend->Accumulate(chunks.back()->view(1, Role::kV)), IsOk());
    ref.Add(*chunks.back(), 1, Role::kV);
  }
  chunks.push_back(NormalChunk(rng, {3, 2, 64}, 16));
  FailNthCudaAllocationForTesting(1);
  EXPECT_THAT(backend->Accumulate(chunks.back()->view(1, Role::kV)),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("")));
  ASSERT_THAT(backend->Accumulate(chunks.back()->view(1, Role::kV)), IsOk());
  ref.Add(*chunks.back(), 1, Role::kV);
  auto snapshot = backend->Snapshot();
  ASSERT_THAT(snapshot, IsOk());
  ExpectMatchesReference(ref, *snapshot, "after the batch table grew");

  // Merge 40 batches into a fresh backend (16 rows): growing fails first.
  auto target = Make(g);
  ASSERT_NE(target, nullptr);
  SessionStatistics forty(g);
  {
    auto source = CreateCpuBackend(g);
    ASSERT_THAT(source, IsOk());
    for (uint64_t batch = 0; batch < 40; ++batch) {
      chunks.push_back(NormalChunk(rng, {2, 2, 64}, 100 + batch));
      ASSERT_THAT((*source)->Accumulate(chunks.back()->view(0, Role::kK)),
                  IsOk());
    }
    auto snap = (*source)->Snapshot();
    ASSERT_THAT(snap, IsOk());
    forty = *snap;
  }
  FailNthCudaAllocationForTesting(1);
  EXPECT_THAT(target->Merge(forty),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("")));
  auto empty = target->Snapshot();
  ASSERT_THAT(empty, IsOk());
  ExpectStatesEqual(SessionStatistics(g), *empty);
  ASSERT_THAT(target->Merge(forty), IsOk());
  auto merged = target->Snapshot();
  ASSERT_THAT(merged, IsOk());
  ExpectStatesEqual(forty, *merged);
  EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess);
}

// ---------------------------------------------------------------------------
// AccumulateDeviceData
// ---------------------------------------------------------------------------

TEST_F(CudaBackendTest, DeviceDataMatchesTheReference) {
  Rng rng(103);
  const Geometry g = TestGeometry();
  auto backend = Make(g);
  ASSERT_NE(backend, nullptr);
  Reference ref(g);
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBf16}) {
    auto chunk = NormalChunk(rng, {77, 4, 64}, 3, dtype);
    DeviceCopy device(*chunk);
    ASSERT_THAT(backend->AccumulateDeviceData(
                    WithData(chunk->view(0, Role::kQ), device.get(),
                             chunk->data().size()),
                    nullptr),
                IsOk());
    ASSERT_THAT(backend->Synchronize(), IsOk());
    ref.Add(*chunk, 0, Role::kQ);
  }
  auto snapshot = backend->Snapshot();
  ASSERT_THAT(snapshot, IsOk());
  ExpectMatchesReference(ref, *snapshot);
}

TEST_F(CudaBackendTest, DeviceDataIsCheckedBeforeAnythingRuns) {
  Rng rng(104);
  const Geometry g = TestGeometry();
  auto backend = Make(g);
  ASSERT_NE(backend, nullptr);
  auto chunk = NormalChunk(rng, {16, 4, 64}, 0);
  const size_t bytes = chunk->data().size();
  DeviceCopy device(*chunk, 64);
  const ChunkView view = chunk->view(0, Role::kQ);

  // The same validation, and message, as Accumulate.
  ChunkView wrong_dim = WithData(view, device.get(), bytes);
  wrong_dim.shape = {16, 4, 32};
  const absl::Status in_band = backend->Accumulate(wrong_dim);
  ASSERT_THAT(in_band, StatusIs(absl::StatusCode::kInvalidArgument,
                                HasSubstr("head_dim")));
  EXPECT_EQ(backend->AccumulateDeviceData(wrong_dim, nullptr), in_band);

  EXPECT_THAT(
      backend->AccumulateDeviceData(WithData(view, device.get() + 2, bytes),
                                    nullptr),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("aligned")));
  // Ordinary (aligned) host memory: the chunk's bytes sit at an odd offset
  // in ChunkBuilder, which the alignment check would catch first.
  std::vector<float> host(bytes / sizeof(float), 1.0f);
  EXPECT_THAT(backend->AccumulateDeviceData(WithData(view, host.data(), bytes),
                                            nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("not CUDA memory")));
  void* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(&pinned, bytes), cudaSuccess);
  EXPECT_THAT(
      backend->AccumulateDeviceData(WithData(view, pinned, bytes), nullptr),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("pinned host memory")));
  (void)cudaFreeHost(pinned);
  EXPECT_THAT(backend->AccumulateDeviceData(
                  WithData(view, device.get() + 128, bytes), nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("past the end of its allocation")));

  // Nothing was applied, and the backend still works.
  auto snapshot = backend->Snapshot();
  ASSERT_THAT(snapshot, IsOk());
  ExpectStatesEqual(SessionStatistics(g), *snapshot);
  ASSERT_THAT(backend->AccumulateDeviceData(WithData(view, device.get(), bytes),
                                            nullptr),
              IsOk());
  Reference ref(g);
  ref.Add(*chunk, 0, Role::kQ);
  snapshot = backend->Snapshot();
  ASSERT_THAT(snapshot, IsOk());
  ExpectMatchesReference(ref, *snapshot);
  EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess);
}

// What a session with reject_non_finite asks before it accumulates a CUDA
// IPC chunk: the per-head NaN and Inf counts of device data, the same as the
// host count of the same bytes (kernels/nonfinite.h), with the checks of
// AccumulateDeviceData first and nothing accumulated.
TEST_F(CudaBackendTest, CountsNonFiniteDeviceDataWithoutApplyingIt) {
  Rng rng(105);
  const Geometry g = TestGeometry();
  auto backend = Make(g);
  ASSERT_NE(backend, nullptr);
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBf16}) {
    // Larger than one 8 MiB host copy for f32: the count spans copies.
    auto chunk = NormalChunk(rng, {9000, 4, 64}, 0, dtype);
    const uint32_t nan = dtype == DType::kF32   ? 0x7fc00000u
                         : dtype == DType::kF16 ? 0x7e00u
                                                : 0x7fc0u;
    const uint32_t inf = dtype == DType::kF32   ? 0xff800000u
                         : dtype == DType::kF16 ? 0xfc00u
                                                : 0xff80u;
    chunk->SetRaw(5 * 64 + 1, nan);                    // token 1, head 1
    chunk->SetRaw(chunk->elements() - 1, inf);         // last token, head 3
    chunk->SetRaw((8999 * 4 + 3) * 64 + 10, nan);      // last token, head 3
    DeviceCopy device(*chunk);
    const ChunkView host_view = chunk->view(0, Role::kQ);
    const ChunkView device_view =
        WithData(host_view, device.get(), chunk->data().size());
    auto found = backend->CountNonFiniteDeviceData(device_view);
    ASSERT_THAT(found, IsOk());
    auto extent = ValidateChunk(g, host_view);
    ASSERT_THAT(extent, IsOk());
    const ChunkNonFinite want = CountNonFinite(host_view, *extent);
    ASSERT_EQ(found->heads.size(), want.heads.size());
    for (size_t h = 0; h < want.heads.size(); ++h) {
      EXPECT_EQ(found->heads[h].nan, want.heads[h].nan) << h;
      EXPECT_EQ(found->heads[h].inf, want.heads[h].inf) << h;
    }
    EXPECT_EQ(found->heads[1].nan, 1u);
    EXPECT_EQ(found->heads[3].nan, 1u);
    EXPECT_EQ(found->heads[3].inf, 1u);
    EXPECT_EQ(found->total(), 3u);
  }
  // The device-data checks come first.
  auto chunk = NormalChunk(rng, {16, 4, 64}, 0);
  std::vector<float> host(chunk->data().size() / sizeof(float), 1.0f);
  EXPECT_THAT(backend->CountNonFiniteDeviceData(WithData(
                  chunk->view(0, Role::kQ), host.data(), chunk->data().size())),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("not CUDA memory")));
  // Counting applied nothing.
  auto snapshot = backend->Snapshot();
  ASSERT_THAT(snapshot, IsOk());
  ExpectStatesEqual(SessionStatistics(g), *snapshot);
  EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess);
}

// The producer writes on its own stream and hands over an event: the read
// waits for it on the device. 64 MiB through a pinned copy keeps the
// producer's stream busy long enough that an unordered read would see the
// NaN pattern the buffer held before.
TEST_F(CudaBackendTest, TheReadyEventOrdersTheRead) {
  Rng rng(105);
  const Geometry g = TestGeometry(0);
  auto backend = Make(g);
  ASSERT_NE(backend, nullptr);
  auto chunk = NormalChunk(rng, {65536, 4, 64}, 0);
  const size_t bytes = chunk->data().size();
  void* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(&pinned, bytes), cudaSuccess);
  std::memcpy(pinned, chunk->data().data(), bytes);
  void* device = nullptr;
  ASSERT_EQ(cudaMalloc(&device, bytes), cudaSuccess);
  ASSERT_EQ(cudaMemset(device, 0xff, bytes), cudaSuccess);  // NaNs
  cudaStream_t producer = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&producer, cudaStreamNonBlocking),
            cudaSuccess);
  cudaEvent_t ready = nullptr;
  ASSERT_EQ(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming),
            cudaSuccess);
  ASSERT_EQ(
      cudaMemcpyAsync(device, pinned, bytes, cudaMemcpyHostToDevice, producer),
      cudaSuccess);
  ASSERT_EQ(cudaEventRecord(ready, producer), cudaSuccess);
  ASSERT_THAT(backend->AccumulateDeviceData(
                  WithData(chunk->view(0, Role::kQ), device, bytes), ready),
              IsOk());
  auto snapshot = backend->Snapshot();
  ASSERT_THAT(snapshot, IsOk());
  Reference ref(g);
  ref.Add(*chunk, 0, Role::kQ);
  ExpectMatchesReference(ref, *snapshot);
  (void)cudaStreamSynchronize(producer);
  (void)cudaEventDestroy(ready);
  (void)cudaStreamDestroy(producer);
  (void)cudaFree(device);
  (void)cudaFreeHost(pinned);
}

// ---------------------------------------------------------------------------
// Device selection
// ---------------------------------------------------------------------------

// Whether device `ordinal`'s primary context is active (created), asked of
// the driver without creating it; nullopt when the driver cannot say.
std::optional<bool> PrimaryContextActive(int ordinal) {
  void* symbol = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion("cuDevicePrimaryCtxGetState", &symbol,
                                       12000, cudaEnableDefault,
                                       &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    return std::nullopt;
  }
  unsigned int flags = 0;
  int active = 0;
  if (reinterpret_cast<PFN_cuDevicePrimaryCtxGetState_v7000>(symbol)(
          static_cast<CUdevice>(ordinal), &flags, &active) != CUDA_SUCCESS) {
    return std::nullopt;
  }
  return active != 0;
}

// --device 1 on fresh threads (as gRPC's are) works and never creates a
// context on device 0. Needs two GPUs, and device 0 untouched by this
// process so far (run this test alone: --gtest_filter=*NotDeviceZero*).
TEST_F(CudaBackendTest, DeviceOneOnFreshThreadsNeverTouchesDeviceZero) {
  if (CudaDeviceCount() < 2) {
    GTEST_SKIP() << "needs two CUDA devices (" << CudaDeviceCount()
                 << " present)";
  }
  const std::optional<bool> before = PrimaryContextActive(0);
  if (!before.has_value() || *before) {
    GTEST_SKIP() << "device 0 already has a context in this process (or the "
                    "driver cannot say); run this test alone";
  }
  Rng rng(106);
  const Geometry g = TestGeometry();
  std::unique_ptr<CudaStatisticsBackend> backend;
  std::thread([&] {
    BackendOptions options;
    options.device = 1;
    backend = Make(g, options);
  }).join();
  ASSERT_NE(backend, nullptr);
  auto chunk = NormalChunk(rng, {200, 4, 64}, 5);
  std::thread([&] {
    EXPECT_THAT(backend->Accumulate(chunk->view(1, Role::kQ)), IsOk());
  }).join();
  absl::StatusOr<SessionStatistics> snapshot;
  std::thread([&] { snapshot = backend->Snapshot(); }).join();
  ASSERT_THAT(snapshot, IsOk());
  Reference ref(g);
  ref.Add(*chunk, 1, Role::kQ);
  ExpectMatchesReference(ref, *snapshot);
  std::thread([&] { backend.reset(); }).join();
  EXPECT_EQ(PrimaryContextActive(0), std::optional<bool>(false))
      << "a context was created on device 0";

  // Device data of device 0 is refused by a device-1 backend.
  // (Creating device-0 memory here is fine: the check above is done.)
  backend = Make(g, BackendOptions{.device = 1});
  ASSERT_NE(backend, nullptr);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  DeviceCopy on_zero(*chunk);
  EXPECT_THAT(backend->AccumulateDeviceData(
                  WithData(chunk->view(1, Role::kQ), on_zero.get(),
                           chunk->data().size()),
                  nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("memory of CUDA device 0")));
  int current = -1;
  ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
  EXPECT_EQ(current, 0) << "a thread that had device 0 gets it back";
}

}  // namespace
}  // namespace kvcal
