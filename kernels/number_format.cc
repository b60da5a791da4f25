#include "kernels/number_format.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <limits>

namespace kvcal {

namespace {

// The grid of an FP8 format: mantissa bits and smallest normal exponent.
struct FloatGrid {
  int mantissa_bits;
  int min_exponent;
};

FloatGrid FloatGridOf(Format format) {
  if (format == Format::kFp8E4m3fnuz) return {3, -7};
  if (format == Format::kFp8E5m2) return {2, -14};
  return {3, -6};  // e4m3fn
}

}  // namespace

float FormatMax(Format format) {
  switch (format) {
    case Format::kFp8E4m3fn:
      return 448.0f;
    case Format::kFp8E4m3fnuz:
      return 240.0f;
    case Format::kFp8E5m2:
      return 57344.0f;
    case Format::kInt8:
      return 127.0f;
  }
  return 448.0f;
}

float FormatMinNormal(Format format) {
  switch (format) {
    case Format::kFp8E4m3fn:
      return 0x1p-6f;
    case Format::kFp8E4m3fnuz:
      return 0x1p-7f;
    case Format::kFp8E5m2:
      return 0x1p-14f;
    case Format::kInt8:
      return 0.0f;
  }
  return 0x1p-6f;
}

float RoundToFormat(float q, Format format) {
  if (format == Format::kInt8) return std::nearbyint(q);
  const FloatGrid grid = FloatGridOf(format);
  const float a = std::fabs(q);
  if (a == 0.0f || !std::isfinite(a)) return q;
  int e;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  const int exponent = std::max(e - 1, grid.min_exponent);
  const float ulp = std::ldexp(1.0f, exponent - grid.mantissa_bits);
  const float r = std::nearbyint(a / ulp) * ulp;  // a / ulp is exact
  return std::copysign(r, q);
}

float FakeQuantize(float x, float scale, Format format) {
  const float qmax = FormatMax(format);
  const float q = std::clamp(x / scale, -qmax, qmax);
  return RoundToFormat(q, format) * scale;
}

float ScaleFromRange(float range, float margin, Format format) {
  const float scale = (range * margin) / FormatMax(format);
  if (!(scale > 0.0f) || !std::isfinite(scale)) {
    return scale > 0.0f ? std::numeric_limits<float>::max() : FLT_EPSILON;
  }
  return scale;
}

double GridStep(double q, Format format) {
  if (format == Format::kInt8) return 1.0;
  const FloatGrid grid = FloatGridOf(format);
  int e;
  std::frexp(q, &e);  // q = m * 2^e, m in [0.5, 1)
  return std::ldexp(1.0,
                    std::max(e - 1, grid.min_exponent) - grid.mantissa_bits);
}

}  // namespace kvcal
