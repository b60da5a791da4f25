// libFuzzer target: ValidateChunk and the CPU backend's Accumulate.
//
// The input is decoded into a session geometry (sometimes invalid) and a
// sequence of chunks whose enums, shapes, offsets and data sizes are mostly
// plausible and sometimes hostile. Checked on every input:
//   - Accumulate succeeds exactly when ValidateChunk does, with the same code;
//     a valid extent accounts for every byte of the data;
//   - the backend's statistics equal a slow reference built with
//     HeadStatistics::Add (min, max, counts, histograms, tails and batch
//     extrema exactly; the double sums within rounding);
//   - Serialize/Deserialize round-trips the snapshot exactly;
//   - Reset gives a fresh backend's statistics, and Merge of the snapshot
//     into it gives the snapshot back.
#include <fuzzer/FuzzedDataProvider.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "kernels/backend.h"
#include "kernels/element_math.h"
#include "kernels/statistics.h"
#include "kernels/types.h"
#include "tests/fuzz/fuzz_util.h"

namespace kvcal {
namespace {

Geometry DecodeGeometry(FuzzedDataProvider& in) {
  Geometry g;
  if (in.ConsumeIntegralInRange<int>(0, 15) == 0) {
    // Any geometry at all: most are rejected by Validate.
    g.num_layers = in.ConsumeIntegral<uint32_t>();
    g.num_attention_heads = in.ConsumeIntegral<uint32_t>();
    g.num_key_value_heads = in.ConsumeIntegral<uint32_t>();
    g.head_dim = in.ConsumeIntegral<uint32_t>();
    g.bins_per_octave = in.ConsumeIntegral<uint32_t>();
    g.role_mask = in.ConsumeIntegral<uint32_t>();
    return g;
  }
  // Small valid-looking geometries keep the reference check cheap.
  g.num_layers = in.ConsumeIntegralInRange<uint32_t>(1, 2);
  g.num_key_value_heads = in.ConsumeIntegralInRange<uint32_t>(1, 2);
  g.num_attention_heads =
      g.num_key_value_heads * in.ConsumeIntegralInRange<uint32_t>(1, 3);
  g.head_dim = in.ConsumeIntegralInRange<uint32_t>(1, 8);
  static constexpr uint32_t kBins[] = {0, 1, 2, 4, 16, 64, 128};
  g.bins_per_octave = in.PickValueInArray(kBins);
  g.role_mask = in.ConsumeIntegralInRange<uint32_t>(1, 7);
  return g;
}

uint64_t DecodeDim(FuzzedDataProvider& in, const Geometry& g) {
  switch (in.ConsumeIntegralInRange<int>(0, 7)) {
    case 0:
      return 0;
    case 1:
      return g.head_dim;
    case 2:
      return in.ConsumeIntegral<uint64_t>();  // overflow bait
    case 3:
      return uint64_t{1} << in.ConsumeIntegralInRange<int>(32, 63);
    default:
      return in.ConsumeIntegralInRange<uint64_t>(1, 4);
  }
}

ChunkView DecodeChunk(FuzzedDataProvider& in, const Geometry& g,
                      std::vector<std::byte>* storage) {
  ChunkView chunk;
  chunk.layer = in.ConsumeBool() ? in.ConsumeIntegral<uint32_t>()
                                 : in.ConsumeIntegralInRange<uint32_t>(0, 2);
  chunk.role = static_cast<Role>(in.ConsumeIntegralInRange<uint32_t>(0, 4));
  chunk.dtype = static_cast<DType>(in.ConsumeIntegralInRange<uint32_t>(0, 4));
  chunk.layout = static_cast<Layout>(in.ConsumeIntegralInRange<uint32_t>(0, 3));
  const int rank = in.ConsumeIntegralInRange<int>(0, 5);
  const bool tidy = in.ConsumeBool();
  for (int i = 0; i < rank; ++i) chunk.shape.push_back(DecodeDim(in, g));
  if (tidy && rank >= 2) {
    // Mostly-valid shapes: heads that fit, the session's head_dim.
    const uint32_t role_heads = static_cast<uint32_t>(chunk.role) == 1
                                    ? g.num_attention_heads
                                    : g.num_key_value_heads;
    const size_t heads_dim =
        chunk.layout == Layout::kHeadsTokensDim && rank == 4 ? 1 : rank - 2;
    chunk.shape[heads_dim] =
        role_heads == 0 ? 1 : 1 + chunk.shape[heads_dim] % role_heads;
    chunk.shape.back() = g.head_dim;
    for (uint64_t& d : chunk.shape) {
      if (d > 4 && &d != &chunk.shape.back()) d %= 5;
    }
  }
  chunk.head_offset = in.ConsumeBool()
                          ? in.ConsumeIntegral<uint32_t>()
                          : in.ConsumeIntegralInRange<uint32_t>(0, 3);
  chunk.batch = in.ConsumeIntegralInRange<uint64_t>(0, 3);
  // Data: usually the size the shape needs, sometimes any size.
  uint64_t elements = 1;
  for (uint64_t d : chunk.shape) {
    if (__builtin_mul_overflow(elements, d, &elements)) elements = 1u << 20;
  }
  const size_t element_size = static_cast<uint32_t>(chunk.dtype) == 1 ? 4 : 2;
  size_t bytes = elements <= 4096 ? elements * element_size : 64;
  if (in.ConsumeIntegralInRange<int>(0, 7) == 0) {
    bytes = in.ConsumeIntegralInRange<size_t>(0, 256);
  }
  storage->assign(bytes, std::byte{0});
  const std::vector<uint8_t> raw = in.ConsumeBytes<uint8_t>(bytes);
  if (!raw.empty()) std::memcpy(storage->data(), raw.data(), raw.size());
  // Fill the rest with a repeating pattern so short inputs still carry
  // non-zero values (including NaN and Inf bit patterns).
  for (size_t i = raw.size(); i < bytes; ++i) {
    static constexpr uint8_t kPattern[] = {0x00, 0x3f, 0x80, 0x7f, 0xff,
                                           0xc0, 0x01, 0x7c, 0xfe, 0x42};
    (*storage)[i] = std::byte{kPattern[i % sizeof(kPattern)]};
  }
  chunk.data = absl::Span<const std::byte>(*storage);
  return chunk;
}

float ElementAt(const ChunkView& chunk, uint64_t index) {
  const std::byte* p = chunk.data.data();
  switch (chunk.dtype) {
    case DType::kF32: {
      float x;
      std::memcpy(&x, p + 4 * index, 4);
      return x;
    }
    case DType::kF16: {
      uint16_t bits;
      std::memcpy(&bits, p + 2 * index, 2);
      return DecodeF16(bits);
    }
    case DType::kBf16: {
      uint16_t bits;
      std::memcpy(&bits, p + 2 * index, 2);
      return DecodeBf16(bits);
    }
  }
  std::abort();
}

// How far the backend's sums may be from the value-by-value double reference,
// per unit of sum |x| (or of sum x^2). f32 values are summed in double; 16-bit
// values are summed in float within blocks of at most 8 values per lane
// before they go into double (kernels/cpu/run_kernels_internal.h), so their
// error is bounded by 8 * 2^-24 of the block's sum of magnitudes, plus the
// double folds.
double SumTolerance(DType dtype) {
  return dtype == DType::kF32 ? 1e-9 : 0x1p-20;
}

// The slow reference: every element through HeadStatistics::Add. `tolerances`
// collects, per head, the allowed error of the sum and of the sum of squares.
void AddReference(const Geometry& g, const ChunkView& chunk,
                  const ChunkExtent& extent, SessionStatistics* reference,
                  std::vector<double>* tolerances) {
  const double tolerance = SumTolerance(chunk.dtype);
  // A zero dimension anywhere makes an empty chunk, however large the others
  // (outer may be near 2^64 with inner 0): nothing to add, nothing to walk.
  if (extent.elements() == 0) return;
  for (uint64_t o = 0; o < extent.outer; ++o) {
    for (uint32_t h = 0; h < extent.heads; ++h) {
      const uint32_t head = chunk.head_offset + h;
      const size_t index = reference->Index(chunk.layer, chunk.role, head);
      HeadStatistics& stats = reference->heads()[index];
      for (uint64_t i = 0; i < extent.inner; ++i) {
        const float x =
            ElementAt(chunk, (o * extent.heads + h) * extent.inner + i);
        stats.Add(x, chunk.batch, g.log2_bins_per_octave());
        if (!IsNonFinite(x)) {
          (*tolerances)[2 * index] +=
              tolerance * std::fabs(static_cast<double>(x));
          (*tolerances)[2 * index + 1] +=
              tolerance * static_cast<double>(x) * x;
        }
      }
    }
  }
}

bool Close(double a, double b, double tolerance) {
  return std::fabs(a - b) <= tolerance + 1e-300;
}

void CheckEqualsReference(const SessionStatistics& got,
                          const SessionStatistics& want,
                          const std::vector<double>& tolerances) {
  FUZZ_CHECK(got.geometry() == want.geometry());
  FUZZ_CHECK(got.num_heads_total() == want.num_heads_total());
  for (size_t i = 0; i < got.num_heads_total(); ++i) {
    const HeadStatistics& a = got.heads()[i];
    const HeadStatistics& b = want.heads()[i];
    FUZZ_CHECK(a.finite_count == b.finite_count);
    FUZZ_CHECK(a.nan_count == b.nan_count);
    FUZZ_CHECK(a.inf_count == b.inf_count);
    FUZZ_CHECK(std::memcmp(&a.min, &b.min, sizeof(float)) == 0);
    FUZZ_CHECK(std::memcmp(&a.max, &b.max, sizeof(float)) == 0);
    FUZZ_CHECK(a.histogram == b.histogram);
    FUZZ_CHECK(a.tail == b.tail);
    FUZZ_CHECK(a.batches == b.batches);
    FUZZ_CHECK(Close(a.sum, b.sum, tolerances[2 * i]));
    FUZZ_CHECK(Close(a.sum_squares, b.sum_squares, tolerances[2 * i + 1]));
  }
}

void Run(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const Geometry g = DecodeGeometry(in);
  const bool valid_geometry = g.Validate().ok();
  BackendOptions options;
  options.cpu_threads = 1;
  auto created = CreateCpuBackend(g, options);
  FUZZ_CHECK(created.ok() == valid_geometry);
  if (!created.ok()) {
    FUZZ_CHECK(created.status().code() == absl::StatusCode::kInvalidArgument);
    return;
  }
  StatisticsBackend& backend = **created;
  SessionStatistics reference(g);
  std::vector<double> tolerances(2 * reference.num_heads_total(), 0.0);

  const int chunks = in.ConsumeIntegralInRange<int>(1, 6);
  std::vector<std::byte> storage;
  for (int c = 0; c < chunks && in.remaining_bytes() > 0; ++c) {
    const ChunkView chunk = DecodeChunk(in, g, &storage);
    const absl::StatusOr<ChunkExtent> extent = ValidateChunk(g, chunk);
    const absl::Status status = backend.Accumulate(chunk);
    FUZZ_CHECK(status.ok() == extent.ok());
    if (!extent.ok()) {
      FUZZ_CHECK(extent.status().code() == absl::StatusCode::kInvalidArgument);
      FUZZ_CHECK(status.code() == absl::StatusCode::kInvalidArgument);
      FUZZ_CHECK(!extent.status().message().empty());
      continue;
    }
    FUZZ_CHECK(extent->heads >= 1);
    FUZZ_CHECK(chunk.head_offset + uint64_t{extent->heads} <=
               g.heads(chunk.role));
    FUZZ_CHECK(extent->elements() * DTypeSize(chunk.dtype) ==
               chunk.data.size());
    FUZZ_CHECK(extent->elements() == 0 || extent->inner % g.head_dim == 0);
    AddReference(g, chunk, *extent, &reference, &tolerances);
  }

  absl::StatusOr<SessionStatistics> snapshot = backend.Snapshot();
  FUZZ_CHECK(snapshot.ok());
  CheckEqualsReference(*snapshot, reference, tolerances);

  // Serialize/Deserialize is exact.
  const std::string bytes = snapshot->Serialize();
  absl::StatusOr<SessionStatistics> parsed =
      SessionStatistics::Deserialize(bytes);
  FUZZ_CHECK(parsed.ok());
  FUZZ_CHECK(*parsed == *snapshot);
  FUZZ_CHECK(parsed->Serialize() == bytes);

  // Reset forgets everything; merging the snapshot back restores it.
  FUZZ_CHECK(backend.Reset().ok());
  absl::StatusOr<SessionStatistics> empty = backend.Snapshot();
  FUZZ_CHECK(empty.ok());
  FUZZ_CHECK(*empty == SessionStatistics(g));
  FUZZ_CHECK(backend.Merge(*snapshot).ok());
  absl::StatusOr<SessionStatistics> restored = backend.Snapshot();
  FUZZ_CHECK(restored.ok());
  FUZZ_CHECK(restored->Serialize() == bytes);

  fuzz::CheckScales(*snapshot, in.ConsumeIntegral<uint8_t>());
}

}  // namespace
}  // namespace kvcal

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvcal::Run(data, size);
  return 0;
}
