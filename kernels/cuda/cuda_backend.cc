// The CUDA statistics backend: host side. Owns the device state, the pinned
// staging ring, the streams and the scratch; splits chunks into pieces that
// fit a staging slot, sizes the grid and enqueues the kernels of
// statistics_kernels.cu. See statistics_kernels.h for the state layout.
//
// Pipeline of one staged piece, slot s of kStagingSlots:
//   host:        wait until the previous copy out of pinned[s] finished,
//                memcpy the piece into pinned[s]
//   copy stream: wait until the kernels that read device[s] finished,
//                pinned[s] -> device[s], record copied[s]
//   compute:     wait copied[s], AccumulateKernel (+ TailSelectKernel),
//                record consumed[s]
// so the copy of piece N+1 overlaps the kernels of piece N, and the host
// waits only when it laps the ring.
//
// Why this file is over 600 lines: it is one class's host side, and the
// staging ring, streams, events and scratch are private state that nearly
// every method touches; the kernels are in kernels/cuda/*.cuh.

#include "kernels/cuda/cuda_backend.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_resources.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/statistics_kernels.h"
#include "kernels/element_math.h"
#include "util/status_macros.h"

namespace kvcal {
namespace {

using cuda::DeviceBuffer;
using cuda::DeviceGuard;
using cuda::ElementType;
using cuda::Event;
using cuda::PinnedBuffer;
using cuda::Stream;

constexpr size_t kStagingSlots = 4;
constexpr size_t kStagingSlotBytes = size_t{8} << 20;
// Kernels count values of one head of one launch in 32 bits.
constexpr uint64_t kMaxElementsPerLaunch = uint64_t{1} << 30;
constexpr size_t kInitialBatchSlots = 16;
// A block should get at least this many values of its head per thread.
constexpr uint64_t kMinValuesPerThread = 16;

ElementType ToElementType(DType dtype) {
  switch (dtype) {
    case DType::kF16:
      return ElementType::kF16;
    case DType::kBf16:
      return ElementType::kBf16;
    case DType::kF32:
      break;
  }
  return ElementType::kF32;
}

int TypeIndex(ElementType type) { return static_cast<int>(type); }

// Calls fn(first_element, piece_extent, piece_head_offset) for contiguous
// pieces of at most max_elements elements that together cover `extent`. A
// piece is again in canonical form (types.h ChunkExtent): whole rows when a
// row fits, else runs of heads of one row, else runs of one head's values
// (statistics do not depend on positions within a head, so any split is
// exact).
template <typename Fn>
absl::Status ForEachPiece(const ChunkExtent& extent, uint32_t head_offset,
                          uint64_t max_elements, Fn&& fn) {
  const uint64_t row = static_cast<uint64_t>(extent.heads) * extent.inner;
  if (row <= max_elements) {
    const uint64_t rows = max_elements / row;
    for (uint64_t o = 0; o < extent.outer; o += rows) {
      const ChunkExtent piece{.outer = std::min(rows, extent.outer - o),
                              .heads = extent.heads,
                              .inner = extent.inner};
      KVCAL_RETURN_IF_ERROR(fn(o * row, piece, head_offset));
    }
    return absl::OkStatus();
  }
  if (extent.inner <= max_elements) {
    const uint32_t heads_per_piece =
        static_cast<uint32_t>(max_elements / extent.inner);  // < heads
    for (uint64_t o = 0; o < extent.outer; ++o) {
      for (uint32_t h = 0; h < extent.heads; h += heads_per_piece) {
        const ChunkExtent piece{
            .outer = 1,
            .heads = std::min(heads_per_piece, extent.heads - h),
            .inner = extent.inner};
        KVCAL_RETURN_IF_ERROR(
            fn((o * extent.heads + h) * extent.inner, piece, head_offset + h));
      }
    }
    return absl::OkStatus();
  }
  for (uint64_t o = 0; o < extent.outer; ++o) {
    for (uint32_t h = 0; h < extent.heads; ++h) {
      for (uint64_t i = 0; i < extent.inner; i += max_elements) {
        const ChunkExtent piece{
            .outer = 1,
            .heads = 1,
            .inner = std::min(max_elements, extent.inner - i)};
        KVCAL_RETURN_IF_ERROR(fn((o * extent.heads + h) * extent.inner + i,
                                 piece, head_offset + h));
      }
    }
  }
  return absl::OkStatus();
}

float DecodeMin(uint32_t key_inverted) {
  if (key_inverted == 0) return BitsToFloat(0x7f800000u);  // +Inf: none
  return BitsToFloat(cuda::BitsFromOrderedKey(~key_inverted));
}
float DecodeMax(uint32_t key) {
  if (key == 0) return BitsToFloat(0xff800000u);  // -Inf: none
  return BitsToFloat(cuda::BitsFromOrderedKey(key));
}
uint32_t EncodeMin(float min) {
  return ~cuda::OrderedKeyFromBits(FloatBits(min));
}
uint32_t EncodeMax(float max) {
  return cuda::OrderedKeyFromBits(FloatBits(max));
}

class CudaBackend final : public CudaStatisticsBackend {
 public:
  CudaBackend(const Geometry& geometry, int device)
      : geometry_(geometry), device_(device) {
    uint32_t offset = 0;
    for (Role role : geometry_.roles()) {
      role_offset_[RoleIndex(role)] = offset;
      offset += geometry_.heads(role);
    }
    heads_per_layer_ = offset;
    heads_total_ = static_cast<uint32_t>(geometry_.total_heads());
    bins_ = geometry_.histogram_bins();
  }

