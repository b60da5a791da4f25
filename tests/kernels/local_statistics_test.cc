// kernels/local_statistics.h: the engine as a producer runs it. Its state
// must be the backend's for the same chunks (what a worker's session holds),
// and what the worker refuses it must refuse with nothing applied, counters
// included. (tests/python/test_local_statistics.py compares it with a
// worker through ExportState/ImportState and Finalize.)
#include "kernels/local_statistics.h"

#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/kernels/test_util.h"

namespace kvcal {
namespace {

using ::kvcal::testing::ChunkBuilder;
using ::kvcal::testing::ElementIndex;
using ::kvcal::testing::IsOk;
using ::kvcal::testing::Rng;
using ::kvcal::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

Geometry TestGeometry() {
  return Geometry{.num_layers = 2,
                  .num_attention_heads = 8,
                  .num_key_value_heads = 2,
                  .head_dim = 16,
                  .bins_per_octave = 64};
}

std::unique_ptr<ChunkBuilder> Chunk(Rng& rng, DType dtype, Layout layout,
                                    std::vector<uint64_t> shape,
                                    uint64_t batch) {
  auto chunk =
      std::make_unique<ChunkBuilder>(dtype, layout, std::move(shape), 0, batch);
  chunk->Fill([&](const ElementIndex&) { return rng.StudentT(2.0) * 3.0; });
  return chunk;
}

TEST(LocalStatisticsTest, StateIsTheBackendsForTheSameChunks) {
  Rng rng(7);
  auto local = LocalStatistics::Create(TestGeometry(), {});
  ASSERT_THAT(local, IsOk());
  auto backend = CreateCpuBackend(TestGeometry());
  ASSERT_THAT(backend, IsOk());
  uint64_t values = 0, bytes = 0, chunks = 0;
  for (uint64_t batch = 0; batch < 4; ++batch) {
    for (uint32_t layer = 0; layer < 2; ++layer) {
      const auto q = Chunk(rng, batch % 2 ? DType::kBf16 : DType::kF32,
                           Layout::kTokensHeadsDim, {9 + batch, 8, 16}, batch);
      const auto k = Chunk(rng, DType::kF16, Layout::kHeadsTokensDim,
                           {2, 2, 5, 16}, batch);
      for (const ChunkView& view :
           {q->view(layer, Role::kQ), k->view(layer, Role::kK)}) {
        ASSERT_THAT((*local)->Accumulate(view), IsOk());
        ASSERT_THAT((*backend)->Accumulate(view), IsOk());
        ++chunks;
        bytes += view.byte_size();
      }
      values += q->elements() + k->elements();
    }
  }
  auto mine = (*local)->Snapshot();
  auto theirs = (*backend)->Snapshot();
  ASSERT_THAT(mine, IsOk());
  ASSERT_THAT(theirs, IsOk());
  EXPECT_TRUE(*mine == *theirs);
  EXPECT_EQ(mine->head(1, Role::kQ, 3).batches.size(), 4u);
  auto serialized = (*local)->SerializedStatistics();
  ASSERT_THAT(serialized, IsOk());
  EXPECT_EQ(*serialized, theirs->Serialize());
  const LocalCounters counters = (*local)->counters();
  EXPECT_EQ(counters.chunks_applied, chunks);
  EXPECT_EQ(counters.values_ingested, values);
  EXPECT_EQ(counters.bytes_ingested, bytes);

  ASSERT_THAT((*local)->Reset(), IsOk());
  EXPECT_EQ((*local)->counters().values_ingested, 0u);
  EXPECT_EQ((*local)->Snapshot()->finite_values(), 0u);
}

TEST(LocalStatisticsTest, RefusedChunksChangeNothing) {
  Rng rng(11);
  LocalStatisticsOptions options;
  options.reject_non_finite = true;
  auto local = LocalStatistics::Create(TestGeometry(), options);
  ASSERT_THAT(local, IsOk());
  const auto good =
      Chunk(rng, DType::kBf16, Layout::kTokensHeadsDim, {4, 2, 16}, 3);
  ASSERT_THAT((*local)->Accumulate(good->view(0, Role::kK)), IsOk());
  const std::string before = *(*local)->SerializedStatistics();
  const LocalCounters counters = (*local)->counters();

  auto nan = Chunk(rng, DType::kBf16, Layout::kTokensHeadsDim, {4, 2, 16}, 3);
  nan->SetRaw(17, 0x7fc0u);  // head 1
  EXPECT_THAT((*local)->Accumulate(nan->view(1, Role::kV)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("layer 1 V, batch 3"),
                             HasSubstr("1 non-finite values"),
                             HasSubstr("head 1 (1 NaN, 0 Inf)"),
                             HasSubstr("rejects non-finite values"))));
  const auto wide =
      Chunk(rng, DType::kF32, Layout::kTokensHeadsDim, {4, 2, 8}, 0);
  EXPECT_THAT((*local)->Accumulate(wide->view(0, Role::kK)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("layer 0 K, batch 0"),
                             HasSubstr("head_dim is 16"))));
  EXPECT_THAT((*local)->Accumulate(good->view(2, Role::kK)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("layer 2 is out of range")));
  // No device data on the CPU backend.
  EXPECT_FALSE((*local)->accepts_device_data());
  EXPECT_THAT((*local)->AccumulateDeviceData(good->view(0, Role::kK), nullptr),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("on the cpu backend")));

  EXPECT_EQ(*(*local)->SerializedStatistics(), before);
  EXPECT_EQ((*local)->counters().chunks_applied, counters.chunks_applied);
  EXPECT_EQ((*local)->counters().values_ingested, counters.values_ingested);
}

TEST(LocalStatisticsTest, CountsNonFiniteWithoutTheRule) {
  Rng rng(3);
  auto local = LocalStatistics::Create(TestGeometry(), {});
  ASSERT_THAT(local, IsOk());
  auto chunk = Chunk(rng, DType::kF32, Layout::kTokensHeadsDim, {4, 2, 16}, 0);
  chunk->SetRaw(0, 0x7f800000u);  // +Inf, head 0
  ASSERT_THAT((*local)->Accumulate(chunk->view(0, Role::kK)), IsOk());
  EXPECT_EQ((*local)->Snapshot()->head(0, Role::kK, 0).inf_count, 1u);
}

TEST(LocalStatisticsTest, InvalidGeometryIsRefused) {
  Geometry g = TestGeometry();
  g.bins_per_octave = 3;
  EXPECT_THAT(LocalStatistics::Create(g, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("3")));
}

}  // namespace
}  // namespace kvcal
