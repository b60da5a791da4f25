// Backend tests, typed over the input dtype. This one source builds two
// executables: kvcal_backend_cpu_test (CPU backend) and, in CUDA builds,
// kvcal_backend_cuda_test (compiled with KVCAL_TEST_CUDA_BACKEND, ctest label
// `gpu`), which skips every test when no device is present.
//
// Every accumulation is checked against the scalar reference in test_util.h:
// bit for bit for min, max, counts, histograms, tails and batch extrema, and
// within a relative tolerance for the double sums.
#include "kernels/backend.h"

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/statistics.h"
#include "kernels/types.h"
#include "tests/kernels/test_util.h"

#if defined(KVCAL_TEST_CUDA_BACKEND)
#include "kernels/cuda/cuda_backend.h"
#endif

namespace kvcal {
namespace {

using ::kvcal::testing::ChunkBuilder;
using ::kvcal::testing::ElementIndex;
using ::kvcal::testing::ExpectMatchesReference;
using ::kvcal::testing::ExpectStatesEqual;
using ::kvcal::testing::IsOk;
using ::kvcal::testing::Reference;
using ::kvcal::testing::Rng;
using ::kvcal::testing::StatusIs;
using ::testing::HasSubstr;

// ---------------------------------------------------------------------------
// The backend under test.
// ---------------------------------------------------------------------------

#if defined(KVCAL_TEST_CUDA_BACKEND)
absl::StatusOr<std::unique_ptr<StatisticsBackend>> NewBackend(
    const Geometry& geometry, const BackendOptions& options = {}) {
  return CreateCudaBackend(geometry, options);
}
// Empty when the backend can run here, else why not.
std::string WhyUnavailable() {
  if (CudaDeviceCount() > 0) return "";
  return "no CUDA device present (" + CudaDeviceDescription(0) +
         "): skipping the CUDA backend tests";
}
#else
absl::StatusOr<std::unique_ptr<StatisticsBackend>> NewBackend(
    const Geometry& geometry, const BackendOptions& options = {}) {
  return CreateCpuBackend(geometry, options);
}
std::string WhyUnavailable() { return ""; }
#endif

Geometry MakeGeometry(uint32_t layers, uint32_t q_heads, uint32_t kv_heads,
                      uint32_t head_dim, uint32_t bins_per_octave,
                      uint32_t role_mask = 0b111) {
  Geometry g;
  g.num_layers = layers;
  g.num_attention_heads = q_heads;
  g.num_key_value_heads = kv_heads;
  g.head_dim = head_dim;
  g.bins_per_octave = bins_per_octave;
  g.role_mask = role_mask;
  return g;
}

template <DType kD>
struct DTypeTag {
  static constexpr DType kValue = kD;
};

class DTypeNames {
 public:
  template <typename T>
  static std::string GetName(int) {
    return std::string(DTypeName(T::kValue));
  }
};

using AllDTypes = ::testing::Types<DTypeTag<DType::kF32>, DTypeTag<DType::kF16>,
                                   DTypeTag<DType::kBf16>>;

// A chunk together with where it goes.
struct Placed {
  std::shared_ptr<ChunkBuilder> chunk;
  uint32_t layer = 0;
  Role role = Role::kQ;
  ChunkView view() const { return chunk->view(layer, role); }
};

template <typename T>
class BackendTest : public ::testing::Test {
 protected:
  static constexpr DType kDType = T::kValue;

  void SetUp() override {
    const std::string why = WhyUnavailable();
    if (!why.empty()) GTEST_SKIP() << why;
  }

  static std::unique_ptr<StatisticsBackend> Make(
      const Geometry& geometry, const BackendOptions& options = {}) {
    auto backend = NewBackend(geometry, options);
    EXPECT_THAT(backend, IsOk());
    if (!backend.ok()) return nullptr;
    return std::move(backend).value();
  }

  static SessionStatistics Snap(StatisticsBackend& backend) {
    auto snapshot = backend.Snapshot();
    EXPECT_THAT(snapshot, IsOk());
    if (!snapshot.ok()) return SessionStatistics(backend.geometry());
    return std::move(snapshot).value();
  }

  static Placed NewChunk(Layout layout, std::vector<uint64_t> shape,
                         uint32_t layer, Role role, uint32_t head_offset = 0,
                         uint64_t batch = 0) {
    Placed p;
    p.chunk = std::make_shared<ChunkBuilder>(kDType, layout, std::move(shape),
                                             head_offset, batch);
    p.layer = layer;
    p.role = role;
    return p;
  }

  // Accumulates every chunk into a fresh backend and into the reference, and
  // compares the two.
  static void RunAndCompare(const Geometry& geometry,
                            const std::vector<Placed>& chunks,
                            const std::string& context = "") {
    auto backend = Make(geometry);
    ASSERT_NE(backend, nullptr);
    Reference ref(geometry);
    for (const Placed& p : chunks) {
      ASSERT_THAT(backend->Accumulate(p.view()), IsOk()) << context;
      ref.Add(*p.chunk, p.layer, p.role);
      ASSERT_TRUE(p.chunk->GuardsIntact()) << context;
    }
    ExpectMatchesReference(ref, Snap(*backend), context);
  }

