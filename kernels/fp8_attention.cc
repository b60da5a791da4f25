#include "kernels/fp8_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "kernels/fp8_math.h"
#include "util/status_macros.h"

namespace kvcal {
namespace {

// q holds tokens x heads x head_dim values, k and v tokens x kv heads x
// head_dim.
absl::Status CheckInputSizes(const AttentionInputs& in) {
  const size_t q_size =
      size_t{in.tokens} * in.num_attention_heads * in.head_dim;
  const size_t kv_size =
      size_t{in.tokens} * in.num_key_value_heads * in.head_dim;
  if (in.q.size() != q_size || in.k.size() != kv_size ||
      in.v.size() != kv_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention inputs of ", in.tokens, " tokens need q ",
                     q_size, " and k, v ", kv_size, " values; got q ",
                     in.q.size(), ", k ", in.k.size(), ", v ", in.v.size()));
  }
  return absl::OkStatus();
}

// Causal attention of one query head over its KV head, float32 as torch's
// eager attention computes it (scores, max-subtracted softmax, P·V).
// q: [tokens, q_stride] at column offset q_col; k, v likewise. Writes
// out[t * head_dim + i].
void CausalHeadAttention(const float* q, size_t q_stride, const float* k,
                         const float* v, size_t kv_stride, uint32_t tokens,
                         uint32_t head_dim, float softmax_scale,
                         bool quantize_probs, std::vector<float>& scores,
                         float* out) {
  for (uint32_t t = 0; t < tokens; ++t) {
    const float* qt = q + t * q_stride;
    float max_score = -std::numeric_limits<float>::infinity();
    for (uint32_t j = 0; j <= t; ++j) {
      const float* kj = k + j * kv_stride;
      float dot = 0.0f;
      for (uint32_t i = 0; i < head_dim; ++i) dot += qt[i] * kj[i];
      scores[j] = dot * softmax_scale;
      max_score = std::max(max_score, scores[j]);
    }
    float denominator = 0.0f;
    for (uint32_t j = 0; j <= t; ++j) {
      scores[j] = std::exp(scores[j] - max_score);
      denominator += scores[j];
    }
    float* ot = out + static_cast<size_t>(t) * head_dim;
    std::fill(ot, ot + head_dim, 0.0f);
    for (uint32_t j = 0; j <= t; ++j) {
      float p = scores[j] / denominator;
      if (quantize_probs) {
        p = Fp8E4m3fnRound(p * kFp8E4m3fnMax) / kFp8E4m3fnMax;
      }
      const float* vj = v + j * kv_stride;
      for (uint32_t i = 0; i < head_dim; ++i) ot[i] += p * vj[i];
    }
  }
}

// Fake-quantizes x [tokens, heads, head_dim] with one scale per head into
// out, counting saturated and subnormal values per head.
void QuantizeRole(absl::Span<const float> x, uint32_t heads, uint32_t head_dim,
                  const std::vector<float>& scale, std::vector<float>& out,
                  QuantizationCounts& counts) {
  out.resize(x.size());
  for (size_t n = 0; n < x.size(); ++n) {
    const uint32_t h = static_cast<uint32_t>((n / head_dim) % heads);
    const float s = scale[h];
    const float t = std::fabs(x[n] / s);
    counts.values[h] += 1;
    if (t > kFp8SaturationThreshold) counts.saturated[h] += 1;
    if (t > 0.0f && t < kFp8E4m3fnMinNormal) counts.subnormal[h] += 1;
    out[n] = Fp8E4m3fnFakeQuantize(x[n], s);
  }
}

absl::Status CheckScales(const std::vector<float>& scale, uint32_t heads,
                         Role role) {
  if (scale.size() != heads) {
    return absl::InvalidArgumentError(
        absl::StrCat(RoleName(role), " has ", scale.size(), " scales for its ",
                     heads, " heads"));
  }
  for (size_t h = 0; h < scale.size(); ++h) {
    if (!(scale[h] > 0.0f) || !std::isfinite(scale[h])) {
      return absl::InvalidArgumentError(
          absl::StrCat(RoleName(role), " scale of head ", h, " is ", scale[h],
                       ": scales must be finite and > 0"));
    }
  }
  return absl::OkStatus();
}

