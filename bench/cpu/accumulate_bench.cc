// CPU accumulate throughput against a plain read pass over the same buffer.
//
//   ./kvcal_bench_cpu                 # all benchmarks, then the ratios
//   ./kvcal_bench_cpu --benchmark_filter=bf16
//
// Every benchmark runs on one thread (BackendOptions::cpu_threads = 1) over a
// 256 MiB buffer of normally distributed activations, far beyond the caches,
// streamed as TOKENS_HEADS_DIM chunks of 2048 tokens x 8 heads x 128 (and,
// for comparison, as HEADS_TOKENS_DIM chunks [1, 8, 2048, 128]). The
// read pass sums the same buffer's 64-bit words (vectorized, and its result
// kept so the compiler cannot drop it). At the end the binary prints, per
// dtype, accumulate GB/s over read GB/s and the values per second with
// histograms. Goals (issue 2): without histograms >= 70% of the read pass;
// with 16 bins per octave >= 0.5 G values/s per thread; (issue 14, bf16) with
// 64 bins per octave >= 2 G values/s per thread. The inner loops are the
// widest the CPU has (KVCAL_CPU_ISA=scalar|avx2|avx512 caps them); the
// summary names the ones used.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu/run_kernels.h"
#include "kernels/types.h"

namespace kvcal {
namespace {

constexpr size_t kBufferBytes = size_t{256} << 20;
constexpr uint32_t kHeads = 8;
constexpr uint32_t kHeadDim = 128;
constexpr uint64_t kChunkTokens = 2048;

uint16_t ToBf16(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

// Normally distributed values (sum of uniforms from xorshift64: cheap to
// generate, realistic enough for bins, the tail threshold and branches).
const std::vector<std::byte>& Buffer(DType dtype) {
  static std::map<DType, std::vector<std::byte>> buffers;
  auto [it, inserted] = buffers.try_emplace(dtype);
  if (!inserted) return it->second;
  std::vector<std::byte>& bytes = it->second;
  bytes.resize(kBufferBytes);
  const size_t n = kBufferBytes / DTypeSize(dtype);
  uint64_t state = 0x9e3779b97f4a7c15ull;
  auto uniform = [&state] {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return static_cast<float>(state >> 40) * (1.0f / 16777216.0f);
  };
  for (size_t i = 0; i < n; ++i) {
    const float x =
        (uniform() + uniform() + uniform() + uniform() - 2.0f) * 1.7f;
    if (dtype == DType::kF32) {
      std::memcpy(bytes.data() + 4 * i, &x, 4);
    } else {
      const uint16_t h = ToBf16(x);
      std::memcpy(bytes.data() + 2 * i, &h, 2);
    }
  }
  return bytes;
}

// The read pass: sum of 64-bit words with four independent accumulators.
__attribute__((target("avx2"))) uint64_t SumWordsAvx2(const uint64_t* p,
                                                      size_t n) {
  uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  for (size_t i = 0; i + 4 <= n; i += 4) {
    s0 += p[i];
    s1 += p[i + 1];
    s2 += p[i + 2];
    s3 += p[i + 3];
  }
  return s0 + s1 + s2 + s3;
}
uint64_t SumWords(const uint64_t* p, size_t n) {
  uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  for (size_t i = 0; i + 4 <= n; i += 4) {
    s0 += p[i];
    s1 += p[i + 1];
    s2 += p[i + 2];
    s3 += p[i + 3];
  }
  return s0 + s1 + s2 + s3;
}

void BM_ReadPass(benchmark::State& state, DType dtype) {
  const std::vector<std::byte>& bytes = Buffer(dtype);
  const auto* words = reinterpret_cast<const uint64_t*>(bytes.data());
  const size_t n = bytes.size() / 8;
  const bool avx2 = __builtin_cpu_supports("avx2");
  for (auto _ : state) {
    uint64_t sum = avx2 ? SumWordsAvx2(words, n) : SumWords(words, n);
    benchmark::DoNotOptimize(sum);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) *
                          static_cast<int64_t>(bytes.size()));
  state.SetItemsProcessed(
      static_cast<int64_t>(state.iterations()) *
      static_cast<int64_t>(bytes.size() / DTypeSize(dtype)));
}

void BM_Accumulate(benchmark::State& state, DType dtype,
                   uint32_t bins_per_octave, Layout layout) {
  const std::vector<std::byte>& bytes = Buffer(dtype);
  Geometry g;
  g.num_layers = 1;
  g.num_attention_heads = kHeads;
  g.num_key_value_heads = kHeads;
  g.head_dim = kHeadDim;
  g.bins_per_octave = bins_per_octave;
  BackendOptions options;
  options.cpu_threads = 1;
  auto backend = CreateCpuBackend(g, options);
  if (!backend.ok()) {
    state.SkipWithError(std::string(backend.status().message()).c_str());
    return;
  }
  const size_t element = DTypeSize(dtype);
  const size_t chunk_bytes = kChunkTokens * kHeads * kHeadDim * element;
  const size_t chunks = bytes.size() / chunk_bytes;
  ChunkView view;
  view.role = Role::kK;
  view.dtype = dtype;
  view.layout = layout;
  view.shape = layout == Layout::kTokensHeadsDim
                   ? std::vector<uint64_t>{kChunkTokens, kHeads, kHeadDim}
                   : std::vector<uint64_t>{1, kHeads, kChunkTokens, kHeadDim};
  for (auto _ : state) {
    for (size_t c = 0; c < chunks; ++c) {
      view.data = absl::Span<const std::byte>(bytes.data() + c * chunk_bytes,
                                              chunk_bytes);
      if (absl::Status s = (*backend)->Accumulate(view); !s.ok()) {
        state.SkipWithError(std::string(s.message()).c_str());
        return;
      }
    }
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) *
                          static_cast<int64_t>(chunks * chunk_bytes));
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()) *
                          static_cast<int64_t>(chunks * chunk_bytes / element));
}

