#include <cuda_runtime.h>

#include "bench/gpu/bench_gpu_kernels.h"

namespace kvcal::bench {
namespace {

__device__ __forceinline__ uint32_t Hash(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

__global__ void FillKernel(void* data, size_t count, bool bf16, uint32_t heads,
                           uint32_t head_dim, uint32_t seed) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < count; i += stride) {
    const uint32_t head = static_cast<uint32_t>((i / head_dim) % heads);
    const uint32_t a = Hash(static_cast<uint32_t>(i) ^ seed);
    const uint32_t b = Hash(a + 0x9e3779b9u);
    // Box-Muller from two uniforms in (0, 1].
    const float u1 = (static_cast<float>(a >> 8) + 1.0f) * (1.0f / 16777216.0f);
    const float u2 = static_cast<float>(b >> 8) * (1.0f / 16777216.0f);
    float x = sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
    x *= 0.05f * static_cast<float>(1u << (head % 8));  // per-head scale
    if ((b & 0xffffu) == 0) x *= 40.0f;                 // rare outliers
    if (bf16) {
      uint32_t bits = __float_as_uint(x);
      bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
      static_cast<uint16_t*>(data)[i] = static_cast<uint16_t>(bits >> 16);
    } else {
      static_cast<float*>(data)[i] = x;
    }
  }
}

__global__ void ReadKernel(const uint4* data, size_t vectors, unsigned* sink) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  uint32_t acc = 0;
  for (; i + 3 * stride < vectors; i += 4 * stride) {
    const uint4 a = __ldcs(data + i);
    const uint4 b = __ldcs(data + i + stride);
    const uint4 c = __ldcs(data + i + 2 * stride);
    const uint4 d = __ldcs(data + i + 3 * stride);
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^
           c.w ^ d.x ^ d.y ^ d.z ^ d.w;
  }
  for (; i < vectors; i += stride) {
    const uint4 a = __ldcs(data + i);
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  if (acc == 0x9e3779b9u) atomicAdd(sink, 1u);  // keeps the loads alive
}

}  // namespace

cudaError_t FillActivations(void* data, size_t count, bool bf16, uint32_t heads,
                            uint32_t head_dim, uint32_t seed,
                            cudaStream_t stream) {
  FillKernel<<<1024, 256, 0, stream>>>(data, count, bf16, heads, head_dim,
                                       seed);
  return cudaGetLastError();
}

cudaError_t LaunchReadPass(const void* data, size_t bytes, unsigned* sink,
                           int sm_count, cudaStream_t stream) {
  ReadKernel<<<sm_count * 8, 256, 0, stream>>>(static_cast<const uint4*>(data),
                                               bytes / 16, sink);
  return cudaGetLastError();
}

}  // namespace kvcal::bench
