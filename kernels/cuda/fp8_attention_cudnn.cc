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

// The shapes cuDNN's FP8 SDPA takes, beyond the CPU emulation's checks: the
// inputs as long as their shape says, head_dim a multiple of 16 up to 256,
// and one Q scale per KV group (the graph has one Q descale).
absl::Status CheckCudnnInputs(const AttentionInputs& in,
                              const HeadScales& scales) {
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
  return absl::OkStatus();
}

uint8_t QuantizeE4m3(float x, float scale) {
  const float t = std::min(std::max(x / scale, -kFp8E4m3fnMax), kFp8E4m3fnMax);
  return Fp8E4m3fnFromFloat(t);
}

// One KV group's inputs in the graph's layout, quantized to e4m3 on the host:
// Q [group heads][tokens][dim], K and V [tokens][dim].
struct GroupInputs {
  std::vector<uint8_t> q, k, v;
  float v_max = 0.0f;  // max |V̂| (the dequantized e4m3 values)
};

GroupInputs QuantizeGroup(const AttentionInputs& in, const HeadScales& scales,
                          uint32_t g) {
  const uint32_t heads = in.num_attention_heads, kv = in.num_key_value_heads,
                 dim = in.head_dim, tokens = in.tokens;
  const uint32_t group = heads / kv;
  const float qs = scales.q[g * group], ks = scales.k[g], vs = scales.v[g];
  GroupInputs out;
  out.q.resize(size_t{group} * tokens * dim);
  out.k.resize(size_t{tokens} * dim);
  out.v.resize(size_t{tokens} * dim);
  for (uint32_t t = 0; t < tokens; ++t) {
    for (uint32_t i = 0; i < dim; ++i) {
      const size_t src = (size_t{t} * kv + g) * dim + i;
      const size_t dst = size_t{t} * dim + i;
      out.k[dst] = QuantizeE4m3(in.k[src], ks);
      out.v[dst] = QuantizeE4m3(in.v[src], vs);
      out.v_max = std::max(out.v_max, std::fabs(Fp8E4m3fnToFloat(out.v[dst])));
    }
    for (uint32_t h = 0; h < group; ++h) {
      for (uint32_t i = 0; i < dim; ++i) {
        out.q[(size_t{h} * tokens + t) * dim + i] = QuantizeE4m3(
            in.q[(size_t{t} * heads + g * group + h) * dim + i], qs);
      }
    }
  }
  return out;
}

// The graph's device tensors, sized for one KV group, and its handle.
struct GraphBuffers {
  cuda::DeviceBuffer<uint8_t> q, k, v, o;
  cuda::DeviceBuffer<float> scalars;  // the eight scalar tensors
  cuda::DeviceBuffer<uint8_t> workspace;
};

absl::StatusOr<GraphBuffers> AllocateGraphBuffers(size_t q_elems,
                                                  size_t kv_elems,
                                                  int64_t workspace_bytes) {
  GraphBuffers b;
  KVCAL_ASSIGN_OR_RETURN(b.q, cuda::DeviceBuffer<uint8_t>::Allocate(q_elems));
  KVCAL_ASSIGN_OR_RETURN(b.k, cuda::DeviceBuffer<uint8_t>::Allocate(kv_elems));
  KVCAL_ASSIGN_OR_RETURN(b.v, cuda::DeviceBuffer<uint8_t>::Allocate(kv_elems));
  KVCAL_ASSIGN_OR_RETURN(b.o, cuda::DeviceBuffer<uint8_t>::Allocate(q_elems));
  KVCAL_ASSIGN_OR_RETURN(b.scalars, cuda::DeviceBuffer<float>::Allocate(8));
  KVCAL_ASSIGN_OR_RETURN(
      b.workspace, cuda::DeviceBuffer<uint8_t>::Allocate(static_cast<size_t>(
                       std::max<int64_t>(workspace_bytes, 1))));
  return b;
}

