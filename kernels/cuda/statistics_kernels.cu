// Instantiates the statistics kernels and launches them (see
// statistics_kernels.h for the state layout and the launch interface). Grid
// sizing is the caller's (cuda_backend.cc).
//
// One kernel per header: accumulate_kernel.cuh (a chunk's values into each
// head's statistics, histogram and warp tails) and tail_select_kernel.cuh
// (the warps' tail candidates merged into each head's exact top 256);
// device/ holds the pieces they share. CUB (CCCL, shipped with the toolkit)
// provides the block reduction of the per-thread statistics
// (cub::BlockReduce over BlockStatistics) and the warp prefix sum that
// places tail candidates (cub::WarpScan); the top-256 selection is
// hand-written (bitonic sort, device/bitonic_sort.cuh; radix select per
// head).
#include <utility>

#include "kernels/cuda/accumulate_kernel.cuh"
#include "kernels/cuda/tail_select_kernel.cuh"

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

// Launches `kernel` and returns the launch's own error (cudaLaunchKernelEx),
// never an earlier one left in the thread's last-error slot, which a
// cudaGetLastError() after a <<<>>> launch would report instead.
template <typename... Params, typename... Args>
cudaError_t Launch(void (*kernel)(Params...), dim3 grid, dim3 block,
                   size_t shared_bytes, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = nullptr;
  config.numAttrs = 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
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
  error = Launch(fn, dim3(chunk.blocks_per_head, chunk.heads),
                 dim3(kAccumulateThreads), shared_bytes, stream, state, scratch,
                 chunk);
  if (error != cudaSuccess || !histograms) return error;
  return Launch(
      &TailSelectKernel, dim3(chunk.heads), dim3(kTailSelectThreads), 0, stream,
      state, scratch, chunk.head_base,
      chunk.blocks_per_head * static_cast<uint32_t>(kAccumulateWarps));
}

}  // namespace kvcal::cuda
