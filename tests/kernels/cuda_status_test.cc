// How CUDA runtime errors become absl::Status, and what handing one on does
// to the thread's last-error slot and to DeviceHealth. Host code only: runs
// in CI without a GPU (the runtime reports "no device" for every call there,
// which is an error like any other for these tests).
#include "kernels/cuda/cuda_status.h"

#include <cuda_runtime_api.h>

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/device_health.h"
#include "tests/kernels/test_util.h"

namespace kvcal::cuda {
namespace {

using ::kvcal::testing::IsOk;
using ::kvcal::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

class CudaStatusTest : public ::testing::Test {
 protected:
  // Without a driver or device the runtime's initialization failure is
  // permanent in the process: no call can clear it, so clearing can only be
  // observed where a device is present (the GPU check runs this binary too).
  static bool RuntimeUsable() {
    int count = 0;
    const bool usable = cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
    (void)cudaGetLastError();
    return usable;
  }

  void SetUp() override {
    (void)cudaGetLastError();
    ResetDeviceHealthForTesting();
  }
  void TearDown() override { ResetDeviceHealthForTesting(); }
};

TEST_F(CudaStatusTest, CodesSayWhatTheErrorMeans) {
  EXPECT_THAT(CudaStatus(cudaSuccess, "x", "f", 1), IsOk());
  EXPECT_THAT(
      CudaStatus(cudaErrorMemoryAllocation, "cudaMalloc(&p, n)", "file.cc", 7),
      StatusIs(absl::StatusCode::kResourceExhausted,
               AllOf(HasSubstr("cudaErrorMemoryAllocation"),
                     HasSubstr("cudaMalloc(&p, n)"), HasSubstr("file.cc:7"))));
  for (cudaError_t error :
       {cudaErrorNoDevice, cudaErrorInsufficientDriver, cudaErrorInvalidDevice,
        cudaErrorDevicesUnavailable, cudaErrorSystemNotReady}) {
    EXPECT_THAT(CudaStatus(error, "call", "f", 1),
                StatusIs(absl::StatusCode::kUnavailable,
                         HasSubstr(cudaGetErrorName(error))));
  }
  for (cudaError_t error :
       {cudaErrorIllegalAddress, cudaErrorLaunchFailure,
        cudaErrorECCUncorrectable, cudaErrorMisalignedAddress,
        cudaErrorHardwareStackError, cudaErrorIllegalInstruction,
        cudaErrorLaunchTimeout, cudaErrorAssert}) {
    EXPECT_TRUE(IsStickyCudaError(error)) << cudaGetErrorName(error);
    EXPECT_THAT(CudaStatus(error, "call", "f", 1),
                StatusIs(absl::StatusCode::kUnavailable,
                         AllOf(HasSubstr(cudaGetErrorName(error)),
                               HasSubstr("until it restarts"))));
  }
  for (cudaError_t error :
       {cudaErrorInvalidValue, cudaErrorLaunchOutOfResources,
        cudaErrorInvalidResourceHandle, cudaErrorNotReady}) {
    EXPECT_FALSE(IsStickyCudaError(error)) << cudaGetErrorName(error);
  }
  EXPECT_THAT(CudaStatus(cudaErrorLaunchOutOfResources, "launch", "f", 1),
              StatusIs(absl::StatusCode::kInternal,
                       HasSubstr("cudaErrorLaunchOutOfResources")));
  // The pure mapping never reports anything.
  EXPECT_THAT(DeviceHealth(), IsOk());
}

// A failed call leaves its error in the thread's last-error slot; once it is
// handed on as a status it must not be reported again against a later,
// unrelated call (a launch checked with cudaGetLastError would fail).
TEST_F(CudaStatusTest, HandingAnErrorOnClearsTheLastError) {
  if (!RuntimeUsable()) {
    GTEST_SKIP() << "no CUDA device: the runtime's initialization error "
                    "cannot be cleared, so clearing is not observable here";
  }
  void* ptr = nullptr;
  // No device has 2^62 bytes: a real out-of-memory.
  const cudaError_t error = cudaMalloc(&ptr, size_t{1} << 62);
  ASSERT_NE(error, cudaSuccess);
  ASSERT_NE(cudaPeekAtLastError(), cudaSuccess)
      << "the runtime records a failed call as the last error";
  const absl::Status status =
      CudaCallFailed(error, "cudaMalloc", __FILE__, __LINE__);
  EXPECT_FALSE(status.ok());
  EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess);
  EXPECT_THAT(DeviceHealth(), IsOk()) << "not a sticky error";
}

TEST_F(CudaStatusTest, TheMacroReturnsTheStatusAndClears) {
  if (!RuntimeUsable()) {
    GTEST_SKIP() << "no CUDA device: the runtime's initialization error "
                    "cannot be cleared, so clearing is not observable here";
  }
  auto allocate = []() -> absl::Status {
    void* ptr = nullptr;
    KVCAL_CUDA_RETURN_IF_ERROR(cudaMalloc(&ptr, size_t{1} << 62));
    return absl::OkStatus();
  };
  const absl::Status status = allocate();
  EXPECT_FALSE(status.ok());
  EXPECT_THAT(std::string(status.message()), HasSubstr("cudaMalloc(&ptr"));
  EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess);
}

TEST_F(CudaStatusTest, StickyErrorsAreReportedAsADeviceLoss) {
  const absl::Status status = CudaCallFailed(
      cudaErrorIllegalAddress, "cudaStreamSynchronize", __FILE__, __LINE__);
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kUnavailable,
                               HasSubstr("cudaErrorIllegalAddress")));
  EXPECT_THAT(DeviceHealth(), StatusIs(absl::StatusCode::kUnavailable,
                                       HasSubstr("cudaErrorIllegalAddress")));
}

TEST_F(CudaStatusTest, OutOfMemoryIsNotADeviceLoss) {
  EXPECT_THAT(CudaCallFailed(cudaErrorMemoryAllocation, "cudaMalloc", "f", 1),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("")));
  EXPECT_THAT(DeviceHealth(), IsOk());
}

}  // namespace
}  // namespace kvcal::cuda
