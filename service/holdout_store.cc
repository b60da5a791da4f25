#include "service/holdout_store.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <set>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/element_math.h"
#include "util/status_macros.h"

namespace kvcal::service {
namespace {

// Sequences and tokens of a held-out chunk (see the header).
struct SequenceShape {
  uint64_t sequences = 0;
  uint64_t tokens = 0;
  uint32_t heads = 0;
  friend bool operator==(const SequenceShape&, const SequenceShape&) = default;
};

SequenceShape ShapeOf(const HoldoutChunk& c) {
  const std::vector<uint64_t>& s = c.shape;
  SequenceShape out;
  if (c.layout == Layout::kHeadsTokensDim) {
    out.sequences = s[0];
    out.heads = static_cast<uint32_t>(s[1]);
    out.tokens = s[2];
    return out;
  }
  const size_t rank = s.size();
  out.heads = static_cast<uint32_t>(s[rank - 2]);
  out.tokens = rank >= 3 ? s[rank - 3] : 1;
  out.sequences = 1;
  for (size_t i = 0; i + 3 < rank; ++i) out.sequences *= s[i];
  return out;
}

float ElementAt(const HoldoutChunk& c, size_t index) {
  const char* p = c.data.data();
  switch (c.dtype) {
    case DType::kF32: {
      float x;
      std::memcpy(&x, p + index * 4, 4);
      return x;
    }
    case DType::kF16: {
      uint16_t h;
      std::memcpy(&h, p + index * 2, 2);
      return DecodeF16(h);
    }
    case DType::kBf16: {
      uint16_t h;
      std::memcpy(&h, p + index * 2, 2);
      return DecodeBf16(h);
    }
  }
  return 0.0f;
}

// Copies sequence `seq` of chunk `c` into out [tokens, total_heads, dim] at
// the chunk's heads.
void CopySequence(const HoldoutChunk& c, const SequenceShape& shape,
                  uint64_t seq, uint32_t total_heads, uint32_t dim,
                  std::vector<float>& out) {
  for (uint64_t t = 0; t < shape.tokens; ++t) {
    for (uint32_t h = 0; h < shape.heads; ++h) {
      const size_t src =
          c.layout == Layout::kHeadsTokensDim
              ? ((seq * shape.heads + h) * shape.tokens + t) * dim
              : ((seq * shape.tokens + t) * shape.heads + h) * dim;
      const size_t dst = (t * total_heads + c.head_offset + h) * size_t{dim};
      for (uint32_t i = 0; i < dim; ++i) out[dst + i] = ElementAt(c, src + i);
    }
  }
}

// The sequences of one (batch, layer, role): each [tokens, heads, dim].
struct RoleSequences {
  std::vector<uint64_t> tokens;
  std::vector<std::vector<float>> data;
};

absl::StatusOr<RoleSequences> Reassemble(
    const std::vector<const HoldoutChunk*>& pieces, uint32_t heads,
    uint32_t dim, const std::string& where) {
  std::map<uint32_t, std::vector<const HoldoutChunk*>> by_offset;
  for (const HoldoutChunk* c : pieces) by_offset[c->head_offset].push_back(c);
  RoleSequences out;
  const auto first = by_offset.find(0);
  if (first == by_offset.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, ": no held-out chunk starts at head 0"));
  }
  size_t used = 0;
  for (size_t n = 0; n < first->second.size(); ++n) {
    std::vector<const HoldoutChunk*> block;
    uint32_t next = 0;
    while (next < heads) {
      auto it = by_offset.find(next);
      if (it == by_offset.end() || it->second.size() <= n) {
        return absl::FailedPreconditionError(absl::StrCat(
            where, ": held-out block ", n, " has no chunk for head ", next,
            " (chunks split by heads must cover every head, in the same "
            "order)"));
      }
      const HoldoutChunk* c = it->second[n];
      if (!block.empty() &&
          !(ShapeOf(*c).sequences == ShapeOf(*block[0]).sequences &&
            ShapeOf(*c).tokens == ShapeOf(*block[0]).tokens)) {
        return absl::FailedPreconditionError(absl::StrCat(
            where, ": held-out chunks ", block[0]->sequence, " and ",
            c->sequence, " from producer '", c->producer_id,
            "' split one tensor by heads but differ in sequences or tokens"));
      }
      block.push_back(c);
      next += ShapeOf(*c).heads;
    }
    used += block.size();
    const SequenceShape shape = ShapeOf(*block[0]);
    for (uint64_t s = 0; s < shape.sequences; ++s) {
      std::vector<float> seq(shape.tokens * heads * size_t{dim});
      for (const HoldoutChunk* c : block) {
        CopySequence(*c, ShapeOf(*c), s, heads, dim, seq);
      }
      out.tokens.push_back(shape.tokens);
      out.data.push_back(std::move(seq));
    }
  }
  if (used != pieces.size()) {
    return absl::FailedPreconditionError(absl::StrCat(
        where, ": ", pieces.size() - used,
        " held-out chunks do not fit into whole tensors (each tensor's "
        "chunks must start at head 0 and cover every head once)"));
  }
  return out;
}