  ~CudaBackend() override {
    // Kernels may still use the buffers: wait, then release everything while
    // this backend's device is current (the destroying thread may have
    // another one current).
    auto guard = DeviceGuard::Enter(device_);
    if (compute_.get() != nullptr) {
      cuda::IgnoreCudaError(cudaStreamSynchronize(compute_.get()));
    }
    if (copy_.get() != nullptr) {
      cuda::IgnoreCudaError(cudaStreamSynchronize(copy_.get()));
    }
    pinned_ = {};
    staged_ = {};
    copied_ = {};
    consumed_ = {};
    candidates_ = {};
    candidate_counts_ = {};
    batch_min_key_inverted_ = {};
    batch_max_key_ = {};
    min_key_inverted_ = {};
    max_key_ = {};
    counts_ = {};
    sums_ = {};
    histogram_ = {};
    tail_ = {};
    tail_size_ = {};
    tail_floor_bits_ = {};
    copy_ = {};
    compute_ = {};
  }

  absl::Status Init() {
    KVCAL_ASSIGN_OR_RETURN(DeviceGuard guard, DeviceGuard::Enter(device_));
    KVCAL_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(
        &sm_count_, cudaDevAttrMultiProcessorCount, device_));
    KVCAL_ASSIGN_OR_RETURN(compute_, Stream::Create());
    KVCAL_ASSIGN_OR_RETURN(copy_, Stream::Create());
    const size_t heads = heads_total_;
    KVCAL_ASSIGN_OR_RETURN(min_key_inverted_,
                           DeviceBuffer<uint32_t>::Allocate(heads));
    KVCAL_ASSIGN_OR_RETURN(max_key_, DeviceBuffer<uint32_t>::Allocate(heads));
    KVCAL_ASSIGN_OR_RETURN(
        counts_, DeviceBuffer<unsigned long long>::Allocate(3 * heads));
    KVCAL_ASSIGN_OR_RETURN(sums_, DeviceBuffer<double>::Allocate(2 * heads));
    const bool histograms = geometry_.has_histograms();
    if (histograms) {
      KVCAL_ASSIGN_OR_RETURN(
          histogram_,
          DeviceBuffer<unsigned long long>::Allocate(heads * bins_));
      KVCAL_ASSIGN_OR_RETURN(
          tail_, DeviceBuffer<float>::Allocate(heads * kTailCapacity));
      KVCAL_ASSIGN_OR_RETURN(tail_size_,
                             DeviceBuffer<uint32_t>::Allocate(heads));
      KVCAL_ASSIGN_OR_RETURN(tail_floor_bits_,
                             DeviceBuffer<uint32_t>::Allocate(heads));
    }
    KVCAL_RETURN_IF_ERROR(GrowBatchTable(kInitialBatchSlots));

    // Grid sizing: resident blocks per SM of every kernel variant.
    int most_blocks_per_sm = 1;
    for (ElementType type :
         {ElementType::kF32, ElementType::kF16, ElementType::kBf16}) {
      for (int vectorized = 0; vectorized < 2; ++vectorized) {
        int blocks = 0;
        KVCAL_CUDA_RETURN_IF_ERROR(cuda::AccumulateBlocksPerSm(
            type, vectorized != 0, histograms, bins_, &blocks));
        if (blocks <= 0) {
          return absl::ResourceExhaustedError(absl::StrCat(
              "the CUDA statistics kernel cannot run on device ", device_,
              " with ", bins_, " histogram bins per head (",
              cuda::AccumulateSharedBytes(histograms, bins_),
              " bytes of shared memory per block)"));
        }
        blocks_per_sm_[TypeIndex(type)][vectorized] = blocks;
        most_blocks_per_sm = std::max(most_blocks_per_sm, blocks);
      }
    }
    if (histograms) {
      // A launch has heads x blocks_per_head blocks, at most
      // max(heads, target blocks) (see BlocksPerHead).
      const size_t max_chunk_heads = std::max(geometry_.num_attention_heads,
                                              geometry_.num_key_value_heads);
      const size_t max_blocks = std::max(
          max_chunk_heads, static_cast<size_t>(sm_count_) * most_blocks_per_sm);
      const size_t warps = max_blocks * cuda::kAccumulateWarps;
      KVCAL_ASSIGN_OR_RETURN(
          candidates_, DeviceBuffer<float>::Allocate(warps * kTailCapacity));
      KVCAL_ASSIGN_OR_RETURN(candidate_counts_,
                             DeviceBuffer<uint32_t>::Allocate(warps));
      scratch_.candidates = candidates_.get();
      scratch_.candidate_counts = candidate_counts_.get();
      scratch_.warps = warps;
    }
    KVCAL_RETURN_IF_ERROR(ZeroStateLocked());
    KVCAL_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(compute_.get()));
    return absl::OkStatus();
  }

  absl::string_view name() const override { return "cuda"; }
  const Geometry& geometry() const override { return geometry_; }

  // Validates `chunk`; unless it is empty, runs fn(extent) under the lock,
  // on the device, when the backend is healthy.
  template <typename Fn>
  absl::Status WithChunkLocked(const ChunkView& chunk, Fn&& fn) {
    KVCAL_ASSIGN_OR_RETURN(const ChunkExtent extent,
                           ValidateChunk(geometry_, chunk));
    if (extent.elements() == 0) return absl::OkStatus();
    std::lock_guard<std::mutex> lock(mu_);
    KVCAL_RETURN_IF_ERROR(CheckHealthyLocked());
    KVCAL_ASSIGN_OR_RETURN(DeviceGuard guard, DeviceGuard::Enter(device_));
    return fn(extent);
  }