  // Values from a standard normal scaled per head, never all zero.
  static std::function<float(const ElementIndex&)> NormalValues(Rng& rng) {
    return [&rng](const ElementIndex& at) {
      return static_cast<float>(rng.Normal() * (0.5 + at.head));
    };
  }
};

TYPED_TEST_SUITE(BackendTest, AllDTypes, DTypeNames);

// ---------------------------------------------------------------------------
// Accumulation against the reference.
// ---------------------------------------------------------------------------

TYPED_TEST(BackendTest, FreshBackendIsEmpty) {
  const Geometry g = MakeGeometry(2, 4, 2, 8, 16);
  auto backend = this->Make(g);
  ASSERT_NE(backend, nullptr);
  ExpectMatchesReference(Reference(g), this->Snap(*backend));
  EXPECT_GT(backend->StateBytes(), 0u);
  EXPECT_EQ(backend->geometry(), g);
}

TYPED_TEST(BackendTest, ZeroTokenChunksAreValidAndAddNothing) {
  for (uint32_t bins : {0u, 16u}) {
    const Geometry g = MakeGeometry(1, 4, 2, 8, bins);
    std::vector<Placed> chunks = {
        this->NewChunk(Layout::kTokensHeadsDim, {0, 4, 8}, 0, Role::kQ),
        this->NewChunk(Layout::kTokensHeadsDim, {3, 0, 2, 8}, 0, Role::kK),
        this->NewChunk(Layout::kHeadsTokensDim, {0, 2, 5, 8}, 0, Role::kV),
        this->NewChunk(Layout::kHeadsTokensDim, {2, 4, 0, 8}, 0, Role::kQ, 0,
                       7),
    };
    for (const Placed& p : chunks) ASSERT_EQ(p.chunk->elements(), 0u);
    this->RunAndCompare(g, chunks, "bins " + std::to_string(bins));
  }
}

TYPED_TEST(BackendTest, ShapesLayoutsAndSizes) {
  Rng rng(1);
  for (uint32_t head_dim : {1u, 7u, 128u, 129u}) {
    for (uint32_t bins : {0u, 1u, 16u, 128u}) {
      const Geometry g = MakeGeometry(2, 4, 2, head_dim, bins);
      const uint64_t d = head_dim;
      std::vector<Placed> chunks = {
          this->NewChunk(Layout::kTokensHeadsDim, {4, d}, 0, Role::kQ),
          this->NewChunk(Layout::kTokensHeadsDim, {1, 4, d}, 1, Role::kQ),
          this->NewChunk(Layout::kTokensHeadsDim, {31, 2, d}, 0, Role::kK),
          this->NewChunk(Layout::kTokensHeadsDim, {32, 2, d}, 1, Role::kK),
          this->NewChunk(Layout::kTokensHeadsDim, {33, 2, d}, 0, Role::kV),
          this->NewChunk(Layout::kTokensHeadsDim, {2, 3, 4, d}, 1, Role::kQ, 0,
                         1),
          this->NewChunk(Layout::kTokensHeadsDim, {5, 1, 1, d}, 1, Role::kV, 1,
                         2),
          this->NewChunk(Layout::kHeadsTokensDim, {1, 4, 1, d}, 0, Role::kQ),
          this->NewChunk(Layout::kHeadsTokensDim, {2, 2, 31, d}, 1, Role::kK, 0,
                         3),
          this->NewChunk(Layout::kHeadsTokensDim, {3, 1, 33, d}, 0, Role::kV, 1,
                         3),
      };
      for (Placed& p : chunks) p.chunk->Fill(this->NormalValues(rng));
      this->RunAndCompare(g, chunks,
                          "head_dim " + std::to_string(head_dim) + " bins " +
                              std::to_string(bins));
      if (this->HasFailure()) return;
    }
  }
}

// A chunk handed over in pieces (as a message arrives in receive buffers),
// cut at random byte offsets, values straddling pieces included, gives the
// reference's statistics; a byte count that does not match is rejected. On
// the CPU the result does not depend on where the pieces were cut: every
// cutting gives the same bits.
TYPED_TEST(BackendTest, ChunkInPiecesMatchesReference) {
  Rng rng(41);
  const Geometry g = MakeGeometry(1, 4, 4, 48, 16);
  for (Layout layout : {Layout::kTokensHeadsDim, Layout::kHeadsTokensDim}) {
    Placed p = layout == Layout::kTokensHeadsDim
                   ? this->NewChunk(layout, {37, 4, 48}, 0, Role::kK)
                   : this->NewChunk(layout, {2, 4, 19, 48}, 0, Role::kK);
    p.chunk->Fill([&rng](const ElementIndex& at) {
      if (at.flat % 997 == 5) return std::numeric_limits<float>::quiet_NaN();
      return static_cast<float>(rng.Normal() * (1 + at.head));
    });
    std::optional<SessionStatistics> first;
    for (uint64_t max_piece : {1u, 3u, 97u, 1000u, 5000u, 100000u}) {
      ChunkView view = p.view();
      const absl::Span<const std::byte> all = view.data;
      view.data = {};
      for (size_t at = 0; at < all.size();) {
        const size_t n =
            std::min<size_t>(all.size() - at, rng.UniformInt(1, max_piece));
        view.pieces.push_back(all.subspan(at, n));
        at += n;
      }
      auto backend = this->Make(g);
      ASSERT_NE(backend, nullptr);
      ASSERT_THAT(backend->Accumulate(view), IsOk());
      Reference ref(g);
      ref.Add(*p.chunk, 0, Role::kK);
      const SessionStatistics snap = this->Snap(*backend);
      ExpectMatchesReference(ref, snap,
                             "pieces of at most " + std::to_string(max_piece));
#if !defined(KVCAL_TEST_CUDA_BACKEND)
      if (!first.has_value()) first = snap;
      EXPECT_TRUE(snap == *first) << "pieces of at most " << max_piece;
#endif
      view.pieces.pop_back();
      EXPECT_THAT(backend->Accumulate(view),
                  StatusIs(absl::StatusCode::kInvalidArgument,
                           HasSubstr("bytes, shape")));
    }
  }
}

TYPED_TEST(BackendTest, HeadOffsetTouchesOnlyItsHeads) {
  Rng rng(2);
  const Geometry g = MakeGeometry(1, 8, 8, 16, 16);
  std::vector<Placed> chunks = {
      this->NewChunk(Layout::kTokensHeadsDim, {9, 3, 16}, 0, Role::kQ, 0),
      this->NewChunk(Layout::kTokensHeadsDim, {9, 1, 16}, 0, Role::kQ, 7),
      this->NewChunk(Layout::kHeadsTokensDim, {2, 5, 3, 16}, 0, Role::kK, 3),
      this->NewChunk(Layout::kTokensHeadsDim, {40, 2, 16}, 0, Role::kV, 5),
  };
  for (Placed& p : chunks) p.chunk->Fill(this->NormalValues(rng));
  this->RunAndCompare(g, chunks);
}

// Bit patterns of NaN, +-Inf, -0.0, subnormals, the largest finite values and
// the histogram's underflow/overflow edges, for the dtype under test.
std::vector<uint32_t> SpecialBits(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return {0x7fc00000, 0xffc00000, 0x7f800001, 0x7f800000, 0xff800000,
              0x80000000, 0x00000000, 0x00000001, 0x807fffff, 0x00800000,
              0x7f7fffff, 0xff7fffff, 0x33800000, 0x337fffff, 0xb37fffff,
              0x4b800000, 0x4b7fffff, 0xcb800000, 0x3f800000, 0xbf800000};
    case DType::kF16:
      return {0x7e00, 0xfe00, 0x7c01, 0x7c00, 0xfc00, 0x8000,
              0x0000, 0x0001, 0x03ff, 0x8001, 0x0400, 0x7bff,
              0xfbff, 0x3c00, 0xbc00, 0x0200, 0x83ff};
    case DType::kBf16:
      return {0x7fc0, 0xffc0, 0x7f81, 0x7f80, 0xff80, 0x8000, 0x0000,
              0x0001, 0x807f, 0x0080, 0x7f7f, 0xff7f, 0x3380, 0x337f,
              0x4b80, 0x4b7f, 0xcb80, 0x3f80, 0xbf80};
  }
  return {};
}

TYPED_TEST(BackendTest, SpecialValuesAtEveryLanePosition) {
  const std::vector<uint32_t> specials = SpecialBits(this->kDType);
  Rng rng(3);
  for (uint32_t bins : {0u, 1u, 16u, 128u}) {
    const Geometry g = MakeGeometry(1, 3, 3, 13, bins);
    // Mixed: specials at random positions among normal values.
    Placed mixed =
        this->NewChunk(Layout::kTokensHeadsDim, {37, 3, 13}, 0, Role::kQ, 0, 4);
    mixed.chunk->Fill(this->NormalValues(rng));
    for (uint64_t i = 0; i < mixed.chunk->elements(); ++i) {
      if (rng.UniformInt(0, 2) == 0) {
        mixed.chunk->SetRaw(i,
                            specials[rng.UniformInt(0, specials.size() - 1)]);
      }
    }
    // Every special in every position of a run of 8 and 16 lanes.
    Placed sweep = this->NewChunk(Layout::kHeadsTokensDim, {1, 1, 40, 13}, 0,
                                  Role::kK, 1, 2);
    sweep.chunk->Fill([](const ElementIndex& at) {
      return 1.0f + static_cast<float>(at.flat % 5);
    });
    for (uint64_t i = 0; i < sweep.chunk->elements(); ++i) {
      if (i % 3 == 0) sweep.chunk->SetRaw(i, specials[i / 3 % specials.size()]);
    }
    // Head 0 sees only NaN and Inf: no finite value, no batch entry.
    Placed nonfinite =
        this->NewChunk(Layout::kTokensHeadsDim, {9, 2, 13}, 0, Role::kV, 0, 9);
    nonfinite.chunk->Fill(this->NormalValues(rng));
    for (uint64_t i = 0; i < nonfinite.chunk->elements(); ++i) {
      if (nonfinite.chunk->HeadOf(i) == 0) {
        nonfinite.chunk->SetRaw(i, specials[i % 5]);  // NaNs and Infs
      }
    }
    // Only the largest finite values, and only -0.0.
    const uint32_t max_bits = specials[this->kDType == DType::kF16 ? 11 : 10];
    Placed largest = this->NewChunk(Layout::kTokensHeadsDim, {300, 1, 13}, 0,
                                    Role::kV, 2, 1);
    for (uint64_t i = 0; i < largest.chunk->elements(); ++i) {
      largest.chunk->SetRaw(
          i, i % 2
                 ? max_bits
                 : max_bits | (1u << (this->kDType == DType::kF32 ? 31 : 15)));
    }
    Placed negative_zero =
        this->NewChunk(Layout::kTokensHeadsDim, {20, 1, 13}, 0, Role::kK, 0, 5);
    for (uint64_t i = 0; i < negative_zero.chunk->elements(); ++i) {
      negative_zero.chunk->SetRaw(
          i, this->kDType == DType::kF32 ? 0x80000000u : 0x8000u);
    }
    this->RunAndCompare(g, {mixed, sweep, nonfinite, largest, negative_zero},
                        "bins " + std::to_string(bins));
    if (this->HasFailure()) return;
  }
}

TYPED_TEST(BackendTest, SubnormalsOfEveryDType) {
  // Float32 subnormals reach a backend only as f32; f16 subnormals decode to
  // normal floats in [2^-24, 2^-14) and are binned exactly.
  const Geometry g = MakeGeometry(1, 2, 2, 64, 128);
  Placed chunk =
      this->NewChunk(Layout::kTokensHeadsDim, {50, 2, 64}, 0, Role::kQ);
  for (uint64_t i = 0; i < chunk.chunk->elements(); ++i) {
    const uint32_t m = static_cast<uint32_t>(i % 1024) + 1;
    switch (this->kDType) {
      case DType::kF32:
        chunk.chunk->SetRaw(i, (i % 2 ? 0x80000000u : 0u) | (m * 8191u));
        break;
      case DType::kF16:
        chunk.chunk->SetRaw(i, (i % 2 ? 0x8000u : 0u) | (m % 1024u));
        break;
      case DType::kBf16:
        chunk.chunk->SetRaw(i, (i % 2 ? 0x8000u : 0u) | (m % 128u));
        break;
    }
  }
  this->RunAndCompare(g, {chunk});
}

TYPED_TEST(BackendTest, ConstantInputs) {
  for (float value : {1.5f, -2.75f, 0.0f, -0.0f, 1e-30f}) {
    const Geometry g = MakeGeometry(1, 2, 1, 64, 16);
    Placed a = this->NewChunk(Layout::kTokensHeadsDim, {257, 2, 64}, 0,
                              Role::kQ, 0, 1);
    a.chunk->Fill([value](const ElementIndex&) { return value; });
    Placed b = this->NewChunk(Layout::kHeadsTokensDim, {2, 1, 129, 64}, 0,
                              Role::kK, 0, 2);
    b.chunk->Fill([value](const ElementIndex&) { return value; });
    this->RunAndCompare(g, {a, b}, "value " + std::to_string(value));
  }
}

// Student-t (3 dof) heads, one Cauchy outlier head a thousand times larger,
// several batches in no particular order, values in increasing order (the
// worst case for the tail) in one chunk.
TYPED_TEST(BackendTest, HeavyTailedDataWithOutlierHeads) {
  Rng rng(4);
  for (uint32_t bins : {16u, 64u}) {
    const Geometry g = MakeGeometry(2, 8, 4, 128, bins);
    auto heavy = [&rng](const ElementIndex& at) {
      if (at.head == 5) return static_cast<float>(1000.0 * rng.StudentT(1.0));
      return static_cast<float>(rng.StudentT(3.0) * (1.0 + at.head));
    };
    std::vector<Placed> chunks;
    const uint64_t batches[] = {3, 1, 2, 3, 0};
    for (uint64_t batch : batches) {
      Placed q = this->NewChunk(Layout::kTokensHeadsDim, {513, 8, 128}, 0,
                                Role::kQ, 0, batch);
      q.chunk->Fill(heavy);
      chunks.push_back(q);
      Placed k = this->NewChunk(Layout::kHeadsTokensDim, {2, 4, 65, 128}, 1,
                                Role::kK, 0, batch);
      k.chunk->Fill(heavy);
      chunks.push_back(k);
    }
    Placed rising = this->NewChunk(Layout::kTokensHeadsDim, {600, 2, 128}, 1,
                                   Role::kV, 2, 7);
    rising.chunk->Fill([](const ElementIndex& at) {
      return static_cast<float>(at.flat) * 0.25f;
    });
    chunks.push_back(rising);
    this->RunAndCompare(g, chunks, "bins " + std::to_string(bins));
    if (this->HasFailure()) return;
  }
}

TYPED_TEST(BackendTest, LargeChunks) {
  Rng rng(5);
  const Geometry g = MakeGeometry(1, 8, 8, 128, 16);
  Placed big = this->NewChunk(Layout::kTokensHeadsDim, {2048, 8, 128}, 0,
                              Role::kQ, 0, 1);
  big.chunk->Fill([&rng](const ElementIndex& at) {
    return static_cast<float>(rng.StudentT(4.0) * (at.head == 3 ? 50.0 : 1.0));
  });
  Placed big_hf = this->NewChunk(Layout::kHeadsTokensDim, {2, 8, 1001, 128}, 0,
                                 Role::kK, 0, 2);
  big_hf.chunk->Fill(this->NormalValues(rng));
  this->RunAndCompare(g, {big, big_hf});
}

// Chunks larger than one 8 MiB staging slot of the CUDA backend, split at
// each of its three levels: whole rows (9 MiB), runs of heads of one row, and
// runs of one head's values ({1, 2, 40000, 128}: one head is 20 MB in f32).
TYPED_TEST(BackendTest, ChunksLargerThanOneStagingSlot) {
  Rng rng(13);
  const Geometry g = MakeGeometry(1, 8, 8, 128, 16);
  const uint64_t nine_mib_tokens =
      (uint64_t{9} << 20) / (8 * 128 * DTypeSize(this->kDType));
  Placed rows = this->NewChunk(Layout::kTokensHeadsDim,
                               {nine_mib_tokens, 8, 128}, 0, Role::kQ, 0, 1);
  rows.chunk->Fill([&rng](const ElementIndex& at) {
    return static_cast<float>(rng.StudentT(3.0) * (1.0 + at.head));
  });
  ASSERT_EQ(rows.chunk->data().size(), size_t{9} << 20);
  Placed heads = this->NewChunk(Layout::kHeadsTokensDim, {1, 8, 4000, 128}, 0,
                                Role::kK, 0, 2);
  heads.chunk->Fill(this->NormalValues(rng));
  Placed one_head = this->NewChunk(Layout::kHeadsTokensDim, {1, 2, 40000, 128},
                                   0, Role::kV, 3, 3);
  one_head.chunk->Fill([&rng](const ElementIndex& at) {
    // Rising magnitudes in the second head: its tail is decided in the last
    // piece.
    return at.head == 0 ? static_cast<float>(rng.Normal())
                        : static_cast<float>(at.flat % 100000) * 0.01f;
  });
  this->RunAndCompare(g, {rows, heads, one_head});
}

// 40 batches: the CUDA backend's batch table (16 rows preallocated) doubles
// twice while chunks keep arriving.
TYPED_TEST(BackendTest, FortyBatchesGrowTheBatchTable) {
  Rng rng(14);
  const Geometry g = MakeGeometry(2, 4, 2, 32, 16);
  std::vector<Placed> chunks;
  for (uint64_t i = 0; i < 40; ++i) {
    const uint64_t batch = (i * 7) % 40;  // not in increasing order
    const Role role = kAllRoles[i % 3];
    Placed p = this->NewChunk(Layout::kTokensHeadsDim,
                              {rng.UniformInt(1, 20), g.heads(role), 32},
                              static_cast<uint32_t>(i % 2), role, 0, batch);
    p.chunk->Fill(this->NormalValues(rng));
    chunks.push_back(p);
  }
  // Early batches again after the table grew.
  for (uint64_t batch : {0u, 7u, 39u}) {
    Placed p = this->NewChunk(Layout::kTokensHeadsDim, {5, 2, 32}, 1, Role::kK,
                              0, batch);
    p.chunk->Fill(this->NormalValues(rng));
    chunks.push_back(p);
  }
  this->RunAndCompare(g, chunks);
}

// Merging a state of 40 batches into a backend that already has some of
// them (and others) equals accumulating everything into one backend.
TYPED_TEST(BackendTest, MergeOfAStateWithMoreThanSixteenBatches) {
  Rng rng(15);
  const Geometry g = MakeGeometry(1, 4, 2, 16, 16);
  std::vector<Placed> many;
  for (uint64_t batch = 0; batch < 40; ++batch) {
    Placed p = this->NewChunk(Layout::kTokensHeadsDim, {4, 2, 16}, 0, Role::kK,
                              0, 1000 + batch);
    p.chunk->Fill(this->NormalValues(rng));
    many.push_back(p);
  }
  std::vector<Placed> few;
  for (uint64_t batch : {1005u, 1039u, 3u}) {
    Placed p = this->NewChunk(Layout::kTokensHeadsDim, {6, 4, 16}, 0, Role::kQ,
                              0, batch);
    p.chunk->Fill(this->NormalValues(rng));
    few.push_back(p);
  }
  auto source = this->Make(g);
  auto target = this->Make(g);
  auto together = this->Make(g);
  ASSERT_NE(source, nullptr);
  ASSERT_NE(target, nullptr);
  ASSERT_NE(together, nullptr);
  Reference ref(g);
  for (const Placed& p : many) {
    ASSERT_THAT(source->Accumulate(p.view()), IsOk());
    ASSERT_THAT(together->Accumulate(p.view()), IsOk());
    ref.Add(*p.chunk, p.layer, p.role);
  }
  for (const Placed& p : few) {
    ASSERT_THAT(target->Accumulate(p.view()), IsOk());
    ASSERT_THAT(together->Accumulate(p.view()), IsOk());
    ref.Add(*p.chunk, p.layer, p.role);
  }
  const SessionStatistics forty = this->Snap(*source);
  ASSERT_THAT(target->Merge(forty), IsOk());
  const SessionStatistics merged = this->Snap(*target);
  ExpectMatchesReference(ref, merged);
  ExpectStatesEqual(this->Snap(*together), merged);
  // A fresh backend takes the 40-batch state whole.
  auto fresh = this->Make(g);
  ASSERT_NE(fresh, nullptr);
  ASSERT_THAT(fresh->Merge(forty), IsOk());
  ExpectStatesEqual(forty, this->Snap(*fresh));
}

TYPED_TEST(BackendTest, ManyChunksLayersRolesAndBatches) {
  Rng rng(6);
  const Geometry g = MakeGeometry(3, 4, 2, 32, 64);
  std::vector<Placed> chunks;
  for (int i = 0; i < 40; ++i) {
    const Role role = kAllRoles[rng.UniformInt(0, 2)];
    const uint32_t heads = g.heads(role);
    const uint32_t offset = static_cast<uint32_t>(rng.UniformInt(0, heads - 1));
    const uint64_t n = rng.UniformInt(1, heads - offset);
    const uint64_t tokens = rng.UniformInt(0, 70);
    const uint32_t layer = static_cast<uint32_t>(rng.UniformInt(0, 2));
    const uint64_t batch = rng.UniformInt(0, 5);
    Placed p = rng.UniformInt(0, 1)
                   ? this->NewChunk(Layout::kTokensHeadsDim, {tokens, n, 32},
                                    layer, role, offset, batch)
                   : this->NewChunk(Layout::kHeadsTokensDim,
                                    {rng.UniformInt(1, 3), n, tokens, 32},
                                    layer, role, offset, batch);
    p.chunk->Fill(this->NormalValues(rng));
    chunks.push_back(p);
  }
  this->RunAndCompare(g, chunks);
}

TYPED_TEST(BackendTest, ResetForgetsEverything) {
  Rng rng(7);
  const Geometry g = MakeGeometry(1, 2, 2, 16, 16);
  auto backend = this->Make(g);
  ASSERT_NE(backend, nullptr);
  Placed p = this->NewChunk(Layout::kTokensHeadsDim, {10, 2, 16}, 0, Role::kQ);
  p.chunk->Fill(this->NormalValues(rng));
  ASSERT_THAT(backend->Accumulate(p.view()), IsOk());
  ASSERT_THAT(backend->Reset(), IsOk());
  ExpectMatchesReference(Reference(g), this->Snap(*backend), "after reset");
  Placed again =
      this->NewChunk(Layout::kTokensHeadsDim, {3, 2, 16}, 0, Role::kK, 0, 4);
  again.chunk->Fill(this->NormalValues(rng));
  ASSERT_THAT(backend->Accumulate(again.view()), IsOk());
  Reference ref(g);
  ref.Add(*again.chunk, 0, Role::kK);
  ExpectMatchesReference(ref, this->Snap(*backend), "after reset and add");
}

// ---------------------------------------------------------------------------
// Validation: InvalidArgument naming the problem, and nothing changes.
// ---------------------------------------------------------------------------

TYPED_TEST(BackendTest, InvalidChunksAreRejectedAndChangeNothing) {
  constexpr uint64_t kBig = uint64_t{1} << 40;
  const Geometry g = MakeGeometry(2, 4, 2, 16, 16, /*role_mask=*/0b011);
  auto backend = this->Make(g);
  ASSERT_NE(backend, nullptr);
  Rng rng(8);
  Placed seed =
      this->NewChunk(Layout::kTokensHeadsDim, {5, 4, 16}, 1, Role::kQ, 0, 2);
  seed.chunk->Fill(this->NormalValues(rng));
  ASSERT_THAT(backend->Accumulate(seed.view()), IsOk());
  const SessionStatistics before = this->Snap(*backend);

  // A valid chunk of 3 tokens x 2 K heads; each case breaks one thing.
  Placed base =
      this->NewChunk(Layout::kTokensHeadsDim, {3, 2, 16}, 0, Role::kK);
  base.chunk->Fill(this->NormalValues(rng));
  ASSERT_THAT(ValidateChunk(g, base.view()), IsOk());
  const size_t size = DTypeSize(this->kDType);
  struct Case {
    std::string name;
    std::function<void(ChunkView&)> mutate;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"layer out of range", [](ChunkView& c) { c.layer = 2; },
       "layer 2 is out of range"},
      {"role not collected", [](ChunkView& c) { c.role = Role::kV; },
       "role V is not collected"},
      {"rank 1", [](ChunkView& c) { c.shape = {96}; }, "rank >= 2"},
      {"rank 3 in HEADS_TOKENS_DIM",
       [](ChunkView& c) {
         c.layout = Layout::kHeadsTokensDim;
         c.shape = {3, 2, 16};
       },
       "needs rank 4"},
      {"rank 5 in HEADS_TOKENS_DIM",
       [](ChunkView& c) {
         c.layout = Layout::kHeadsTokensDim;
         c.shape = {1, 3, 2, 1, 16};
       },
       "needs rank 4"},
      {"head_dim mismatch",
       [](ChunkView& c) {
         c.shape = {6, 2, 8};
       },
       "head_dim is 16"},
      {"more heads than the role has",
       [](ChunkView& c) {
         c.shape = {2, 3, 16};
       },
       "exceed the 2 K heads"},
      {"heads + offset beyond", [](ChunkView& c) { c.head_offset = 1; },
       "heads [1, 3)"},
      {"huge offset", [](ChunkView& c) { c.head_offset = 0xffffffffu; },
       "exceed"},
      {"zero heads",
       [](ChunkView& c) {
         c.shape = {3, 0, 16};
       },
       "zero heads"},
      {"element count overflows",
       [](ChunkView& c) {
         c.shape = {kBig, kBig, 2, 16};
       },
       "overflows"},
      {"byte count overflows",
       [](ChunkView& c) {
         c.shape = {uint64_t{1} << 59, 2, 16};
       },
       "overflows"},
      {"data one element short",
       [size](ChunkView& c) {
         c.data = c.data.subspan(0, c.data.size() - size);
       },
       "data is"},
      {"data one byte long",
       [](ChunkView& c) {
         c.data = absl::Span<const std::byte>(c.data.data(), c.data.size() + 1);
       },
       "needs"},
      {"data empty for a non-empty shape", [](ChunkView& c) { c.data = {}; },
       "data is 0 bytes"},
      {"role 0", [](ChunkView& c) { c.role = static_cast<Role>(0); },
       "unknown role"},
      {"role 4", [](ChunkView& c) { c.role = static_cast<Role>(4); },
       "unknown role"},
      {"dtype 0", [](ChunkView& c) { c.dtype = static_cast<DType>(0); },
       "unknown dtype"},
      {"dtype 4", [](ChunkView& c) { c.dtype = static_cast<DType>(4); },
       "unknown dtype"},
      {"layout 0", [](ChunkView& c) { c.layout = static_cast<Layout>(0); },
       "unknown layout"},
      {"layout 3", [](ChunkView& c) { c.layout = static_cast<Layout>(3); },
       "unknown layout"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    ChunkView view = base.view();
    c.mutate(view);
    EXPECT_THAT(
        backend->Accumulate(view),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.message)));
  }
  ExpectStatesEqual(before, this->Snap(*backend));
  EXPECT_EQ(before, this->Snap(*backend));
  EXPECT_TRUE(base.chunk->GuardsIntact());
}

