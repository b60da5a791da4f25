// Same-host shared memory: the region registry's validation (unit tests on
// SharedMemoryRegistry) and chunks by reference against a real kvcal-worker
// process on loopback (same host, so its shm_open sees our objects).
#include "service/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvcal/v1/calibration.grpc.pb.h"
#include "service/calibration_service.h"
#include "tests/service/rpc_helpers.h"
#include "tests/service/worker_process.h"
#include "tests/wait_until.h"

namespace kvcal {
namespace {

namespace pb = ::kvcal::v1;
using ::kvcal::CudaIpcMemory;
using ::kvcal::service::SharedMemoryKind;
using ::kvcal::service::SharedMemoryLease;
using ::kvcal::service::SharedMemoryOptions;
using ::kvcal::service::SharedMemoryRegistration;
using ::kvcal::service::SharedMemoryRegistry;
using ::kvcal::testing::ExportStatistics;
using ::kvcal::testing::GetSession;
using ::kvcal::testing::IngestAll;
using ::kvcal::testing::StreamResult;
using ::kvcal::testing::WaitUntil;
using ::kvcal::testing::WorkerProcess;
using ::testing::HasSubstr;

MATCHER_P2(StatusIs, code, message_matcher, "") {
  return arg.code() == code &&
         ::testing::ExplainMatchResult(
             message_matcher, std::string(arg.message()), result_listener);
}

// A POSIX shared-memory object this process creates, maps read-write and
// unlinks on destruction.
class ShmObject {
 public:
  explicit ShmObject(size_t size) : size_(size) {
    name_ = absl::StrCat("/kvcal-test-", getpid(), "-", counter_++);
    const int fd = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    EXPECT_GE(fd, 0) << std::strerror(errno);
    EXPECT_EQ(ftruncate(fd, static_cast<off_t>(size)), 0);
    data_ = static_cast<std::byte*>(
        mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    EXPECT_NE(data_, MAP_FAILED);
    fd_ = fd;
  }
  ~ShmObject() {
    munmap(data_, size_);
    close(fd_);
    shm_unlink(name_.c_str());
  }
  ShmObject(const ShmObject&) = delete;
  ShmObject& operator=(const ShmObject&) = delete;

  const std::string& name() const { return name_; }
  std::byte* data() { return data_; }
  size_t size() const { return size_; }
  void Shrink(size_t size) { ASSERT_EQ(ftruncate(fd_, size), 0); }

 private:
  static inline int counter_ = 0;
  std::string name_;
  size_t size_;
  int fd_ = -1;
  std::byte* data_ = nullptr;
};

SharedMemoryRegistration System(const std::string& name, uint64_t size) {
  SharedMemoryRegistration r;
  r.kind = SharedMemoryKind::kSystem;
  r.name = name;
  r.byte_size = size;
  return r;
}

SharedMemoryOptions Options(uint64_t max_regions = 0, uint64_t max_bytes = 0,
                            bool enabled = true, std::string host_id = "") {
  SharedMemoryOptions o;
  o.max_regions_per_tenant = max_regions;
  o.max_bytes_per_tenant = max_bytes;
  o.enabled = enabled;
  o.host_id = std::move(host_id);
  return o;
}

// ---------------------------------------------------------------------------
// SharedMemoryRegistry

TEST(SharedMemoryRegistryTest, RegisterAcquireAndReadTheProducersBytes) {
  ShmObject shm(4096);
  std::memset(shm.data(), 0x5a, shm.size());
  SharedMemoryRegistry registry(Options());
  auto region = registry.Register("a", System(shm.name(), 4096));
  ASSERT_TRUE(region.ok()) << region.status();
  EXPECT_GE(region->id, 1u);
  EXPECT_EQ(region->name, shm.name());
  auto lease = registry.Acquire("a", region->id, 100, 28);
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_EQ(lease->bytes().size(), 28u);
  EXPECT_EQ(lease->bytes()[0], std::byte{0x5a});
  // Zero-copy: the view is the producer's memory.
  shm.data()[100] = std::byte{0x11};
  EXPECT_EQ(lease->bytes()[0], std::byte{0x11});
  ASSERT_EQ(registry.List("a").size(), 1u);
  EXPECT_TRUE(registry.List("b").empty());
}

TEST(SharedMemoryRegistryTest, NamesAndSizesAreValidated) {
  ShmObject shm(1024);
  SharedMemoryRegistry registry(Options());
  for (const std::string& name : std::vector<std::string>{
           "", "kvcal-x", "/kvcal", "/other", "/kvcal/../x", "/kvcal x",
           "/kvcal" + std::string(201, 'a')}) {
    EXPECT_THAT(registry.Register("a", System(name, 16)).status(),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("is not \"/kvcal\" followed by")))
        << name;
  }
  EXPECT_THAT(registry.Register("a", System(shm.name(), 0)).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("byte_size is 0")));
  EXPECT_THAT(registry.Register("a", System(shm.name(), 1025)).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("is 1024 bytes, smaller than the byte_size "
                                 "1025")));
  EXPECT_EQ(registry.size(), 0u);
}