// Keeps bytes/s and items/s of every run for the summary.
class SummaryReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& run : runs) {
      if (run.error_occurred || run.run_type != Run::RT_Iteration) continue;
      const auto bytes = run.counters.find("bytes_per_second");
      const auto items = run.counters.find("items_per_second");
      if (bytes == run.counters.end() || items == run.counters.end()) continue;
      // Best of the repetitions: the machine may be shared.
      Rate& best = results_[run.run_name.function_name];
      best.bytes_per_second =
          std::max(best.bytes_per_second, bytes->second.value);
      best.items_per_second =
          std::max(best.items_per_second, items->second.value);
    }
  }
  struct Rate {
    double bytes_per_second = 0;
    double items_per_second = 0;
  };
  const std::map<std::string, Rate>& results() const { return results_; }

 private:
  std::map<std::string, Rate> results_;
};

}  // namespace
}  // namespace kvcal

int main(int argc, char** argv) {
  using kvcal::DType;
  using kvcal::Layout;
  struct Case {
    const char* name;
    DType dtype;
  };
  const Case dtypes[] = {{"bf16", DType::kBf16}, {"f32", DType::kF32}};
  for (const Case& c : dtypes) {
    const std::string d = c.name;
    benchmark::RegisterBenchmark(("read/" + d).c_str(), kvcal::BM_ReadPass,
                                 c.dtype)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("accumulate/" + d + "/no_hist").c_str(),
                                 kvcal::BM_Accumulate, c.dtype, 0u,
                                 Layout::kTokensHeadsDim)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("accumulate/" + d + "/hist16").c_str(),
                                 kvcal::BM_Accumulate, c.dtype, 16u,
                                 Layout::kTokensHeadsDim)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("accumulate/" + d + "/hist64").c_str(),
                                 kvcal::BM_Accumulate, c.dtype, 64u,
                                 Layout::kTokensHeadsDim)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(
        ("accumulate/" + d + "/no_hist/heads_tokens_dim").c_str(),
        kvcal::BM_Accumulate, c.dtype, 0u, Layout::kHeadsTokensDim)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(
        ("accumulate/" + d + "/hist16/heads_tokens_dim").c_str(),
        kvcal::BM_Accumulate, c.dtype, 16u, Layout::kHeadsTokensDim)
        ->Unit(benchmark::kMillisecond);
  }
  // Several repetitions by default; the summary takes the best of each.
  std::vector<char*> args(argv, argv + argc);
  std::string repetitions = "--benchmark_repetitions=3";
  bool has_repetitions = false;
  for (int i = 1; i < argc; ++i) {
    has_repetitions |=
        std::strncmp(argv[i], "--benchmark_repetitions", 23) == 0;
  }
  if (!has_repetitions) args.push_back(repetitions.data());
  argc = static_cast<int>(args.size());
  argv = args.data();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  kvcal::SummaryReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);

  const auto& r = reporter.results();
  std::printf(
      "\nsummary (one thread, %zu MiB buffer, best of the repetitions, %s "
      "inner loops)\n",
      kvcal::kBufferBytes >> 20,
      std::string(kvcal::cpu::CpuIsaName(kvcal::cpu::ActiveCpuIsa())).c_str());
  for (const Case& c : dtypes) {
    const std::string d = c.name;
    const auto read = r.find("read/" + d);
    if (read == r.end()) continue;
    std::printf("%s read pass: %.2f GB/s\n", c.name,
                read->second.bytes_per_second / 1e9);
    for (const char* variant :
         {"no_hist", "hist16", "hist64", "no_hist/heads_tokens_dim",
          "hist16/heads_tokens_dim"}) {
      const auto acc = r.find("accumulate/" + d + "/" + variant);
      if (acc == r.end()) continue;
      std::printf(
          "%s accumulate %-24s %6.2f GB/s  %5.3f G values/s  ratio to read "
          "%.2f\n",
          c.name, variant, acc->second.bytes_per_second / 1e9,
          acc->second.items_per_second / 1e9,
          acc->second.bytes_per_second / read->second.bytes_per_second);
    }
  }
  std::printf(
      "goals: no_hist ratio >= 0.70; hist16 >= 0.5 G values/s per thread; "
      "bf16 hist64 >= 2 G values/s per thread\n");
  return 0;
}