// A zero dimension anywhere makes an empty chunk: valid, whatever the size
// of the other leading dimensions, and it changes no statistic.
TYPED_TEST(BackendTest, ZeroDimensionMakesAnEmptyChunkWhereverItStands) {
  constexpr uint64_t kBig = uint64_t{1} << 40;
  const Geometry g = MakeGeometry(1, 2, 2, 16, 16);
  auto backend = this->Make(g);
  ASSERT_NE(backend, nullptr);
  const SessionStatistics before = this->Snap(*backend);
  for (std::vector<uint64_t> shape :
       {std::vector<uint64_t>{kBig, kBig, 0, 2, 16},
        std::vector<uint64_t>{0, kBig, kBig, 2, 16}}) {
    ChunkView view;
    view.layer = 0;
    view.role = Role::kQ;
    view.dtype = this->kDType;
    view.shape = shape;
    EXPECT_THAT(backend->Accumulate(view), IsOk());
  }
  EXPECT_EQ(before, this->Snap(*backend));
}

TYPED_TEST(BackendTest, MergeOfOtherGeometryIsRejectedAndChangesNothing) {
  Rng rng(9);
  const Geometry g = MakeGeometry(1, 2, 2, 16, 16);
  auto backend = this->Make(g);
  ASSERT_NE(backend, nullptr);
  Placed p = this->NewChunk(Layout::kTokensHeadsDim, {4, 2, 16}, 0, Role::kQ);
  p.chunk->Fill(this->NormalValues(rng));
  ASSERT_THAT(backend->Accumulate(p.view()), IsOk());
  const SessionStatistics before = this->Snap(*backend);
  for (const Geometry& other :
       {MakeGeometry(1, 2, 2, 16, 64), MakeGeometry(1, 2, 2, 8, 16),
        MakeGeometry(2, 2, 2, 16, 16), MakeGeometry(1, 2, 2, 16, 16, 0b001),
        MakeGeometry(1, 4, 2, 16, 16)}) {
    SessionStatistics stats(other);
    stats.head(0, Role::kQ, 0).Add(1.0f, 0, other.log2_bins_per_octave());
    EXPECT_THAT(
        backend->Merge(stats),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("geometry")));
  }
  EXPECT_EQ(before, this->Snap(*backend));
}