double Ratio(uint64_t part, uint64_t whole) {
  return whole == 0 ? 0.0
                    : static_cast<double>(part) / static_cast<double>(whole);
}

// sum(part) / sum(whole) over every head.
double WholeRatio(const std::vector<uint64_t>& part,
                  const std::vector<uint64_t>& whole) {
  uint64_t p = 0, w = 0;
  for (size_t h = 0; h < whole.size(); ++h) {
    p += part[h];
    w += whole[h];
  }
  return Ratio(p, w);
}

}  // namespace

Fp8AttentionErrorSums::Fp8AttentionErrorSums(uint32_t num_attention_heads,
                                             uint32_t num_key_value_heads)
    : error_sq(num_attention_heads, 0.0),
      reference_sq(num_attention_heads, 0.0) {
  for (Role role : kAllRoles) {
    const uint32_t n =
        role == Role::kQ ? num_attention_heads : num_key_value_heads;
    QuantizationCounts& c = roles[RoleIndex(role)];
    c.values.assign(n, 0);
    c.saturated.assign(n, 0);
    c.subnormal.assign(n, 0);
  }
}

double Fp8AttentionErrorSums::RelativeError(uint32_t head) const {
  if (reference_sq[head] <= 0.0) return error_sq[head] > 0.0 ? INFINITY : 0.0;
  return std::sqrt(error_sq[head] / reference_sq[head]);
}

double Fp8AttentionErrorSums::RelativeError() const {
  double error = 0.0, reference = 0.0;
  for (size_t h = 0; h < error_sq.size(); ++h) {
    error += error_sq[h];
    reference += reference_sq[h];
  }
  if (reference <= 0.0) return error > 0.0 ? INFINITY : 0.0;
  return std::sqrt(error / reference);
}

double Fp8AttentionErrorSums::SaturatedShare(Role role, uint32_t head) const {
  const QuantizationCounts& c = roles[RoleIndex(role)];
  return Ratio(c.saturated[head], c.values[head]);
}

double Fp8AttentionErrorSums::SubnormalShare(Role role, uint32_t head) const {
  const QuantizationCounts& c = roles[RoleIndex(role)];
  return Ratio(c.subnormal[head], c.values[head]);
}

double Fp8AttentionErrorSums::SaturatedShare(Role role) const {
  const QuantizationCounts& c = roles[RoleIndex(role)];
  return WholeRatio(c.saturated, c.values);
}

double Fp8AttentionErrorSums::SubnormalShare(Role role) const {
  const QuantizationCounts& c = roles[RoleIndex(role)];
  return WholeRatio(c.subnormal, c.values);
}

absl::Status Fp8AttentionErrorSums::Merge(const Fp8AttentionErrorSums& other) {
  if (other.error_sq.size() != error_sq.size() ||
      other.roles[RoleIndex(Role::kK)].values.size() !=
          roles[RoleIndex(Role::kK)].values.size()) {
    return absl::InvalidArgumentError(
        "cannot merge attention error sums of different head counts");
  }
  for (size_t h = 0; h < error_sq.size(); ++h) {
    error_sq[h] += other.error_sq[h];
    reference_sq[h] += other.reference_sq[h];
  }
  for (int r = 0; r < 3; ++r) {
    for (size_t h = 0; h < roles[r].values.size(); ++h) {
      roles[r].values[h] += other.roles[r].values[h];
      roles[r].saturated[h] += other.roles[r].saturated[h];
      roles[r].subnormal[h] += other.roles[r].subnormal[h];
    }
  }
  sequences += other.sequences;
  tokens += other.tokens;
  return absl::OkStatus();
}

