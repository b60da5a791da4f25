// Non-finite activations at the session level (CPU backend): by default they
// are counted and the session says where (Session Info, Finalize); a session
// created with reject_non_finite refuses any chunk holding one, in-band,
// split into receive-buffer pieces or held out, naming layer, role, head and
// counts, and changes nothing; imports cannot bring them in; the option
// survives the state (export, the state dir's proto) and is part of the
// session's identity for CreateSession.
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvcal/v1/calibration.pb.h"
#include "service/proto_convert.h"
#include "service/session.h"
#include "service/session_registry.h"
#include "tests/service/session_fixture.h"

namespace kvcal::service {
namespace {

using ::testing::HasSubstr;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

using fixture::kGeometry;

// A [tokens, heads, 8] f32 chunk of a fixed ramp of values.
struct Chunk : fixture::OwnedChunk {
  Chunk(uint32_t layer, Role role, uint32_t tokens, uint32_t heads,
        uint64_t batch = 0)
      : OwnedChunk(layer, role, tokens, heads, batch) {
    for (size_t i = 0; i < values.size(); ++i) {
      values[i] = 0.01f * static_cast<float>(i % 97) - 0.3f;
    }
  }
};

std::shared_ptr<Session> MakeSession(bool reject) {
  return fixture::MakeCpuSession(kGeometry, reject);
}

// Everything a refused chunk must leave as it was.
void ExpectSameState(const SessionSnapshot& a, const SessionSnapshot& b) {
  EXPECT_EQ(a.statistics, b.statistics);
  EXPECT_EQ(a.counters.chunks_applied, b.counters.chunks_applied);
  EXPECT_EQ(a.counters.values_ingested, b.counters.values_ingested);
  EXPECT_EQ(a.counters.bytes_ingested, b.counters.bytes_ingested);
  EXPECT_EQ(a.counters.nonfinite_values, b.counters.nonfinite_values);
  EXPECT_EQ(a.producers, b.producers);
  EXPECT_EQ(a.holdout_chunks, b.holdout_chunks);
}

TEST(NonFiniteSessionTest, CountedByDefaultAndListedPerHead) {
  auto session = MakeSession(false);
  ASSERT_NE(session, nullptr);
  Chunk k(1, Role::kK, 10, 2);
  for (uint32_t t = 0; t < 10; ++t) {
    for (uint32_t d = 0; d < 8; ++d) k.Set(t, 1, d, kNaN);  // all of head 1
  }
  k.Set(3, 0, 2, -kInf);
  k.Set(4, 0, 2, kInf);
  auto applied = session->Ingest("p", 1, k.view);
  ASSERT_TRUE(applied.ok()) << applied.status();
  EXPECT_TRUE(applied->applied);
  auto info = session->Info();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_FALSE(info->reject_non_finite);
  EXPECT_EQ(info->counters.nonfinite_values, 82u);
  EXPECT_EQ(info->nonfinite_heads.total_heads, 2u);
  EXPECT_EQ(info->nonfinite_heads.heads,
            (std::vector<NonFiniteHead>{{1, Role::kK, 0, 0, 2},
                                        {1, Role::kK, 1, 80, 0}}));

  // Finalize lists them for its layers only.
  EvaluatedFinalizeOptions options;
  options.scale.allow_missing = true;
  auto all = session->Finalize(options);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->nonfinite_heads.total_heads, 2u);
  EXPECT_EQ(all->nonfinite_heads.heads, info->nonfinite_heads.heads);
  options.scale.layers = {0};
  auto layer0 = session->Finalize(options);
  ASSERT_TRUE(layer0.ok()) << layer0.status();
  EXPECT_EQ(layer0->nonfinite_heads.total_heads, 0u);
  EXPECT_TRUE(layer0->nonfinite_heads.heads.empty());

  // On the wire.
  kvcal::v1::Session proto;
  SessionInfoToProto(*info, &proto);
  ASSERT_EQ(proto.nonfinite_heads_size(), 2);
  EXPECT_EQ(proto.nonfinite_heads(1).layer(), 1u);
  EXPECT_EQ(proto.nonfinite_heads(1).role(), kvcal::v1::ROLE_K);
  EXPECT_EQ(proto.nonfinite_heads(1).head(), 1u);
  EXPECT_EQ(proto.nonfinite_heads(1).nan(), 80u);
  EXPECT_EQ(proto.nonfinite_heads_total(), 2u);
}

TEST(NonFiniteSessionTest, RejectingSessionRefusesTheChunkAndChangesNothing) {
  auto session = MakeSession(true);
  ASSERT_NE(session, nullptr);
  Chunk clean(0, Role::kQ, 6, 4);
  ASSERT_TRUE(session->Ingest("p", 1, clean.view).ok());
  auto before = session->Export();
  ASSERT_TRUE(before.ok()) << before.status();

  Chunk bad(0, Role::kK, 6, 2);
  bad.Set(5, 1, 7, kInf);  // one +Inf among finite values
  auto refused = session->Ingest("p", 2, bad.view);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("chunk 2 from producer 'p': 1 non-finite values (0 "
                        "NaN, 1 Inf) in layer 0 K: head 1 (0 NaN, 1 Inf); "
                        "session 's' rejects non-finite values"));
  auto after = session->Export();
  ASSERT_TRUE(after.ok()) << after.status();
  ExpectSameState(*before, *after);

