// HoldoutStore: budget, merge by (producer, sequence), and the reassembly of
// held-out chunks split by heads into whole sequences for evaluation.
#include "service/holdout_store.h"

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/fp8_attention.h"

namespace kvcal::service {
namespace {

using ::testing::HasSubstr;

constexpr uint32_t kHeads = 4, kKv = 2, kDim = 8, kTokens = 6, kSeqs = 2;

Geometry TestGeometry() {
  return Geometry{.num_layers = 1,
                  .num_attention_heads = kHeads,
                  .num_key_value_heads = kKv,
                  .head_dim = kDim,
                  .bins_per_octave = 0};
}

// [kSeqs, heads, kTokens, kDim] float32, seeded.
std::vector<float> Tensor(uint32_t heads, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(size_t{kSeqs} * heads * kTokens * kDim);
  for (float& v : x) v = dist(rng);
  return x;
}

// Heads [h0, h0 + n) of a [kSeqs, heads, kTokens, kDim] tensor, sequence s.
HoldoutChunk Piece(const std::vector<float>& x, Role role, uint32_t heads,
                   uint32_t s, uint32_t h0, uint32_t n, uint64_t sequence) {
  HoldoutChunk c;
  c.producer_id = "p";
  c.sequence = sequence;
  c.role = role;
  c.layout = Layout::kHeadsTokensDim;
  c.shape = {1, n, kTokens, kDim};
  c.head_offset = h0;
  const size_t per_head = size_t{kTokens} * kDim;
  const float* begin = x.data() + (size_t{s} * heads + h0) * per_head;
  c.data.assign(reinterpret_cast<const char*>(begin),
                n * per_head * sizeof(float));
  return c;
}

HoldoutChunk Whole(const std::vector<float>& x, Role role, uint32_t heads,
                   uint64_t sequence) {
  HoldoutChunk c;
  c.producer_id = "p";
  c.sequence = sequence;
  c.role = role;
  c.layout = Layout::kHeadsTokensDim;
  c.shape = {kSeqs, heads, kTokens, kDim};
  c.data.assign(reinterpret_cast<const char*>(x.data()), x.size() * 4);
  return c;
}

LayerScales Scales(float q, float k, float v) {
  LayerScales s;
  const float values[3] = {q, k, v};
  for (int r = 0; r < 3; ++r) {
    s.roles[r].emplace();
    s.roles[r]->scale = {values[r]};
  }
  return s;
}

// The reference: AccumulateFp8AttentionError on the tensors directly.
double Expected(const std::vector<float>& q, const std::vector<float>& k,
                const std::vector<float>& v, float qs, float ks, float vs) {
  Fp8AttentionErrorSums sums(kHeads, kKv);
  for (uint32_t s = 0; s < kSeqs; ++s) {
    // [heads, tokens, dim] -> [tokens, heads, dim]
    auto layout = [&](const std::vector<float>& x, uint32_t heads) {
      std::vector<float> out(size_t{kTokens} * heads * kDim);
      for (uint32_t h = 0; h < heads; ++h)
        for (uint32_t t = 0; t < kTokens; ++t)
          for (uint32_t i = 0; i < kDim; ++i)
            out[(size_t{t} * heads + h) * kDim + i] =
                x[((size_t{s} * heads + h) * kTokens + t) * kDim + i];
      return out;
    };
    const std::vector<float> qt = layout(q, kHeads), kt = layout(k, kKv),
                             vt = layout(v, kKv);
    EXPECT_TRUE(AccumulateFp8AttentionError(
                    {kTokens, kHeads, kKv, kDim, qt, kt, vt},
                    {std::vector<float>(kHeads, qs),
                     std::vector<float>(kKv, ks), std::vector<float>(kKv, vs)},
                    {}, &sums)
                    .ok());
  }
  return sums.RelativeError();
}

TEST(HoldoutStoreTest, ChunksSplitByHeadsReassembleIntoTheSameSequences) {
  const std::vector<float> q = Tensor(kHeads, 1), k = Tensor(kKv, 2),
                           v = Tensor(kKv, 3);
  const double want = Expected(q, k, v, 0.01f, 0.01f, 0.01f);
  ASSERT_GT(want, 0.0);

  HoldoutStore whole;
  ASSERT_TRUE(whole.Add(Whole(q, Role::kQ, kHeads, 1)).ok());
  ASSERT_TRUE(whole.Add(Whole(k, Role::kK, kKv, 2)).ok());
  ASSERT_TRUE(whole.Add(Whole(v, Role::kV, kKv, 3)).ok());
  auto a = whole.EvaluateLayer(TestGeometry(), Scales(0.01f, 0.01f, 0.01f), {});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_DOUBLE_EQ(a->error, want);
  EXPECT_EQ(a->sequences, kSeqs);

  // Q in head ranges {0,1}, {2}, {3} per sequence; K, V per head.
  HoldoutStore split;
  uint64_t seq = 1;
  for (uint32_t s = 0; s < kSeqs; ++s) {
    ASSERT_TRUE(split.Add(Piece(q, Role::kQ, kHeads, s, 0, 2, seq++)).ok());
    ASSERT_TRUE(split.Add(Piece(q, Role::kQ, kHeads, s, 2, 1, seq++)).ok());
    ASSERT_TRUE(split.Add(Piece(q, Role::kQ, kHeads, s, 3, 1, seq++)).ok());
    for (uint32_t h = 0; h < kKv; ++h) {
      ASSERT_TRUE(split.Add(Piece(k, Role::kK, kKv, s, h, 1, seq++)).ok());
      ASSERT_TRUE(split.Add(Piece(v, Role::kV, kKv, s, h, 1, seq++)).ok());
    }
  }
  auto b = split.EvaluateLayer(TestGeometry(), Scales(0.01f, 0.01f, 0.01f), {});
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_DOUBLE_EQ(b->error, want);
  EXPECT_EQ(b->head_error, a->head_error);
}

TEST(HoldoutStoreTest, IncompleteOrMismatchedSequencesAreFailedPrecondition) {
  const std::vector<float> q = Tensor(kHeads, 1), k = Tensor(kKv, 2),
                           v = Tensor(kKv, 3);
  HoldoutStore store;
  ASSERT_TRUE(store.Add(Piece(q, Role::kQ, kHeads, 0, 0, 2, 1)).ok());
  ASSERT_TRUE(store.Add(Whole(k, Role::kK, kKv, 2)).ok());
  ASSERT_TRUE(store.Add(Whole(v, Role::kV, kKv, 3)).ok());
  auto r = store.EvaluateLayer(TestGeometry(), Scales(1, 1, 1), {});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("has no chunk for head 2"));

