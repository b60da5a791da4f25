// ResolveBackend (the one place that decides what --backend auto means),
// CreateBackend's fallback to the CPU backend, and DeviceHealth. Runs
// without a GPU: a device loss is simulated with ReportDeviceLost.
#include <string>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/backend_factory.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/device_health.h"
#include "tests/kernels/test_util.h"

namespace kvcal {
namespace {

using ::kvcal::testing::IsOk;
using ::kvcal::testing::StatusIs;
using ::testing::HasSubstr;

Geometry SmallGeometry() {
  Geometry g;
  g.num_layers = 1;
  g.num_attention_heads = 2;
  g.num_key_value_heads = 1;
  g.head_dim = 8;
  g.bins_per_octave = 16;
  return g;
}

class BackendChoiceTest : public ::testing::Test {
 protected:
  void TearDown() override { ResetDeviceHealthForTesting(); }
};

TEST_F(BackendChoiceTest, CpuIsAlwaysCpu) {
  auto choice = ResolveBackend(BackendKind::kCpu);
  ASSERT_THAT(choice, IsOk());
  EXPECT_EQ(choice->kind, BackendKind::kCpu);
}

TEST_F(BackendChoiceTest, AutoFollowsTheDevices) {
  auto choice = ResolveBackend(BackendKind::kAuto);
  ASSERT_THAT(choice, IsOk());
  if (CudaDeviceCount() > 0) {
    EXPECT_EQ(choice->kind, BackendKind::kCuda);
    EXPECT_THAT(choice->description, HasSubstr("cuda on device 0"));
  } else {
    EXPECT_EQ(choice->kind, BackendKind::kCpu);
    EXPECT_THAT(choice->description, HasSubstr("cpu ("));
    auto backend = CreateBackend(BackendKind::kAuto, SmallGeometry());
    ASSERT_THAT(backend, IsOk());
    EXPECT_EQ((*backend)->name(), "cpu");
  }
  // A device that does not exist: auto takes the CPU, cuda refuses.
  BackendOptions options;
  options.device = 4096;
  auto missing = ResolveBackend(BackendKind::kAuto, options);
  ASSERT_THAT(missing, IsOk());
  EXPECT_EQ(missing->kind, BackendKind::kCpu);
  EXPECT_THAT(ResolveBackend(BackendKind::kCuda, options),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("--backend cuda: no CUDA device 4096")));
  auto fallback = CreateBackend(BackendKind::kAuto, SmallGeometry(), options);
  ASSERT_THAT(fallback, IsOk());
  EXPECT_EQ((*fallback)->name(), "cpu");
}

TEST_F(BackendChoiceTest, InvalidGeometryIsRejectedWhateverTheChoice) {
  Geometry bad = SmallGeometry();
  bad.head_dim = 0;
  EXPECT_THAT(
      CreateBackend(BackendKind::kAuto, bad),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("head_dim")));
}

TEST_F(BackendChoiceTest, DeviceLossSendsAutoToTheCpuAndCudaIsUnavailable) {
  EXPECT_THAT(DeviceHealth(), IsOk());
  ReportDeviceLost(absl::InternalError(
      "CUDA error cudaErrorIllegalAddress (simulated) from a kernel"));
  // The first report wins.
  ReportDeviceLost(absl::InternalError("a later error"));
  EXPECT_THAT(DeviceHealth(),
              StatusIs(absl::StatusCode::kUnavailable,
                       HasSubstr("cudaErrorIllegalAddress (simulated)")));

  auto choice = ResolveBackend(BackendKind::kAuto);
  ASSERT_THAT(choice, IsOk());
  EXPECT_EQ(choice->kind, BackendKind::kCpu);
  if (CudaBackendCompiled()) {
    EXPECT_THAT(choice->description, HasSubstr("lost"));
    EXPECT_THAT(ResolveBackend(BackendKind::kCuda),
                StatusIs(absl::StatusCode::kUnavailable, HasSubstr("restart")));
  }
  auto backend = CreateBackend(BackendKind::kAuto, SmallGeometry());
  ASSERT_THAT(backend, IsOk());
  EXPECT_EQ((*backend)->name(), "cpu");

  ResetDeviceHealthForTesting();
  EXPECT_THAT(DeviceHealth(), IsOk());
}

TEST_F(BackendChoiceTest, OkIsNotALoss) {
  ReportDeviceLost(absl::OkStatus());
  EXPECT_THAT(DeviceHealth(), IsOk());
}

}  // namespace
}  // namespace kvcal