  // Resending the same sequence is still refused (not taken for a
  // duplicate); the fixed chunk then applies as sequence 2.
  EXPECT_EQ(session->Ingest("p", 2, bad.view).status().code(),
            absl::StatusCode::kInvalidArgument);
  bad.Set(5, 1, 7, 1.0f);
  auto fixed = session->Ingest("p", 2, bad.view);
  ASSERT_TRUE(fixed.ok()) << fixed.status();
  EXPECT_TRUE(fixed->applied);

  // A new producer whose first chunk is refused is not registered.
  Chunk nan_q(1, Role::kQ, 2, 4);
  nan_q.Set(0, 3, 0, kNaN);
  EXPECT_EQ(session->Ingest("new", 1, nan_q.view).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto info = session->Info();
  ASSERT_TRUE(info.ok());
  ASSERT_EQ(info->producers.size(), 1u);
  EXPECT_EQ(info->producers[0].producer_id, "p");
  EXPECT_EQ(info->producers[0].watermark, 2u);
  EXPECT_EQ(info->counters.nonfinite_values, 0u);
  EXPECT_TRUE(info->reject_non_finite);

  // A duplicate is acknowledged without being read.
  auto duplicate = session->Ingest("p", 1, nan_q.view);
  ASSERT_TRUE(duplicate.ok()) << duplicate.status();
  EXPECT_FALSE(duplicate->applied);
}

// Chunks straight from gRPC's receive buffers come as pieces that may split
// a value; held-out chunks are kept whole. Both are checked the same way.
TEST(NonFiniteSessionTest, PiecesAndHeldOutChunksAreCheckedToo) {
  auto session = MakeSession(true);
  ASSERT_NE(session, nullptr);
  auto before = session->Export();
  ASSERT_TRUE(before.ok());

  Chunk bad(1, Role::kV, 9, 2);
  bad.Set(8, 0, 5, kNaN);
  ChunkView pieces = bad.view;
  pieces.data = {};
  const absl::Span<const std::byte> bytes = bad.view.data;
  for (size_t at = 0; at < bytes.size(); at += 7) {
    pieces.pieces.push_back(
        bytes.subspan(at, std::min<size_t>(7, bytes.size() - at)));
  }
  auto refused = session->Ingest("p", 1, pieces);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("in layer 1 V: head 0 (1 NaN, 0 Inf)"));

  Chunk held_out(0, Role::kQ, 5, 4, /*batch=*/9);
  held_out.Set(2, 2, 2, -kInf);
  refused = session->Ingest("p", 1, held_out.view, /*holdout=*/true);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("head 2 (0 NaN, 1 Inf)"));
  EXPECT_EQ(session->holdout().chunks(), 0u);
  auto after = session->Export();
  ASSERT_TRUE(after.ok());
  ExpectSameState(*before, *after);
}

// Held-out chunks are kept whole for Finalize's evaluation, which runs
// attention on them: a NaN or Inf would make every error NaN (and auto pick
// an observer on NaN). Every session refuses them, counting or not.
TEST(NonFiniteSessionTest, HeldOutChunksMustBeFiniteInEverySession) {
  auto session = MakeSession(false);
  ASSERT_NE(session, nullptr);
  Chunk held(1, Role::kV, 4, 2, /*batch=*/3);
  held.Set(3, 1, 0, kInf);
  auto refused = session->Ingest("p", 1, held.view, /*holdout=*/true);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("chunk 1 from producer 'p': 1 non-finite values (0 "
                        "NaN, 1 Inf) in layer 1 V: head 1 (0 NaN, 1 Inf); "
                        "held-out chunks must be finite"));
  auto info = session->Info();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->holdout_chunks, 0u);
  EXPECT_TRUE(info->producers.empty());
  // The same values as a calibration chunk are counted, as always.
  auto counted = session->Ingest("p", 1, held.view);
  ASSERT_TRUE(counted.ok()) << counted.status();
  EXPECT_TRUE(counted->applied);
  info = session->Info();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->counters.nonfinite_values, 1u);
}