// ---------------------------------------------------------------------------
// Merge and concurrency.
// ---------------------------------------------------------------------------

// Copies elements of `src` into a new chunk: tokens [t0, t1) and chunk heads
// [h0, h1) of a rank-3 TOKENS_HEADS_DIM chunk, or batches [t0, t1) of a
// HEADS_TOKENS_DIM chunk (all heads).
std::shared_ptr<ChunkBuilder> Slice(const ChunkBuilder& src, uint64_t t0,
                                    uint64_t t1, uint32_t h0, uint32_t h1) {
  std::vector<uint64_t> shape = src.shape();
  if (src.layout() == Layout::kHeadsTokensDim) {
    shape[0] = t1 - t0;
    auto out = std::make_shared<ChunkBuilder>(src.dtype(), src.layout(), shape,
                                              src.head_offset(), src.batch());
    const uint64_t per_batch = shape[1] * shape[2] * shape[3];
    for (uint64_t i = 0; i < out->elements(); ++i) {
      out->SetRaw(i, src.Raw(t0 * per_batch + i));
    }
    return out;
  }
  const uint64_t heads = shape[1], dim = shape[2];
  shape[0] = t1 - t0;
  shape[1] = h1 - h0;
  auto out = std::make_shared<ChunkBuilder>(
      src.dtype(), src.layout(), shape, src.head_offset() + h0, src.batch());
  uint64_t j = 0;
  for (uint64_t t = t0; t < t1; ++t) {
    for (uint64_t h = h0; h < h1; ++h) {
      for (uint64_t i = 0; i < dim; ++i) {
        out->SetRaw(j++, src.Raw((t * heads + h) * dim + i));
      }
    }
  }
  return out;
}

