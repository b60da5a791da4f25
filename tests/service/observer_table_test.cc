// The engine's observers (kernels/observers/, one file each) against the
// proto's observer table (proto/kvcal/v1/calibration.proto, ObserverTable()):
// the same numbers, names and "needs histograms", so that an observer added
// to one and not the other fails here. Every definition is also run through
// ComputeScales and Finalize's conversion from the wire.
#include <cmath>
#include <set>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/observers/observer.h"
#include "kernels/scale_math.h"
#include "kernels/statistics.h"
#include "kvcal/v1/calibration.pb.h"
#include "proto/names.h"
#include "service/proto_convert.h"

namespace kvcal {
namespace {

TEST(ObserverTableTest, EveryProtoObserverHasItsEngineDefinition) {
  for (const ObserverRow& row : ObserverTable()) {
    SCOPED_TRACE(row.name);
    const ObserverDefinition* d =
        FindObserver(static_cast<Observer>(row.value));
    ASSERT_NE(d, nullptr) << "no file in kernels/observers/ defines observer "
                          << static_cast<int>(row.value) << " (" << row.name
                          << ")";
    EXPECT_EQ(std::string(d->name), row.name);
    EXPECT_EQ(d->needs_histograms, row.needs_histograms);
    EXPECT_NE(d->range, nullptr);
  }
}

TEST(ObserverTableTest, EveryEngineObserverIsOnTheWire) {
  std::set<int> wire;
  for (const ObserverRow& row : ObserverTable()) wire.insert(row.value);
  ASSERT_FALSE(Observers().empty());
  uint32_t previous = 0;
  for (const ObserverDefinition* d : Observers()) {
    const uint32_t id = static_cast<uint32_t>(d->id);
    EXPECT_GT(id, previous) << d->name << ": ids ascending and distinct";
    previous = id;
    EXPECT_TRUE(wire.count(static_cast<int>(id)))
        << d->name << " (" << id
        << ") has no value with a simplicity in the proto's enum Observer";
    EXPECT_NE(id, static_cast<uint32_t>(v1::OBSERVER_AUTO));
  }
  EXPECT_EQ(Observers().size(), ObserverTable().size());
}

TEST(ObserverTableTest, EveryObserverFinalizesFromTheWire) {
  const Geometry g{.num_layers = 1,
                   .num_attention_heads = 2,
                   .num_key_value_heads = 1,
                   .head_dim = 1,
                   .bins_per_octave = 16};
  SessionStatistics stats(g);
  const uint32_t log2 = g.log2_bins_per_octave();
  for (Role role : g.roles()) {
    for (uint32_t h = 0; h < g.heads(role); ++h) {
      for (uint64_t batch = 0; batch < 3; ++batch) {
        for (int i = 1; i <= 500; ++i) {
          const float x = (i % 2 ? 1.0f : -1.0f) * 0.01f * i * (batch + 1);
          stats.head(0, role, h).Add(x, batch, log2);
        }
      }
    }
  }
  for (const ObserverRow& row : ObserverTable()) {
    SCOPED_TRACE(row.name);
    v1::FinalizeRequest request;
    request.set_observer(row.value);
    request.set_granularity(v1::GRANULARITY_PER_HEAD);
    absl::StatusOr<ScaleOptions> options =
        service::ScaleOptionsFromProto(request);
    ASSERT_TRUE(options.ok()) << options.status();
    absl::StatusOr<ScaleResult> result = ComputeScales(stats, *options);
    ASSERT_TRUE(result.ok()) << result.status();
    for (Role role : g.roles()) {
      for (float scale : result->layers[0].role(role)->scale) {
        EXPECT_TRUE(std::isfinite(scale) && scale > 0.0f) << scale;
        EXPECT_LE(scale, 15.0f / 448.0f * 1.0001f);
      }
    }
  }
}

}  // namespace
}  // namespace kvcal
