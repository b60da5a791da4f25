// The grid-stride walk over one head's load units of a chunk.
#ifndef KVCAL_KERNELS_CUDA_DEVICE_HEAD_WALK_CUH_
#define KVCAL_KERNELS_CUDA_DEVICE_HEAD_WALK_CUH_

#include "kernels/cuda/device/element_math.cuh"

namespace kvcal::cuda {

// The load units of head h that one thread visits: flat indices j = t,
// t + stride, ... below total over the head's outer x units_per_row units.
// Unit u of row o sits at (o * heads + h) * units_per_row + u; the walk tracks
// (row, unit-in-row) and the absolute unit index incrementally.
struct HeadWalk {
  uint64_t total;
  uint64_t units_per_row;
  uint64_t stride;
  uint64_t stride_units;  // stride % units_per_row
  uint64_t step;          // absolute advance of one stride, before the carry
  uint64_t carry_step;    // extra advance when the unit-in-row wraps
  uint64_t j;
  uint64_t in_row;
  uint64_t unit;

  __device__ __forceinline__ HeadWalk(const ChunkLaunch& chunk, uint32_t h,
                                      uint32_t values_per_unit) {
    units_per_row = chunk.inner / values_per_unit;
    total = chunk.outer * units_per_row;
    const uint64_t row_step =
        static_cast<uint64_t>(chunk.heads) * units_per_row;
    stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
    const uint64_t stride_rows = stride / units_per_row;
    stride_units = stride - stride_rows * units_per_row;
    step = stride_rows * row_step + stride_units;
    carry_step = row_step - units_per_row;
    j = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    in_row = j % units_per_row;
    unit = (j / units_per_row) * row_step +
           static_cast<uint64_t>(h) * units_per_row + in_row;
  }
  __device__ __forceinline__ bool Valid() const { return j < total; }
  __device__ __forceinline__ void Advance() {
    j += stride;
    in_row += stride_units;
    unit += step;
    if (in_row >= units_per_row) {  // stride_units < units_per_row: one carry
      in_row -= units_per_row;
      unit += carry_step;
    }
  }
};

}  // namespace kvcal::cuda

#endif  // KVCAL_KERNELS_CUDA_DEVICE_HEAD_WALK_CUH_