TYPED_TEST(BackendTest, SplitAcrossStatesThenMergedEqualsUnsplit) {
  Rng rng(10);
  for (uint32_t bins : {0u, 16u}) {
    const Geometry g = MakeGeometry(2, 4, 2, 24, bins);
    std::vector<Placed> chunks;
    for (int i = 0; i < 12; ++i) {
      const Role role = kAllRoles[static_cast<size_t>(i % 3)];
      const uint32_t layer = static_cast<uint32_t>(i / 3 % 2);
      const uint64_t batch = rng.UniformInt(0, 3);
      Placed p = i % 4 == 3 ? this->NewChunk(Layout::kHeadsTokensDim,
                                             {5, g.heads(role), 40, 24}, layer,
                                             role, 0, batch)
                            : this->NewChunk(Layout::kTokensHeadsDim,
                                             {300, g.heads(role), 24}, layer,
                                             role, 0, batch);
      p.chunk->Fill([&rng](const ElementIndex& at) {
        return static_cast<float>(rng.StudentT(2.0) * (1 + at.head));
      });
      chunks.push_back(p);
    }
    auto unsplit = this->Make(g);
    ASSERT_NE(unsplit, nullptr);
    for (const Placed& p : chunks)
      ASSERT_THAT(unsplit->Accumulate(p.view()), IsOk());
    const SessionStatistics expected = this->Snap(*unsplit);

    for (int trial = 0; trial < 6; ++trial) {
      const size_t k = static_cast<size_t>(rng.UniformInt(2, 8));
      SCOPED_TRACE(::testing::Message()
                   << "bins " << bins << " trial " << trial << " states " << k);
      std::vector<std::unique_ptr<StatisticsBackend>> states;
      for (size_t s = 0; s < k; ++s) {
        states.push_back(this->Make(g));
        ASSERT_NE(states.back(), nullptr);
      }
      auto random_state = [&] {
        return states[rng.UniformInt(0, k - 1)].get();
      };
      for (const Placed& p : chunks) {
        const ChunkBuilder& c = *p.chunk;
        const uint64_t outer = c.shape()[0];
        // Cut the outer dimension at random points; for TOKENS_HEADS_DIM
        // also cut the heads.
        std::vector<uint64_t> cuts = {0, outer};
        for (int n = 0; n < 3; ++n) cuts.push_back(rng.UniformInt(0, outer));
        std::sort(cuts.begin(), cuts.end());
        for (size_t s = 0; s + 1 < cuts.size(); ++s) {
          const uint32_t heads = c.heads();
          uint32_t head_cut = heads;
          if (c.layout() == Layout::kTokensHeadsDim && heads > 1) {
            head_cut = static_cast<uint32_t>(rng.UniformInt(1, heads));
          }
          auto part = Slice(c, cuts[s], cuts[s + 1], 0, head_cut);
          ASSERT_THAT(random_state()->Accumulate(part->view(p.layer, p.role)),
                      IsOk());
          if (head_cut < heads) {
            auto rest = Slice(c, cuts[s], cuts[s + 1], head_cut, heads);
            ASSERT_THAT(random_state()->Accumulate(rest->view(p.layer, p.role)),
                        IsOk());
          }
        }
      }
      // Merge the states' snapshots into a fresh backend in random order.
      std::vector<SessionStatistics> snaps;
      for (auto& s : states) snaps.push_back(this->Snap(*s));
      std::shuffle(snaps.begin(), snaps.end(), rng.engine());
      auto merged = this->Make(g);
      ASSERT_NE(merged, nullptr);
      for (const SessionStatistics& s : snaps) {
        ASSERT_THAT(merged->Merge(s), IsOk());
      }
      ExpectStatesEqual(expected, this->Snap(*merged));
      // The same through SessionStatistics::Merge, into a non-empty state.
      SessionStatistics host = snaps[0];
      for (size_t s = 1; s < snaps.size(); ++s) {
        ASSERT_THAT(host.Merge(snaps[s]), IsOk());
      }
      ExpectStatesEqual(expected, host);
      if (this->HasFailure()) return;
    }
  }
}