// Runs the graph on one group's quantized inputs; returns O in e4m3
// ([group heads][tokens][dim]) and its scale o_bound / 448 through
// `o_descale`.
absl::StatusOr<std::vector<uint8_t>> RunGroup(
    fe::graph::Graph& graph, cudnnHandle_t handle, GraphBuffers& b,
    const GroupInputs& group, float qs, float ks, float vs, float* o_descale) {
  // O = P·V̂ · vs: |O| <= max|V̂| · vs. Its FP8 scale maps that to 448.
  const float o_bound = std::max(group.v_max * vs, 1e-30f);
  const float scalars[8] = {qs,
                            ks,
                            vs,
                            1.0f / kFp8E4m3fnMax,
                            kFp8E4m3fnMax,
                            kFp8E4m3fnMax / o_bound,
                            0.0f,
                            0.0f};
  KVCAL_CUDA_RETURN_IF_ERROR(cudaMemcpy(
      b.q.get(), group.q.data(), group.q.size(), cudaMemcpyHostToDevice));
  KVCAL_CUDA_RETURN_IF_ERROR(cudaMemcpy(
      b.k.get(), group.k.data(), group.k.size(), cudaMemcpyHostToDevice));
  KVCAL_CUDA_RETURN_IF_ERROR(cudaMemcpy(
      b.v.get(), group.v.data(), group.v.size(), cudaMemcpyHostToDevice));
  KVCAL_CUDA_RETURN_IF_ERROR(cudaMemcpy(
      b.scalars.get(), scalars, sizeof(scalars), cudaMemcpyHostToDevice));
  float* s = b.scalars.get();
  std::unordered_map<int64_t, void*> pack = {
      {kQ, b.q.get()},    {kK, b.k.get()},    {kV, b.v.get()},
      {kO, b.o.get()},    {kDescaleQ, s + 0}, {kDescaleK, s + 1},
      {kDescaleV, s + 2}, {kDescaleS, s + 3}, {kScaleS, s + 4},
      {kScaleO, s + 5},   {kAmaxS, s + 6},    {kAmaxO, s + 7}};
  KVCAL_FE_RETURN_IF_ERROR(graph.execute(handle, pack, b.workspace.get()),
                           "execute");
  std::vector<uint8_t> o(group.q.size());
  KVCAL_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(o.data(), b.o.get(), o.size(), cudaMemcpyDeviceToHost));
  *o_descale = o_bound / kFp8E4m3fnMax;
  return o;
}

}  // namespace

bool HaveCudnnFp8Attention() { return true; }

absl::StatusOr<std::vector<float>> CudnnFp8AttentionOutput(
    int device, const AttentionInputs& in, const HeadScales& scales) {
  KVCAL_RETURN_IF_ERROR(CheckCudnnInputs(in, scales));
  const uint32_t heads = in.num_attention_heads, kv = in.num_key_value_heads,
                 dim = in.head_dim, tokens = in.tokens;
  const uint32_t group = heads / kv;
  std::vector<float> out(size_t{tokens} * heads * dim);
  if (tokens == 0) return out;

  KVCAL_ASSIGN_OR_RETURN(cuda::DeviceGuard guard,
                         cuda::DeviceGuard::Enter(device));
  KVCAL_ASSIGN_OR_RETURN(CudnnHandle handle, CudnnHandle::Create());
  const float attn_scale = 1.0f / std::sqrt(static_cast<float>(dim));
  absl::StatusOr<std::shared_ptr<fe::graph::Graph>> built =
      BuildGraph(handle.get(), group, tokens, dim, attn_scale);
  if (!built.ok()) {
    // cuDNN refuses some shapes (on an H200 with cuDNN 9: a single token,
    // "No valid engine configs"): say which.
    return absl::Status(built.status().code(),
                        absl::StrCat(built.status().message(), " (tokens ",
                                     tokens, ", query heads per KV head ",
                                     group, ", head_dim ", dim, ")"));
  }
  std::shared_ptr<fe::graph::Graph> graph = *std::move(built);
  int64_t workspace_bytes = 0;
  KVCAL_FE_RETURN_IF_ERROR(graph->get_workspace_size(workspace_bytes),
                           "get_workspace_size");
  KVCAL_ASSIGN_OR_RETURN(
      GraphBuffers buffers,
      AllocateGraphBuffers(size_t{group} * tokens * dim, size_t{tokens} * dim,
                           workspace_bytes));

  for (uint32_t g = 0; g < kv; ++g) {
    const GroupInputs inputs = QuantizeGroup(in, scales, g);
    float o_descale = 0.0f;
    KVCAL_ASSIGN_OR_RETURN(
        const std::vector<uint8_t> o,
        RunGroup(*graph, handle.get(), buffers, inputs, scales.q[g * group],
                 scales.k[g], scales.v[g], &o_descale));
    for (uint32_t h = 0; h < group; ++h) {
      for (uint32_t t = 0; t < tokens; ++t) {
        for (uint32_t i = 0; i < dim; ++i) {
          out[(size_t{t} * heads + g * group + h) * dim + i] =
              Fp8E4m3fnToFloat(o[(size_t{h} * tokens + t) * dim + i]) *
              o_descale;
        }
      }
    }
  }
  return out;
}

}  // namespace kvcal
