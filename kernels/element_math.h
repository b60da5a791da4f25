// Per-element math shared by every statistics backend.
//
// Everything here is `__host__ __device__` when compiled by nvcc, so the CPU
// reference and the CUDA kernels use the very same code to decode a value and
// to find its histogram bin; the backends cannot drift apart.
//
//   float x = kvcal::DecodeBf16(raw_bits);
//   uint32_t bin = kvcal::HistogramBin(x, /*log2_bins_per_octave=*/4);
//
// Histogram layout (docs/formats.md "Statistics"), B = 2^k bins per octave:
//   bin 0                       |x| == 0 (also -0.0)
//   bin 1                       0 < |x| < 2^-24 (underflow, includes
//                               float32 subnormals)
//   bins 2 .. 2 + 48*B - 1      2^-24 <= |x| < 2^24: octave e in [-24, 24)
//                               and the top k mantissa bits select the bin
//   bin 2 + 48*B                |x| >= 2^24, finite (overflow)
// Non-finite values never reach the histogram.
#ifndef KVCAL_KERNELS_ELEMENT_MATH_H_
#define KVCAL_KERNELS_ELEMENT_MATH_H_

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KVCAL_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define KVCAL_HOST_DEVICE inline
#endif

namespace kvcal {

inline constexpr int kHistogramMinExponent =
    -24;                                          // first exactly binned octave
inline constexpr int kHistogramMaxExponent = 24;  // first overflow octave
inline constexpr int kHistogramOctaves =
    kHistogramMaxExponent - kHistogramMinExponent;
inline constexpr uint32_t kZeroBin = 0;
inline constexpr uint32_t kUnderflowBin = 1;
inline constexpr uint32_t kFirstOctaveBin = 2;
// Number of exactly kept largest |x| values per (layer, role, head).
inline constexpr uint32_t kTailCapacity = 256;

// The bits of `from` as a `To` of the same size (std::bit_cast's job; this
// code is C++17 for nvcc's host compiler).
template <typename To, typename From>
inline To BitCast(const From& from) {
  static_assert(sizeof(To) == sizeof(From), "BitCast between sizes");
  To to;
  std::memcpy(&to, &from, sizeof(to));
  return to;
}

KVCAL_HOST_DEVICE uint32_t FloatBits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  return BitCast<uint32_t>(x);
#endif
}

KVCAL_HOST_DEVICE float BitsToFloat(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  return BitCast<float>(bits);
#endif
}

// bfloat16 is the top half of a float32: widening is exact.
KVCAL_HOST_DEVICE float DecodeBf16(uint16_t bits) {
  return BitsToFloat(static_cast<uint32_t>(bits) << 16);
}

// IEEE binary16 to float32, exact for every input (NaN payloads kept).
KVCAL_HOST_DEVICE float DecodeF16(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) {  // Inf or NaN
    return BitsToFloat(sign | 0x7f800000u | (mantissa << 13));
  }
  if (exponent != 0) {  // normal
    return BitsToFloat(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  }
  if (mantissa == 0) return BitsToFloat(sign);  // +-0
  // Subnormal: value = mantissa * 2^-24; normalise.
  int e = -1;
  do {
    ++e;
    mantissa <<= 1;
  } while ((mantissa & 0x400u) == 0);
  mantissa &= 0x3ffu;
  return BitsToFloat(sign | ((112u - static_cast<uint32_t>(e)) << 23) |
                     (mantissa << 13));
}

// -0.0 becomes +0.0 (IEEE: -0 + +0 = +0); every other value is unchanged.
// min and max see values through this, so their bits do not depend on the
// order in which +0.0 and -0.0 arrive.
KVCAL_HOST_DEVICE float CanonicalZero(float x) { return x + 0.0f; }

// True for NaN and +-Inf.
KVCAL_HOST_DEVICE bool IsNonFinite(float x) {
  return (FloatBits(x) & 0x7f800000u) == 0x7f800000u;
}
KVCAL_HOST_DEVICE bool IsNan(float x) {
  return (FloatBits(x) & 0x7fffffffu) > 0x7f800000u;
}

// For NaN and +-Inf: counts x in `nan` or `inf` and returns true (such a
// value takes part in no other statistic). False for a finite x.
template <typename Count>
KVCAL_HOST_DEVICE bool CountIfNonFinite(float x, Count& nan, Count& inf) {
  if (!IsNonFinite(x)) return false;
  if (IsNan(x)) {
    ++nan;
  } else {
    ++inf;
  }
  return true;
}

KVCAL_HOST_DEVICE uint32_t HistogramBinCount(uint32_t log2_bins_per_octave) {
  return kFirstOctaveBin +
         (static_cast<uint32_t>(kHistogramOctaves) << log2_bins_per_octave) +
         1u;
}

// Bin of a finite x; exact integer arithmetic on the float's bits.
KVCAL_HOST_DEVICE uint32_t HistogramBin(float x,
                                        uint32_t log2_bins_per_octave) {
  const uint32_t bits = FloatBits(x) & 0x7fffffffu;
  if (bits == 0) return kZeroBin;
  const uint32_t biased_exponent = bits >> 23;
  constexpr uint32_t kLowest =
      static_cast<uint32_t>(127 + kHistogramMinExponent);  // 103
  constexpr uint32_t kHighest =
      static_cast<uint32_t>(127 + kHistogramMaxExponent);  // 151
  if (biased_exponent < kLowest) return kUnderflowBin;
  if (biased_exponent >= kHighest) {
    return HistogramBinCount(log2_bins_per_octave) - 1u;
  }
  const uint32_t sub = (bits & 0x7fffffu) >> (23u - log2_bins_per_octave);
  return kFirstOctaveBin +
         ((biased_exponent - kLowest) << log2_bins_per_octave) + sub;
}

// Smallest |x| that falls into `bin` (0 for the zero and underflow bins).
KVCAL_HOST_DEVICE float HistogramBinLowerEdge(uint32_t bin,
                                              uint32_t log2_bins_per_octave) {
  if (bin <= kUnderflowBin) return bin == kZeroBin ? 0.0f : 0.0f;
  const uint32_t overflow = HistogramBinCount(log2_bins_per_octave) - 1u;
  if (bin >= overflow)
    return BitsToFloat((static_cast<uint32_t>(127 + kHistogramMaxExponent))
                       << 23);
  const uint32_t index = bin - kFirstOctaveBin;
  const uint32_t octave = index >> log2_bins_per_octave;
  const uint32_t sub = index & ((1u << log2_bins_per_octave) - 1u);
  return BitsToFloat(
      ((static_cast<uint32_t>(127 + kHistogramMinExponent) + octave) << 23) |
      (sub << (23u - log2_bins_per_octave)));
}

// Exclusive upper edge of `bin`: the lower edge of the next bin. For the zero
// bin it is 0; for the overflow bin it is +Inf (callers cap at the absmax).
KVCAL_HOST_DEVICE float HistogramBinUpperEdge(uint32_t bin,
                                              uint32_t log2_bins_per_octave) {
  if (bin == kZeroBin) return 0.0f;
  if (bin == kUnderflowBin) {
    return BitsToFloat((static_cast<uint32_t>(127 + kHistogramMinExponent))
                       << 23);
  }
  const uint32_t overflow = HistogramBinCount(log2_bins_per_octave) - 1u;
  if (bin >= overflow) return BitsToFloat(0x7f800000u);
  return HistogramBinLowerEdge(bin + 1u, log2_bins_per_octave);
}

}  // namespace kvcal

#endif  // KVCAL_KERNELS_ELEMENT_MATH_H_