absl::Status AccumulateFp8AttentionError(const AttentionInputs& in,
                                         const HeadScales& scales,
                                         const Fp8AttentionOptions& options,
                                         Fp8AttentionErrorSums* sums) {
  const uint32_t heads = in.num_attention_heads, kv = in.num_key_value_heads;
  if (heads == 0 || kv == 0 || in.head_dim == 0 || heads % kv != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attention needs heads >= 1, kv heads >= 1 dividing "
        "them and head_dim >= 1; got ",
        heads, " heads, ", kv, " kv heads, head_dim ", in.head_dim));
  }
  KVCAL_RETURN_IF_ERROR(CheckInputSizes(in));
  if (sums->error_sq.size() != heads ||
      sums->roles[RoleIndex(Role::kK)].values.size() != kv) {
    return absl::InvalidArgumentError(
        "attention error sums were made for other head counts");
  }
  if (options.quantize_q) {
    if (absl::Status s = CheckScales(scales.q, heads, Role::kQ); !s.ok())
      return s;
  }
  if (absl::Status s = CheckScales(scales.k, kv, Role::kK); !s.ok()) return s;
  if (absl::Status s = CheckScales(scales.v, kv, Role::kV); !s.ok()) return s;
  const float softmax_scale =
      options.softmax_scale > 0.0f
          ? options.softmax_scale
          : 1.0f / std::sqrt(static_cast<float>(in.head_dim));

  std::vector<float> qq, kq, vq;
  if (options.quantize_q) {
    QuantizeRole(in.q, heads, in.head_dim, scales.q, qq,
                 sums->roles[RoleIndex(Role::kQ)]);
  }
  QuantizeRole(in.k, kv, in.head_dim, scales.k, kq,
               sums->roles[RoleIndex(Role::kK)]);
  QuantizeRole(in.v, kv, in.head_dim, scales.v, vq,
               sums->roles[RoleIndex(Role::kV)]);
  const float* q_fp8 = options.quantize_q ? qq.data() : in.q.data();

  const uint32_t group = heads / kv;
  const size_t q_stride = size_t{heads} * in.head_dim;
  const size_t kv_stride = size_t{kv} * in.head_dim;
  std::vector<float> scores(in.tokens);
  std::vector<float> reference(size_t{in.tokens} * in.head_dim);
  std::vector<float> quantized(reference.size());
  for (uint32_t h = 0; h < heads; ++h) {
    const size_t q_col = size_t{h} * in.head_dim;
    const size_t kv_col = size_t{h / group} * in.head_dim;
    CausalHeadAttention(in.q.data() + q_col, q_stride, in.k.data() + kv_col,
                        in.v.data() + kv_col, kv_stride, in.tokens, in.head_dim,
                        softmax_scale, /*quantize_probs=*/false, scores,
                        reference.data());
    CausalHeadAttention(q_fp8 + q_col, q_stride, kq.data() + kv_col,
                        vq.data() + kv_col, kv_stride, in.tokens, in.head_dim,
                        softmax_scale, options.quantize_probs, scores,
                        quantized.data());
    double error = 0.0, ref = 0.0;
    for (size_t n = 0; n < reference.size(); ++n) {
      const double d = static_cast<double>(quantized[n]) - reference[n];
      error += d * d;
      ref += static_cast<double>(reference[n]) * reference[n];
    }
    sums->error_sq[h] += error;
    sums->reference_sq[h] += ref;
  }
  sums->sequences += 1;
  sums->tokens += in.tokens;
  return absl::OkStatus();
}

absl::Status ValidateFp8Attention(const AttentionInputs& in,
                                  const HeadScales& scales,
                                  const Fp8AttentionOptions& options) {
  // The error sums' own checks, on scratch sums of an empty sequence: they
  // all come before any arithmetic.
  Fp8AttentionErrorSums scratch(in.num_attention_heads, in.num_key_value_heads);
  AttentionInputs empty = in;
  empty.tokens = 0;
  empty.q = {};
  empty.k = {};
  empty.v = {};
  return AccumulateFp8AttentionError(empty, scales, options, &scratch);
}

