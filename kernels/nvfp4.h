// NVFP4 KV cache emulation: what vLLM 0.34's store kernel
// (csrc/nvfp4_kv_cache_kernels.cu, reshape_and_cache_nvfp4_kernel, with
// cvt_warp_fp16_to_fp4 / cvt_warp_fp16_to_fp4_4over6 of
// csrc/quantization/fp4/nvfp4_utils.cuh) writes for `--kv-cache-dtype nvfp4`
// and `nvfp4_4over6`, and the value its attention reads back.
//
//   std::vector<float> out(x.size());
//   KVCAL_RETURN_IF_ERROR(kvcal::Nvfp4FakeQuantize(
//       x, k_scale, kvcal::Nvfp4Variant::kDefault, absl::MakeSpan(out)));
//
// The kernel's arithmetic, per block of 16 consecutive values of one head
// (float32 throughout; the inputs are the model's bf16/fp16 K or V, which
// this emulation takes as floats that are already representable in that
// type):
//
//   global_scale = 1.0f / k_scale                  (IEEE division: the file
//                                                    is built without fast math)
//   vec_max      = max |x_i|                       (exact)
//   sf_value     = global_scale * (vec_max * rcp(6.0f))
//   sf           = e4m3(sf_value)                  (__nv_fp8_e4m3: round to
//                                                    nearest even, satfinite:
//                                                    448 beyond; the same cast
//                                                    as Fp8E4m3fnFromFloat)
//   out_scale    = sf != 0 ? rcp(float(sf) * rcp(global_scale)) : 0
//   code_i       = cvt.rn.satfinite.e2m1x2.f32(x_i * out_scale)
//
// where rcp is `reciprocal_approximate_ftz` (PTX rcp.approx.ftz.f32). The
// attention kernels read e2m1(code) * float(sf) and apply k_scale (v_scale)
// as a scalar, so the value the emulation returns is
// (E2m1ToFloat(code) * float(sf)) * k_scale: the first product is exact,
// the second rounds once.
//
// nvfp4_4over6 computes the candidate above with 6 and a second one with 4
// in place of 6 (nvfp4_candidate_scale), and keeps the one whose squared
// reconstruction error is strictly smaller (ties keep 6). The error uses
// vLLM's software rounding round_to_nearest_e2m1 (the same rounding as the
// cvt) and dequant = rcp(out_scale):
//   d_i = q_i * dequant - x_i;  error += d_0² + d_1²  per pair of values
// nvcc contracts these (its default --fmad=true; the file sets no flag), so
// the emulation computes d_i = fma(q_i, dequant, -x_i) and each pair as
// fma(d_0, d_0, d_1 * d_1), added to the running sum in the order of the 16
// values (one thread per block: NVFP4_ENABLE_ELTS16 with CUDA >= 12.9, what
// the SM100 build needs). A block whose out_scale is 0 adds
// fma(x_0, x_0, x_1 * x_1) per pair.
//
// What a CPU cannot reproduce exactly: rcp.approx.ftz.f32 is the GPU's
// special-function-unit reciprocal; the PTX ISA does not promise it is
// correctly rounded. ReciprocalApproximateFtz returns the correctly rounded
// 1/a (1.0f / a) with the instruction's flushes: a zero or subnormal input
// gives ±Inf, a result below 2^-126 gives ±0, Inf gives ±0, NaN stays NaN.
// Where the hardware's result differs from that by an ulp: rcp(6.0f) (a
// constant) moves sf_value by an ulp, which changes the e4m3 block scale only
// when sf_value lies within an ulp of an e4m3 rounding midpoint; and
// rcp(float(sf) * rcp(global_scale)) moves x * out_scale by an ulp, which
// changes an E2M1 code only when x / float(sf) is within an ulp of an E2M1
// midpoint. Both happen (a bf16 value can sit exactly on such a midpoint),
// so on those inputs this emulation can differ from a GPU by one E2M1 step;
// with k_scale a power of two (1.0 included) only the eight reciprocals of
// the e4m3 mantissas 1.000..1.875 and of 6.0 matter. Checking them needs an
// SM100/SM120 GPU (the PTX cvt to e2m1 does not exist before), which the
// tests do not have.
//
// NaN is outside what this models: vec_max skips it (as the kernel's __hmax
// does), and a NaN value's code is ±6 (vLLM's round_to_nearest_e2m1 falls
// through to 6; what the hardware cvt gives is not verified here).
#ifndef KVCAL_KERNELS_NVFP4_H_
#define KVCAL_KERNELS_NVFP4_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace kvcal {