  absl::Status Accumulate(const ChunkView& chunk) override {
    return WithChunkLocked(chunk, [&](const ChunkExtent& extent) {
      return AccumulateLocked(chunk, extent);
    });
  }

  absl::Status AccumulateLocked(const ChunkView& chunk,
                                const ChunkExtent& extent) {
    // Neither of these enqueues anything, so their failure leaves the state
    // intact.
    KVCAL_RETURN_IF_ERROR(EnsureStagingLocked());
    KVCAL_ASSIGN_OR_RETURN(const uint32_t slot, BatchSlotLocked(chunk.batch));
    const size_t element_size = DTypeSize(chunk.dtype);
    const ElementType type = ToElementType(chunk.dtype);
    return Poison(ForEachPiece(
        extent, chunk.head_offset, kStagingSlotBytes / element_size,
        [&](uint64_t first, const ChunkExtent& piece,
            uint32_t head_offset) -> absl::Status {
          const size_t bytes = piece.elements() * element_size;
          const size_t s = next_slot_;
          next_slot_ = (next_slot_ + 1) % kStagingSlots;
          // The previous copy out of pinned[s] must be done before we refill
          // it; the kernels reading device[s] before the copy overwrites it.
          KVCAL_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(copied_[s].get()));
          chunk.CopyBytes(first * element_size, bytes, pinned_[s].get());
          KVCAL_CUDA_RETURN_IF_ERROR(
              cudaStreamWaitEvent(copy_.get(), consumed_[s].get(), 0));
          KVCAL_CUDA_RETURN_IF_ERROR(
              cudaMemcpyAsync(staged_[s].get(), pinned_[s].get(), bytes,
                              cudaMemcpyHostToDevice, copy_.get()));
          KVCAL_CUDA_RETURN_IF_ERROR(
              cudaEventRecord(copied_[s].get(), copy_.get()));
          KVCAL_CUDA_RETURN_IF_ERROR(
              cudaStreamWaitEvent(compute_.get(), copied_[s].get(), 0));
          // Slots are 16-byte aligned (cudaMalloc), so rows are vectorizable
          // when inner is a multiple of the vector width.
          KVCAL_RETURN_IF_ERROR(EnqueueLocked(
              staged_[s].get(), type, piece,
              FlatIndex(chunk.layer, chunk.role, head_offset), slot,
              piece.inner % cuda::ValuesPerVector(type) == 0));
          KVCAL_CUDA_RETURN_IF_ERROR(
              cudaEventRecord(consumed_[s].get(), compute_.get()));
          return absl::OkStatus();
        }));
  }

  absl::Status AccumulateDeviceData(const ChunkView& chunk,
                                    CUevent_st* ready) override {
    if (!chunk.pieces.empty()) {
      return absl::InvalidArgumentError(
          "device data must be one range (chunk.data), not pieces");
    }
    return WithChunkLocked(chunk, [&](const ChunkExtent& extent) {
      return AccumulateDeviceDataLocked(chunk, extent, ready);
    });
  }

  absl::Status AccumulateDeviceDataLocked(const ChunkView& chunk,
                                          const ChunkExtent& extent,
                                          CUevent_st* ready) {
    KVCAL_RETURN_IF_ERROR(CheckDeviceData(chunk));
    if (ready != nullptr) {
      // Changes no state (a later failure leaves only a harmless wait
      // behind). A bad event is the caller's error: INVALID_ARGUMENT rather
      // than the INTERNAL that cudaErrorInvalidResourceHandle maps to.
      const cudaError_t error = cudaStreamWaitEvent(compute_.get(), ready, 0);
      if (error != cudaSuccess) {
        absl::Status status = cuda::CudaCallFailed(
            error, "cudaStreamWaitEvent(ready)", __FILE__, __LINE__);
        if (cuda::IsStickyCudaError(error)) return Poison(status);
        return absl::InvalidArgumentError(absl::StrCat(
            "the ready event cannot be waited on: ", status.message()));
      }
    }
    KVCAL_ASSIGN_OR_RETURN(const uint32_t slot, BatchSlotLocked(chunk.batch));
    const size_t element_size = DTypeSize(chunk.dtype);
    const ElementType type = ToElementType(chunk.dtype);
    const auto* base =
        reinterpret_cast<const unsigned char*>(chunk.data.data());
    return Poison(ForEachPiece(
        extent, chunk.head_offset, kMaxElementsPerLaunch,
        [&](uint64_t first, const ChunkExtent& piece,
            uint32_t head_offset) -> absl::Status {
          const unsigned char* data = base + first * element_size;
          const bool vectorized =
              reinterpret_cast<uintptr_t>(data) % 16 == 0 &&
              piece.inner % cuda::ValuesPerVector(type) == 0;
          return EnqueueLocked(data, type, piece,
                               FlatIndex(chunk.layer, chunk.role, head_offset),
                               slot, vectorized);
        }));
  }

  absl::StatusOr<ChunkNonFinite> CountNonFiniteDeviceData(
      const ChunkView& chunk) override {
    if (!chunk.pieces.empty()) {
      return absl::InvalidArgumentError(
          "device data must be one range (chunk.data), not pieces");
    }
    KVCAL_ASSIGN_OR_RETURN(const ChunkExtent extent,
                           ValidateChunk(geometry_, chunk));
    ChunkNonFinite found;
    found.heads.resize(extent.heads);
    if (extent.elements() == 0) return found;
    std::lock_guard<std::mutex> lock(mu_);
    KVCAL_RETURN_IF_ERROR(CheckHealthyLocked());
    KVCAL_ASSIGN_OR_RETURN(DeviceGuard guard, DeviceGuard::Enter(device_));
    KVCAL_RETURN_IF_ERROR(CheckDeviceData(chunk));
    const size_t element_size = DTypeSize(chunk.dtype);
    const uint64_t elements = extent.elements();
    const uint64_t per_copy = kStagingSlotBytes / element_size;
    std::vector<std::byte> host(std::min<uint64_t>(per_copy, elements) *
                                element_size);
    const auto* base = reinterpret_cast<const std::byte*>(chunk.data.data());
    auto copy_and_count = [&]() -> absl::Status {
      for (uint64_t e = 0; e < elements; e += per_copy) {
        const uint64_t n = std::min(per_copy, elements - e);
        KVCAL_CUDA_RETURN_IF_ERROR(
            cudaMemcpy(host.data(), base + e * element_size, n * element_size,
                       cudaMemcpyDeviceToHost));
        CountNonFiniteElements(chunk.dtype, host.data(), e, n, extent, found);
      }
      return absl::OkStatus();
    };
    if (absl::Status status = copy_and_count(); !status.ok()) {
      // A lost device makes the state untrustworthy; anything else was this
      // read's alone.
      if (absl::IsUnavailable(status)) return Poison(status);
      return status;
    }
    return found;
  }

  absl::Status Synchronize() override {
    std::lock_guard<std::mutex> lock(mu_);
    KVCAL_RETURN_IF_ERROR(broken_);
    KVCAL_ASSIGN_OR_RETURN(DeviceGuard guard, DeviceGuard::Enter(device_));
    return Poison(SynchronizeLocked());
  }

  absl::StatusOr<SessionStatistics> Snapshot() override {
    std::lock_guard<std::mutex> lock(mu_);
    KVCAL_RETURN_IF_ERROR(broken_);
    KVCAL_ASSIGN_OR_RETURN(DeviceGuard guard, DeviceGuard::Enter(device_));
    KVCAL_RETURN_IF_ERROR(Poison(SynchronizeLocked()));
    SessionStatistics stats(geometry_);
    KVCAL_RETURN_IF_ERROR(Poison(DownloadLocked(stats)));
    return stats;
  }

  absl::Status Merge(const SessionStatistics& other) override {
    if (!(other.geometry() == geometry_)) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot merge statistics of geometry {",
                       other.geometry().DebugString(), "} into {",
                       geometry_.DebugString(), "}"));
    }
    std::lock_guard<std::mutex> lock(mu_);
    KVCAL_RETURN_IF_ERROR(broken_);
    KVCAL_ASSIGN_OR_RETURN(DeviceGuard guard, DeviceGuard::Enter(device_));
    KVCAL_RETURN_IF_ERROR(Poison(SynchronizeLocked()));
    SessionStatistics merged(geometry_);
    KVCAL_RETURN_IF_ERROR(Poison(DownloadLocked(merged)));
    KVCAL_RETURN_IF_ERROR(merged.Merge(other));
    // Room for every batch first: growing keeps the state as it is, so an
    // out-of-memory here leaves the session usable.
    std::set<uint64_t> batches;
    for (const HeadStatistics& head : merged.heads()) {
      for (const auto& entry : head.batches) batches.insert(entry.first);
    }
    KVCAL_RETURN_IF_ERROR(ReserveBatchSlotsLocked(batches.size()));
    return Poison(UploadLocked(merged, batches));
  }

  absl::Status Reset() override {
    std::lock_guard<std::mutex> lock(mu_);
    KVCAL_RETURN_IF_ERROR(broken_);
    KVCAL_ASSIGN_OR_RETURN(DeviceGuard guard, DeviceGuard::Enter(device_));
    // Stream-ordered after everything already enqueued.
    return Poison(ZeroStateLocked());
  }

  size_t StateBytes() const override {
    std::lock_guard<std::mutex> lock(mu_);
    size_t bytes = min_key_inverted_.bytes() + max_key_.bytes() +
                   counts_.bytes() + sums_.bytes() + histogram_.bytes() +
                   tail_.bytes() + tail_size_.bytes() +
                   tail_floor_bits_.bytes() + batch_min_key_inverted_.bytes() +
                   batch_max_key_.bytes() + candidates_.bytes() +
                   candidate_counts_.bytes();
    for (const DeviceBuffer<unsigned char>& slot : staged_)
      bytes += slot.bytes();
    return bytes;
  }

 private:
  uint32_t FlatIndex(uint32_t layer, Role role, uint32_t head) const {
    return layer * heads_per_layer_ + role_offset_[RoleIndex(role)] + head;
  }

  cuda::DeviceState State() const {
    cuda::DeviceState state;
    state.min_key_inverted = min_key_inverted_.get();
    state.max_key = max_key_.get();
    state.counts = counts_.get();
    state.sums = sums_.get();
    state.histogram = histogram_.get();
    state.tail = tail_.get();
    state.tail_size = tail_size_.get();
    state.tail_floor_bits = tail_floor_bits_.get();
    state.batch_min_key_inverted = batch_min_key_inverted_.get();
    state.batch_max_key = batch_max_key_.get();
    state.heads_total = heads_total_;
    state.bins = bins_;
    state.log2_bins_per_octave =
        geometry_.has_histograms() ? geometry_.log2_bins_per_octave() : 0;
    return state;
  }

  // Records the first error; after it the device state is not trustworthy
  // (a chunk may be half applied, or the context lost), so every later call
  // returns it.
  absl::Status Poison(absl::Status status) {
    if (!status.ok() && broken_.ok()) broken_ = status;
    return status;
  }

  // Reports an earlier asynchronous device error without waiting.
  absl::Status CheckHealthyLocked() {
    KVCAL_RETURN_IF_ERROR(broken_);
    if (compute_.get() == nullptr) return absl::OkStatus();
    const cudaError_t error = cudaStreamQuery(compute_.get());
    if (error == cudaSuccess) return absl::OkStatus();
    if (error == cudaErrorNotReady) {
      // Not an error, but the runtime still leaves it as the thread's last
      // error.
      (void)cudaGetLastError();
      return absl::OkStatus();
    }
    return Poison(cuda::CudaCallFailed(error, "an earlier chunk's kernels",
                                       __FILE__, __LINE__));
  }

  // The checks AccumulateDeviceData promises; the device is current.
  absl::Status CheckDeviceData(const ChunkView& chunk) const {
    const size_t element_size = DTypeSize(chunk.dtype);
    const void* data = chunk.data.data();
    const auto address = reinterpret_cast<uintptr_t>(data);
    const std::string where =
        absl::StrCat("device data at 0x", absl::Hex(address));
    if (address % element_size != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " is not aligned to its ", element_size, "-byte ",
                       DTypeName(chunk.dtype), " elements"));
    }
    cudaPointerAttributes attributes{};
    const cudaError_t error = cudaPointerGetAttributes(&attributes, data);
    if (error != cudaSuccess) {
      absl::Status status = cuda::CudaCallFailed(
          error, "cudaPointerGetAttributes", __FILE__, __LINE__);
      if (cuda::IsStickyCudaError(error)) return status;
      return absl::InvalidArgumentError(
          absl::StrCat(where, " is not CUDA memory: ", status.message()));
    }
    if (attributes.type != cudaMemoryTypeDevice &&
        attributes.type != cudaMemoryTypeManaged) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " is ",
                       attributes.type == cudaMemoryTypeHost
                           ? "pinned host memory"
                           : "not CUDA memory (ordinary host memory?)",
                       ", not device memory of CUDA device ", device_,
                       " (host data goes through Accumulate)"));
    }
    if (attributes.device != device_) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " is memory of CUDA device ", attributes.device,
                       "; this backend runs on device ", device_));
    }
    if (const auto address_range = cuda::DriverMemGetAddressRange()) {
      CUdeviceptr base = 0;
      size_t size = 0;
      if (address_range(&base, &size, static_cast<CUdeviceptr>(address)) ==
          CUDA_SUCCESS) {
        const uint64_t left = base + size - address;
        if (chunk.data.size() > left) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, ": the chunk's ", chunk.data.size(),
                           " bytes run past the end of its allocation (", left,
                           " bytes from there)"));
        }
      }
    }
    return absl::OkStatus();
  }

  absl::Status SynchronizeLocked() {
    KVCAL_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(copy_.get()));
    KVCAL_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(compute_.get()));
    return absl::OkStatus();
  }

  // The pinned ring is allocated on first use, so sessions that never
  // accumulate host data do not pin memory.
  absl::Status EnsureStagingLocked() {
    if (pinned_[0].get() != nullptr) return absl::OkStatus();
    std::array<PinnedBuffer, kStagingSlots> pinned;
    std::array<DeviceBuffer<unsigned char>, kStagingSlots> staged;
    std::array<Event, kStagingSlots> copied;
    std::array<Event, kStagingSlots> consumed;
    for (size_t s = 0; s < kStagingSlots; ++s) {
      KVCAL_ASSIGN_OR_RETURN(pinned[s],
                             PinnedBuffer::Allocate(kStagingSlotBytes));
      KVCAL_ASSIGN_OR_RETURN(
          staged[s], DeviceBuffer<unsigned char>::Allocate(kStagingSlotBytes));
      KVCAL_ASSIGN_OR_RETURN(copied[s], Event::Create());
      KVCAL_ASSIGN_OR_RETURN(consumed[s], Event::Create());
    }
    pinned_ = std::move(pinned);
    staged_ = std::move(staged);
    copied_ = std::move(copied);
    consumed_ = std::move(consumed);
    next_slot_ = 0;
    return absl::OkStatus();
  }

  // Blocks per head: enough to fill the device once over all heads of the
  // launch, but not more than the head's values keep busy.
  uint32_t BlocksPerHead(ElementType type, bool vectorized,
                         const ChunkExtent& piece) const {
    const uint64_t target = static_cast<uint64_t>(sm_count_) *
                            blocks_per_sm_[TypeIndex(type)][vectorized ? 1 : 0];
    const uint64_t values = piece.outer * piece.inner;
    const uint64_t useful =
        (values + cuda::kAccumulateThreads * kMinValuesPerThread - 1) /
        (cuda::kAccumulateThreads * kMinValuesPerThread);
    const uint64_t wanted = std::max<uint64_t>(1, target / piece.heads);
    return static_cast<uint32_t>(
        std::max<uint64_t>(1, std::min(wanted, useful)));
  }

  absl::Status EnqueueLocked(const void* device_data, ElementType type,
                             const ChunkExtent& piece, uint32_t head_base,
                             uint32_t batch_slot, bool vectorized) {
    cuda::ChunkLaunch launch;
    launch.data = device_data;
    launch.type = type;
    launch.outer = piece.outer;
    launch.heads = piece.heads;
    launch.inner = piece.inner;
    launch.head_base = head_base;
    launch.batch_slot = batch_slot;
    launch.vectorized = vectorized;
    launch.blocks_per_head = BlocksPerHead(type, vectorized, piece);
    if (geometry_.has_histograms() && static_cast<size_t>(launch.heads) *
                                              launch.blocks_per_head *
                                              cuda::kAccumulateWarps >
                                          scratch_.warps) {
      return absl::InternalError(absl::StrCat(
          "tail scratch holds ", scratch_.warps, " warps, launch needs ",
          static_cast<size_t>(launch.heads) * launch.blocks_per_head *
              cuda::kAccumulateWarps));
    }
    KVCAL_CUDA_RETURN_IF_ERROR(
        cuda::EnqueueChunk(State(), scratch_, launch, compute_.get()));
    return absl::OkStatus();
  }

  // The batch table row of `batch`, adding one (and growing the table) for a
  // new batch.
  absl::StatusOr<uint32_t> BatchSlotLocked(uint64_t batch) {
    auto it = batch_slots_.find(batch);
    if (it != batch_slots_.end()) return it->second;
    if (batch_slots_.size() >= batch_capacity_) {
      KVCAL_RETURN_IF_ERROR(GrowBatchTable(2 * batch_capacity_));
    }
    const uint32_t slot = static_cast<uint32_t>(batch_slots_.size());
    batch_slots_.emplace(batch, slot);
    return slot;
  }

  // Reallocates the batch table with `slots` rows, keeping the rows in use.
  // Rare (the table doubles), so it may wait for the device: kernels already
  // enqueued hold the old table's address.
  absl::Status GrowBatchTable(size_t slots) {
    const size_t count = slots * heads_total_;
    if (slots <= batch_capacity_) return absl::OkStatus();
    KVCAL_ASSIGN_OR_RETURN(auto min_table,
                           DeviceBuffer<uint32_t>::Allocate(count));
    KVCAL_ASSIGN_OR_RETURN(auto max_table,
                           DeviceBuffer<uint32_t>::Allocate(count));
    cudaStream_t stream = compute_.get();
    KVCAL_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(min_table.get(), 0, min_table.bytes(), stream));
    KVCAL_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(max_table.get(), 0, max_table.bytes(), stream));
    const size_t used = batch_slots_.size() * heads_total_ * sizeof(uint32_t);
    if (used != 0) {
      KVCAL_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(min_table.get(), batch_min_key_inverted_.get(), used,
                          cudaMemcpyDeviceToDevice, stream));
      KVCAL_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(max_table.get(), batch_max_key_.get(), used,
                          cudaMemcpyDeviceToDevice, stream));
    }
    KVCAL_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    batch_min_key_inverted_ = std::move(min_table);
    batch_max_key_ = std::move(max_table);
    batch_capacity_ = slots;
    return absl::OkStatus();
  }

  absl::Status ZeroStateLocked() {
    cudaStream_t stream = compute_.get();
    auto zero = [stream](void* ptr, size_t bytes) {
      return bytes == 0 ? cudaSuccess : cudaMemsetAsync(ptr, 0, bytes, stream);
    };
    KVCAL_CUDA_RETURN_IF_ERROR(
        zero(min_key_inverted_.get(), min_key_inverted_.bytes()));
    KVCAL_CUDA_RETURN_IF_ERROR(zero(max_key_.get(), max_key_.bytes()));
    KVCAL_CUDA_RETURN_IF_ERROR(zero(counts_.get(), counts_.bytes()));
    KVCAL_CUDA_RETURN_IF_ERROR(zero(sums_.get(), sums_.bytes()));
    KVCAL_CUDA_RETURN_IF_ERROR(zero(histogram_.get(), histogram_.bytes()));
    KVCAL_CUDA_RETURN_IF_ERROR(zero(tail_.get(), tail_.bytes()));
    KVCAL_CUDA_RETURN_IF_ERROR(zero(tail_size_.get(), tail_size_.bytes()));
    KVCAL_CUDA_RETURN_IF_ERROR(
        zero(tail_floor_bits_.get(), tail_floor_bits_.bytes()));
    KVCAL_CUDA_RETURN_IF_ERROR(
        zero(batch_min_key_inverted_.get(), batch_min_key_inverted_.bytes()));
    KVCAL_CUDA_RETURN_IF_ERROR(
        zero(batch_max_key_.get(), batch_max_key_.bytes()));
    batch_slots_.clear();
    return absl::OkStatus();
  }

  // Host copies of the device state's arrays, sized as the device arrays
  // (the batch tables: `batch_rows` rows of heads).
  struct HostState {
    std::vector<uint32_t> min_key_inverted, max_key;
    std::vector<unsigned long long> counts;
    std::vector<double> sums;
    std::vector<unsigned long long> histogram;
    std::vector<float> tail;
    std::vector<uint32_t> tail_size, tail_floor;
    std::vector<uint32_t> batch_min, batch_max;
  };

  HostState MakeHostState(size_t batch_rows) const {
    HostState host;
    host.min_key_inverted.resize(min_key_inverted_.size());
    host.max_key.resize(max_key_.size());
    host.counts.resize(counts_.size());
    host.sums.resize(sums_.size());
    host.histogram.resize(histogram_.size());
    host.tail.resize(tail_.size());
    host.tail_size.resize(tail_size_.size());
    host.tail_floor.resize(tail_floor_bits_.size());
    host.batch_min.resize(batch_rows * heads_total_);
    host.batch_max.resize(batch_rows * heads_total_);
    return host;
  }

  // Copies every array of the state between `host` and the device (`kind`:
  // cudaMemcpyDeviceToHost or cudaMemcpyHostToDevice) on the compute stream
  // and waits for the copies.
  absl::Status CopyStateLocked(HostState& host, cudaMemcpyKind kind) {
    struct Array {
      void* host;
      void* device;
      size_t bytes;
    };
    auto array = [](auto& host_vector, auto* device) {
      return Array{host_vector.data(), device,
                   host_vector.size() * sizeof(host_vector[0])};
    };
    const Array arrays[] = {
        array(host.min_key_inverted, min_key_inverted_.get()),
        array(host.max_key, max_key_.get()),
        array(host.counts, counts_.get()),
        array(host.sums, sums_.get()),
        array(host.histogram, histogram_.get()),
        array(host.tail, tail_.get()),
        array(host.tail_size, tail_size_.get()),
        array(host.tail_floor, tail_floor_bits_.get()),
        array(host.batch_min, batch_min_key_inverted_.get()),
        array(host.batch_max, batch_max_key_.get()),
    };
    const bool to_host = kind == cudaMemcpyDeviceToHost;
    cudaStream_t stream = compute_.get();
    for (const Array& a : arrays) {
      if (a.bytes == 0) continue;
      KVCAL_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(to_host ? a.host : a.device,
                                                 to_host ? a.device : a.host,
                                                 a.bytes, kind, stream));
    }
    KVCAL_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    return absl::OkStatus();
  }

  // Copies the device state into `stats` (freshly constructed). The device
  // must be idle (SynchronizeLocked).
  absl::Status DownloadLocked(SessionStatistics& stats) {
    const size_t heads = heads_total_;
    HostState host = MakeHostState(batch_slots_.size());
    KVCAL_RETURN_IF_ERROR(CopyStateLocked(host, cudaMemcpyDeviceToHost));
    const auto& [min_key_inverted, max_key, counts, sums, histogram, tail,
                 tail_size, tail_floor, batch_min, batch_max] = host;

    for (size_t h = 0; h < heads; ++h) {
      HeadStatistics& head = stats.heads()[h];
      head.min = DecodeMin(min_key_inverted[h]);
      head.max = DecodeMax(max_key[h]);
      head.finite_count = counts[3 * h];
      head.nan_count = counts[3 * h + 1];
      head.inf_count = counts[3 * h + 2];
      head.sum = sums[2 * h];
      head.sum_squares = sums[2 * h + 1];
      if (bins_ != 0) {
        std::copy_n(histogram.begin() + static_cast<ptrdiff_t>(h * bins_),
                    bins_, head.histogram.begin());
        const size_t n = std::min<size_t>(tail_size[h], kTailCapacity);
        const auto first =
            tail.begin() + static_cast<ptrdiff_t>(h * kTailCapacity);
        head.tail.assign(first, first + static_cast<ptrdiff_t>(n));
      }
    }
    for (const auto& [batch, slot] : batch_slots_) {  // ascending batches
      const size_t row = static_cast<size_t>(slot) * heads;
      for (size_t h = 0; h < heads; ++h) {
        if (batch_max[row + h] == 0) continue;  // no finite value
        stats.heads()[h].batches.emplace_hint(
            stats.heads()[h].batches.end(), batch,
            MinMax{DecodeMin(batch_min[row + h]),
                   DecodeMax(batch_max[row + h])});
      }
    }
    return absl::OkStatus();
  }

  // Grows the batch table (doubling) to at least `batches` rows. Like
  // GrowBatchTable it leaves the state as it was when it fails.
  absl::Status ReserveBatchSlotsLocked(size_t batches) {
    size_t capacity = std::max(batch_capacity_, kInitialBatchSlots);
    while (capacity < batches) capacity *= 2;
    return GrowBatchTable(capacity);
  }

  // Replaces the device state with `stats`, whose batches are `batches`
  // (ReserveBatchSlotsLocked made room for them). The device must be idle.
  absl::Status UploadLocked(const SessionStatistics& stats,
                            const std::set<uint64_t>& batches) {
    const size_t heads = heads_total_;
    if (batches.size() > batch_capacity_) {
      return absl::InternalError(
          absl::StrCat("the batch table holds ", batch_capacity_,
                       " batches, the state has ", batches.size()));
    }
    KVCAL_RETURN_IF_ERROR(ZeroStateLocked());
    for (uint64_t batch : batches) {
      batch_slots_.emplace(batch, static_cast<uint32_t>(batch_slots_.size()));
    }

    HostState host = MakeHostState(batches.size());
    auto& [min_key_inverted, max_key, counts, sums, histogram, tail, tail_size,
           tail_floor, batch_min, batch_max] = host;
    for (size_t h = 0; h < heads; ++h) {
      const HeadStatistics& head = stats.heads()[h];
      min_key_inverted[h] = head.finite_count == 0 ? 0 : EncodeMin(head.min);
      max_key[h] = head.finite_count == 0 ? 0 : EncodeMax(head.max);
      counts[3 * h] = head.finite_count;
      counts[3 * h + 1] = head.nan_count;
      counts[3 * h + 2] = head.inf_count;
      sums[2 * h] = head.sum;
      sums[2 * h + 1] = head.sum_squares;
      if (bins_ != 0) {
        std::copy_n(head.histogram.begin(),
                    std::min<size_t>(bins_, head.histogram.size()),
                    histogram.begin() + static_cast<ptrdiff_t>(h * bins_));
        const size_t n = std::min<size_t>(head.tail.size(), kTailCapacity);
        std::copy_n(head.tail.begin(), n,
                    tail.begin() + static_cast<ptrdiff_t>(h * kTailCapacity));
        tail_size[h] = static_cast<uint32_t>(n);
        tail_floor[h] = n == kTailCapacity
                            ? FloatBits(head.tail[kTailCapacity - 1]) + 1u
                            : 0u;
      }
      for (const auto& [batch, extrema] : head.batches) {
        const size_t row = static_cast<size_t>(batch_slots_.at(batch)) * heads;
        batch_min[row + h] = EncodeMin(extrema.min);
        batch_max[row + h] = EncodeMax(extrema.max);
      }
    }
    // (CopyStateLocked waits: the host vectors die on return.)
    return CopyStateLocked(host, cudaMemcpyHostToDevice);
  }

  const Geometry geometry_;
  const int device_;
  uint32_t heads_per_layer_ = 0;
  std::array<uint32_t, 3> role_offset_ = {0, 0, 0};
  uint32_t heads_total_ = 0;
  uint32_t bins_ = 0;
  int sm_count_ = 1;
  int blocks_per_sm_[3][2] = {{1, 1}, {1, 1}, {1, 1}};

  mutable std::mutex mu_;
  absl::Status broken_;

  Stream compute_;
  Stream copy_;
  // Device state (statistics_kernels.h).
  DeviceBuffer<uint32_t> min_key_inverted_;
  DeviceBuffer<uint32_t> max_key_;
  DeviceBuffer<unsigned long long> counts_;
  DeviceBuffer<double> sums_;
  DeviceBuffer<unsigned long long> histogram_;
  DeviceBuffer<float> tail_;
  DeviceBuffer<uint32_t> tail_size_;
  DeviceBuffer<uint32_t> tail_floor_bits_;
  DeviceBuffer<uint32_t> batch_min_key_inverted_;
  DeviceBuffer<uint32_t> batch_max_key_;
  size_t batch_capacity_ = 0;
  std::map<uint64_t, uint32_t> batch_slots_;  // batch -> table row
  // Scratch of the tail selection.
  DeviceBuffer<float> candidates_;
  DeviceBuffer<uint32_t> candidate_counts_;
  cuda::TailScratch scratch_;
  // Staging ring.
  std::array<PinnedBuffer, kStagingSlots> pinned_;
  std::array<DeviceBuffer<unsigned char>, kStagingSlots> staged_;
  std::array<Event, kStagingSlots> copied_;
  std::array<Event, kStagingSlots> consumed_;
  size_t next_slot_ = 0;
};

}  // namespace

