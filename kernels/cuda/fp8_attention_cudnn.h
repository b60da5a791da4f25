// FP8 causal attention on the GPU through cuDNN's scaled-dot-product
// attention for FP8 (graph API, via the header-only cudnn-frontend), next to
// kvcal's CPU emulation (kernels/fp8_attention.h). No CUDA types here.
//
//   KVCAL_ASSIGN_OR_RETURN(std::vector<float> out,
//       kvcal::CudnnFp8AttentionOutput(/*device=*/0, inputs, scales));
//
// What runs: Q, K and V are divided by their scales, clamped to ±448 and cast
// to e4m3 on the host (Fp8E4m3fnFromFloat, the same bits as the CPU
// emulation); cuDNN computes S = Q·Kᵀ · descale_q · descale_k · s (s =
// 1/sqrt(head_dim)), causal softmax, P quantized to e4m3 with scale 448
// (cuDNN's FP8 SDPA always quantizes P), O = P·V in FP8 with scale
// 448 / max|V̂|, dequantized here. cuDNN takes one descale per tensor, so the
// attention runs once per KV group with that group's K and V scales and the
// group's Q scale: Q scales must be equal within each KV group (vLLM's
// per-head layout with q reduced per KV group, or per tensor); otherwise
// InvalidArgument.
//
// Requires a Hopper (sm_90) or newer GPU, cuDNN >= 9.1 and head_dim a
// multiple of 16 up to 256; FailedPrecondition otherwise (and Unavailable
// from builds without cuDNN).
#ifndef KVCAL_KERNELS_CUDA_FP8_ATTENTION_CUDNN_H_
#define KVCAL_KERNELS_CUDA_FP8_ATTENTION_CUDNN_H_

#include <vector>

#include "absl/status/statusor.h"
#include "kernels/fp8_attention.h"

namespace kvcal {

// True when this build has the cuDNN path.
bool HaveCudnnFp8Attention();

// The FP8 attention output of one sequence, [tokens, num_attention_heads,
// head_dim] float32 (compare with Fp8AttentionOutput with quantize_probs).
absl::StatusOr<std::vector<float>> CudnnFp8AttentionOutput(
    int device, const AttentionInputs& inputs, const HeadScales& scales);

}  // namespace kvcal

#endif  // KVCAL_KERNELS_CUDA_FP8_ATTENTION_CUDNN_H_