  ASSERT_TRUE(store.Add(Piece(q, Role::kQ, kHeads, 0, 2, 2, 4)).ok());
  r = store.EvaluateLayer(TestGeometry(), Scales(1, 1, 1), {});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(),
              HasSubstr("Q has 1 sequences, K 2 (or their token counts "
                        "differ)"));

  HoldoutStore empty;
  EXPECT_THAT(empty.EvaluateLayer(TestGeometry(), Scales(1, 1, 1), {})
                  .status()
                  .message(),
              HasSubstr("layer 0 has no held-out batches"));
}

TEST(HoldoutStoreTest, BudgetIsEnforcedAndMergeIsByProducerAndSequence) {
  const std::vector<float> k = Tensor(kKv, 2);
  const HoldoutChunk c = Whole(k, Role::kK, kKv, 1);  // 768 bytes
  HoldoutStore store(1000);
  ASSERT_TRUE(store.Add(c).ok());
  const absl::Status over = store.Add(Whole(k, Role::kK, kKv, 2));
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(over.message(), HasSubstr("held-out budget of 1000 bytes"));
  EXPECT_EQ(store.chunks(), 1u);
  EXPECT_EQ(store.bytes(), c.data.size());

  // The same (producer, sequence) again: nothing to add, within budget.
  ASSERT_TRUE(store.Merge({c}).ok());
  EXPECT_EQ(store.chunks(), 1u);
  HoldoutChunk other = c;
  other.producer_id = "q";
  EXPECT_EQ(store.Merge({other}).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(store.chunks(), 1u);
  EXPECT_EQ(HoldoutStore(0).budget_bytes(), kDefaultHoldoutBudgetBytes);
}

}  // namespace
}  // namespace kvcal::service