bool CudaBackendCompiled() { return true; }

void FailNthCudaAllocationForTesting(int n) {
  cuda::AllocationFailureCountdown().store(std::max(n, 0));
}

int CudaDeviceCount() {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no device: not an error here
    return 0;
  }
  return count;
}

std::string CudaDeviceDescription(int device) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::StrCat("no CUDA device: ", cudaGetErrorName(error), " (",
                        cudaGetErrorString(error), ")");
  }
  if (device < 0 || device >= count) {
    return absl::StrCat("no CUDA device ", device, " (", count,
                        " device(s) present)");
  }
  cudaDeviceProp prop;
  const cudaError_t prop_error = cudaGetDeviceProperties(&prop, device);
  if (prop_error != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::StrCat("CUDA device ", device, ": ",
                        cudaGetErrorString(prop_error));
  }
  return absl::StrCat(prop.name, ", sm_", prop.major, prop.minor, ", ",
                      prop.totalGlobalMem >> 30, " GiB, ",
                      prop.multiProcessorCount, " SMs");
}

absl::StatusOr<std::unique_ptr<CudaStatisticsBackend>>
CreateCudaStatisticsBackend(const Geometry& geometry,
                            const BackendOptions& options) {
  KVCAL_RETURN_IF_ERROR(geometry.Validate());
  const int count = CudaDeviceCount();
  if (count == 0) {
    return absl::UnavailableError(absl::StrCat("the CUDA backend needs a GPU: ",
                                               CudaDeviceDescription(0)));
  }
  if (options.device < 0 || options.device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA device ", options.device, " does not exist (", count,
                     " device(s) present)"));
  }
  auto backend = std::make_unique<CudaBackend>(geometry, options.device);
  KVCAL_RETURN_IF_ERROR(backend->Init());
  return std::unique_ptr<CudaStatisticsBackend>(std::move(backend));
}

absl::StatusOr<std::unique_ptr<StatisticsBackend>> CreateCudaBackend(
    const Geometry& geometry, const BackendOptions& options) {
  KVCAL_ASSIGN_OR_RETURN(std::unique_ptr<CudaStatisticsBackend> backend,
                         CreateCudaStatisticsBackend(geometry, options));
  return std::unique_ptr<StatisticsBackend>(std::move(backend));
}

}  // namespace kvcal