RoleShares SharesOf(const Fp8AttentionErrorSums& sums, Role role,
                    uint32_t heads) {
  RoleShares out;
  for (uint32_t h = 0; h < heads; ++h) {
    out.saturated.push_back(sums.SaturatedShare(role, h));
    out.subnormal.push_back(sums.SubnormalShare(role, h));
  }
  out.saturated_all = sums.SaturatedShare(role);
  out.subnormal_all = sums.SubnormalShare(role);
  return out;
}

}  // namespace

HoldoutChunk HoldoutChunk::Of(std::string producer_id, uint64_t sequence,
                              const ChunkView& chunk) {
  HoldoutChunk c;
  static_cast<ChunkHeader&>(c) = chunk;
  c.producer_id = std::move(producer_id);
  c.sequence = sequence;
  // A chunk from the zero-copy Ingest path is in gRPC's slices (`pieces`):
  // the held-out copy gathers them.
  c.data.resize(chunk.byte_size());
  chunk.CopyBytes(0, c.data.size(), c.data.data());
  return c;
}

ChunkView HoldoutChunk::view() const {
  return ChunkView{
      *this,
      absl::MakeConstSpan(reinterpret_cast<const std::byte*>(data.data()),
                          data.size()),
      {}};
}

HoldoutStore::HoldoutStore(uint64_t budget_bytes)
    : budget_bytes_(budget_bytes == 0 ? kDefaultHoldoutBudgetBytes
                                      : budget_bytes) {}

absl::Status HoldoutStore::Add(HoldoutChunk chunk) {
  std::lock_guard<std::mutex> lock(mu_);
  if (bytes_ + chunk.data.size() > budget_bytes_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("held-out chunk of ", chunk.data.size(),
                     " bytes would pass the "
                     "session's held-out budget of ",
                     budget_bytes_, " bytes (", bytes_,
                     " held; CreateSession holdout_budget_bytes sets it)"));
  }
  bytes_ += chunk.data.size();
  chunks_.push_back(std::move(chunk));
  return absl::OkStatus();
}

absl::Status HoldoutStore::Merge(const std::vector<HoldoutChunk>& chunks) {
  std::lock_guard<std::mutex> lock(mu_);
  std::set<std::pair<std::string, uint64_t>> held;
  for (const HoldoutChunk& c : chunks_) held.emplace(c.producer_id, c.sequence);
  std::vector<const HoldoutChunk*> fresh;
  uint64_t bytes = 0;
  for (const HoldoutChunk& c : chunks) {
    if (!held.emplace(c.producer_id, c.sequence).second) continue;
    fresh.push_back(&c);
    bytes += c.data.size();
  }
  if (bytes_ + bytes > budget_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the imported state's ", fresh.size(), " held-out chunks (", bytes,
        " bytes) would pass the session's held-out budget of ", budget_bytes_,
        " bytes (", bytes_, " held)"));
  }
  for (const HoldoutChunk* c : fresh) chunks_.push_back(*c);
  bytes_ += bytes;
  return absl::OkStatus();
}

std::vector<HoldoutChunk> HoldoutStore::Chunks() const {
  std::lock_guard<std::mutex> lock(mu_);
  return chunks_;
}

uint64_t HoldoutStore::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_;
}

uint64_t HoldoutStore::chunks() const {
  std::lock_guard<std::mutex> lock(mu_);
  return chunks_.size();
}

uint64_t HoldoutStore::batches() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::set<uint64_t> batches;
  for (const HoldoutChunk& c : chunks_) batches.insert(c.batch);
  return batches.size();
}

bool HoldoutStore::HasLayer(uint32_t layer) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const HoldoutChunk& c : chunks_) {
    if (c.layer == layer) return true;
  }
  return false;
}

namespace {

// The layer's calibrated scales, one per head of each role.
absl::StatusOr<HeadScales> ExpandLayerScales(const Geometry& g,
                                             const LayerScales& scales,
                                             bool q_per_kv_group) {
  HeadScales calibrated;
  for (Role role : kAllRoles) {
    const std::optional<RoleScales>& r = scales.role(role);
    if (!r.has_value() || r->scale.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("layer ", scales.layer, " has no ", RoleName(role),
                       " scales to evaluate (FP8 attention needs Q, K and V)"));
    }
    KVCAL_ASSIGN_OR_RETURN(
        std::vector<float> expanded,
        ExpandRoleScales(r->scale, role, g.num_attention_heads,
                         g.num_key_value_heads, q_per_kv_group));
    (role == Role::kQ   ? calibrated.q
     : role == Role::kK ? calibrated.k
                        : calibrated.v) = std::move(expanded);
  }
  return calibrated;
}

