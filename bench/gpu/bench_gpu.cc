// kvcal_bench_gpu: how close the CUDA backend comes to the hardware, every
// figure next to a baseline measured in the same run on the same device:
//
//   - HBM: the fused accumulate kernel on device-resident data (bf16 and
//     f32; without histograms: min/max, counts, moments, per-batch extrema;
//     with 16 bins per octave plus the exact 256-value tail) against the
//     device's peak read bandwidth, measured with a plain 16-byte read pass
//     (a device-to-device copy is shown too). Goals: >= 0.85 of peak without
//     histograms, >= 0.50 with.
//   - H2D: host-staged accumulate (pageable host memory -> pinned staging
//     ring -> device, the copy of each piece overlapping the kernels of the
//     previous one) against a plain pinned host-to-device copy, and against
//     the bound of the host-side memcpy into the ring.
//
//   kvcal_bench_gpu [--mib 1024] [--iterations 10] [--repeats 3]
//
// Timings are never assertions: a missed goal prints "NOT met" and exits 0.
// Exits 3 when there is no CUDA device (nothing measured) and 1 when any
// measurement failed or came out empty, so a GPU check cannot pass without
// having measured.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "bench/gpu/bench_gpu_kernels.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_resources.h"
#include "kernels/cuda/cuda_status.h"
#include "util/status_macros.h"

