// Instantiates the statistics kernels and launches them (see
// statistics_kernels.h). Grid sizing is the caller's (cuda_backend.cc).
#include "kernels/cuda/statistics_kernels.cuh"

namespace kvcal::cuda {
namespace {

using AccumulateFn = void (*)(DeviceState, TailScratch, ChunkLaunch);

template <bool kHistograms>
AccumulateFn SelectAccumulate(ElementType type, bool vectorized) {
  switch (type) {
    case ElementType::kF32:
      return vectorized
                 ? &AccumulateKernel<ElementType::kF32, true, kHistograms>
                 : &AccumulateKernel<ElementType::kF32, false, kHistograms>;
    case ElementType::kF16:
      return vectorized
                 ? &AccumulateKernel<ElementType::kF16, true, kHistograms>
                 : &AccumulateKernel<ElementType::kF16, false, kHistograms>;
    case ElementType::kBf16:
      return vectorized
                 ? &AccumulateKernel<ElementType::kBf16, true, kHistograms>
                 : &AccumulateKernel<ElementType::kBf16, false, kHistograms>;
  }
  return nullptr;
}

AccumulateFn SelectAccumulate(ElementType type, bool vectorized,
                              bool histograms) {
  return histograms ? SelectAccumulate<true>(type, vectorized)
                    : SelectAccumulate<false>(type, vectorized);
}

// Above 48 KiB of dynamic shared memory a kernel must opt in.
cudaError_t AllowSharedBytes(AccumulateFn fn, size_t shared_bytes) {
  if (shared_bytes <= 48u * 1024u) return cudaSuccess;
  return cudaFuncSetAttribute(reinterpret_cast<const void*>(fn),
                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(shared_bytes));
}

}  // namespace

size_t AccumulateSharedBytes(bool histograms, uint32_t bins) {
  if (!histograms) return 0;
  return SharedHistogramBytes(bins) + static_cast<size_t>(kAccumulateWarps) *
                                          kWarpTailBuffer * sizeof(float);
}

cudaError_t AccumulateBlocksPerSm(ElementType type, bool vectorized,
                                  bool histograms, uint32_t bins,
                                  int* blocks_per_sm) {
  const AccumulateFn fn = SelectAccumulate(type, vectorized, histograms);
  if (fn == nullptr) return cudaErrorInvalidValue;
  const size_t shared_bytes = AccumulateSharedBytes(histograms, bins);
  const cudaError_t error = AllowSharedBytes(fn, shared_bytes);
  if (error != cudaSuccess) return error;
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      blocks_per_sm, fn, kAccumulateThreads, shared_bytes);
}

cudaError_t EnqueueChunk(const DeviceState& state, const TailScratch& scratch,
                         const ChunkLaunch& chunk, cudaStream_t stream) {
  const bool histograms = state.bins != 0;
  const AccumulateFn fn =
      SelectAccumulate(chunk.type, chunk.vectorized, histograms);
  if (fn == nullptr || chunk.heads == 0 || chunk.blocks_per_head == 0) {
    return cudaErrorInvalidValue;
  }
  const size_t shared_bytes = AccumulateSharedBytes(histograms, state.bins);
  cudaError_t error = AllowSharedBytes(fn, shared_bytes);
  if (error != cudaSuccess) return error;
  const dim3 grid(chunk.blocks_per_head, chunk.heads);
  fn<<<grid, kAccumulateThreads, shared_bytes, stream>>>(state, scratch, chunk);
  error = cudaGetLastError();
  if (error != cudaSuccess || !histograms) return error;
  TailSelectKernel<<<chunk.heads, kTailSelectThreads, 0, stream>>>(
      state, scratch, chunk.head_base,
      chunk.blocks_per_head * static_cast<uint32_t>(kAccumulateWarps));
  return cudaGetLastError();
}

}  // namespace kvcal::cuda
