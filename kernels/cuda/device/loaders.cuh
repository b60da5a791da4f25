// How AccumulateKernel's variants load and decode their data: one load unit
// (a 16-byte vector or a single value) of f32, f16 or bf16 at a time.
#ifndef KVCAL_KERNELS_CUDA_DEVICE_LOADERS_CUH_
#define KVCAL_KERNELS_CUDA_DEVICE_LOADERS_CUH_

#include "kernels/cuda/device/element_math.cuh"

namespace kvcal::cuda {

template <ElementType kType>
__device__ __forceinline__ float Decode16(uint32_t bits) {
  if constexpr (kType == ElementType::kF16) {
    return DecodeF16(static_cast<uint16_t>(bits));
  } else {
    return DecodeBf16(static_cast<uint16_t>(bits));
  }
}

// How a kernel variant loads its data: Raw is one load unit of kValues
// values; a thread issues kUnroll loads per round before using any.
// kUnroll * kValues is 16 values with histograms (so that a warp adds at most
// 512 tail candidates per round) and 32 without.
template <ElementType kType, bool kVectorized, bool kHistograms>
struct Loader;

template <bool kHistograms>
struct Loader<ElementType::kF32, true, kHistograms> {
  using Raw = float4;
  static constexpr int kValues = 4;
  static constexpr int kUnroll = kHistograms ? 4 : 8;
  __device__ __forceinline__ static Raw Load(const void* data, uint64_t unit) {
    return __ldcs(static_cast<const float4*>(data) + unit);
  }
  __device__ __forceinline__ static void Decode(const Raw& raw, float* out) {
    out[0] = raw.x;
    out[1] = raw.y;
    out[2] = raw.z;
    out[3] = raw.w;
  }
};

template <bool kHistograms>
struct Loader<ElementType::kF32, false, kHistograms> {
  using Raw = float;
  static constexpr int kValues = 1;
  static constexpr int kUnroll = 8;
  __device__ __forceinline__ static Raw Load(const void* data, uint64_t unit) {
    return __ldcs(static_cast<const float*>(data) + unit);
  }
  __device__ __forceinline__ static void Decode(const Raw& raw, float* out) {
    out[0] = raw;
  }
};

template <ElementType kType, bool kHistograms>
struct Loader16Vector {
  using Raw = uint4;
  static constexpr int kValues = 8;
  static constexpr int kUnroll = kHistograms ? 2 : 4;
  __device__ __forceinline__ static Raw Load(const void* data, uint64_t unit) {
    return __ldcs(static_cast<const uint4*>(data) + unit);
  }
  // Little-endian: element 2w is the low half of word w.
  __device__ __forceinline__ static void Decode(const Raw& raw, float* out) {
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      out[2 * w] = Decode16<kType>(words[w] & 0xffffu);
      out[2 * w + 1] = Decode16<kType>(words[w] >> 16);
    }
  }
};

template <ElementType kType>
struct Loader16Scalar {
  using Raw = unsigned short;
  static constexpr int kValues = 1;
  static constexpr int kUnroll = 8;
  __device__ __forceinline__ static Raw Load(const void* data, uint64_t unit) {
    return __ldcs(static_cast<const unsigned short*>(data) + unit);
  }
  __device__ __forceinline__ static void Decode(const Raw& raw, float* out) {
    out[0] = Decode16<kType>(raw);
  }
};

template <bool kHistograms>
struct Loader<ElementType::kF16, true, kHistograms>
    : Loader16Vector<ElementType::kF16, kHistograms> {};
template <bool kHistograms>
struct Loader<ElementType::kBf16, true, kHistograms>
    : Loader16Vector<ElementType::kBf16, kHistograms> {};
template <bool kHistograms>
struct Loader<ElementType::kF16, false, kHistograms>
    : Loader16Scalar<ElementType::kF16> {};
template <bool kHistograms>
struct Loader<ElementType::kBf16, false, kHistograms>
    : Loader16Scalar<ElementType::kBf16> {};

}  // namespace kvcal::cuda

#endif  // KVCAL_KERNELS_CUDA_DEVICE_LOADERS_CUH_