namespace kvcal::bench {
namespace {

constexpr uint32_t kHeads = 8;
constexpr uint32_t kHeadDim = 128;

struct Options {
  size_t mib = 1024;
  int iterations = 10;
  int repeats = 3;
};

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

// Best bandwidth in GB/s (1e9 bytes) of `repeats` timings of `iterations`
// calls of `pass`, each moving `bytes`.
template <typename Pass, typename Wait>
absl::StatusOr<double> BestGbps(const Options& options, double bytes,
                                Pass&& pass, Wait&& wait) {
  double best = 0.0;
  for (int r = 0; r < options.repeats; ++r) {
    const Clock::time_point start = Clock::now();
    for (int i = 0; i < options.iterations; ++i) KVCAL_RETURN_IF_ERROR(pass());
    KVCAL_RETURN_IF_ERROR(wait());
    best = std::max(best, bytes * options.iterations / Seconds(start) / 1e9);
  }
  return best;
}

// A measured bandwidth is a positive finite number, or the run is broken.
absl::Status CheckMeasured(const char* what, double gbps) {
  if (!(gbps > 0.0) || gbps > 1e6) {
    return absl::InternalError(absl::StrCat(what, ": measured ", gbps,
                                            " GB/s, which is no measurement"));
  }
  return absl::OkStatus();
}

struct Variant {
  DType dtype;
  uint32_t bins_per_octave;
  const char* label;
  double goal;
};

absl::Status Run(const Options& options) {
  std::printf("kvcal_bench_gpu on %s\n", CudaDeviceDescription(0).c_str());
  KVCAL_CUDA_RETURN_IF_ERROR(cudaSetDevice(0));
  int sm_count = 0;
  KVCAL_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, 0));
  const size_t row_bytes_f32 = size_t{kHeads} * kHeadDim * 4;
  const size_t bytes =
      std::max<size_t>(1, (options.mib << 20) / row_bytes_f32) * row_bytes_f32;
  KVCAL_ASSIGN_OR_RETURN(auto buffer,
                         cuda::DeviceBuffer<unsigned char>::Allocate(bytes));
  KVCAL_ASSIGN_OR_RETURN(auto sink, cuda::DeviceBuffer<unsigned>::Allocate(1));
  KVCAL_ASSIGN_OR_RETURN(cuda::Stream stream, cuda::Stream::Create());
  auto wait_stream = [&]() -> absl::Status {
    KVCAL_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream.get()));
    return absl::OkStatus();
  };
  std::printf("buffer %zu MiB, %d iterations per timing, best of %d\n\n",
              bytes >> 20, options.iterations, options.repeats);

  KVCAL_CUDA_RETURN_IF_ERROR(FillActivations(
      buffer.get(), bytes / 4, false, kHeads, kHeadDim, 1, stream.get()));
  KVCAL_RETURN_IF_ERROR(wait_stream());
  KVCAL_ASSIGN_OR_RETURN(
      const double read_gbps,
      BestGbps(
          options, static_cast<double>(bytes),
          [&]() -> absl::Status {
            KVCAL_CUDA_RETURN_IF_ERROR(LaunchReadPass(
                buffer.get(), bytes, sink.get(), sm_count, stream.get()));
            return absl::OkStatus();
          },
          wait_stream));
  const size_t half = bytes / 2;
  KVCAL_ASSIGN_OR_RETURN(const double copy_gbps,
                         BestGbps(
                             options, 2.0 * static_cast<double>(half),
                             [&]() -> absl::Status {
                               KVCAL_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
                                   buffer.get() + half, buffer.get(), half,
                                   cudaMemcpyDeviceToDevice, stream.get()));
                               return absl::OkStatus();
                             },
                             wait_stream));
  KVCAL_RETURN_IF_ERROR(CheckMeasured("read pass", read_gbps));
  KVCAL_RETURN_IF_ERROR(CheckMeasured("device copy", copy_gbps));
  std::printf("HBM peak, read pass (16-byte loads)  %9.1f GB/s   (baseline)\n",
              read_gbps);
  std::printf(
      "device-to-device copy (read + write) %9.1f GB/s   (%.2f of "
      "the read pass)\n\n",
      copy_gbps, copy_gbps / read_gbps);

  const Variant variants[] = {
      {DType::kBf16, 0, "bf16, no histograms", 0.85},
      {DType::kBf16, 16, "bf16, 16 bins/octave + tail", 0.50},
      {DType::kF32, 0, "f32, no histograms", 0.85},
      {DType::kF32, 16, "f32, 16 bins/octave + tail", 0.50},
  };
  bool all_goals_met = true;
  DType filled = DType::kF32;
  bool have_fill = false;
  for (const Variant& variant : variants) {
    const size_t element_size = DTypeSize(variant.dtype);
    const uint64_t values = bytes / element_size;
    const uint64_t tokens = values / (kHeads * kHeadDim);
    if (!have_fill || filled != variant.dtype) {
      KVCAL_CUDA_RETURN_IF_ERROR(
          FillActivations(buffer.get(), values, variant.dtype == DType::kBf16,
                          kHeads, kHeadDim, 7, stream.get()));
      KVCAL_RETURN_IF_ERROR(wait_stream());
      filled = variant.dtype;
      have_fill = true;
    }
    const Geometry geometry{.num_layers = 1,
                            .num_attention_heads = kHeads,
                            .num_key_value_heads = kHeads,
                            .head_dim = kHeadDim,
                            .bins_per_octave = variant.bins_per_octave,
                            .role_mask = 0b010};
    KVCAL_ASSIGN_OR_RETURN(std::unique_ptr<CudaStatisticsBackend> backend,
                           CreateCudaStatisticsBackend(geometry));
    ChunkView chunk{{.layer = 0,
                     .role = Role::kK,
                     .dtype = variant.dtype,
                     .layout = Layout::kTokensHeadsDim,
                     .shape = {tokens, kHeads, kHeadDim},
                     .batch = 0},
                    absl::Span<const std::byte>(
                        reinterpret_cast<const std::byte*>(buffer.get()),
                        tokens * kHeads * kHeadDim * element_size),
                    {}};
    const double chunk_bytes = static_cast<double>(chunk.data.size());
    // First chunk: the tails are empty, so every value is a candidate.
    const Clock::time_point first = Clock::now();
    KVCAL_RETURN_IF_ERROR(backend->AccumulateDeviceData(chunk, nullptr));
    KVCAL_RETURN_IF_ERROR(backend->Synchronize());
    const double first_gbps = chunk_bytes / Seconds(first) / 1e9;
    KVCAL_ASSIGN_OR_RETURN(const double gbps,
                           BestGbps(
                               options, chunk_bytes,
                               [&]() -> absl::Status {
                                 ++chunk.batch;
                                 return backend->AccumulateDeviceData(chunk,
                                                                      nullptr);
                               },
                               [&]() { return backend->Synchronize(); }));
    // The result must account for every value.
    KVCAL_ASSIGN_OR_RETURN(SessionStatistics stats, backend->Snapshot());
    const uint64_t expected =
        tokens * kHeads * kHeadDim *
        (1 + static_cast<uint64_t>(options.iterations) * options.repeats);
    uint64_t seen = 0;
    for (const HeadStatistics& head : stats.heads()) {
      seen += head.finite_count + head.nonfinite_count();
    }
    if (seen != expected) {
      return absl::InternalError(absl::StrCat(variant.label,
                                              ": statistics count ", seen,
                                              " values, expected ", expected));
    }
    KVCAL_RETURN_IF_ERROR(CheckMeasured(variant.label, gbps));
    const double ratio = gbps / read_gbps;
    const bool met = ratio >= variant.goal;
    all_goals_met = all_goals_met && met;
    std::printf(
        "accumulate %-27s %9.1f GB/s %7.1f Gvalues/s  HBM ratio %.2f of peak "
        "(goal >= %.2f: %s)  first chunk, empty tails: %.1f GB/s\n",
        variant.label, gbps, gbps / static_cast<double>(element_size), ratio,
        variant.goal, met ? "met" : "NOT met", first_gbps);
  }

  // Host-staged path: pageable host memory through the pinned ring, 32 MiB
  // chunks (four 8 MiB staging pieces each), against a plain pinned copy.
  {
    const uint64_t tokens = 16384;
    const size_t staged_bytes = tokens * kHeads * kHeadDim * 2;  // 32 MiB
    std::vector<uint16_t> host(staged_bytes / 2);
    for (size_t i = 0; i < host.size(); ++i) {
      host[i] =
          static_cast<uint16_t>(0x3c00u + (i * 2654435761u >> 20) % 0x300u);
    }
    KVCAL_ASSIGN_OR_RETURN(cuda::PinnedBuffer pinned,
                           cuda::PinnedBuffer::Allocate(staged_bytes));
    std::memcpy(pinned.get(), host.data(), staged_bytes);
    KVCAL_ASSIGN_OR_RETURN(
        auto h2d_target,
        cuda::DeviceBuffer<unsigned char>::Allocate(staged_bytes));
    Options copy_options = options;
    copy_options.iterations = 16;
    KVCAL_ASSIGN_OR_RETURN(
        const double h2d_gbps,
        BestGbps(
            copy_options, static_cast<double>(staged_bytes),
            [&]() -> absl::Status {
              KVCAL_CUDA_RETURN_IF_ERROR(
                  cudaMemcpyAsync(h2d_target.get(), pinned.get(), staged_bytes,
                                  cudaMemcpyHostToDevice, stream.get()));
              return absl::OkStatus();
            },
            wait_stream));
    KVCAL_ASSIGN_OR_RETURN(const double memcpy_gbps,
                           BestGbps(
                               copy_options, static_cast<double>(staged_bytes),
                               [&]() -> absl::Status {
                                 std::memcpy(pinned.get(), host.data(),
                                             staged_bytes);
                                 return absl::OkStatus();
                               },
                               []() { return absl::OkStatus(); }));
    const Geometry geometry{.num_layers = 1,
                            .num_attention_heads = kHeads,
                            .num_key_value_heads = kHeads,
                            .head_dim = kHeadDim,
                            .bins_per_octave = 16,
                            .role_mask = 0b010};
    KVCAL_ASSIGN_OR_RETURN(std::unique_ptr<CudaStatisticsBackend> backend,
                           CreateCudaStatisticsBackend(geometry));
    const ChunkView chunk{
        {.layer = 0,
         .role = Role::kK,
         .dtype = DType::kBf16,
         .layout = Layout::kTokensHeadsDim,
         .shape = {tokens, kHeads, kHeadDim}},
        absl::Span<const std::byte>(
            reinterpret_cast<const std::byte*>(host.data()), staged_bytes),
        {}};
    KVCAL_RETURN_IF_ERROR(backend->Accumulate(chunk));
    KVCAL_RETURN_IF_ERROR(backend->Synchronize());
    KVCAL_ASSIGN_OR_RETURN(const double gbps,
                           BestGbps(
                               copy_options, static_cast<double>(staged_bytes),
                               [&]() { return backend->Accumulate(chunk); },
                               [&]() { return backend->Synchronize(); }));
    KVCAL_ASSIGN_OR_RETURN(SessionStatistics stats, backend->Snapshot());
    uint64_t seen = 0;
    for (const HeadStatistics& head : stats.heads()) {
      seen += head.finite_count + head.nonfinite_count();
    }
    const uint64_t expected =
        (tokens * kHeads * kHeadDim) *
        (1 +
         static_cast<uint64_t>(copy_options.iterations) * copy_options.repeats);
    if (seen != expected) {
      return absl::InternalError(absl::StrCat("host-staged: statistics count ",
                                              seen, " values, expected ",
                                              expected));
    }
    KVCAL_RETURN_IF_ERROR(CheckMeasured("pinned H2D copy", h2d_gbps));
    KVCAL_RETURN_IF_ERROR(CheckMeasured("host memcpy", memcpy_gbps));
    KVCAL_RETURN_IF_ERROR(CheckMeasured("host-staged accumulate", gbps));
    std::printf(
        "\npinned host-to-device copy          %9.1f GB/s   (H2D baseline)\n"
        "host memcpy into the pinned ring    %9.1f GB/s   (one thread)\n"
        "host-staged accumulate, bf16 32 MiB chunks, 16 bins/octave: %.1f GB/s"
        "  H2D ratio %.2f of the pinned copy, %.2f of min(H2D, memcpy)\n",
        h2d_gbps, memcpy_gbps, gbps, gbps / h2d_gbps,
        gbps / std::min(h2d_gbps, memcpy_gbps));
  }
  std::printf("\n%s\n", all_goals_met ? "all throughput goals met"
                                      : "some throughput goals NOT met");
  return absl::OkStatus();
}

}  // namespace
}  // namespace kvcal::bench

int main(int argc, char** argv) {
  kvcal::bench::Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--mib" && has_value) {
      options.mib = std::strtoull(argv[++i], nullptr, 10);
    } else if (arg == "--iterations" && has_value) {
      options.iterations = std::max(1, std::atoi(argv[++i]));
    } else if (arg == "--repeats" && has_value) {
      options.repeats = std::max(1, std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr,
                   "usage: %s [--mib N] [--iterations N] [--repeats N]\n",
                   argv[0]);
      return 2;
    }
  }
  if (kvcal::CudaDeviceCount() == 0) {
    std::fprintf(stderr, "kvcal_bench_gpu: %s; nothing measured.\n",
                 kvcal::CudaDeviceDescription(0).c_str());
    return 3;
  }
  const absl::Status status = kvcal::bench::Run(options);
  if (!status.ok()) {
    std::fprintf(stderr, "kvcal_bench_gpu: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
