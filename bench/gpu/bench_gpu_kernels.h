// Device helpers of kvcal_bench_gpu: test data and the bandwidth baseline.
#ifndef KVCAL_BENCH_GPU_BENCH_GPU_KERNELS_H_
#define KVCAL_BENCH_GPU_BENCH_GPU_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace kvcal::bench {

// Fills `count` values (f32, or bf16 when `bf16`) with seeded pseudo-normal
// data whose scale differs per head of a [tokens, heads, head_dim] layout,
// plus rare large outliers, so histograms and tails see realistic spread.
cudaError_t FillActivations(void* data, size_t count, bool bf16, uint32_t heads,
                            uint32_t head_dim, uint32_t seed,
                            cudaStream_t stream);

// Reads `bytes` (a multiple of 16, 16-byte aligned) with 16-byte loads and
// folds them into *sink: the achievable read bandwidth.
cudaError_t LaunchReadPass(const void* data, size_t bytes, unsigned* sink,
                           int sm_count, cudaStream_t stream);

}  // namespace kvcal::bench

#endif  // KVCAL_BENCH_GPU_BENCH_GPU_KERNELS_H_
