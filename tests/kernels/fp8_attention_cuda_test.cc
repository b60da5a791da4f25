// cuDNN's FP8 SDPA (kernels/cuda/fp8_attention_cudnn.h) against kvcal's CPU
// emulation with the same quantization steps. Label `gpu`: skips with a
// message when no CUDA device is present; run by bench/gpu_check.sh.
//
// Tolerance: the emulation rounds P (× 448) and O (× 448 / max|V̂|) to e4m3
// as cuDNN does, so the outputs differ only where float32 accumulation order
// or cuDNN's exp approximation moves a value across an e4m3 rounding
// boundary (one e4m3 ulp, 6.25% or 12.5% of that element). We require the
// relative RMS difference over each sequence's output below 2%. Not yet run
// on a GPU when it was written: the first gpu_check run confirms it.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cuda/fp8_attention_cudnn.h"
#include "kernels/fp8_attention.h"
#include "kernels/fp8_math.h"

namespace kvcal {
namespace {

bool HaveDevice() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

std::vector<float> Random(size_t n, uint32_t seed, float sigma) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, sigma);
  std::vector<float> x(n);
  for (float& v : x) v = dist(rng);
  return x;
}

double RelativeRms(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double{a[i]} - b[i]) * (double{a[i]} - b[i]);
    den += double{b[i]} * b[i];
  }
  return std::sqrt(num / den);
}

struct Case {
  uint32_t tokens, heads, kv, dim;
  bool per_group;  // per-KV-group scales (else per tensor)
};

class CudnnFp8AttentionTest : public ::testing::TestWithParam<Case> {};

TEST_P(CudnnFp8AttentionTest, MatchesTheCpuEmulation) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device";
  ASSERT_TRUE(HaveCudnnFp8Attention());
  const Case c = GetParam();
  const std::vector<float> q =
      Random(size_t{c.tokens} * c.heads * c.dim, 1, 2.0f);
  const std::vector<float> k = Random(size_t{c.tokens} * c.kv * c.dim, 2, 1.0f);
  const std::vector<float> v = Random(size_t{c.tokens} * c.kv * c.dim, 3, 1.0f);
  auto absmax = [](const std::vector<float>& x) {
    float m = 0.0f;
    for (float e : x) m = std::max(m, std::fabs(e));
    return m;
  };
  HeadScales scales{std::vector<float>(c.heads, absmax(q) / 448),
                    std::vector<float>(c.kv, absmax(k) / 448),
                    std::vector<float>(c.kv, absmax(v) / 448)};
  if (c.per_group) {
    const uint32_t group = c.heads / c.kv;
    for (uint32_t g = 0; g < c.kv; ++g) {
      const float f = 1.0f + 0.5f * g;
      scales.k[g] *= f;
      scales.v[g] *= f;
      for (uint32_t i = 0; i < group; ++i) scales.q[g * group + i] *= f;
    }
  }
  const AttentionInputs in{c.tokens, c.heads, c.kv, c.dim, q, k, v};
  auto gpu = CudnnFp8AttentionOutput(0, in, scales);
  ASSERT_TRUE(gpu.ok()) << gpu.status();

  Fp8AttentionOptions options;
  options.quantize_probs = true;
  auto cpu = Fp8AttentionOutput(in, scales, options);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  // cuDNN's O is FP8 with scale 448 / (max|V̂| · v_scale) per KV group.
  const uint32_t group = c.heads / c.kv;
  for (uint32_t g = 0; g < c.kv; ++g) {
    float v_max = 0.0f;
    for (uint32_t t = 0; t < c.tokens; ++t)
      for (uint32_t i = 0; i < c.dim; ++i)
        v_max = std::max(
            v_max, std::fabs(Fp8E4m3fnFakeQuantize(
                       v[(size_t{t} * c.kv + g) * c.dim + i], scales.v[g])));
    const float bound = v_max;
    for (uint32_t t = 0; t < c.tokens; ++t)
      for (uint32_t h = g * group; h < (g + 1) * group; ++h)
        for (uint32_t i = 0; i < c.dim; ++i) {
          float& o = (*cpu)[(size_t{t} * c.heads + h) * c.dim + i];
          o = Fp8E4m3fnRound(o * (448.0f / bound)) * (bound / 448.0f);
        }
  }
  EXPECT_LT(RelativeRms(*gpu, *cpu), 0.02);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudnnFp8AttentionTest,
                         ::testing::Values(Case{1, 1, 1, 64, false},
                                           Case{33, 4, 2, 64, false},
                                           Case{128, 8, 2, 128, true},
                                           Case{257, 4, 4, 64, true}));

TEST(CudnnFp8Attention, RefusesQScalesThatDifferWithinAKvGroup) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device";
  const std::vector<float> q(4 * 2 * 64, 1.0f), k(4 * 64, 1.0f),
      v(4 * 64, 1.0f);
  auto r = CudnnFp8AttentionOutput(0, {4, 2, 1, 64, q, k, v},
                                   {{1.0f, 2.0f}, {1.0f}, {1.0f}});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(),
              ::testing::HasSubstr("one Q scale per KV group"));
}

}  // namespace
}  // namespace kvcal