absl::StatusOr<std::vector<float>> Fp8AttentionOutput(
    const AttentionInputs& in, const HeadScales& scales,
    const Fp8AttentionOptions& options) {
  KVCAL_RETURN_IF_ERROR(ValidateFp8Attention(in, scales, options));
  KVCAL_RETURN_IF_ERROR(CheckInputSizes(in));
  const uint32_t heads = in.num_attention_heads, kv = in.num_key_value_heads;
  const float softmax_scale =
      options.softmax_scale > 0.0f
          ? options.softmax_scale
          : 1.0f / std::sqrt(static_cast<float>(in.head_dim));
  QuantizationCounts counts;
  counts.values.assign(heads, 0);
  counts.saturated.assign(heads, 0);
  counts.subnormal.assign(heads, 0);
  std::vector<float> qq, kq, vq;
  if (options.quantize_q) {
    QuantizeRole(in.q, heads, in.head_dim, scales.q, qq, counts);
  }
  QuantizeRole(in.k, kv, in.head_dim, scales.k, kq, counts);
  QuantizeRole(in.v, kv, in.head_dim, scales.v, vq, counts);
  const float* q_fp8 = options.quantize_q ? qq.data() : in.q.data();
  const uint32_t group = heads / kv;
  std::vector<float> scores(in.tokens);
  std::vector<float> head(size_t{in.tokens} * in.head_dim);
  std::vector<float> out(in.q.size());
  for (uint32_t h = 0; h < heads; ++h) {
    const size_t kv_col = size_t{h / group} * in.head_dim;
    CausalHeadAttention(q_fp8 + size_t{h} * in.head_dim,
                        size_t{heads} * in.head_dim, kq.data() + kv_col,
                        vq.data() + kv_col, size_t{kv} * in.head_dim, in.tokens,
                        in.head_dim, softmax_scale, options.quantize_probs,
                        scores, head.data());
    for (uint32_t t = 0; t < in.tokens; ++t) {
      std::copy(head.begin() + size_t{t} * in.head_dim,
                head.begin() + size_t{t + 1} * in.head_dim,
                out.begin() + (size_t{t} * heads + h) * in.head_dim);
    }
  }
  return out;
}

absl::StatusOr<std::vector<float>> ExpandRoleScales(
    absl::Span<const float> scale, Role role, uint32_t num_attention_heads,
    uint32_t num_key_value_heads, bool q_per_kv_group) {
  const uint32_t heads =
      role == Role::kQ ? num_attention_heads : num_key_value_heads;
  if (scale.size() == 1) return std::vector<float>(heads, scale[0]);
  if (role == Role::kQ && num_key_value_heads != 0 &&
      num_attention_heads % num_key_value_heads == 0) {
    const uint32_t group = num_attention_heads / num_key_value_heads;
    if (scale.size() == num_key_value_heads && group > 1) {
      std::vector<float> out(heads);
      for (uint32_t h = 0; h < heads; ++h) out[h] = scale[h / group];
      return out;
    }
    if (scale.size() == heads && q_per_kv_group && group > 1) {
      std::vector<float> out(heads);
      for (uint32_t g = 0; g < num_key_value_heads; ++g) {
        float m = scale[g * group];
        for (uint32_t i = 1; i < group; ++i)
          m = std::max(m, scale[g * group + i]);
        for (uint32_t i = 0; i < group; ++i) out[g * group + i] = m;
      }
      return out;
    }
  }
  if (scale.size() != heads) {
    return absl::InvalidArgumentError(absl::StrCat(
        RoleName(role), " has ", scale.size(), " scales; its ", heads,
        " heads need 1, ", heads,
        role == Role::kQ ? absl::StrCat(" or ", num_key_value_heads) : "",
        " scales"));
  }
  return std::vector<float>(scale.begin(), scale.end());
}

}  // namespace kvcal
