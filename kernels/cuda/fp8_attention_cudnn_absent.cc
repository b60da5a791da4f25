// Builds without cuDNN (or without the cudnn-frontend headers): the cuDNN FP8
// attention path reports that it is absent.
#include "kernels/cuda/fp8_attention_cudnn.h"

namespace kvcal {

bool HaveCudnnFp8Attention() { return false; }

absl::StatusOr<std::vector<float>> CudnnFp8AttentionOutput(
    int /*device*/, const AttentionInputs& /*inputs*/,
    const HeadScales& /*scales*/) {
  return absl::UnavailableError(
      "this build has no cuDNN FP8 attention (configure with CUDA, cuDNN 9 "
      "and the cudnn-frontend headers: ./run installs them into "
      ".deps/cudnn-frontend)");
}

}  // namespace kvcal