TEST(SharedMemoryRegistryTest, NamesItCannotOpenMeanAnotherHost) {
  SharedMemoryRegistry registry(Options(0, 0, true, "host-a"));
  const std::string missing = absl::StrCat("/kvcal-missing-", getpid());
  EXPECT_THAT(
      registry.Register("a", System(missing, 16)).status(),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               HasSubstr(absl::StrCat("shared memory '", missing, "'"))));
  EXPECT_THAT(registry.Register("a", System(missing, 16)).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr(service::kNotOnProducerHost)));
  ShmObject shm(64);
  SharedMemoryRegistration other = System(shm.name(), 64);
  other.host_id = "host-b";
  EXPECT_THAT(registry.Register("a", other).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr(service::kNotOnProducerHost)));
  other.host_id = "host-a";
  EXPECT_TRUE(registry.Register("a", other).ok());
}

TEST(SharedMemoryRegistryTest, DisabledIsFailedPrecondition) {
  ShmObject shm(64);
  SharedMemoryRegistry disabled(Options(0, 0, /*enabled=*/false));
  EXPECT_THAT(disabled.Register("a", System(shm.name(), 64)).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("--shared-memory=false")));
  EXPECT_EQ(disabled.size(), 0u);
}

// Host memory standing in for an opened CUDA IPC allocation (no GPU here):
// what the registry and the service do with a device region is checked
// without one.
class FakeCudaIpcMemory final : public CudaIpcMemory {
 public:
  FakeCudaIpcMemory(uint64_t size, int device)
      : bytes_(size, std::byte{0}), device_(device) {}
  const std::byte* data() const override { return bytes_.data(); }
  uint64_t byte_size() const override { return bytes_.size(); }
  int device() const override { return device_; }

 private:
  std::vector<std::byte> bytes_;
  int device_;
};

SharedMemoryOptions WithFakeCudaIpc(int* opened) {
  SharedMemoryOptions o = Options();
  o.open_cuda_ipc = [opened](absl::string_view, int device, uint64_t size)
      -> absl::StatusOr<std::unique_ptr<CudaIpcMemory>> {
    ++*opened;
    return std::make_unique<FakeCudaIpcMemory>(size, device);
  };
  return o;
}

SharedMemoryRegistration CudaIpc(size_t handle_bytes, uint64_t size,
                                 uint32_t device = 0) {
  SharedMemoryRegistration r;
  r.kind = SharedMemoryKind::kCudaIpc;
  r.cuda_ipc_handle = std::string(handle_bytes, '\1');
  r.device = device;
  r.byte_size = size;
  return r;
}

TEST(SharedMemoryRegistryTest, CudaIpcNeedsTheCudaBackend) {
  SharedMemoryRegistry registry(Options());
  EXPECT_THAT(registry.Register("a", CudaIpc(64, 4096)).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("CUDA IPC shared memory needs the CUDA "
                                 "backend")));
  EXPECT_EQ(registry.size(), 0u);
}

TEST(SharedMemoryRegistryTest, CudaIpcRequestsAreValidatedBeforeOpening) {
  int opened = 0;
  SharedMemoryRegistry registry(WithFakeCudaIpc(&opened));
  EXPECT_THAT(registry.Register("a", CudaIpc(63, 4096)).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("CUDA IPC handle is 63 bytes; a "
                                 "cudaIpcMemHandle_t is 64")));
  EXPECT_THAT(registry.Register("a", CudaIpc(64, 0)).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("byte_size is 0")));
  EXPECT_THAT(registry.Register("a", CudaIpc(64, 16, 5000)).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("CUDA device 5000 is not a device ordinal")));
  EXPECT_EQ(opened, 0);
  auto region = registry.Register("a", CudaIpc(64, 4096, 1));
  ASSERT_TRUE(region.ok()) << region.status();
  EXPECT_EQ(opened, 1);
  EXPECT_EQ(region->kind, SharedMemoryKind::kCudaIpc);
  EXPECT_EQ(region->device, 1u);
  // References into it are checked like any region and hold device memory.
  auto lease = registry.Acquire("a", region->id, 4000, 96);
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_TRUE(lease->device());
  EXPECT_EQ(lease->bytes().size(), 96u);
  EXPECT_THAT(registry.Acquire("a", region->id, 4000, 97).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("is outside shared memory region")));
  EXPECT_THAT(registry.Acquire("b", region->id, 0, 8).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("not found")));
  EXPECT_THAT(registry.Acquire("a", region->id, 3990, 20).status(),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("overlaps")));
}

