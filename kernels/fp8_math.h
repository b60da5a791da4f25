// FP8 e4m3fn conversion, bit-identical to PyTorch's `float8_e4m3fn` cast, and
// the fake quantization vLLM's FP8 attention applies to Q, K and V.
//
//   uint8_t bits = kvcal::Fp8E4m3fnFromFloat(x);      // torch: x.to(e4m3fn)
//   float y = kvcal::Fp8E4m3fnToFloat(bits);           // exact
//   float fq = kvcal::Fp8E4m3fnFakeQuantize(x, scale); // (x/s).clamp(±448)
//                                                      //   .to(e4m3fn) * s
//
// e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities; 0x7f
// and 0xff are NaN; the largest finite magnitude is 448, the smallest normal
// 2^-6, the smallest subnormal 2^-9.
//
// The cast is PyTorch 2.14's (the version tests/python/requirements.lock
// pins), which saturates: every |x| > 448, ±Inf included, becomes ±448; NaN
// stays NaN with its sign (0x7f / 0xff). Below 2^-6 the magnitude is rounded
// to a multiple of 2^-9 by adding 2^14 as a float (whose ulp is 2^-9: the
// FPU's round-to-nearest-even does the rounding) and keeping the low bits of
// the sum; otherwise the mantissa is rounded to 3 bits, ties to even, by
// integer arithmetic on the float's bits (c10's fp8e4m3fn_from_fp32_value
// does the same; older PyTorch turned |x| >= 480 into NaN instead, which is
// why vLLM clamps to ±448 before the cast; with the clamp both agree).
//
// Everything is `__host__ __device__` under nvcc (one definition for the CPU
// emulation and the CUDA kernels). The subnormal branch needs IEEE
// round-to-nearest without flush-to-zero, which is the default on both.
#ifndef KVCAL_KERNELS_FP8_MATH_H_
#define KVCAL_KERNELS_FP8_MATH_H_

#include <cstdint>

#include "kernels/element_math.h"

namespace kvcal {

inline constexpr float kFp8E4m3fnMax = 448.0f;
// e4m3fn's smallest normal magnitude, 2^-6.
inline constexpr float kFp8E4m3fnMinNormal = 0.015625f;
// A quantized |x / scale| above this saturated. A static scale is absmax /
// 448, and x / (absmax / 448) can round one float32 ulp above 448, so the
// threshold sits a little above 448 (as kvcal.torch.evaluate's SATURATED).
inline constexpr float kFp8SaturationThreshold = 448.0f * (1.0f + 0x1p-20f);

KVCAL_HOST_DEVICE uint8_t Fp8E4m3fnFromFloat(float x) {
  constexpr uint32_t kMaxBits = 0x43e00000u;    // 448.0f
  constexpr uint32_t kDenormMask = 141u << 23;  // 2^14 as a float
  uint32_t bits = FloatBits(x);
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  uint8_t result;
  if (bits > 0x7f800000u) {  // NaN
    result = 0x7f;
  } else if (bits > kMaxBits) {  // saturates, Inf included
    result = 0x7e;
  } else if (bits < (121u << 23)) {  // < 2^-6: subnormal or zero
    // Adding 2^14 leaves the magnitude's multiples of 2^-9 in the low bits
    // of the sum, rounded to nearest even by the addition itself.
    const float sum = BitsToFloat(bits) + BitsToFloat(kDenormMask);
    result = static_cast<uint8_t>(FloatBits(sum) - kDenormMask);
  } else {
    const uint32_t mantissa_odd = (bits >> 20) & 1u;
    bits += (static_cast<uint32_t>(7 - 127) << 23) + 0x7ffffu;
    bits += mantissa_odd;
    result = static_cast<uint8_t>(bits >> 20);
  }
  return static_cast<uint8_t>(result | (sign >> 24));
}

KVCAL_HOST_DEVICE float Fp8E4m3fnToFloat(uint8_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x80u) << 24;
  const uint32_t exponent = (bits >> 3) & 0xfu;
  const uint32_t mantissa = bits & 0x7u;
  if (exponent == 0xfu && mantissa == 0x7u) {
    return BitsToFloat(sign | 0x7fc00000u);  // NaN
  }
  if (exponent == 0) {  // subnormal: mantissa * 2^-9, exact in float32
    const float magnitude = static_cast<float>(mantissa) * 0x1p-9f;
    return BitsToFloat(sign | FloatBits(magnitude));
  }
  return BitsToFloat(sign | ((exponent + 120u) << 23) | (mantissa << 20));
}

// The e4m3fn value nearest x as torch's cast picks it (±448 beyond).
KVCAL_HOST_DEVICE float Fp8E4m3fnRound(float x) {
  return Fp8E4m3fnToFloat(Fp8E4m3fnFromFloat(x));
}

// x / scale clamped to ±448 (NaN stays NaN, as torch.clamp keeps it), cast
// to e4m3fn, times scale; float32 throughout, as vLLM's scaled conversion
// and kvcal.torch.fake_quantize do it.
KVCAL_HOST_DEVICE float Fp8E4m3fnFakeQuantize(float x, float scale) {
  float q = x / scale;
  if (q > kFp8E4m3fnMax) q = kFp8E4m3fnMax;
  if (q < -kFp8E4m3fnMax) q = -kFp8E4m3fnMax;
  return Fp8E4m3fnRound(q) * scale;
}

}  // namespace kvcal

#endif  // KVCAL_KERNELS_FP8_MATH_H_
