// The FP8 e4m3fn emulation: the cast's edge cases (the full comparison with
// PyTorch is tests/python/test_fp8_emulation.py) and the attention error.
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/fp8_attention.h"
#include "kernels/fp8_math.h"

namespace kvcal {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(Fp8E4m3fn, EveryByteRoundTrips) {
  for (int b = 0; b < 256; ++b) {
    const uint8_t bits = static_cast<uint8_t>(b);
    const float x = Fp8E4m3fnToFloat(bits);
    if ((bits & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(x)) << b;
      EXPECT_EQ(Fp8E4m3fnFromFloat(x), bits) << b;
      continue;
    }
    EXPECT_EQ(Fp8E4m3fnFromFloat(x), bits) << b << " = " << x;
  }
  EXPECT_EQ(Fp8E4m3fnToFloat(0x7e), 448.0f);
  EXPECT_EQ(Fp8E4m3fnToFloat(0x01), 0x1p-9f);
  EXPECT_EQ(Fp8E4m3fnToFloat(0x08), kFp8E4m3fnMinNormal);
}

TEST(Fp8E4m3fn, TiesRoundToEven) {
  EXPECT_EQ(Fp8E4m3fnRound(1.0625f), 1.0f);   // 1.000|1 -> 1.000
  EXPECT_EQ(Fp8E4m3fnRound(1.1875f), 1.25f);  // 1.001|1 -> 1.010
  EXPECT_EQ(Fp8E4m3fnRound(-1.1875f), -1.25f);
  EXPECT_EQ(Fp8E4m3fnRound(std::nextafter(1.0625f, 2.0f)), 1.125f);
  // Subnormals: multiples of 2^-9, ties to even.
  EXPECT_EQ(Fp8E4m3fnRound(0x1p-10f), 0.0f);
  EXPECT_EQ(Fp8E4m3fnRound(3 * 0x1p-10f), 0x1p-8f);
  EXPECT_EQ(Fp8E4m3fnRound(5 * 0x1p-10f), 0x1p-8f);
  EXPECT_EQ(Fp8E4m3fnRound(std::nextafter(0x1p-10f, 1.0f)), 0x1p-9f);
  // The boundary between subnormals and normals.
  EXPECT_EQ(Fp8E4m3fnRound(15 * 0x1p-10f), kFp8E4m3fnMinNormal);
}

TEST(Fp8E4m3fn, LargeMagnitudesSaturateNanStaysNan) {
  EXPECT_EQ(Fp8E4m3fnRound(464.0f), 448.0f);
  EXPECT_EQ(Fp8E4m3fnRound(465.0f), 448.0f);
  EXPECT_EQ(Fp8E4m3fnRound(480.0f), 448.0f);
  EXPECT_EQ(Fp8E4m3fnRound(INFINITY), 448.0f);
  EXPECT_EQ(Fp8E4m3fnFromFloat(-INFINITY), 0xfe);
  EXPECT_EQ(Fp8E4m3fnFromFloat(std::numeric_limits<float>::quiet_NaN()), 0x7f);
  EXPECT_EQ(Fp8E4m3fnFromFloat(-std::numeric_limits<float>::quiet_NaN()), 0xff);
  EXPECT_EQ(Fp8E4m3fnFakeQuantize(1e9f, 0.5f), 224.0f);
  EXPECT_EQ(Fp8E4m3fnFakeQuantize(-INFINITY, 2.0f), -896.0f);
  EXPECT_TRUE(std::isnan(
      Fp8E4m3fnFakeQuantize(std::numeric_limits<float>::quiet_NaN(), 1.0f)));
}

std::vector<float> Random(size_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> out(n);
  for (float& x : out) x = dist(rng);
  return out;
}

TEST(Fp8Attention, RepresentableInputsHaveNoError) {
  const uint32_t tokens = 5, heads = 4, kv = 2, dim = 3;
  std::vector<float> q(tokens * heads * dim), k(tokens * kv * dim),
      v(tokens * kv * dim);
  for (size_t i = 0; i < q.size(); ++i) q[i] = Fp8E4m3fnRound(0.25f * (i % 7));
  for (size_t i = 0; i < k.size(); ++i) k[i] = 0.5f * (i % 5) - 1.0f;
  for (size_t i = 0; i < v.size(); ++i) v[i] = 1.0f + (i % 3);
  Fp8AttentionErrorSums sums(heads, kv);
  ASSERT_TRUE(AccumulateFp8AttentionError(
                  {tokens, heads, kv, dim, q, k, v},
                  {std::vector<float>(heads, 1.0f),
                   std::vector<float>(kv, 1.0f), std::vector<float>(kv, 1.0f)},
                  {}, &sums)
                  .ok());
  EXPECT_EQ(sums.RelativeError(), 0.0);
  EXPECT_GT(sums.reference_sq[0], 0.0);
  EXPECT_EQ(sums.roles[RoleIndex(Role::kQ)].values[0], tokens * dim);
  EXPECT_EQ(sums.sequences, 1u);
}

TEST(Fp8Attention, ClippingScaleCostsMoreThanAbsmaxScale) {
  const uint32_t tokens = 33, heads = 4, kv = 1, dim = 16;
  std::vector<float> q = Random(tokens * heads * dim, 1, 1.0f);
  std::vector<float> k = Random(tokens * kv * dim, 2, 1.0f);
  std::vector<float> v = Random(tokens * kv * dim, 3, 1.0f);
  k[7] = 40.0f;  // an outlier that a small K scale clips
  auto run = [&](float k_scale, bool quantize_q) {
    Fp8AttentionErrorSums sums(heads, kv);
    Fp8AttentionOptions options;
    options.quantize_q = quantize_q;
    EXPECT_TRUE(
        AccumulateFp8AttentionError({tokens, heads, kv, dim, q, k, v},
                                    {std::vector<float>(heads, 5.0f / 448),
                                     std::vector<float>(kv, k_scale),
                                     std::vector<float>(kv, 5.0f / 448)},
                                    options, &sums)
            .ok());
    return sums;
  };
  const Fp8AttentionErrorSums absmax = run(40.0f / 448, true);
  const Fp8AttentionErrorSums clipped = run(4.0f / 448, true);
  EXPECT_GT(absmax.RelativeError(), 0.0);
  EXPECT_LT(absmax.RelativeError(), 0.2);
  EXPECT_GT(clipped.RelativeError(), absmax.RelativeError());
  EXPECT_GT(clipped.SaturatedShare(Role::kK), 0.0);
  EXPECT_EQ(absmax.SaturatedShare(Role::kK), 0.0);
  const Fp8AttentionErrorSums kv_only = run(40.0f / 448, false);
  EXPECT_EQ(kv_only.roles[RoleIndex(Role::kQ)].values[0], 0u);
  EXPECT_NE(kv_only.RelativeError(), absmax.RelativeError());

  Fp8AttentionErrorSums twice = absmax;
  ASSERT_TRUE(twice.Merge(absmax).ok());
  EXPECT_DOUBLE_EQ(twice.RelativeError(), absmax.RelativeError());
  EXPECT_EQ(twice.sequences, 2u);
}

TEST(Fp8Attention, OutputIsWhatTheErrorSumsCompare) {
  const uint32_t tokens = 9, heads = 4, kv = 2, dim = 8;
  const std::vector<float> q = Random(tokens * heads * dim, 4, 1.0f);
  const std::vector<float> k = Random(tokens * kv * dim, 5, 1.0f);
  const std::vector<float> v = Random(tokens * kv * dim, 6, 1.0f);
  const AttentionInputs in{tokens, heads, kv, dim, q, k, v};
  const HeadScales scales{std::vector<float>(heads, 4.0f / 448),
                          std::vector<float>(kv, 4.0f / 448),
                          std::vector<float>(kv, 4.0f / 448)};
  auto out = Fp8AttentionOutput(in, scales, {});
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ(out->size(), q.size());
  Fp8AttentionErrorSums sums(heads, kv);
  ASSERT_TRUE(AccumulateFp8AttentionError(in, scales, {}, &sums).ok());
  // Σ out² differs from Σ reference² by the FP8 error only.
  double out_sq = 0.0;
  for (float x : *out) out_sq += double{x} * x;
  double ref_sq = 0.0;
  for (double r : sums.reference_sq) ref_sq += r;
  EXPECT_NEAR(std::sqrt(out_sq / ref_sq), 1.0, 2 * sums.RelativeError());
  EXPECT_NE(std::sqrt(out_sq / ref_sq), 1.0);

  Fp8AttentionOptions probs;
  probs.quantize_probs = true;
  auto rounded = Fp8AttentionOutput(in, scales, probs);
  ASSERT_TRUE(rounded.ok());
  EXPECT_NE(*rounded, *out);
}

TEST(Fp8Attention, RejectsBadInputs) {
  std::vector<float> q(8), k(4), v(4);
  Fp8AttentionErrorSums sums(2, 1);
  absl::Status s = AccumulateFp8AttentionError(
      {2, 2, 1, 2, q, k, v}, {{1, 1}, {1}, {0.0f}}, {}, &sums);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("V scale of head 0 is 0"));
  s = AccumulateFp8AttentionError({3, 2, 1, 2, q, k, v}, {{1, 1}, {1}, {1}}, {},
                                  &sums);
  EXPECT_THAT(s.message(), HasSubstr("3 tokens need q 12"));
  EXPECT_EQ(sums.sequences, 0u);
}

TEST(ExpandRoleScales, FollowsVllmsLoader) {
  const std::vector<float> one = {2.0f};
  EXPECT_THAT(*ExpandRoleScales(one, Role::kK, 4, 2, true),
              ElementsAre(2.0f, 2.0f));
  const std::vector<float> per_group = {1.0f, 3.0f};
  EXPECT_THAT(*ExpandRoleScales(per_group, Role::kQ, 4, 2, true),
              ElementsAre(1.0f, 1.0f, 3.0f, 3.0f));
  const std::vector<float> per_query = {1.0f, 2.0f, 4.0f, 3.0f};
  EXPECT_THAT(*ExpandRoleScales(per_query, Role::kQ, 4, 2, true),
              ElementsAre(2.0f, 2.0f, 4.0f, 4.0f));
  EXPECT_THAT(*ExpandRoleScales(per_query, Role::kQ, 4, 2, false),
              ElementsAre(1.0f, 2.0f, 4.0f, 3.0f));
  EXPECT_THAT(
      ExpandRoleScales(per_query, Role::kK, 4, 2, true).status().message(),
      HasSubstr("K has 4 scales; its 2 heads need 1, 2 scales"));
}

}  // namespace
}  // namespace kvcal