TEST(SharedMemoryRegistryTest, PerTenantLimits) {
  ShmObject shm(1 << 16);
  SharedMemoryRegistry count(Options(/*max_regions=*/2));
  ASSERT_TRUE(count.Register("a", System(shm.name(), 16)).ok());
  ASSERT_TRUE(count.Register("a", System(shm.name(), 16)).ok());
  EXPECT_THAT(count.Register("a", System(shm.name(), 16)).status(),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("tenant 'a' already has 2")));
  EXPECT_TRUE(count.Register("b", System(shm.name(), 16)).ok())
      << "limits are per tenant";

  SharedMemoryRegistry bytes(Options(0, /*max_bytes=*/1000));
  ASSERT_TRUE(bytes.Register("a", System(shm.name(), 600)).ok());
  EXPECT_THAT(bytes.Register("a", System(shm.name(), 401)).status(),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("may have at most 1000")));
  EXPECT_THAT(bytes.Register("a", System(shm.name(), 1 << 15)).status(),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("has 600 bytes registered")));
  EXPECT_TRUE(bytes.Register("a", System(shm.name(), 400)).ok());
}

TEST(SharedMemoryRegistryTest, ReferencesAreCheckedWithoutOverflow) {
  ShmObject shm(4096);
  SharedMemoryRegistry registry(Options());
  const uint64_t id = registry.Register("a", System(shm.name(), 4000))->id;
  for (auto [offset, size] :
       std::vector<std::pair<uint64_t, uint64_t>>{{0, 4001},
                                                  {4000, 1},
                                                  {4001, 0},
                                                  {3999, 2},
                                                  {1, UINT64_MAX},
                                                  {UINT64_MAX, 2},
                                                  {UINT64_MAX, UINT64_MAX}}) {
    EXPECT_THAT(registry.Acquire("a", id, offset, size).status(),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr(absl::StrCat("[", offset, ", ", offset,
                                                " + ", size, ") is outside"))))
        << offset << " " << size;
  }
  EXPECT_TRUE(registry.Acquire("a", id, 0, 4000).ok());
  EXPECT_TRUE(registry.Acquire("a", id, 4000, 0).ok());
}

TEST(SharedMemoryRegistryTest, AnotherTenantsRegionDoesNotExist) {
  ShmObject shm(64);
  SharedMemoryRegistry registry(Options());
  const uint64_t id = registry.Register("a", System(shm.name(), 64))->id;
  EXPECT_THAT(registry.Acquire("b", id, 0, 8).status(),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr(absl::StrCat("region ", id, " not found"))));
  EXPECT_THAT(registry.Acquire("a", id + 1, 0, 8).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("not found")));
  EXPECT_THAT(registry.Unregister("b", id),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("not found")));
  EXPECT_TRUE(registry.Acquire("a", id, 0, 8).ok()) << "b changed nothing";
}

TEST(SharedMemoryRegistryTest, OverlapWithARangeInUseIsRefused) {
  ShmObject shm(4096);
  SharedMemoryRegistry registry(Options());
  const uint64_t id = registry.Register("a", System(shm.name(), 4096))->id;
  auto held = registry.Acquire("a", id, 1000, 1000);  // [1000, 2000)
  ASSERT_TRUE(held.ok());
  for (auto [offset, size] : std::vector<std::pair<uint64_t, uint64_t>>{
           {1000, 1000}, {500, 501}, {1999, 1}, {0, 4096}, {1500, 10}}) {
    EXPECT_THAT(registry.Acquire("a", id, offset, size).status(),
                StatusIs(absl::StatusCode::kAborted,
                         HasSubstr("overlaps [1000, 2000)")))
        << offset << " " << size;
  }
  // Adjacent ranges and empty ones are fine, and so is the range once free.
  auto before = registry.Acquire("a", id, 0, 1000);
  auto after = registry.Acquire("a", id, 2000, 1000);
  EXPECT_TRUE(before.ok());
  EXPECT_TRUE(after.ok());
  EXPECT_TRUE(registry.Acquire("a", id, 1500, 0).ok());
  *held = SharedMemoryLease();
  EXPECT_TRUE(registry.Acquire("a", id, 1500, 10).ok());
}

TEST(SharedMemoryRegistryTest, UnregisterKeepsTheMappingForLeasesInFlight) {
  ShmObject shm(4096);
  std::memset(shm.data(), 7, shm.size());
  SharedMemoryRegistry registry(Options());
  const uint64_t id = registry.Register("a", System(shm.name(), 4096))->id;
  auto lease = registry.Acquire("a", id, 0, 4096);
  ASSERT_TRUE(lease.ok());
  ASSERT_TRUE(registry.Unregister("a", id).ok());
  EXPECT_THAT(registry.Acquire("a", id, 0, 8).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("not found")));
  // Still mapped: reading every byte must not fault.
  int sum = 0;
  for (std::byte b : lease->bytes()) sum += static_cast<int>(b);
  EXPECT_EQ(sum, 7 * 4096);
  EXPECT_THAT(registry.Unregister("a", id),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("not found")));
}

