// Partial statistics (IngestRequest.partial_statistics): what a
// local-statistics producer sends instead of its chunks. Merged exactly into
// the session, numbered in the producer's sequence space (duplicates change
// nothing, gaps are refused), refused when computed with other options or
// holding another worker's layers, and never applied in part.
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service/session.h"
#include "service/session_registry.h"
#include "tests/service/session_fixture.h"

namespace kvcal::service {
namespace {

using ::testing::HasSubstr;

using fixture::kGeometry;

// A [5, heads, 8] f32 chunk of heavy-tailed values, a different pattern per
// (seed, batch).
struct Chunk : fixture::OwnedChunk {
  Chunk(uint32_t layer, Role role, uint32_t heads, uint64_t batch,
        uint32_t seed)
      : OwnedChunk(layer, role, /*tokens=*/5, heads, batch) {
    uint32_t x = seed * 2654435761u + static_cast<uint32_t>(batch) + 1;
    for (float& v : values) {
      x = x * 1664525u + 1013904223u;
      const float u = static_cast<float>(x >> 8) / 16777216.0f - 0.5f;
      v = u / (0.02f + std::abs(u)) * static_cast<float>(1 + batch % 3);
    }
  }
};

using fixture::MakeCpuSession;

// The chunks of batches [first, last) for every layer and role.
std::vector<Chunk> Batches(uint64_t first, uint64_t last, uint32_t seed) {
  std::vector<Chunk> chunks;
  for (uint64_t b = first; b < last; ++b) {
    for (uint32_t layer = 0; layer < kGeometry.num_layers; ++layer) {
      chunks.emplace_back(layer, Role::kQ, 4, b, seed);
      chunks.emplace_back(layer, Role::kK, 2, b, seed);
      chunks.emplace_back(layer, Role::kV, 2, b, seed);
    }
  }
  return chunks;
}

// What a local-statistics producer holds after `chunks`: the statistics and
// the counters an in-band session would have added.
struct Partial {
  std::string statistics;
  SessionCounters counters;
};

Partial Accumulate(const std::vector<Chunk>& chunks) {
  std::shared_ptr<Session> local = MakeCpuSession(kGeometry, false);
  uint64_t sequence = 0;
  for (const Chunk& c : chunks) {
    EXPECT_TRUE(local->Ingest("local", ++sequence, c.view).ok());
  }
  auto snapshot = local->Export();
  EXPECT_TRUE(snapshot.ok());
  return {snapshot->statistics, snapshot->counters};
}

absl::StatusOr<IngestOutcome> Send(Session& session, uint64_t sequence,
                                   const Partial& partial,
                                   const std::string& worker = "") {
  return session.IngestPartial("p", sequence, partial.statistics,
                               partial.counters, {}, worker);
}

void ExpectSameScales(Session& a, Session& b) {
  for (Observer observer :
       {Observer::kStaticMinMax, Observer::kMinMaxEma,
        Observer::kMemorylessMinMax, Observer::kMse, Observer::kPercentile}) {
    for (Granularity granularity :
         {Granularity::kPerTensor, Granularity::kPerHead}) {
      ScaleOptions options;
      options.observer = observer;
      options.granularity = granularity;
      auto sa = a.Finalize(options);
      auto sb = b.Finalize(options);
      ASSERT_TRUE(sa.ok()) << sa.status();
      ASSERT_TRUE(sb.ok()) << sb.status();
      ASSERT_EQ(sa->layers.size(), sb->layers.size());
      for (size_t l = 0; l < sa->layers.size(); ++l) {
        for (Role r : {Role::kQ, Role::kK, Role::kV}) {
          const auto& ra = sa->layers[l].role(r);
          const auto& rb = sb->layers[l].role(r);
          ASSERT_TRUE(ra.has_value() && rb.has_value());
          // Bit for bit: == on floats, no tolerance.
          EXPECT_EQ(ra->scale, rb->scale)
              << "observer " << static_cast<int>(observer) << " layer " << l;
          EXPECT_EQ(ra->absmax, rb->absmax);
          EXPECT_EQ(ra->count, rb->count);
        }
      }
    }
  }
}

TEST(PartialStatisticsTest, NumberedPartialsEqualTheChunksInBand) {
  // In-band: batches 0..5 as chunks. Partial: the same batches as three
  // partials of two batches each, sequences 1..3.
  std::shared_ptr<Session> in_band = MakeCpuSession(kGeometry, false);
  uint64_t sequence = 0;
  for (const Chunk& c : Batches(0, 6, 7)) {
    ASSERT_TRUE(in_band->Ingest("p", ++sequence, c.view).ok());
  }
  std::shared_ptr<Session> partial = MakeCpuSession(kGeometry, false);
  for (uint64_t n = 0; n < 3; ++n) {
    auto outcome =
        Send(*partial, n + 1, Accumulate(Batches(2 * n, 2 * n + 2, 7)));
    ASSERT_TRUE(outcome.ok()) << outcome.status();
    EXPECT_TRUE(outcome->applied);
    EXPECT_EQ(outcome->watermark, n + 1);
  }
  ExpectSameScales(*in_band, *partial);
  auto a = in_band->Info();
  auto b = partial->Info();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->counters.chunks_applied, b->counters.chunks_applied);
  EXPECT_EQ(a->counters.values_ingested, b->counters.values_ingested);
  EXPECT_EQ(a->counters.bytes_ingested, b->counters.bytes_ingested);
  EXPECT_EQ(b->producers.at(0).watermark, 3u);
}

TEST(PartialStatisticsTest, DuplicatesChangeNothingAndGapsAreRefused) {
  std::shared_ptr<Session> session = MakeCpuSession(kGeometry, false);
  const Partial first = Accumulate(Batches(0, 2, 3));
  ASSERT_TRUE(Send(*session, 1, first).ok());
  auto before = session->Export();
  ASSERT_TRUE(before.ok());
  // Sent again (a resend after a broken stream), with other contents even:
  // sequence 1 is applied already.
  const Partial other = Accumulate(Batches(5, 6, 9));
  for (uint64_t sequence : {0u, 1u}) {
    auto dup = Send(*session, sequence, other);
    ASSERT_TRUE(dup.ok()) << dup.status();
    EXPECT_FALSE(dup->applied);
    EXPECT_EQ(dup->watermark, 1u);
  }
  auto gap = Send(*session, 3, other);
  EXPECT_EQ(gap.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(gap.status().message(),
              HasSubstr("partial statistics 3 from producer 'p': sequence "
                        "gap, expected sequence 2 (watermark 1)"));
  auto after = session->Export();
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(before->statistics, after->statistics);
  EXPECT_EQ(before->counters.values_ingested, after->counters.values_ingested);
  // A new producer starts at 1.
  EXPECT_THAT(session->IngestPartial("q", 2, other.statistics, {}, {}, "")
                  .status()
                  .message(),
              HasSubstr("expected sequence 1 (watermark 0)"));
}

TEST(PartialStatisticsTest, OtherOptionsAreFailedPreconditionAndChangeNothing) {
  std::shared_ptr<Session> session = MakeCpuSession(kGeometry, false);
  ASSERT_TRUE(Send(*session, 1, Accumulate(Batches(0, 1, 1))).ok());
  auto before = session->Export();
  ASSERT_TRUE(before.ok());
  // Statistics with 32 bins per octave instead of 16; with one layer more.
  Geometry finer = kGeometry;
  finer.bins_per_octave = 32;
  Geometry deeper = kGeometry;
  deeper.num_layers = 3;
  for (const Geometry& other : {finer, deeper}) {
    SessionStatistics stats(other);
    auto status = session->IngestPartial("p", 2, stats.Serialize(), {}, {}, "");
    EXPECT_EQ(status.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(status.status().message(),
                HasSubstr("partial statistics 2 from producer 'p': computed "
                          "with geometry {"));
    EXPECT_THAT(status.status().message(), HasSubstr("but session 's' has {"));
  }
  auto garbage = session->IngestPartial("p", 2, "not statistics", {}, {}, "");
  EXPECT_EQ(garbage.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(garbage.status().message(),
              HasSubstr("partial statistics 2 from producer 'p': "));
  auto after = session->Export();
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(before->statistics, after->statistics);
  EXPECT_EQ(after->producers.at(0).watermark, 1u);
}

TEST(PartialStatisticsTest, NonFiniteRefusedWhenTheSessionRejectsThem) {
  std::vector<Chunk> chunks = Batches(0, 1, 2);
  chunks[1].values[3] = std::nanf("");
  const Partial with_nan = Accumulate(chunks);
  std::shared_ptr<Session> rejecting = MakeCpuSession(kGeometry, true);
  auto refused = Send(*rejecting, 1, with_nan);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("rejects non-finite"));
  auto info = rejecting->Info();
  ASSERT_TRUE(info.ok());
  EXPECT_TRUE(info->producers.empty());  // not even registered
  // Counted where the session counts them.
  std::shared_ptr<Session> counting = MakeCpuSession(kGeometry, false);
  ASSERT_TRUE(Send(*counting, 1, with_nan).ok());
  auto counted = counting->Info();
  ASSERT_TRUE(counted.ok());
  EXPECT_EQ(counted->counters.nonfinite_values, 1u);
}

TEST(PartialStatisticsTest, AnotherWorkersLayerIsRefused) {
  SessionRegistry registry({});
  const ShardMap map{{"a", "b"}, {0, 1}};
  auto session = registry.Create("t", "s", kGeometry, map);
  ASSERT_TRUE(session.ok()) << session.status();
  // Layer 0 only: worker a takes it, worker b refuses it.
  std::vector<Chunk> layer0;
  for (Chunk& c : Batches(0, 1, 4)) {
    if (c.view.layer == 0) layer0.push_back(std::move(c));
  }
  const Partial partial = Accumulate(layer0);
  auto wrong = Send(**session, 1, partial, "b");
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(wrong.status().message(),
              HasSubstr("layer 0 of session 's' belongs to worker 'a', not to "
                        "this worker 'b'"));
  auto right = Send(**session, 1, partial, "a");
  ASSERT_TRUE(right.ok()) << right.status();
  EXPECT_TRUE(right->applied);
  // Both layers in one partial: refused on either worker.
  EXPECT_FALSE(Send(**session, 2, Accumulate(Batches(1, 2, 4)), "a").ok());
}

}  // namespace
}  // namespace kvcal::service
