// Built with -ffp-contract=off (kernels/CMakeLists.txt): every FMA that the
// GPU's code has is written out with std::fma, and nothing else may fuse.
#include "kernels/nvfp4.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "kernels/element_math.h"
#include "kernels/fp8_math.h"

namespace kvcal {
namespace {

// vLLM's round_to_nearest_e2m1 (the 4over6 error): the value, not the code.
float RoundToNearestE2m1(float x) { return E2m1ToFloat(E2m1FromFloat(x)); }

struct Candidate {
  uint8_t scale_bits;
  float output_scale;
  bool saturated;
};

// nvfp4_candidate_scale (and cvt_warp_fp16_to_fp4's scale with 6).
Candidate CandidateScale(float global_scale, float vec_max, float denominator) {
  const float sf_value =
      global_scale * (vec_max * ReciprocalApproximateFtz(denominator));
  const uint8_t bits = Fp8E4m3fnFromFloat(sf_value);
  const float sf = Fp8E4m3fnToFloat(bits);
  const float output_scale =
      sf != 0.0f ? ReciprocalApproximateFtz(
                       sf * ReciprocalApproximateFtz(global_scale))
                 : 0.0f;
  return {bits, output_scale, sf_value > kFp8E4m3fnMax};
}

// nvfp4_reconstruction_error, 16 values in one thread.
float ReconstructionError(const float* x, float output_scale) {
  float error = 0.0f;
  const float dequant =
      output_scale != 0.0f ? ReciprocalApproximateFtz(output_scale) : 0.0f;
  for (int i = 0; i < kNvfp4BlockSize; i += 2) {
    const float a = x[i], b = x[i + 1];
    if (output_scale == 0.0f) {
      error += std::fma(a, a, b * b);
    } else {
      const float qa = RoundToNearestE2m1(a * output_scale);
      const float qb = RoundToNearestE2m1(b * output_scale);
      const float da = std::fma(qa, dequant, -a);
      const float db = std::fma(qb, dequant, -b);
      error += std::fma(da, da, db * db);
    }
  }
  return error;
}

}  // namespace

uint8_t E2m1FromFloat(float x) {
  const uint8_t sign = (FloatBits(x) >> 28) & 0x8u;
  const float ax = std::fabs(x);
  uint8_t code;
  // Midpoints 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5: a tie goes to the even
  // code (0, 2, 2, 4, 4, 6, 6), so the comparison is <= toward an even code
  // below and < toward an odd one.
  if (ax <= 0.25f) {
    code = 0;
  } else if (ax < 0.75f) {
    code = 1;
  } else if (ax <= 1.25f) {
    code = 2;
  } else if (ax < 1.75f) {
    code = 3;
  } else if (ax <= 2.5f) {
    code = 4;
  } else if (ax < 3.5f) {
    code = 5;
  } else if (ax <= 5.0f) {
    code = 6;
  } else {
    code = 7;  // up to 6, and satfinite beyond (NaN lands here too)
  }
  return static_cast<uint8_t>(sign | code);
}

float E2m1ToFloat(uint8_t code) {
  static constexpr float kValues[8] = {0.0f, 0.5f, 1.0f, 1.5f,
                                       2.0f, 3.0f, 4.0f, 6.0f};
  const float v = kValues[code & 0x7u];
  return (code & 0x8u) ? -v : v;
}

float ReciprocalApproximateFtz(float a) {
  const uint32_t bits = FloatBits(a);
  const uint32_t sign = bits & 0x80000000u;
  const uint32_t magnitude = bits ^ sign;
  if (magnitude > 0x7f800000u) return std::numeric_limits<float>::quiet_NaN();
  if (magnitude < 0x00800000u) {  // zero or subnormal, flushed: 1/±0
    return BitsToFloat(sign | 0x7f800000u);
  }
  const float r = 1.0f / a;
  if (std::fabs(r) < std::numeric_limits<float>::min()) {
    return BitsToFloat(sign);  // a subnormal result, flushed
  }
  return r;
}

float Nvfp4GlobalScale(float checkpoint_scale) {
  return 1.0f / checkpoint_scale;
}

Nvfp4Block Nvfp4QuantizeBlock(const float* x, float global_scale,
                              Nvfp4Variant variant, uint8_t* codes) {
  float vec_max = 0.0f;
  for (int i = 0; i < kNvfp4BlockSize; ++i) {
    const float a = std::fabs(x[i]);
    if (a > vec_max) vec_max = a;  // NaN never compares greater
  }
  Candidate chosen = CandidateScale(global_scale, vec_max, 6.0f);
  bool max4 = false;
  if (variant == Nvfp4Variant::kFourOverSix) {
    const Candidate four = CandidateScale(global_scale, vec_max, 4.0f);
    const float error6 = ReconstructionError(x, chosen.output_scale);
    const float error4 = ReconstructionError(x, four.output_scale);
    if (error4 < error6) {
      chosen = four;
      max4 = true;
    }
  }
  for (int i = 0; i < kNvfp4BlockSize; ++i) {
    codes[i] = E2m1FromFloat(x[i] * chosen.output_scale);
  }
  return {chosen.scale_bits, chosen.output_scale, max4, chosen.saturated};
}

float Nvfp4Dequantize(uint8_t code, uint8_t scale_bits,
                      float checkpoint_scale) {
  return (E2m1ToFloat(code) * Fp8E4m3fnToFloat(scale_bits)) * checkpoint_scale;
}

absl::Status Nvfp4FakeQuantize(absl::Span<const float> x,
                               float checkpoint_scale, Nvfp4Variant variant,
                               absl::Span<float> out, Nvfp4RowCounts* counts) {
  if (x.size() % kNvfp4BlockSize != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("NVFP4: ", x.size(), " values are not whole blocks of ",
                     kNvfp4BlockSize, " (vLLM requires head_size % 16 == 0)"));
  }
  if (out.size() != x.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "NVFP4: output has ", out.size(), " values, input ", x.size()));
  }
  const float global_scale = Nvfp4GlobalScale(checkpoint_scale);
  if (!std::isfinite(checkpoint_scale) || !(checkpoint_scale > 0.0f) ||
      !std::isfinite(global_scale)) {
    return absl::InvalidArgumentError(
        absl::StrCat("NVFP4: checkpoint scale ", checkpoint_scale,
                     " is not finite and > 0 with a finite reciprocal"));
  }
  uint8_t codes[kNvfp4BlockSize];
  for (size_t at = 0; at < x.size(); at += kNvfp4BlockSize) {
    const Nvfp4Block block =
        Nvfp4QuantizeBlock(x.data() + at, global_scale, variant, codes);
    for (int i = 0; i < kNvfp4BlockSize; ++i) {
      out[at + i] =
          Nvfp4Dequantize(codes[i], block.scale_bits, checkpoint_scale);
    }
    if (counts != nullptr) {
      const float sf = Fp8E4m3fnToFloat(block.scale_bits);
      ++counts->blocks;
      counts->zero_scale += sf == 0.0f;
      counts->subnormal_scale += sf > 0.0f && sf < kFp8E4m3fnMinNormal;
      counts->saturated_scale += block.saturated;
      counts->max4 += block.max4;
    }
  }
  return absl::OkStatus();
}

}  // namespace kvcal