TEST(SharedMemoryRegistryTest, AShrunkObjectIsRefusedInsteadOfRead) {
  ShmObject shm(8192);
  SharedMemoryRegistry registry(Options());
  const uint64_t id = registry.Register("a", System(shm.name(), 8192))->id;
  shm.Shrink(100);
  EXPECT_THAT(registry.Acquire("a", id, 0, 8).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("shrank below the 8192 bytes")));
}

// ---------------------------------------------------------------------------
// Against a real worker.

constexpr uint32_t kLayers = 2;
constexpr uint32_t kQHeads = 4;
constexpr uint32_t kKvHeads = 2;
constexpr uint32_t kHeadDim = 8;

pb::CreateSessionRequest CreateRequest(const std::string& id) {
  return kvcal::testing::CreateSessionRequest(
      id, {kLayers, kQHeads, kKvHeads, kHeadDim, 16});
}

std::vector<float> RandomValues(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

// Every (layer, role) of `batches` batches, `tokens` tokens each, in-band,
// numbered 1.. for producer "p".
std::vector<pb::IngestRequest> Workload(const std::string& session, int batches,
                                        uint64_t tokens) {
  std::vector<pb::IngestRequest> chunks;
  uint64_t seq = 1;
  for (int b = 0; b < batches; ++b) {
    for (uint32_t layer = 0; layer < kLayers; ++layer) {
      for (pb::Role role : {pb::ROLE_Q, pb::ROLE_K, pb::ROLE_V}) {
        const uint32_t heads = role == pb::ROLE_Q ? kQHeads : kKvHeads;
        pb::IngestRequest r;
        r.set_session_id(session);
        r.set_producer_id("p");
        r.set_sequence(seq);
        r.set_batch(b);
        r.set_layer(layer);
        r.set_role(role);
        r.set_dtype(pb::DTYPE_F32);
        r.set_layout(pb::LAYOUT_TOKENS_HEADS_DIM);
        r.add_shape(tokens);
        r.add_shape(heads);
        r.add_shape(kHeadDim);
        const auto values = RandomValues(tokens * heads * kHeadDim, seq);
        r.set_data(values.data(), values.size() * sizeof(float));
        chunks.push_back(std::move(r));
        ++seq;
      }
    }
  }
  return chunks;
}

// Moves each chunk's data into `shm` (one after the other from `offset`)
// and replaces it by a reference to region `region`.
std::vector<pb::IngestRequest> ByReference(
    std::vector<pb::IngestRequest> chunks, ShmObject& shm, uint64_t region,
    uint64_t offset = 0) {
  for (pb::IngestRequest& c : chunks) {
    EXPECT_LE(offset + c.data().size(), shm.size());
    std::memcpy(shm.data() + offset, c.data().data(), c.data().size());
    c.mutable_shared_memory()->set_region_id(region);
    c.mutable_shared_memory()->set_offset(offset);
    c.mutable_shared_memory()->set_byte_size(c.data().size());
    offset += c.data().size();
    c.clear_data();
  }
  return chunks;
}

grpc::Status Register(pb::Calibration::Stub* stub, const std::string& name,
                      uint64_t size, pb::SharedMemoryRegion* region,
                      const std::string& token = "") {
  grpc::ClientContext context;
  if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
  pb::RegisterSharedMemoryRequest request;
  request.set_kind(pb::SHARED_MEMORY_KIND_SYSTEM);
  request.set_name(name);
  request.set_byte_size(size);
  return stub->RegisterSharedMemory(&context, request, region);
}

grpc::Status Unregister(pb::Calibration::Stub* stub, uint64_t id,
                        const std::string& token = "") {
  grpc::ClientContext context;
  if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
  pb::UnregisterSharedMemoryRequest request;
  request.set_region_id(id);
  pb::UnregisterSharedMemoryResponse response;
  return stub->UnregisterSharedMemory(&context, request, &response);
}

class SharedMemoryWorkerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(worker_.ok()) << worker_.error();
    stub_ = pb::Calibration::NewStub(worker_.Channel());
  }
  void Create(const std::string& id) {
    grpc::ClientContext context;
    pb::Session session;
    ASSERT_TRUE(
        stub_->CreateSession(&context, CreateRequest(id), &session).ok());
  }
  pb::Session Get(const std::string& id) {
    grpc::Status status;
    pb::Session s = GetSession(stub_.get(), id, &status);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return s;
  }
  uint64_t RegisterOk(const ShmObject& shm) {
    pb::SharedMemoryRegion region;
    grpc::Status status =
        Register(stub_.get(), shm.name(), shm.size(), &region);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return region.region_id();
  }

  WorkerProcess worker_;
  std::unique_ptr<pb::Calibration::Stub> stub_;
};