TYPED_TEST(BackendTest, ConcurrentAccumulateEqualsSequential) {
  Rng rng(11);
  const Geometry g = MakeGeometry(2, 4, 2, 64, 16);
  std::vector<Placed> chunks;
  for (int i = 0; i < 48; ++i) {
    // Half of the chunks contend for layer 0 / K.
    const Role role = i % 2 ? Role::kK : kAllRoles[static_cast<size_t>(i % 3)];
    const uint32_t layer = i % 2 ? 0 : static_cast<uint32_t>(i % 4 / 2);
    // Some chunks are large enough for the backend's own parallel path.
    const uint64_t tokens = i % 8 == 0 ? 600 : rng.UniformInt(1, 60);
    Placed p =
        this->NewChunk(Layout::kTokensHeadsDim, {tokens, g.heads(role), 64},
                       layer, role, 0, rng.UniformInt(0, 4));
    p.chunk->Fill(this->NormalValues(rng));
    chunks.push_back(p);
  }
  auto sequential = this->Make(g);
  ASSERT_NE(sequential, nullptr);
  for (const Placed& p : chunks) {
    ASSERT_THAT(sequential->Accumulate(p.view()), IsOk());
  }
  auto concurrent = this->Make(g);
  ASSERT_NE(concurrent, nullptr);
  constexpr int kThreads = 6;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (size_t i = static_cast<size_t>(t); i < chunks.size();
           i += kThreads) {
        if (!concurrent->Accumulate(chunks[i].view()).ok()) ++failures;
        if (i % 7 == 0 && !concurrent->Snapshot().ok()) ++failures;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  ExpectStatesEqual(this->Snap(*sequential), this->Snap(*concurrent));
}

#if !defined(KVCAL_TEST_CUDA_BACKEND)
// The CPU backend's thread count does not change its results.
TYPED_TEST(BackendTest, CpuThreadCountDoesNotChangeResults) {
  Rng rng(12);
  const Geometry g = MakeGeometry(1, 8, 8, 128, 16);
  Placed p =
      this->NewChunk(Layout::kTokensHeadsDim, {256, 8, 128}, 0, Role::kQ);
  p.chunk->Fill(this->NormalValues(rng));
  Reference ref(g);
  ref.Add(*p.chunk, 0, Role::kQ);
  for (int threads : {1, 2, 3, 0}) {
    BackendOptions options;
    options.cpu_threads = threads;
    auto backend = this->Make(g, options);
    ASSERT_NE(backend, nullptr);
    ASSERT_THAT(backend->Accumulate(p.view()), IsOk());
    ExpectMatchesReference(ref, this->Snap(*backend),
                           "threads " + std::to_string(threads));
  }
}
#endif

}  // namespace
}  // namespace kvcal