// Values per block scale.
inline constexpr int kNvfp4BlockSize = 16;
// E2M1's largest magnitude.
inline constexpr float kE2m1Max = 6.0f;

enum class Nvfp4Variant {
  kDefault,     // --kv-cache-dtype nvfp4: block scale from max / 6
  kFourOverSix  // nvfp4_4over6: max / 6 or max / 4, the smaller error
};

// cvt.rn.satfinite.e2m1x2.f32 for one value: the 4-bit code (bit 3 the
// sign; 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6). Rounds to nearest, ties to the
// even code; magnitudes above 6 (Inf included) give 6; -0 and negative
// values that round to 0 keep the sign bit.
uint8_t E2m1FromFloat(float x);
// The value of a code (its low 4 bits).
float E2m1ToFloat(uint8_t code);

// reciprocal_approximate_ftz as emulated (see above).
float ReciprocalApproximateFtz(float a);

// What one block of kNvfp4BlockSize values became.
struct Nvfp4Block {
  uint8_t scale_bits = 0;    // the e4m3 block scale as stored
  float output_scale = 0.f;  // what the values were multiplied by
  bool max4 = false;         // nvfp4_4over6 chose max / 4
  // sf_value before the e4m3 cast exceeded 448 (the block scale saturated).
  bool saturated = false;
};

// Quantizes x[0..15] with `global_scale` (= 1 / k_scale, as the kernel
// computes it: Nvfp4GlobalScale); writes the 16 codes.
Nvfp4Block Nvfp4QuantizeBlock(const float* x, float global_scale,
                              Nvfp4Variant variant, uint8_t* codes);

// 1.0f / checkpoint_scale.
float Nvfp4GlobalScale(float checkpoint_scale);

// The value attention reads for a code under a block scale and the
// checkpoint scale: (E2m1ToFloat(code) * float(e4m3 scale)) * scale.
float Nvfp4Dequantize(uint8_t code, uint8_t scale_bits, float checkpoint_scale);

// Counts of one row's blocks.
struct Nvfp4RowCounts {
  uint64_t blocks = 0;
  uint64_t zero_scale = 0;       // block scale 0: the block reads as zeros
  uint64_t subnormal_scale = 0;  // 0 < scale < 2^-6 (e4m3 subnormals)
  uint64_t saturated_scale = 0;  // the block scale clipped at 448
  uint64_t max4 = 0;             // nvfp4_4over6 chose max / 4
};

// Quantize-dequantize of `x` (blocks of 16 consecutive values: lay out one
// head's head_dim values contiguously, head_dim a multiple of 16 as vLLM
// requires) under `checkpoint_scale` (k_scale or v_scale): `out[i]` is what
// the attention reads for x[i]. InvalidArgument (naming what) when x.size()
// is not a multiple of 16, out.size() differs, or the scale is not finite
// and > 0 with a finite 1 / scale; nothing is written then. `counts`, when
// given, is added to.
absl::Status Nvfp4FakeQuantize(absl::Span<const float> x,
                               float checkpoint_scale, Nvfp4Variant variant,
                               absl::Span<float> out,
                               Nvfp4RowCounts* counts = nullptr);

}  // namespace kvcal

#endif  // KVCAL_KERNELS_NVFP4_H_