// Q, K and V of one held-out batch of a layer, reassembled into sequences
// (the chunks of each role in (producer, sequence) order); an error unless
// the three carry the same sequences.
absl::StatusOr<std::array<RoleSequences, 3>> BatchSequences(
    const Geometry& g, uint32_t layer, uint64_t batch,
    std::array<std::vector<const HoldoutChunk*>, 3>& roles) {
  std::array<RoleSequences, 3> seqs;
  for (Role role : kAllRoles) {
    auto& pieces = roles[RoleIndex(role)];
    std::sort(pieces.begin(), pieces.end(),
              [](const HoldoutChunk* a, const HoldoutChunk* b) {
                return std::tie(a->producer_id, a->sequence) <
                       std::tie(b->producer_id, b->sequence);
              });
    const std::string where = absl::StrCat("held-out batch ", batch, ", layer ",
                                           layer, ", ", RoleName(role));
    if (pieces.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat(where,
                       ": no chunks (a held-out batch needs Q, K "
                       "and V of the same sequences)"));
    }
    KVCAL_ASSIGN_OR_RETURN(
        seqs[RoleIndex(role)],
        Reassemble(pieces, g.heads(role), g.head_dim, where));
  }
  const RoleSequences& q = seqs[0];
  for (int r = 1; r < 3; ++r) {
    if (seqs[r].tokens != q.tokens) {
      return absl::FailedPreconditionError(absl::StrCat(
          "held-out batch ", batch, ", layer ", layer, ": Q has ",
          q.tokens.size(), " sequences, ", RoleName(kAllRoles[r]), " ",
          seqs[r].tokens.size(),
          " (or their token counts differ): Q, K and V must carry the "
          "same sequences"));
    }
  }
  return seqs;
}

// The layer's evaluation from the error sums with its scales and with 1.0.
LayerEvaluation EvaluationOf(const Geometry& g, uint32_t layer,
                             const Fp8AttentionErrorSums& sums,
                             const Fp8AttentionErrorSums& sums_ones) {
  LayerEvaluation out;
  out.layer = layer;
  out.error = sums.RelativeError();
  out.error_ones = sums_ones.RelativeError();
  for (uint32_t h = 0; h < g.num_attention_heads; ++h) {
    out.head_error.push_back(sums.RelativeError(h));
    out.head_error_ones.push_back(sums_ones.RelativeError(h));
    out.error_sq += sums.error_sq[h];
    out.error_sq_ones += sums_ones.error_sq[h];
    out.reference_sq += sums.reference_sq[h];
  }
  for (Role role : kAllRoles) {
    out.shares[RoleIndex(role)] = SharesOf(sums, role, g.heads(role));
    out.shares_ones[RoleIndex(role)] = SharesOf(sums_ones, role, g.heads(role));
  }
  out.sequences = sums.sequences;
  out.tokens = sums.tokens;
  return out;
}

}  // namespace

absl::StatusOr<LayerEvaluation> HoldoutStore::EvaluateLayer(
    const Geometry& g, const LayerScales& scales,
    const EvaluationOptions& options) const {
  const uint32_t layer = scales.layer;
  const uint32_t heads = g.num_attention_heads, kv = g.num_key_value_heads;
  KVCAL_ASSIGN_OR_RETURN(const HeadScales calibrated,
                         ExpandLayerScales(g, scales, options.q_per_kv_group));
  const HeadScales ones{std::vector<float>(heads, 1.0f),
                        std::vector<float>(kv, 1.0f),
                        std::vector<float>(kv, 1.0f)};

  // (batch) -> role -> chunks.
  std::map<uint64_t, std::array<std::vector<const HoldoutChunk*>, 3>> batches;
  std::lock_guard<std::mutex> lock(mu_);
  for (const HoldoutChunk& c : chunks_) {
    if (c.layer == layer) batches[c.batch][RoleIndex(c.role)].push_back(&c);
  }
  if (batches.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer ", layer, " has no held-out batches"));
  }
  Fp8AttentionErrorSums sums(heads, kv), sums_ones(heads, kv);
  Fp8AttentionOptions attention;
  attention.quantize_q = !options.kv_only;
  for (auto& [batch, roles] : batches) {
    using Sequences = std::array<RoleSequences, 3>;
    KVCAL_ASSIGN_OR_RETURN(const Sequences seqs,
                           BatchSequences(g, layer, batch, roles));
    const RoleSequences& q = seqs[0];
    for (size_t s = 0; s < q.tokens.size(); ++s) {
      if (q.tokens[s] == 0) continue;
      const AttentionInputs in{static_cast<uint32_t>(q.tokens[s]),
                               heads,
                               kv,
                               g.head_dim,
                               q.data[s],
                               seqs[1].data[s],
                               seqs[2].data[s]};
      KVCAL_RETURN_IF_ERROR(
          AccumulateFp8AttentionError(in, calibrated, attention, &sums));
      KVCAL_RETURN_IF_ERROR(
          AccumulateFp8AttentionError(in, ones, attention, &sums_ones));
    }
  }
  return EvaluationOf(g, layer, sums, sums_ones);
}

}  // namespace kvcal::service
