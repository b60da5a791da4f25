// The number format a scale maps values into (FP8 E4M3FN, E4M3FNUZ, E5M2,
// INT8): its range, its grid, and fake quantization as torch computes it.
// This is the scale's number type, not a KV-cache format (which also says how
// scales are laid out and which engine reads them: client/checkpoint/).
#ifndef KVCAL_KERNELS_NUMBER_FORMAT_H_
#define KVCAL_KERNELS_NUMBER_FORMAT_H_

#include <cstdint>

namespace kvcal {

// Numbers match the wire enum (kvcal.v1.Format).
enum class Format : uint32_t {
  kFp8E4m3fn = 1,
  kFp8E4m3fnuz = 2,
  kFp8E5m2 = 3,
  kInt8 = 4,
};
// The spellings of these values (names users type and files record) live
// in one table: proto/kvcal/v1/calibration.proto, read through proto/names.h.

// Largest magnitude of the format: 448, 240, 57344, 127.
float FormatMax(Format format);
// Smallest normal magnitude: 2^-6, 2^-7, 2^-14; 0 for int8 (no subnormals).
float FormatMinNormal(Format format);

// Rounds q (already within [-FormatMax, FormatMax]) to the nearest value of
// the format, ties to even.
float RoundToFormat(float q, Format format);

// The spacing of the format's grid at |q| (q >= 0, below the format's max).
double GridStep(double q, Format format);

// Fake quantization: clamp(x / scale) rounded to the format, times scale,
// all in float32 as torch does it.
float FakeQuantize(float x, float scale, Format format);

// scale = range * margin / FormatMax, FLT_EPSILON when that is 0.
float ScaleFromRange(float range, float margin, Format format);

}  // namespace kvcal

#endif  // KVCAL_KERNELS_NUMBER_FORMAT_H_
