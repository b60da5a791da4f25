// What the session-level tests (non_finite_test, partial_statistics_test)
// share: their small geometry, a chunk that owns its bytes, and a session
// on the CPU backend.
#ifndef KVCAL_TESTS_SERVICE_SESSION_FIXTURE_H_
#define KVCAL_TESTS_SERVICE_SESSION_FIXTURE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "service/session.h"

namespace kvcal::service::fixture {

// 2 layers, 4 query and 2 KV heads of head_dim 8, 16 bins per octave.
inline const Geometry kGeometry{.num_layers = 2,
                                .num_attention_heads = 4,
                                .num_key_value_heads = 2,
                                .head_dim = 8,
                                .bins_per_octave = 16};

// A [tokens, heads, 8] f32 chunk (tokens_heads_dim) owning its bytes, all
// zero; the test writes `values` (in place: the view keeps pointing at
// them, and moving the chunk keeps the buffer).
struct OwnedChunk {
  std::vector<float> values;
  ChunkView view;

  OwnedChunk(uint32_t layer, Role role, uint32_t tokens, uint32_t heads,
             uint64_t batch) {
    values.resize(static_cast<size_t>(tokens) * heads * 8);
    view.layer = layer;
    view.role = role;
    view.dtype = DType::kF32;
    view.layout = Layout::kTokensHeadsDim;
    view.shape = {tokens, heads, 8};
    view.batch = batch;
    view.data = absl::Span<const std::byte>(
        reinterpret_cast<const std::byte*>(values.data()),
        values.size() * sizeof(float));
  }
  // Element (token, head, dim).
  void Set(uint32_t token, uint32_t head, uint32_t dim, float x) {
    values[(static_cast<size_t>(token) * view.shape[1] + head) * 8 + dim] = x;
  }
};

// Session "s" of tenant "t" on the CPU backend (null after a failed
// expectation).
inline std::shared_ptr<Session> MakeCpuSession(const Geometry& geometry,
                                               bool reject_non_finite) {
  SessionOptions options;
  options.backend = BackendKind::kCpu;
  options.reject_non_finite = reject_non_finite;
  auto session = Session::Create("s", "t", geometry, options);
  EXPECT_TRUE(session.ok()) << session.status();
  return session.ok() ? *session : nullptr;
}

}  // namespace kvcal::service::fixture

#endif  // KVCAL_TESTS_SERVICE_SESSION_FIXTURE_H_
