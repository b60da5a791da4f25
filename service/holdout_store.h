// A session's held-out batches: chunks a producer marked `holdout`, kept
// whole (never added to the statistics) for Finalize's `evaluate` and the
// `auto` observer, up to a byte budget fixed when the session is created.
//
//   HoldoutStore store(/*budget_bytes=*/64 << 20);
//   KVCAL_RETURN_IF_ERROR(store.Add(HoldoutChunk::Of("rank0", 7, chunk)));
//   KVCAL_ASSIGN_OR_RETURN(LayerEvaluation e,
//                          store.EvaluateLayer(geometry, layer_scales, {}));
//
// What a held-out chunk carries (kvcal.v1 IngestRequest.holdout): whole
// sequences. Layout kHeadsTokensDim [batch, heads, tokens, head_dim] is
// `batch` sequences of `tokens`; kTokensHeadsDim [..., tokens, heads,
// head_dim] is prod(...) sequences of `tokens` (rank 2: one token). A
// tensor may be split by heads (head_offset), never by tokens.
//
// Reassembly, per (batch, layer, role): the chunks, in (producer, sequence)
// order, are grouped by head_offset; the n-th block of the role is the n-th
// chunk starting at head 0, followed by the n-th chunk starting where that
// one ends, and so on up to the role's head count. Every chunk must belong
// to exactly one block and a block's chunks must agree on sequences and
// tokens. Q, K and V of a (batch, layer) must then list the same sequences
// (count and tokens, in order): those are the sequences evaluated.
//
// The data lives in host memory on every backend (the CUDA backend does not
// yet keep it in device memory).
#ifndef KVCAL_SERVICE_HOLDOUT_STORE_H_
#define KVCAL_SERVICE_HOLDOUT_STORE_H_

#include <array>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/fp8_attention.h"
#include "kernels/scale_math.h"
#include "kernels/types.h"

namespace kvcal::service {

// 64 MiB: CreateSession's holdout_budget_bytes = 0.
inline constexpr uint64_t kDefaultHoldoutBudgetBytes = uint64_t{64} << 20;

// One held-out chunk, owning its data: the chunk's header, its bytes and
// who sent it.
struct HoldoutChunk : ChunkHeader {
  std::string producer_id;
  uint64_t sequence = 0;
  std::string data;

  static HoldoutChunk Of(std::string producer_id, uint64_t sequence,
                         const ChunkView& chunk);
  ChunkView view() const;
  friend bool operator==(const HoldoutChunk&, const HoldoutChunk&) = default;
};

struct RoleShares {
  std::vector<double> saturated, subnormal;  // per head of the role
  double saturated_all = 0.0, subnormal_all = 0.0;
};

// One layer's FP8 attention error on the held-out batches (see
// kernels/fp8_attention.h for the definitions); `_ones` under scale 1.0.
struct LayerEvaluation {
  uint32_t layer = 0;
  double error = 0.0, error_ones = 0.0;
  std::vector<double> head_error, head_error_ones;  // per query head
  std::array<RoleShares, 3> shares, shares_ones;    // by RoleIndex
  // Sums behind `error`, so layers (and sessions) can be combined.
  double error_sq = 0.0, error_sq_ones = 0.0, reference_sq = 0.0;
  uint64_t sequences = 0, tokens = 0;
};

struct EvaluationOptions {
  bool kv_only = false;
  // How Q scales given per query head are applied (ExpandRoleScales): reduced
  // to the max of each KV group, as vLLM's loader does.
  bool q_per_kv_group = true;
};

class HoldoutStore {
 public:
  explicit HoldoutStore(uint64_t budget_bytes = kDefaultHoldoutBudgetBytes);

  // Keeps the chunk (already valid for the session) unless its data would
  // take the store past its budget: ResourceExhausted naming the budget,
  // and nothing changes.
  absl::Status Add(HoldoutChunk chunk);

  // Adds every chunk of `chunks` whose (producer, sequence) the store does
  // not hold yet; ResourceExhausted (nothing changes) when they would pass
  // the budget.
  absl::Status Merge(const std::vector<HoldoutChunk>& chunks);

  std::vector<HoldoutChunk> Chunks() const;
  uint64_t budget_bytes() const { return budget_bytes_; }
  uint64_t bytes() const;
  uint64_t chunks() const;
  // Distinct batch numbers held.
  uint64_t batches() const;
  // Layers with any held-out chunk.
  bool HasLayer(uint32_t layer) const;

  // The FP8 attention error of `layer` under `scales` (Finalize's result for
  // the layer) and under scale 1.0, over every held-out sequence of the
  // layer. FailedPrecondition naming batch and layer when the chunks do not
  // reassemble (see the file comment), when the layer has no held-out data,
  // or when Q, K or V has no scales.
  absl::StatusOr<LayerEvaluation> EvaluateLayer(
      const Geometry& geometry, const LayerScales& scales,
      const EvaluationOptions& options) const;

 private:
  const uint64_t budget_bytes_;
  mutable std::mutex mu_;
  std::vector<HoldoutChunk> chunks_;  // guarded by mu_, in arrival order
  uint64_t bytes_ = 0;                // guarded by mu_
};

}  // namespace kvcal::service

#endif  // KVCAL_SERVICE_HOLDOUT_STORE_H_