TEST(NonFiniteSessionTest, ImportsCannotBringNonFiniteValuesIn) {
  auto counting = MakeSession(false);
  ASSERT_NE(counting, nullptr);
  Chunk nan_k(0, Role::kK, 3, 2);
  nan_k.Set(0, 0, 0, kNaN);
  ASSERT_TRUE(counting->Ingest("p", 1, nan_k.view).ok());
  auto with_nan = counting->Export();
  ASSERT_TRUE(with_nan.ok());
  EXPECT_FALSE(with_nan->reject_non_finite);

  auto rejecting = MakeSession(true);
  ASSERT_NE(rejecting, nullptr);
  auto before = rejecting->Export();
  ASSERT_TRUE(before.ok());
  absl::Status merged = rejecting->Merge(*with_nan, "import-1");
  EXPECT_EQ(merged.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(merged.message()),
              HasSubstr("first: layer 0 K head 0, 1 NaN, 0 Inf"));
  auto after = rejecting->Export();
  ASSERT_TRUE(after.ok());
  ExpectSameState(*before, *after);
  EXPECT_TRUE(after->applied_import_ids.empty());

  // A held-out chunk with a NaN in the state (from an older worker: this
  // one refuses such chunks): refused by every session.
  auto holdout_source = MakeSession(false);
  Chunk held(0, Role::kQ, 2, 4, 5);
  ASSERT_TRUE(holdout_source->Ingest("p", 1, held.view, true).ok());
  auto holdout_state = holdout_source->Export();
  ASSERT_TRUE(holdout_state.ok());
  ASSERT_EQ(holdout_state->holdout_chunks.size(), 1u);
  const float nan = kNaN;
  std::memcpy(holdout_state->holdout_chunks[0].data.data() + 4 * (4 * 8 + 1),
              &nan, sizeof(nan));
  for (bool reject : {true, false}) {
    auto target = MakeSession(reject);
    const absl::Status refused = target->Merge(*holdout_state, "");
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(refused.message()),
                HasSubstr("held-out chunk 1 from producer 'p' holds 1 "
                          "non-finite values (1 NaN, 0 Inf) in layer 0 Q: "
                          "head 0 (1 NaN, 0 Inf); held-out chunks must be "
                          "finite"));
    EXPECT_EQ(target->holdout().chunks(), 0u);
  }

  // A state that says reject but holds NaN (not written by a worker) does
  // not become a session.
  SessionSnapshot forged = *with_nan;
  forged.reject_non_finite = true;
  SessionOptions options;
  options.backend = BackendKind::kCpu;
  EXPECT_EQ(
      Session::FromSnapshot("f", "t", forged, options, "").status().code(),
      absl::StatusCode::kInvalidArgument);
}

// The option travels with the state: ExportState, the state dir's
// SessionState proto, and the session recreated from it (a restart).
TEST(NonFiniteSessionTest, OptionSurvivesTheState) {
  auto session = MakeSession(true);
  ASSERT_NE(session, nullptr);
  Chunk clean(0, Role::kV, 4, 2);
  ASSERT_TRUE(session->Ingest("p", 1, clean.view).ok());
  auto snapshot = session->Export();
  ASSERT_TRUE(snapshot.ok());
  EXPECT_TRUE(snapshot->reject_non_finite);
  kvcal::v1::SessionState state;
  SnapshotToProto("s", *snapshot, &state);
  EXPECT_TRUE(state.reject_non_finite());
  auto parsed = SnapshotFromProto(state);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_TRUE(parsed->reject_non_finite);
  SessionOptions options;
  options.backend = BackendKind::kCpu;  // the worker's options: no reject
  auto restored = Session::FromSnapshot("s", "t", *parsed, options, "");
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_TRUE((*restored)->reject_non_finite());
  Chunk bad(0, Role::kV, 4, 2);
  bad.Set(0, 0, 0, kNaN);
  EXPECT_EQ((*restored)->Ingest("p", 2, bad.view).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(NonFiniteSessionTest, CreateSessionComparesTheOption) {
  RegistryOptions options;
  options.session.backend = BackendKind::kCpu;
  SessionRegistry registry(options);
  auto created =
      registry.Create("t", "r", kGeometry, {}, {.reject_non_finite = true});
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_TRUE((*created)->reject_non_finite());
  auto again =
      registry.Create("t", "r", kGeometry, {}, {.reject_non_finite = true});
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, *created);
  auto other = registry.Create("t", "r", kGeometry);
  EXPECT_EQ(other.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(std::string(other.status().message()),
              HasSubstr("exists with reject_non_finite true; requested false"));
}

}  // namespace
}  // namespace kvcal::service
