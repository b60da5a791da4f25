// What FP8 Q, K and V cost causal attention: the CPU emulation that the
// worker's Finalize `evaluate` runs on held-out batches (and the reference
// the CUDA/cuDNN path is tested against).
//
//   kvcal::AttentionInputs in{.tokens = 128, .num_attention_heads = 8,
//                             .num_key_value_heads = 2, .head_dim = 64,
//                             .q = q, .k = k, .v = v};  // [tokens, heads, dim]
//   KVCAL_ASSIGN_OR_RETURN(std::vector<float> k_scale,
//       kvcal::ExpandRoleScales(result_k_scale, Role::kK, 8, 2, true));
//   kvcal::Fp8AttentionErrorSums sums(8, 2);
//   KVCAL_RETURN_IF_ERROR(kvcal::AccumulateFp8AttentionError(
//       in, {q_scale, k_scale, v_scale}, {}, &sums));   // once per sequence
//   double layer_error = sums.RelativeError();
//
// Definitions (the same as kvcal.torch.evaluate, python/kvcal/torch/
// evaluation.py): for each sequence, reference o = softmax(q kᵀ · s + causal) v
// in float32 with s = 1/sqrt(head_dim); the FP8 run replaces q, k and v by
// Fp8E4m3fnFakeQuantize(x, scale) (q left alone with quantize_q = false:
// an FP8 KV cache with a bf16 query). GQA: query head h reads KV head
// h / (heads / kv_heads). The relative error of a head is
// sqrt(Σ (o_fp8 − o)² / Σ o²) over every token and dimension of every
// sequence accumulated; of a layer, the same sums over all its heads.
// Per (role, head): the share of quantized values with |x / scale| above
// kFp8SaturationThreshold (saturated) and in (0, 2^-6) (e4m3 subnormals).
#ifndef KVCAL_KERNELS_FP8_ATTENTION_H_
#define KVCAL_KERNELS_FP8_ATTENTION_H_

#include <array>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/types.h"

namespace kvcal {

// One sequence, float32, row-major: q [tokens, num_attention_heads,
// head_dim], k and v [tokens, num_key_value_heads, head_dim].
struct AttentionInputs {
  uint32_t tokens = 0;
  uint32_t num_attention_heads = 0;
  uint32_t num_key_value_heads = 0;
  uint32_t head_dim = 0;
  absl::Span<const float> q, k, v;
};

// One scale per head: q per query head, k and v per KV head.
struct HeadScales {
  std::vector<float> q, k, v;
};

struct Fp8AttentionOptions {
  // False: Q stays unquantized (K/V only); its shares are not counted.
  bool quantize_q = true;
  // 0 = 1/sqrt(head_dim).
  float softmax_scale = 0.0f;
  // Also round the softmax probabilities to e4m3 before P·V, as FP8
  // attention kernels (FlashAttention-3, cuDNN's FP8 SDPA) do: p × 448 cast
  // to e4m3, divided by 448 (kvcal.torch.evaluate's quantize_probs rounds p
  // itself; the worker's evaluation leaves P alone).
  bool quantize_probs = false;
};

// Per (role, head) value counts.
struct QuantizationCounts {
  std::vector<uint64_t> values, saturated, subnormal;
};

// Sums that sequences add to and that merge; ratios at the end.
class Fp8AttentionErrorSums {
 public:
  Fp8AttentionErrorSums() = default;
  Fp8AttentionErrorSums(uint32_t num_attention_heads,
                        uint32_t num_key_value_heads);

  // Per query head: Σ (o_fp8 − o)² and Σ o².
  std::vector<double> error_sq, reference_sq;
  // Indexed by RoleIndex; per head of the role.
  std::array<QuantizationCounts, 3> roles;
  uint64_t sequences = 0;
  uint64_t tokens = 0;

  // sqrt(Σ error² / Σ reference²) of one query head, or over all heads.
  double RelativeError(uint32_t head) const;
  double RelativeError() const;
  // Shares of a (role, head); 0 when nothing was counted.
  double SaturatedShare(Role role, uint32_t head) const;
  double SubnormalShare(Role role, uint32_t head) const;
  // Over all heads of the role.
  double SaturatedShare(Role role) const;
  double SubnormalShare(Role role) const;

  // Same head counts, else InvalidArgument.
  absl::Status Merge(const Fp8AttentionErrorSums& other);
};

// Adds one causal sequence. InvalidArgument (naming what) for spans that do
// not match the shape, head counts that do not divide, scales of the wrong
// count or not finite and > 0; nothing is added then.
absl::Status AccumulateFp8AttentionError(const AttentionInputs& inputs,
                                         const HeadScales& scales,
                                         const Fp8AttentionOptions& options,
                                         Fp8AttentionErrorSums* sums);

// The checks of AccumulateFp8AttentionError on shapes, head counts and
// scales, without any arithmetic (the output functions and the cuDNN path
// validate through it).
absl::Status ValidateFp8Attention(const AttentionInputs& inputs,
                                  const HeadScales& scales,
                                  const Fp8AttentionOptions& options = {});

// The FP8 run's attention output of one sequence, [tokens,
// num_attention_heads, head_dim] float32 (what AccumulateFp8AttentionError
// compares with the reference); the same checks.
absl::StatusOr<std::vector<float>> Fp8AttentionOutput(
    const AttentionInputs& inputs, const HeadScales& scales,
    const Fp8AttentionOptions& options);

// A finalized role's scales (one per tensor, per KV head or per query head)
// as vLLM's loader applies them, one per head of the role: a single value
// for every head; for Q, kv_heads values repeated over each group, and
// per-query-head values reduced to the max of each KV group when
// `q_per_kv_group` (vLLM) or kept as they are when not (FlashAttention-3
// could use them). InvalidArgument for any other count.
absl::StatusOr<std::vector<float>> ExpandRoleScales(
    absl::Span<const float> scale, Role role, uint32_t num_attention_heads,
    uint32_t num_key_value_heads, bool q_per_kv_group);

}  // namespace kvcal

#endif  // KVCAL_KERNELS_FP8_ATTENTION_H_
