#include "kernels/cuda/fp8_attention_cudnn.h"

#include <cudnn.h>
#include <cudnn_frontend.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_resources.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/fp8_math.h"
#include "util/status_macros.h"

namespace kvcal {
namespace {

namespace fe = cudnn_frontend;

// Tensor uids of the graph.
enum Uid : int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kDescaleQ,
  kDescaleK,
  kDescaleV,
  kDescaleS,
  kScaleS,
  kScaleO,
  kAmaxS,
  kAmaxO,
};

absl::Status FromFrontend(fe::error_t e, absl::string_view what) {
  if (e.is_good()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("cuDNN FP8 attention: ", what, ": ", e.get_message()));
}

#define KVCAL_FE_RETURN_IF_ERROR(expr, what) \
  KVCAL_RETURN_IF_ERROR(FromFrontend((expr), (what)))

// cuDNN handle, owned.
class CudnnHandle {
 public:
  static absl::StatusOr<CudnnHandle> Create() {
    CudnnHandle h;
    const cudnnStatus_t s = cudnnCreate(&h.handle_);
    if (s != CUDNN_STATUS_SUCCESS) {
      return absl::FailedPreconditionError(
          absl::StrCat("cudnnCreate failed: ", cudnnGetErrorString(s),
                       " (is libcudnn 9 installed next to the CUDA runtime?)"));
    }
    return h;
  }
  CudnnHandle(CudnnHandle&& o) noexcept
      : handle_(std::exchange(o.handle_, nullptr)) {}
  CudnnHandle& operator=(CudnnHandle&&) = delete;
  CudnnHandle(const CudnnHandle&) = delete;
  CudnnHandle& operator=(const CudnnHandle&) = delete;
  ~CudnnHandle() {
    if (handle_ != nullptr) cudnnDestroy(handle_);
  }
  cudnnHandle_t get() const { return handle_; }

 private:
  CudnnHandle() = default;
  cudnnHandle_t handle_ = nullptr;
};

// One causal FP8 SDPA graph: batch 1, `heads` query heads sharing one KV
// head, [1, heads, tokens, dim] Q and O, [1, 1, tokens, dim] K and V.
absl::StatusOr<std::shared_ptr<fe::graph::Graph>> BuildGraph(
    cudnnHandle_t handle, int64_t heads, int64_t tokens, int64_t dim,
    float attn_scale) {
  auto graph = std::make_shared<fe::graph::Graph>();
  graph->set_io_data_type(fe::DataType_t::FP8_E4M3)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  auto bhsd = [&](const char* name, Uid uid, int64_t h) {
    return graph->tensor(
        fe::graph::Tensor_attributes()
            .set_name(name)
            .set_uid(uid)
            .set_dim({1, h, tokens, dim})
            .set_stride({h * tokens * dim, tokens * dim, dim, 1}));
  };
  auto scalar = [&](const char* name, Uid uid) {
    return graph->tensor(fe::graph::Tensor_attributes()
                             .set_name(name)
                             .set_uid(uid)
                             .set_dim({1, 1, 1, 1})
                             .set_stride({1, 1, 1, 1})
                             .set_data_type(fe::DataType_t::FLOAT));
  };
  auto q = bhsd("Q", kQ, heads);
  auto k = bhsd("K", kK, 1);
  auto v = bhsd("V", kV, 1);
  auto options = fe::graph::SDPA_fp8_attributes()
                     .set_name("kvcal_fp8_sdpa")
                     .set_generate_stats(false)
                     .set_causal_mask(true)
                     .set_attn_scale(attn_scale);
  auto [o, stats, amax_s, amax_o] = graph->sdpa_fp8(
      q, k, v, scalar("Descale_Q", kDescaleQ), scalar("Descale_K", kDescaleK),
      scalar("Descale_V", kDescaleV), scalar("Descale_S", kDescaleS),
      scalar("Scale_S", kScaleS), scalar("Scale_O", kScaleO), options);
  (void)stats;
  o->set_output(true)
      .set_uid(kO)
      .set_dim({1, heads, tokens, dim})
      .set_stride({heads * tokens * dim, tokens * dim, dim, 1});
  amax_s->set_output(true)
      .set_uid(kAmaxS)
      .set_dim({1, 1, 1, 1})
      .set_stride({1, 1, 1, 1})
      .set_data_type(fe::DataType_t::FLOAT);
  amax_o->set_output(true)
      .set_uid(kAmaxO)
      .set_dim({1, 1, 1, 1})
      .set_stride({1, 1, 1, 1})
      .set_data_type(fe::DataType_t::FLOAT);
  KVCAL_FE_RETURN_IF_ERROR(graph->validate(), "validate");
  KVCAL_FE_RETURN_IF_ERROR(graph->build_operation_graph(handle),
                           "build_operation_graph");
  KVCAL_FE_RETURN_IF_ERROR(graph->create_execution_plans({fe::HeurMode_t::A}),
                           "create_execution_plans");
  KVCAL_FE_RETURN_IF_ERROR(graph->check_support(), "check_support");
  KVCAL_FE_RETURN_IF_ERROR(graph->build_plans(), "build_plans");
  return graph;
}

}  // namespace

