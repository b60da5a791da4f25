// kernels/nonfinite.h: what a session created with reject_non_finite checks
// each chunk with. Its per-head NaN and Inf counts must be the engine's (the
// CPU backend's HeadStatistics) for every dtype, layout, head offset and
// special bit pattern, whether the chunk is one range or receive-buffer
// pieces that split values.
#include "kernels/nonfinite.h"

#include <cstring>
#include <memory>
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
using ::testing::HasSubstr;

// Bit patterns per dtype: NaN (quiet, signalling, negative), +Inf, -Inf, and
// the finite values next to them (largest magnitude, smallest subnormal).
std::vector<uint32_t> Specials(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return {0x7fc00000u, 0x7f800001u, 0xffc00000u, 0x7f800000u, 0xff800000u,
              0x7f7fffffu, 0xff7fffffu, 0x00000001u};
    case DType::kF16:
      return {0x7e00u, 0x7c01u, 0xfe00u, 0x7c00u, 0xfc00u, 0x7bffu, 0xfbffu,
              0x0001u};
    case DType::kBf16:
      return {0x7fc0u, 0x7f81u, 0xffc0u, 0x7f80u, 0xff80u, 0x7f7fu, 0xff7fu,
              0x0001u};
  }
  return {};
}

Geometry TestGeometry() {
  return Geometry{.num_layers = 2,
                  .num_attention_heads = 8,
                  .num_key_value_heads = 4,
                  .head_dim = 16,
                  .bins_per_octave = 0};
}

// Every element's head from the builder, special values sprinkled in.
std::unique_ptr<ChunkBuilder> MixedChunk(Rng& rng, DType dtype, Layout layout,
                                         std::vector<uint64_t> shape,
                                         uint32_t head_offset) {
  auto chunk = std::make_unique<ChunkBuilder>(dtype, layout, std::move(shape),
                                              head_offset, 0);
  chunk->Fill([&](const ElementIndex&) { return rng.Normal(); });
  const std::vector<uint32_t> specials = Specials(dtype);
  for (uint64_t i = 0; i < chunk->elements(); ++i) {
    if (rng.UniformInt(0, 9) == 0) {
      chunk->SetRaw(i, specials[rng.UniformInt(0, specials.size() - 1)]);
    }
  }
  return chunk;
}

// The engine's counts for the chunk's heads: a fresh CPU backend fed the
// chunk.
std::vector<NonFiniteCount> EngineCounts(const Geometry& g,
                                         const ChunkView& chunk) {
  auto backend = CreateCpuBackend(g);
  EXPECT_THAT(backend, IsOk());
  EXPECT_THAT((*backend)->Accumulate(chunk), IsOk());
  auto stats = (*backend)->Snapshot();
  EXPECT_THAT(stats, IsOk());
  auto extent = ValidateChunk(g, chunk);
  EXPECT_THAT(extent, IsOk());
  std::vector<NonFiniteCount> out(extent->heads);
  for (uint32_t h = 0; h < extent->heads; ++h) {
    const HeadStatistics& s =
        stats->head(chunk.layer, chunk.role, chunk.head_offset + h);
    out[h] = {s.nan_count, s.inf_count};
  }
  return out;
}

void ExpectSameCounts(const std::vector<NonFiniteCount>& want,
                      const ChunkNonFinite& got) {
  ASSERT_EQ(got.heads.size(), want.size());
  for (size_t h = 0; h < want.size(); ++h) {
    EXPECT_EQ(got.heads[h].nan, want[h].nan) << "head " << h;
    EXPECT_EQ(got.heads[h].inf, want[h].inf) << "head " << h;
  }
}

TEST(NonFiniteTest, CountsWhatTheEngineCounts) {
  Rng rng(7);
  const Geometry g = TestGeometry();
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBf16}) {
    for (Layout layout : {Layout::kTokensHeadsDim, Layout::kHeadsTokensDim}) {
      SCOPED_TRACE(::testing::PrintToString(static_cast<int>(dtype)) + "/" +
                   ::testing::PrintToString(static_cast<int>(layout)));
      // K heads 1..3 of 4; the KV-head chunk of heads_tokens_dim is
      // [batch, heads, tokens, head_dim].
      const std::vector<uint64_t> shape =
          layout == Layout::kTokensHeadsDim
              ? std::vector<uint64_t>{37, 3, 16}
              : std::vector<uint64_t>{2, 3, 19, 16};
      auto chunk = MixedChunk(rng, dtype, layout, shape, 1);
      const ChunkView view = chunk->view(1, Role::kK);
      auto extent = ValidateChunk(g, view);
      ASSERT_THAT(extent, IsOk());
      const ChunkNonFinite found = CountNonFinite(view, *extent);
      EXPECT_GT(found.total(), 0u);
      ExpectSameCounts(EngineCounts(g, view), found);
    }
  }
}

