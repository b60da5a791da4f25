// safetensors files: a validating, memory-mapped reader and a streaming
// writer that never holds a whole file in memory.
//
//   KVCAL_ASSIGN_OR_RETURN(kvcal::SafetensorsFile file,
//                          kvcal::SafetensorsFile::Open("model.safetensors"));
//   for (const kvcal::TensorInfo& t : file.tensors()) {
//     absl::Span<const std::byte> bytes = file.Data(t);  // mapped, no copy
//   }
//   std::vector<kvcal::TensorToWrite> out = ...;        // spans into maps
//   KVCAL_RETURN_IF_ERROR(kvcal::WriteSafetensors("new.safetensors", out, {}));
//
// Format: u64 little-endian header length N, N bytes of JSON (padded with
// spaces to a multiple of 8 when we write), then the data buffer. The reader
// rejects a truncated file, a header length beyond the file, a header that is
// not a JSON object, unknown dtypes, shape/size mismatches, duplicate names,
// and offsets that overlap, leave gaps or fall outside the buffer.
#ifndef KVCAL_CLIENT_CHECKPOINT_SAFETENSORS_H_
#define KVCAL_CLIENT_CHECKPOINT_SAFETENSORS_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "util/file_io.h"  // ReadSmallFile, WriteOutputFile, SyncDirectory
#include "util/strings.h"  // ShapeString

namespace kvcal {

// Bytes per element of a safetensors dtype ("F32", "BF16", ...); nullopt
// when the dtype is unknown.
std::optional<size_t> SafetensorsDTypeSize(absl::string_view dtype);

struct TensorInfo {
  std::string name;
  std::string dtype;
  std::vector<uint64_t> shape;
  // [begin, end) relative to the data buffer.
  uint64_t begin = 0;
  uint64_t end = 0;
  uint64_t size() const { return end - begin; }
  uint64_t elements() const;
};

struct SafetensorsHeader {
  // Sorted by begin offset.
  std::vector<TensorInfo> tensors;
  std::map<std::string, std::string> metadata;
};

// Parses and validates a header against a data buffer of `data_size` bytes.
absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(absl::string_view json,
                                                         uint64_t data_size);

// A read-only mapping of one safetensors file. Move-only.
class SafetensorsFile {
 public:
  [[nodiscard]] static absl::StatusOr<SafetensorsFile> Open(
      const std::string& path);

  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  // Sorted by offset.
  const std::vector<TensorInfo>& tensors() const { return header_.tensors; }
  const std::map<std::string, std::string>& metadata() const {
    return header_.metadata;
  }
  const TensorInfo* Find(absl::string_view name) const;
  absl::Span<const std::byte> Data(const TensorInfo& tensor) const;
  // The values of an F32, F16 or BF16 tensor as floats; nullopt for any
  // other dtype.
  std::optional<std::vector<float>> ReadFloats(const TensorInfo& tensor) const;
  uint64_t file_size() const { return size_; }

 private:
  SafetensorsFile() = default;
  void Release();

  std::string path_;
  const std::byte* map_ = nullptr;
  uint64_t size_ = 0;
  uint64_t data_offset_ = 0;
  SafetensorsHeader header_;
  std::map<std::string, size_t, std::less<>> index_;
};

// One tensor to write; `data` is not owned (typically a span into a mapped
// source file, or a small vector the caller keeps alive).
struct TensorToWrite {
  std::string name;
  std::string dtype;
  std::vector<uint64_t> shape;
  absl::Span<const std::byte> data;
};

// Writes `tensors` (in the given order) to `path` with WriteOutputFile (a
// temporary file beside it, fsync, rename; a symbolic link is written
// through, a non-regular file refused): header padded to 8 bytes, data
// copied in blocks of at most `block_bytes`. Checks every tensor's size
// against its dtype and shape before anything is created.
// `on_block`, when set, is called with each block's size once written.
[[nodiscard]] absl::Status WriteSafetensors(
    const std::string& path, absl::Span<const TensorToWrite> tensors,
    const std::map<std::string, std::string>& metadata,
    size_t block_bytes = size_t{8} << 20,
    const std::function<void(uint64_t bytes)>& on_block = {});

}  // namespace kvcal

#endif  // KVCAL_CLIENT_CHECKPOINT_SAFETENSORS_H_