bool HaveCudnnFp8Attention() { return true; }

absl::StatusOr<std::vector<float>> CudnnFp8AttentionOutput(
    int device, const AttentionInputs& in, const HeadScales& scales) {
  // The CPU emulation's checks on shapes and scales.
  KVCAL_RETURN_IF_ERROR(ValidateFp8Attention(in, scales));
  const uint32_t heads = in.num_attention_heads, kv = in.num_key_value_heads,
                 dim = in.head_dim, tokens = in.tokens;
  if (in.q.size() != size_t{tokens} * heads * dim ||
      in.k.size() != size_t{tokens} * kv * dim ||
      in.v.size() != size_t{tokens} * kv * dim) {
    return absl::InvalidArgumentError(
        "cuDNN FP8 attention: inputs do not match their shape");
  }
  if (dim % 16 != 0 || dim > 256) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cuDNN FP8 attention needs head_dim a multiple of 16 up to 256; "
        "got ",
        dim));
  }
  const uint32_t group = heads / kv;
  for (uint32_t g = 0; g < kv; ++g) {
    for (uint32_t i = 1; i < group; ++i) {
      if (scales.q[g * group + i] != scales.q[g * group]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "cuDNN FP8 attention takes one Q scale per KV group; group ", g,
            " has ", scales.q[g * group], " and ", scales.q[g * group + i]));
      }
    }
  }
  std::vector<float> out(size_t{tokens} * heads * dim);
  if (tokens == 0) return out;

  KVCAL_ASSIGN_OR_RETURN(cuda::DeviceGuard guard,
                         cuda::DeviceGuard::Enter(device));
  KVCAL_ASSIGN_OR_RETURN(CudnnHandle handle, CudnnHandle::Create());
  const float attn_scale = 1.0f / std::sqrt(static_cast<float>(dim));
  KVCAL_ASSIGN_OR_RETURN(
      std::shared_ptr<fe::graph::Graph> graph,
      BuildGraph(handle.get(), group, tokens, dim, attn_scale));
  int64_t workspace_bytes = 0;
  KVCAL_FE_RETURN_IF_ERROR(graph->get_workspace_size(workspace_bytes),
                           "get_workspace_size");

  const size_t q_elems = size_t{group} * tokens * dim;
  const size_t kv_elems = size_t{tokens} * dim;
  KVCAL_ASSIGN_OR_RETURN(auto d_q,
                         cuda::DeviceBuffer<uint8_t>::Allocate(q_elems));
  KVCAL_ASSIGN_OR_RETURN(auto d_k,
                         cuda::DeviceBuffer<uint8_t>::Allocate(kv_elems));
  KVCAL_ASSIGN_OR_RETURN(auto d_v,
                         cuda::DeviceBuffer<uint8_t>::Allocate(kv_elems));
  KVCAL_ASSIGN_OR_RETURN(auto d_o,
                         cuda::DeviceBuffer<uint8_t>::Allocate(q_elems));
  KVCAL_ASSIGN_OR_RETURN(auto d_scalars,
                         cuda::DeviceBuffer<float>::Allocate(8));
  KVCAL_ASSIGN_OR_RETURN(
      auto d_workspace,
      cuda::DeviceBuffer<uint8_t>::Allocate(
          static_cast<size_t>(std::max<int64_t>(workspace_bytes, 1))));

  std::vector<uint8_t> h_q(q_elems), h_k(kv_elems), h_v(kv_elems), h_o(q_elems);
  auto quantize = [](float x, float scale) {
    float t = x / scale;
    t = std::min(std::max(t, -kFp8E4m3fnMax), kFp8E4m3fnMax);
    return Fp8E4m3fnFromFloat(t);
  };
  for (uint32_t g = 0; g < kv; ++g) {
    const float qs = scales.q[g * group], ks = scales.k[g], vs = scales.v[g];
    float v_max = 0.0f;
    for (uint32_t t = 0; t < tokens; ++t) {
      for (uint32_t i = 0; i < dim; ++i) {
        const size_t src = (size_t{t} * kv + g) * dim + i;
        h_k[size_t{t} * dim + i] = quantize(in.k[src], ks);
        h_v[size_t{t} * dim + i] = quantize(in.v[src], vs);
        v_max = std::max(v_max,
                         std::fabs(Fp8E4m3fnToFloat(h_v[size_t{t} * dim + i])));
      }
      for (uint32_t h = 0; h < group; ++h) {
        for (uint32_t i = 0; i < dim; ++i) {
          h_q[(size_t{h} * tokens + t) * dim + i] =
              quantize(in.q[(size_t{t} * heads + g * group + h) * dim + i], qs);
        }
      }
    }
    // O = P·V̂ · vs: |O| <= max|V̂| · vs. Its FP8 scale maps that to 448.
    const float o_bound = std::max(v_max * vs, 1e-30f);
    const float scalars[8] = {qs,
                              ks,
                              vs,
                              1.0f / kFp8E4m3fnMax,
                              kFp8E4m3fnMax,
                              kFp8E4m3fnMax / o_bound,
                              0.0f,
                              0.0f};
    KVCAL_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(d_q.get(), h_q.data(), q_elems, cudaMemcpyHostToDevice));
    KVCAL_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(d_k.get(), h_k.data(), kv_elems, cudaMemcpyHostToDevice));
    KVCAL_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(d_v.get(), h_v.data(), kv_elems, cudaMemcpyHostToDevice));
    KVCAL_CUDA_RETURN_IF_ERROR(cudaMemcpy(
        d_scalars.get(), scalars, sizeof(scalars), cudaMemcpyHostToDevice));
    float* s = d_scalars.get();
    std::unordered_map<int64_t, void*> pack = {
        {kQ, d_q.get()},    {kK, d_k.get()},    {kV, d_v.get()},
        {kO, d_o.get()},    {kDescaleQ, s + 0}, {kDescaleK, s + 1},
        {kDescaleV, s + 2}, {kDescaleS, s + 3}, {kScaleS, s + 4},
        {kScaleO, s + 5},   {kAmaxS, s + 6},    {kAmaxO, s + 7}};
    KVCAL_FE_RETURN_IF_ERROR(
        graph->execute(handle.get(), pack, d_workspace.get()), "execute");
    KVCAL_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(h_o.data(), d_o.get(), q_elems, cudaMemcpyDeviceToHost));
    const float o_descale = o_bound / kFp8E4m3fnMax;
    for (uint32_t h = 0; h < group; ++h) {
      for (uint32_t t = 0; t < tokens; ++t) {
        for (uint32_t i = 0; i < dim; ++i) {
          out[(size_t{t} * heads + g * group + h) * dim + i] =
              Fp8E4m3fnToFloat(h_o[(size_t{h} * tokens + t) * dim + i]) *
              o_descale;
        }
      }
    }
  }
  return out;
}

}  // namespace kvcal