TEST_F(SharedMemoryWorkerTest, ByReferenceEqualsInBandBitForBit) {
  Create("inband");
  Create("shm");
  ShmObject shm(1 << 20);
  const uint64_t region = RegisterOk(shm);
  {
    grpc::ClientContext context;
    pb::ListSharedMemoryResponse list;
    ASSERT_TRUE(stub_->ListSharedMemory(&context, {}, &list).ok());
    ASSERT_EQ(list.regions_size(), 1);
    EXPECT_EQ(list.regions(0).region_id(), region);
    EXPECT_EQ(list.regions(0).name(), shm.name());
    EXPECT_EQ(list.regions(0).byte_size(), shm.size());
  }
  const auto inband = Workload("inband", 3, 7);
  StreamResult a = IngestAll(stub_.get(), inband);
  ASSERT_TRUE(a.status.ok()) << a.status.error_message();
  auto refs = ByReference(Workload("shm", 3, 7), shm, region);
  StreamResult b = IngestAll(stub_.get(), refs);
  ASSERT_TRUE(b.status.ok()) << b.status.error_message();
  ASSERT_EQ(b.responses.size(), refs.size());
  for (size_t i = 0; i < refs.size(); ++i) {
    EXPECT_TRUE(b.responses[i].applied());
    EXPECT_EQ(b.responses[i].watermark(), i + 1);
  }
  EXPECT_EQ(ExportStatistics(stub_.get(), "shm"),
            ExportStatistics(stub_.get(), "inband"));
  const pb::Session s = Get("shm");
  EXPECT_EQ(s.bytes_ingested(), Get("inband").bytes_ingested());
  EXPECT_EQ(s.chunks_applied(), refs.size());

  // A duplicate by reference is a duplicate, as in-band.
  StreamResult again = IngestAll(stub_.get(), {refs[0], refs[1]});
  ASSERT_TRUE(again.status.ok()) << again.status.error_message();
  ASSERT_EQ(again.responses.size(), 2u);
  EXPECT_FALSE(again.responses[0].applied());
  EXPECT_EQ(again.responses[0].watermark(), refs.size());
  EXPECT_EQ(ExportStatistics(stub_.get(), "shm"),
            ExportStatistics(stub_.get(), "inband"));
}

