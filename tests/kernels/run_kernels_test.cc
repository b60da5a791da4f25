// The CPU inner loops of every instruction set that this machine supports
// (scalar, AVX2, AVX-512: kernels/cpu/run_kernels.h) give the same bits for
// every statistic, the double sums included, on the same input: random
// shapes around the loops' block sizes, normal data with NaN, +-Inf, zeros,
// subnormals, values whose squares overflow or underflow float, and all-tiny
// runs. ISAs the machine lacks are skipped with a message.
#include "kernels/cpu/run_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/element_math.h"
#include "tests/kernels/test_util.h"

namespace kvcal::cpu {
namespace {

using ::kvcal::testing::EncodeBf16;
using ::kvcal::testing::EncodeF16;
using ::kvcal::testing::Rng;

struct Result {
  std::vector<RunAccumulator> accs;
  std::vector<uint64_t> histograms;
  std::vector<std::vector<float>> tails;
};

uint64_t DoubleBits(double x) {
  uint64_t b;
  std::memcpy(&b, &x, 8);
  return b;
}

// Runs `fn` over the data into fresh accumulators (several calls, as the
// backend does for row splits, so that state carried between calls counts).
Result RunLoop(RowsFn fn, const std::vector<unsigned char>& data, size_t rows,
               size_t heads, size_t length, uint32_t bins_per_octave, bool tail,
               size_t calls) {
  Result r;
  r.accs.resize(heads);
  const uint32_t log2 = bins_per_octave == 0
                            ? 0
                            : static_cast<uint32_t>(std::log2(bins_per_octave));
  const size_t bins = bins_per_octave == 0 ? 0 : HistogramBinCount(log2);
  r.histograms.assign(heads * bins, 0);
  std::vector<TailKeeper> keepers(heads, TailKeeper({}));
  for (size_t h = 0; h < heads; ++h) {
    if (bins != 0) {
      r.accs[h].histogram = r.histograms.data() + h * bins;
      r.accs[h].log2_bins_per_octave = log2;
    }
    if (tail) r.accs[h].tail = &keepers[h];
  }
  const size_t element = data.size() / (rows * heads * length);
  const size_t stride = heads * length;
  for (size_t c = 0; c < calls; ++c) {
    const size_t begin = rows * c / calls, end = rows * (c + 1) / calls;
    fn(data.data() + begin * stride * element, end - begin, stride, heads,
       length, r.accs.data());
  }
  for (TailKeeper& k : keepers) {
    r.tails.emplace_back();
    k.StoreSortedDescending(&r.tails.back());
  }
  return r;
}

void ExpectSameBits(const Result& e, const Result& a, const std::string& what) {
  SCOPED_TRACE(what);
  ASSERT_EQ(e.accs.size(), a.accs.size());
  for (size_t h = 0; h < e.accs.size(); ++h) {
    SCOPED_TRACE("head " + std::to_string(h));
    EXPECT_EQ(FloatBits(e.accs[h].min), FloatBits(a.accs[h].min));
    EXPECT_EQ(FloatBits(e.accs[h].max), FloatBits(a.accs[h].max));
    EXPECT_EQ(e.accs[h].finite, a.accs[h].finite);
    EXPECT_EQ(e.accs[h].nan, a.accs[h].nan);
    EXPECT_EQ(e.accs[h].inf, a.accs[h].inf);
    EXPECT_EQ(DoubleBits(e.accs[h].sum), DoubleBits(a.accs[h].sum))
        << e.accs[h].sum << " vs " << a.accs[h].sum;
    EXPECT_EQ(DoubleBits(e.accs[h].sum_squares),
              DoubleBits(a.accs[h].sum_squares))
        << e.accs[h].sum_squares << " vs " << a.accs[h].sum_squares;
  }
  EXPECT_EQ(e.histograms, a.histograms);
  EXPECT_EQ(e.tails, a.tails);
}

// Mostly normal values, with specials sprinkled in at `special_rate`.
std::vector<unsigned char> MakeData(Rng& rng, DType dtype, size_t n,
                                    double special_rate, double scale) {
  std::vector<unsigned char> out(n * DTypeSize(dtype));
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            0.0f,
                            -0.0f,
                            1e-40f,
                            -3e-39f,
                            3e38f,
                            -2e30f,
                            1e-30f};
  for (size_t i = 0; i < n; ++i) {
    float x = static_cast<float>(rng.Normal() * scale);
    if (rng.Uniform(0, 1) < special_rate) {
      x = specials[rng.UniformInt(0, std::size(specials) - 1)];
    }
    if (dtype == DType::kF32) {
      std::memcpy(out.data() + 4 * i, &x, 4);
    } else {
      const uint16_t b = dtype == DType::kBf16 ? EncodeBf16(x) : EncodeF16(x);
      std::memcpy(out.data() + 2 * i, &b, 2);
    }
  }
  return out;
}

class RunKernelsTest : public ::testing::TestWithParam<DType> {};

TEST_P(RunKernelsTest, EveryInstructionSetGivesTheSameBits) {
  const DType dtype = GetParam();
  std::vector<CpuIsa> isas;
  for (CpuIsa isa : {CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (LoopsFor(isa, dtype).rows != nullptr) {
      isas.push_back(isa);
    } else {
      std::printf("note: %s is not supported here: not compared\n",
                  std::string(CpuIsaName(isa)).c_str());
    }
  }
  if (isas.empty()) GTEST_SKIP() << "only the scalar loop runs here";
  Rng rng(1234);
  struct Shape {
    size_t rows, heads, length;
  };
  const Shape shapes[] = {{1, 1, 1},   {3, 2, 7},   {5, 3, 8},   {4, 2, 15},
                          {4, 2, 16},  {3, 3, 31},  {3, 3, 32},  {2, 4, 33},
                          {9, 2, 100}, {6, 3, 128}, {2, 2, 255}, {2, 2, 256},
                          {2, 2, 257}, {3, 1, 600}, {40, 8, 64}, {1, 1, 4096},
                          {17, 5, 136}};
  for (const Shape& s : shapes) {
    for (double special_rate : {0.0, 0.002, 0.05}) {
      // 1e-39 and 1e-6: mostly bf16 and f16 subnormals.
      for (double scale : {1.0, 1e-25, 1e18, 1e-39, 1e-6}) {
        const auto data = MakeData(rng, dtype, s.rows * s.heads * s.length,
                                   special_rate, scale);
        for (uint32_t bins : {0u, 1u, 16u, 64u, 128u}) {
          for (size_t calls : {size_t{1}, size_t{3}}) {
            if (calls > s.rows) continue;
            const bool tail = bins != 0;
            const Result expected =
                RunLoop(ScalarLoops(dtype).rows, data, s.rows, s.heads,
                        s.length, bins, tail, calls);
            for (CpuIsa isa : isas) {
              const Result actual =
                  RunLoop(LoopsFor(isa, dtype).rows, data, s.rows, s.heads,
                          s.length, bins, tail, calls);
              ExpectSameBits(expected, actual,
                             std::string(CpuIsaName(isa)) + " rows " +
                                 std::to_string(s.rows) + " heads " +
                                 std::to_string(s.heads) + " length " +
                                 std::to_string(s.length) + " specials " +
                                 std::to_string(special_rate) + " scale " +
                                 std::to_string(scale) + " bins " +
                                 std::to_string(bins) + " calls " +
                                 std::to_string(calls));
              if (::testing::Test::HasFailure()) return;
            }
          }
        }
      }
    }
  }
}

// SpansFn (a chunk in pieces): runs cut at a third of their length, handed
// over as separate spans, give the same bits on every ISA.
TEST_P(RunKernelsTest, SpansGiveTheSameBitsOnEveryInstructionSet) {
  const DType dtype = GetParam();
  Rng rng(99);
  const size_t element = DTypeSize(dtype);
  for (size_t length : {size_t{5}, size_t{64}, size_t{300}}) {
    const size_t rows = 7, heads = 3;
    const auto data = MakeData(rng, dtype, rows * heads * length, 0.01, 1.0);
    std::vector<RowSpan> spans;
    const size_t cut = length / 3;
    for (size_t r = 0; r < rows; ++r) {
      for (size_t h = 0; h < heads; ++h) {
        const unsigned char* run =
            data.data() + (r * heads + h) * length * element;
        if (cut != 0) spans.push_back({run, 1, 0, h, 1, cut});
        spans.push_back({run + cut * element, 1, 0, h, 1, length - cut});
      }
    }
    for (uint32_t bins : {0u, 64u}) {
      auto run_spans = [&](SpansFn fn) {
        Result r;
        r.accs.resize(heads);
        const size_t n = bins == 0 ? 0 : HistogramBinCount(6);
        r.histograms.assign(heads * n, 0);
        std::vector<TailKeeper> keepers(heads, TailKeeper({}));
        for (size_t h = 0; h < heads; ++h) {
          if (n != 0) {
            r.accs[h].histogram = r.histograms.data() + h * n;
            r.accs[h].log2_bins_per_octave = 6;
            r.accs[h].tail = &keepers[h];
          }
        }
        fn(spans.data(), spans.size(), heads, r.accs.data());
        for (TailKeeper& k : keepers) {
          r.tails.emplace_back();
          k.StoreSortedDescending(&r.tails.back());
        }
        return r;
      };
      const Result expected = run_spans(ScalarLoops(dtype).spans);
      for (CpuIsa isa : {CpuIsa::kAvx2, CpuIsa::kAvx512}) {
        SpansFn fn = LoopsFor(isa, dtype).spans;
        if (fn == nullptr) continue;
        ExpectSameBits(expected, run_spans(fn),
                       std::string(CpuIsaName(isa)) + " spans, length " +
                           std::to_string(length) + " bins " +
                           std::to_string(bins));
      }
    }
  }
}

// Two values whose squares fit in float but whose sum of squares does not,
// in the two float lanes (A and B) that add up into one double lane: every
// ISA, scalar included, must give the finite double sums (a fuzz input found
// +Inf when only A and B were checked, not A + B).
TEST_P(RunKernelsTest, LaneSumsOverflowingOnlyWhenAddedStayExact) {
  const DType dtype = GetParam();
  if (dtype == DType::kF32) GTEST_SKIP() << "f32 is summed in double";
  // bf16: 1.6e19 (x^2 = 2.6e38 < FLT_MAX, 2 x^2 > FLT_MAX); f16 tops out at
  // 65504, whose squares never overflow float: then the test is that nothing
  // changes.
  const float big = dtype == DType::kBf16 ? 1.6e19f : 65504.0f;
  const size_t length = 36;  // a whole group of 32 and a padded rest
  std::vector<unsigned char> data(2 * length, 0);
  auto put = [&](size_t i, float x) {
    const uint16_t b = dtype == DType::kBf16 ? EncodeBf16(x) : EncodeF16(x);
    std::memcpy(data.data() + 2 * i, &b, 2);
  };
  for (size_t i = 0; i < length; ++i) put(i, 1.0f);
  // Values 0 and 1 land in lane 0 of A and lane 0 of B for bf16 (even / odd),
  // values 0 and 16 for f16 (first / second half): set all three.
  for (size_t i : {size_t{0}, size_t{1}, size_t{16}}) put(i, big);
  double sum = 0, sum_squares = 0;
  for (size_t i = 0; i < length; ++i) {
    uint16_t b;
    std::memcpy(&b, data.data() + 2 * i, 2);
    const double x = dtype == DType::kBf16 ? ::kvcal::testing::RefDecodeBf16(b)
                                           : ::kvcal::testing::RefDecodeF16(b);
    sum += x;
    sum_squares += x * x;
  }
  std::vector<std::pair<std::string, RowsFn>> fns = {
      {"scalar", ScalarLoops(dtype).rows}};
  for (CpuIsa isa : {CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (RowsFn fn = LoopsFor(isa, dtype).rows) {
      fns.emplace_back(std::string(CpuIsaName(isa)), fn);
    }
  }
  for (const auto& [name, fn] : fns) {
    const Result r = RunLoop(fn, data, 1, 1, length, 0, false, 1);
    EXPECT_TRUE(std::isfinite(r.accs[0].sum_squares)) << name;
    EXPECT_NEAR(r.accs[0].sum_squares, sum_squares, sum_squares * 0x1p-20)
        << name;
    EXPECT_NEAR(r.accs[0].sum, sum, std::fabs(sum) * 0x1p-20) << name;
    EXPECT_EQ(r.accs[0].finite, length) << name;
  }
}

// Every bf16 bit pattern, in every loop and at every bin width, lands in
// the bin that element_math.h's HistogramBin gives its value: the vector
// loops count bf16 keys (|bits| >> (7 - log2 bins)) and map them to bins
// when they flush, and key 0 must still tell the zeros from the subnormals
// that share it. Once with the patterns below 2^40 only (their squares sum
// in float, so every block goes through the vector code), once with all of
// them (the blocks with NaN, Inf or overflowing squares taken back and redone
// by the careful path).
TEST(RunKernelsBf16Test, EveryBitPatternLandsInItsBin) {
  std::vector<uint16_t> finite, all;
  for (uint32_t b = 0; b < 0x10000; ++b) {
    all.push_back(static_cast<uint16_t>(b));
    if (std::fabs(DecodeBf16(static_cast<uint16_t>(b))) < 0x1p40f) {
      finite.push_back(static_cast<uint16_t>(b));
    }
  }
  Rng rng(5);
  for (std::vector<uint16_t>* patterns : {&finite, &all}) {
    for (size_t i = patterns->size(); i > 1; --i) {  // shuffled
      std::swap((*patterns)[i - 1], (*patterns)[rng.UniformInt(0, i - 1)]);
    }
    std::vector<unsigned char> data(patterns->size() * 2);
    std::memcpy(data.data(), patterns->data(), data.size());
    for (uint32_t log2 = 0; log2 <= 7; ++log2) {
      const uint32_t bins_per_octave = 1u << log2;
      std::vector<uint64_t> expected(HistogramBinCount(log2), 0);
      for (uint16_t b : *patterns) {
        const float x = DecodeBf16(b);
        if (std::isfinite(x)) ++expected[HistogramBin(x, log2)];
      }
      for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
        RowsFn fn = LoopsFor(isa, DType::kBf16).rows;
        if (fn == nullptr) continue;
        // 16 rows x 4 heads of runs of size / 64 values, in 4 calls.
        const Result r =
            RunLoop(fn, data, 16, 4, patterns->size() / 64, bins_per_octave,
                    /*tail=*/false, 4);
        std::vector<uint64_t> total(expected.size(), 0);
        for (size_t h = 0; h < 4; ++h) {
          for (size_t bin = 0; bin < total.size(); ++bin) {
            total[bin] += r.histograms[h * total.size() + bin];
          }
        }
        EXPECT_EQ(total, expected)
            << CpuIsaName(isa) << ", " << bins_per_octave
            << " bins per octave, " << patterns->size() << " patterns";
      }
    }
  }
}

// The tail against a full sort of everything offered: random values with
// many duplicates (small integers), started from empty, partial and full
// tails, in offers of every length around the capacity and twice it.
TEST(TailKeeperTest, KeepsTheLargestOfEverythingOffered) {
  uint64_t state = 0x2545f4914f6cdd1dull;
  auto next = [&state] {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
  };
  for (size_t start :
       {size_t{0}, size_t{1}, size_t{100}, size_t{kTailCapacity}}) {
    for (size_t offers :
         {size_t{0}, size_t{1}, size_t{255}, size_t{256}, size_t{257},
          size_t{511}, size_t{512}, size_t{513}, size_t{5000}}) {
      for (bool duplicates : {false, true}) {
        auto value = [&] {
          return duplicates ? static_cast<float>(next() % 50)
                            : static_cast<float>(next() >> 40) * 0x1p-20f;
        };
        std::vector<float> all;
        std::vector<float> initial;
        for (size_t i = 0; i < start; ++i) initial.push_back(value());
        std::sort(initial.begin(), initial.end(), std::greater<float>());
        all = initial;
        TailKeeper keeper(initial);
        for (size_t i = 0; i < offers; ++i) {
          const float v = value();
          all.push_back(v);
          // Every value above the threshold is offered (as the loops do);
          // the rest cannot be among the largest.
          if (v > keeper.threshold()) keeper.Offer(v);
        }
        std::sort(all.begin(), all.end(), std::greater<float>());
        if (all.size() > kTailCapacity) all.resize(kTailCapacity);
        std::vector<float> kept;
        keeper.StoreSortedDescending(&kept);
        EXPECT_EQ(kept, all) << "start " << start << " offers " << offers
                             << " duplicates " << duplicates;
        if (all.size() == kTailCapacity) {
          EXPECT_LE(keeper.threshold(), all.back());
        }
      }
    }
  }
}

TEST(CpuIsaTest, NamesRoundTripAndUnknownIsRejected) {
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    auto parsed = ParseCpuIsa(CpuIsaName(isa));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, isa);
  }
  EXPECT_THAT(ParseCpuIsa("sse9").status(),
              ::kvcal::testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                         ::testing::HasSubstr("'sse9'")));
  // The active ISA never exceeds what the machine supports, and its loop
  // exists.
  EXPECT_LE(static_cast<int>(ActiveCpuIsa()),
            static_cast<int>(SupportedCpuIsa()));
  EXPECT_NE(LoopsFor(ActiveCpuIsa(), DType::kBf16).rows, nullptr);
  std::printf("supported: %s, active: %s\n",
              std::string(CpuIsaName(SupportedCpuIsa())).c_str(),
              std::string(CpuIsaName(ActiveCpuIsa())).c_str());
}

INSTANTIATE_TEST_SUITE_P(AllDTypes, RunKernelsTest,
                         ::testing::Values(DType::kF32, DType::kF16,
                                           DType::kBf16),
                         [](const ::testing::TestParamInfo<DType>& p) {
                           return std::string(DTypeName(p.param));
                         });

}  // namespace
}  // namespace kvcal::cpu