TEST(NonFiniteTest, OneInfAmongBf16Values) {
  const Geometry g = TestGeometry();
  ChunkBuilder chunk(DType::kBf16, Layout::kTokensHeadsDim, {64, 8, 16});
  chunk.Fill([](const ElementIndex& at) { return 0.25f * (1 + at.head); });
  // Token 50, head 6, dim 3.
  chunk.SetRaw((50 * 8 + 6) * 16 + 3, 0x7f80u);
  const ChunkView view = chunk.view(0, Role::kQ);
  auto extent = ValidateChunk(g, view);
  ASSERT_THAT(extent, IsOk());
  const ChunkNonFinite found = CountNonFinite(view, *extent);
  EXPECT_EQ(found.total(), 1u);
  EXPECT_EQ(found.heads[6].inf, 1u);
  EXPECT_EQ(found.heads[6].nan, 0u);
  EXPECT_EQ(DescribeNonFinite(view, found),
            "1 non-finite values (0 NaN, 1 Inf) in layer 0 Q: head 6 (0 NaN, "
            "1 Inf)");
  // The largest finite bf16 is not Inf.
  chunk.SetRaw((50 * 8 + 6) * 16 + 3, 0x7f7fu);
  EXPECT_EQ(CountNonFinite(view, *extent).total(), 0u);
}

// Receive buffers split a message anywhere, values included; the counts do
// not change.
TEST(NonFiniteTest, PiecesThatSplitValuesCountTheSame) {
  Rng rng(8);
  const Geometry g = TestGeometry();
  for (DType dtype : {DType::kF32, DType::kBf16}) {
    auto chunk = MixedChunk(rng, dtype, Layout::kTokensHeadsDim, {301, 4, 16},
                            0);
    const ChunkView whole = chunk->view(1, Role::kV);
    auto extent = ValidateChunk(g, whole);
    ASSERT_THAT(extent, IsOk());
    const ChunkNonFinite want = CountNonFinite(whole, *extent);
    ChunkView split = whole;
    split.data = {};
    const absl::Span<const std::byte> bytes = chunk->data();
    for (size_t at = 0; at < bytes.size();) {
      const size_t n = std::min<size_t>(bytes.size() - at, 1 + (at % 4093));
      split.pieces.push_back(bytes.subspan(at, n));
      at += n;
    }
    ASSERT_EQ(split.byte_size(), whole.byte_size());
    const ChunkNonFinite got = CountNonFinite(split, *extent);
    ASSERT_EQ(got.heads.size(), want.heads.size());
    for (size_t h = 0; h < want.heads.size(); ++h) {
      EXPECT_EQ(got.heads[h].nan, want.heads[h].nan);
      EXPECT_EQ(got.heads[h].inf, want.heads[h].inf);
    }
    ExpectSameCounts(EngineCounts(g, whole), got);
  }
}

// The scan goes block by block; a NaN in the very last element of a chunk
// of several blocks is found, and a clean chunk counts nothing.
TEST(NonFiniteTest, FindsTheLastElementOfALargeChunk) {
  const Geometry g = TestGeometry();
  ChunkBuilder chunk(DType::kF32, Layout::kTokensHeadsDim, {4099, 8, 16});
  chunk.Fill([](const ElementIndex& at) { return -1.0f * at.head; });
  const ChunkView view = chunk.view(1, Role::kQ);
  auto extent = ValidateChunk(g, view);
  ASSERT_THAT(extent, IsOk());
  EXPECT_EQ(CountNonFinite(view, *extent).total(), 0u);
  chunk.SetRaw(chunk.elements() - 1, 0xffc00000u);
  const ChunkNonFinite found = CountNonFinite(view, *extent);
  EXPECT_EQ(found.total(), 1u);
  EXPECT_EQ(found.heads[7].nan, 1u);
}

TEST(NonFiniteTest, DescriptionNamesLayerHeadsWithTheirOffset) {
  const Geometry g = TestGeometry();
  ChunkBuilder chunk(DType::kF16, Layout::kTokensHeadsDim, {5, 6, 16}, 2);
  chunk.Fill([](const ElementIndex&) { return 1.0f; });
  for (uint64_t i = 0; i < chunk.elements(); ++i) chunk.SetRaw(i, 0x7e00u);
  const ChunkView view = chunk.view(1, Role::kQ);
  auto extent = ValidateChunk(g, view);
  ASSERT_THAT(extent, IsOk());
  const ChunkNonFinite found = CountNonFinite(view, *extent);
  EXPECT_EQ(found.total(), 5u * 6 * 16);
  const std::string text = DescribeNonFinite(view, found, 2);
  EXPECT_THAT(text, HasSubstr("480 non-finite values (480 NaN, 0 Inf) in "
                              "layer 1 Q: head 2 (80 NaN, 0 Inf), head 3 (80 "
                              "NaN, 0 Inf), and 4 more heads"));
}

}  // namespace
}  // namespace kvcal