TEST_F(SharedMemoryWorkerTest, ConcurrentStreamsShareOneRegion) {
  // Four producers stream at once, each from its own part of one region:
  // the same scales as the same four producers in-band.
  Create("inband");
  Create("shm");
  ShmObject shm(4 << 20);
  const uint64_t region = RegisterOk(shm);
  std::vector<std::vector<pb::IngestRequest>> inband(4), refs(4);
  for (int p = 0; p < 4; ++p) {
    for (const std::string id : {"inband", "shm"}) {
      auto chunks = Workload(id, 2, 9 + p);
      for (pb::IngestRequest& c : chunks) {
        c.set_producer_id(absl::StrCat("p", p));
        // Different data per producer.
        std::string data = c.data();
        for (size_t i = 0; i + 4 <= data.size(); i += 4) data[i] ^= p;
        c.set_data(data);
      }
      if (id == "inband") {
        inband[p] = chunks;
      } else {
        refs[p] = ByReference(chunks, shm, region, p * (1 << 20));
      }
    }
  }
  auto run = [&](std::vector<std::vector<pb::IngestRequest>>& streams) {
    std::vector<std::thread> threads;
    std::vector<grpc::Status> status(streams.size());
    for (size_t p = 0; p < streams.size(); ++p) {
      threads.emplace_back(
          [&, p] { status[p] = IngestAll(stub_.get(), streams[p]).status; });
    }
    for (auto& t : threads) t.join();
    for (const grpc::Status& s : status) {
      EXPECT_TRUE(s.ok()) << s.error_message();
    }
  };
  run(inband);
  run(refs);
  // Concurrent streams apply in any order, and double sums depend on it:
  // compare what is order-independent (min/max, histograms, the exact tail).
  auto finalize = [&](const std::string& id, pb::Observer observer) {
    grpc::ClientContext context;
    pb::FinalizeRequest request;
    request.set_session_id(id);
    request.set_granularity(pb::GRANULARITY_PER_HEAD);
    request.set_observer(observer);
    pb::FinalizeResponse response;
    grpc::Status status = stub_->Finalize(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    response.clear_resolved();  // names the session
    return response.SerializeAsString();
  };
  for (pb::Observer observer :
       {pb::OBSERVER_STATIC_MINMAX, pb::OBSERVER_PERCENTILE}) {
    EXPECT_EQ(finalize("shm", observer), finalize("inband", observer));
  }
  const pb::Session shm_session = Get("shm");
  const pb::Session inband_session = Get("inband");
  EXPECT_EQ(shm_session.chunks_applied(), inband_session.chunks_applied());
  EXPECT_EQ(shm_session.values_ingested(), inband_session.values_ingested());
  EXPECT_EQ(shm_session.producers_size(), 4);
}

TEST_F(SharedMemoryWorkerTest,
       BadReferencesFailLikeInBandChunksAndChangeNothing) {
  Create("s");
  ShmObject shm(1 << 16);
  const uint64_t region = RegisterOk(shm);
  auto refs = ByReference(Workload("s", 1, 4), shm, region);
  ASSERT_TRUE(IngestAll(stub_.get(), {refs[0]}).status.ok());
  const std::string before = ExportStatistics(stub_.get(), "s");
  pb::IngestRequest next = refs[1];  // sequence 2

  // The in-band message for a wrong size, to compare with.
  auto inband = Workload("s", 1, 4);
  pb::IngestRequest short_inband = inband[1];
  short_inband.mutable_data()->resize(short_inband.data().size() - 4);
  StreamResult short_result = IngestAll(stub_.get(), {short_inband});
  ASSERT_EQ(short_result.status.error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);

  struct Case {
    std::string name;
    std::function<void(pb::IngestRequest&)> mutate;
    grpc::StatusCode code;
    std::string message;
  };
  const uint64_t size = next.shared_memory().byte_size();
  const std::vector<Case> cases = {
      {"both data and reference", [](auto& r) { r.set_data("abcd"); },
       grpc::StatusCode::INVALID_ARGUMENT,
       "sets both data (4 bytes) and shared_memory"},
      {"unknown region",
       [&](auto& r) { r.mutable_shared_memory()->set_region_id(region + 9); },
       grpc::StatusCode::NOT_FOUND,
       absl::StrCat("region ", region + 9, " not found")},
      {"past the end",
       [&](auto& r) { r.mutable_shared_memory()->set_offset(shm.size() - 4); },
       grpc::StatusCode::INVALID_ARGUMENT, "is outside shared memory region"},
      {"overflowing offset",
       [&](auto& r) { r.mutable_shared_memory()->set_offset(UINT64_MAX - 1); },
       grpc::StatusCode::INVALID_ARGUMENT, "is outside"},
      {"size not what the shape needs (the in-band message)",
       [&](auto& r) { r.mutable_shared_memory()->set_byte_size(size - 4); },
       grpc::StatusCode::INVALID_ARGUMENT, short_result.status.error_message()},
      {"bad shape", [](auto& r) { r.set_shape(2, kHeadDim / 2); },
       grpc::StatusCode::INVALID_ARGUMENT, "head_dim"},
  };
  for (const Case& c : cases) {
    pb::IngestRequest chunk = next;
    c.mutate(chunk);
    StreamResult result = IngestAll(stub_.get(), {chunk});
    EXPECT_EQ(result.status.error_code(), c.code) << c.name;
    EXPECT_THAT(result.status.error_message(), HasSubstr(c.message)) << c.name;
    EXPECT_THAT(result.status.error_message(),
                HasSubstr("chunk 2 from producer 'p'"))
        << c.name;
    EXPECT_TRUE(result.responses.empty()) << c.name;
  }
  EXPECT_EQ(ExportStatistics(stub_.get(), "s"), before);
  EXPECT_EQ(Get("s").producers(0).sequence(), 1u);

  // Unregistered: later references are NOT_FOUND.
  ASSERT_TRUE(Unregister(stub_.get(), region).ok());
  StreamResult gone = IngestAll(stub_.get(), {next});
  EXPECT_EQ(gone.status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(gone.status.error_message(),
              HasSubstr(absl::StrCat("region ", region, " not found")));
  EXPECT_EQ(Unregister(stub_.get(), region).error_code(),
            grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(ExportStatistics(stub_.get(), "s"), before);
}

TEST_F(SharedMemoryWorkerTest, NamesTheWorkerCannotOpenSayAnotherHost) {
  pb::SharedMemoryRegion region;
  grpc::Status status = Register(
      stub_.get(), absl::StrCat("/kvcal-nowhere-", getpid()), 64, &region);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(), HasSubstr(service::kNotOnProducerHost));
  grpc::ClientContext context;
  pb::RegisterSharedMemoryRequest bad_kind;
  bad_kind.set_name("/kvcal-x");
  bad_kind.set_byte_size(1);
  EXPECT_EQ(
      stub_->RegisterSharedMemory(&context, bad_kind, &region).error_code(),
      grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_F(SharedMemoryWorkerTest, HeldOutChunksAreCopiedBeforeTheAck) {
  Create("s");
  ShmObject shm(1 << 16);
  const uint64_t region = RegisterOk(shm);
  pb::IngestRequest chunk;
  chunk.set_session_id("s");
  chunk.set_producer_id("p");
  chunk.set_sequence(1);
  chunk.set_layer(0);
  chunk.set_role(pb::ROLE_K);
  chunk.set_dtype(pb::DTYPE_F32);
  chunk.set_layout(pb::LAYOUT_HEADS_TOKENS_DIM);
  for (uint64_t d : {1u, kKvHeads, 3u, kHeadDim}) chunk.add_shape(d);
  chunk.set_holdout(true);
  const auto values = RandomValues(kKvHeads * 3 * kHeadDim, 5);
  chunk.set_data(values.data(), values.size() * 4);
  const std::string original = chunk.data();
  auto refs = ByReference({chunk}, shm, region, 128);
  StreamResult result = IngestAll(stub_.get(), refs);
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  // The producer reuses its memory after the ack.
  std::memset(shm.data(), 0xff, shm.size());
  grpc::ClientContext context;
  pb::ExportStateRequest request;
  request.set_session_id("s");
  pb::SessionState state;
  ASSERT_TRUE(stub_->ExportState(&context, request, &state).ok());
  ASSERT_EQ(state.holdout_chunks_size(), 1);
  EXPECT_EQ(state.holdout_chunks(0).data(), original);
}

TEST_F(SharedMemoryWorkerTest, CudaIpcOnACpuWorkerIsFailedPrecondition) {
  grpc::ClientContext context;
  pb::RegisterSharedMemoryRequest request;
  request.set_kind(pb::SHARED_MEMORY_KIND_CUDA_IPC);
  request.set_cuda_ipc_handle(std::string(64, '\7'));
  request.set_byte_size(1 << 20);
  pb::SharedMemoryRegion region;
  grpc::Status status = stub_->RegisterSharedMemory(&context, request, &region);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(),
              HasSubstr("needs the CUDA backend, and this worker's sessions "
                        "use the CPU backend"));
}

// An in-process worker whose CUDA IPC opener hands out host memory: the
// service routes chunks in a device region to the CUDA backend's device
// entry point only, so a CPU session refuses them, and held-out chunks
// are refused there too, both before the sequence is looked at.
TEST(SharedMemoryCudaIpcServiceTest, DeviceChunksNeedACudaSession) {
  int opened = 0;
  service::ServiceOptions options;
  options.executor_threads = 2;
  options.shared_memory = WithFakeCudaIpc(&opened);
  service::CalibrationService service(options);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                           &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  auto stub = pb::Calibration::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  {
    grpc::ClientContext context;
    pb::Session session;
    ASSERT_TRUE(
        stub->CreateSession(&context, CreateRequest("s"), &session).ok());
    EXPECT_EQ(session.backend(), "cpu");
  }
  pb::SharedMemoryRegion region;
  {
    grpc::ClientContext context;
    pb::RegisterSharedMemoryRequest request;
    request.set_kind(pb::SHARED_MEMORY_KIND_CUDA_IPC);
    request.set_cuda_ipc_handle(std::string(64, '\7'));
    request.set_byte_size(1 << 16);
    ASSERT_TRUE(stub->RegisterSharedMemory(&context, request, &region).ok());
    EXPECT_EQ(region.kind(), pb::SHARED_MEMORY_KIND_CUDA_IPC);
    EXPECT_EQ(opened, 1);
  }
  pb::IngestRequest chunk = Workload("s", 1, 2)[0];
  const uint64_t size = chunk.data().size();
  chunk.clear_data();
  chunk.mutable_shared_memory()->set_region_id(region.region_id());
  chunk.mutable_shared_memory()->set_byte_size(size);
  StreamResult cpu = IngestAll(stub.get(), {chunk});
  EXPECT_EQ(cpu.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(cpu.status.error_message(),
              HasSubstr("chunk 1 from producer 'p': its data is in CUDA IPC "
                        "memory but session 's' keeps its statistics on the "
                        "cpu backend"));
  chunk.set_holdout(true);
  StreamResult holdout = IngestAll(stub.get(), {chunk});
  EXPECT_EQ(holdout.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(holdout.status.error_message(),
              HasSubstr("a held-out chunk cannot be in CUDA IPC memory"));
  grpc::Status status;
  EXPECT_EQ(GetSession(stub.get(), "s", &status).chunks_applied(), 0u);
  server->Shutdown();
}

TEST(SharedMemoryTenantTest, AnotherTenantsRegionIsNotFound) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("kvcal-shm-auth-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  { std::ofstream(dir / "tokens") << "team-a:alpha\nteam-b:beta\n"; }
  WorkerProcess worker({"--auth-token-file", (dir / "tokens").string()});
  ASSERT_TRUE(worker.ok()) << worker.error();
  auto stub = pb::Calibration::NewStub(worker.Channel());
  ShmObject shm(1 << 16);
  pb::SharedMemoryRegion region;
  ASSERT_TRUE(
      Register(stub.get(), shm.name(), shm.size(), &region, "alpha").ok());
  for (const std::string token : {"alpha", "beta"}) {
    grpc::ClientContext context;
    context.AddMetadata("authorization", "Bearer " + token);
    pb::Session session;
    ASSERT_TRUE(
        stub->CreateSession(&context, CreateRequest("s"), &session).ok());
  }
  auto refs = ByReference(Workload("s", 1, 2), shm, region.region_id());
  StreamResult b = IngestAll(stub.get(), {refs[0]}, "beta");
  EXPECT_EQ(b.status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(
      b.status.error_message(),
      HasSubstr(absl::StrCat("region ", region.region_id(), " not found")));
  EXPECT_EQ(Unregister(stub.get(), region.region_id(), "beta").error_code(),
            grpc::StatusCode::NOT_FOUND);
  {
    grpc::ClientContext context;
    context.AddMetadata("authorization", "Bearer beta");
    pb::ListSharedMemoryResponse list;
    ASSERT_TRUE(stub->ListSharedMemory(&context, {}, &list).ok());
    EXPECT_EQ(list.regions_size(), 0);
  }
  StreamResult a = IngestAll(stub.get(), refs, "alpha");
  EXPECT_TRUE(a.status.ok()) << a.status.error_message();
  EXPECT_EQ(a.responses.size(), refs.size());
  std::filesystem::remove_all(dir);
}

TEST(SharedMemoryDurableTest, RestartResumesByReferenceAndRestoresExactly) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("kvcal-shm-state-" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  const std::vector<std::string> args = {"--state-dir", dir.string(),
                                         "--snapshot-interval-ms", "50"};
  ShmObject shm(1 << 20);
  const auto inband = Workload("s", 2, 5);
  std::string expected;
  {
    // The reference run: everything in-band, on a worker without a state dir.
    WorkerProcess plain;
    ASSERT_TRUE(plain.ok());
    auto stub = pb::Calibration::NewStub(plain.Channel());
    grpc::ClientContext context;
    pb::Session session;
    ASSERT_TRUE(
        stub->CreateSession(&context, CreateRequest("s"), &session).ok());
    ASSERT_TRUE(IngestAll(stub.get(), inband).status.ok());
    expected = ExportStatistics(stub.get(), "s");
  }
  const size_t half = inband.size() / 2;
  {
    WorkerProcess worker(args);
    ASSERT_TRUE(worker.ok()) << worker.error();
    auto stub = pb::Calibration::NewStub(worker.Channel());
    grpc::ClientContext context;
    pb::Session session;
    ASSERT_TRUE(
        stub->CreateSession(&context, CreateRequest("s"), &session).ok());
    pb::SharedMemoryRegion region;
    ASSERT_TRUE(Register(stub.get(), shm.name(), shm.size(), &region).ok());
    auto refs = ByReference(
        std::vector<pb::IngestRequest>(inband.begin(), inband.begin() + half),
        shm, region.region_id());
    ASSERT_TRUE(IngestAll(stub.get(), refs).status.ok());
    // Durable, then killed.
    ASSERT_TRUE(WaitUntil(
        [&] {
          grpc::Status status;
          pb::Session s = GetSession(stub.get(), "s", &status);
          return status.ok() && s.producers_size() == 1 &&
                 s.producers(0).durable_sequence() == half;
        },
        std::chrono::seconds(10)))
        << "never durable";
    ASSERT_NE(worker.SignalAndWait(SIGKILL, std::chrono::seconds(10)), -1);
  }
  WorkerProcess worker(args);
  ASSERT_TRUE(worker.ok()) << worker.error();
  auto stub = pb::Calibration::NewStub(worker.Channel());
  grpc::Status status;
  pb::Session restored = GetSession(stub.get(), "s", &status);
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(restored.producers(0).sequence(), half);
  // Regions do not survive a restart: the old id is unknown, the producer
  // registers again and resends from its watermark, by reference.
  auto stale = ByReference({inband[half]}, shm, 1);
  EXPECT_EQ(IngestAll(stub.get(), stale).status.error_code(),
            grpc::StatusCode::NOT_FOUND);
  pb::SharedMemoryRegion region;
  ASSERT_TRUE(Register(stub.get(), shm.name(), shm.size(), &region).ok());
  // Resend everything: the first half is acknowledged as duplicates.
  auto refs = ByReference(inband, shm, region.region_id());
  StreamResult rest = IngestAll(stub.get(), refs);
  ASSERT_TRUE(rest.status.ok()) << rest.status.error_message();
  ASSERT_EQ(rest.responses.size(), inband.size());
  for (size_t i = 0; i < inband.size(); ++i) {
    EXPECT_EQ(rest.responses[i].applied(), i >= half) << i;
  }
  EXPECT_EQ(ExportStatistics(stub.get(), "s"), expected);
  // Stopped first: its persister writes into the directory every 50 ms, and
  // a file it creates during remove_all fails the removal.
  ASSERT_NE(worker.SignalAndWait(SIGKILL, std::chrono::seconds(10)), -1);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kvcal
