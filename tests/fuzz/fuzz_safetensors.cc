// libFuzzer target: the safetensors reader (client/checkpoint/safetensors.h).
//
// The input is a whole safetensors file. It goes through
// ParseSafetensorsHeader directly and through SafetensorsFile::Open (from an
// in-memory file, no disk I/O); both must agree. An accepted file must be
// what the reader promises: tensors sorted, contiguous, covering the data
// buffer, each size = elements x dtype size, every Data() span inside the
// mapping, Find() consistent. An accepted file written back with
// WriteSafetensors reads back with the same tensors, bytes and metadata.
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "client/checkpoint/safetensors.h"
#include "tests/fuzz/fuzz_util.h"

namespace kvcal {
namespace {

// An anonymous in-memory file and a path that opens it.
class MemFile {
 public:
  explicit MemFile(const char* name)
      : fd_(memfd_create(name, 0)),
        path_("/proc/self/fd/" + std::to_string(fd_)) {
    FUZZ_CHECK(fd_ >= 0);
  }
  void Set(const uint8_t* data, size_t size) {
    FUZZ_CHECK(ftruncate(fd_, 0) == 0);
    size_t done = 0;
    while (done < size) {
      const ssize_t n = pwrite(fd_, data + done, size - done, done);
      FUZZ_CHECK(n > 0);
      done += static_cast<size_t>(n);
    }
  }
  const std::string& path() const { return path_; }

 private:
  int fd_;
  std::string path_;
};

void CheckHeader(const SafetensorsHeader& header, uint64_t data_size) {
  uint64_t cursor = 0;
  for (const TensorInfo& t : header.tensors) {
    FUZZ_CHECK(t.begin == cursor);
    FUZZ_CHECK(t.begin <= t.end && t.end <= data_size);
    const std::optional<size_t> element_size = SafetensorsDTypeSize(t.dtype);
    FUZZ_CHECK(element_size.has_value());
    FUZZ_CHECK(t.elements() * *element_size == t.size());
    FUZZ_CHECK(t.name != "__metadata__");
    cursor = t.end;
  }
  FUZZ_CHECK(cursor == data_size);
}

void Run(const uint8_t* data, size_t size) {
  static MemFile* input = new MemFile("fuzz-input");
  // The copy goes to a real file: WriteSafetensors writes a temporary file
  // beside its target and renames it (WriteOutputFile), which a memfd's
  // /proc/self/fd link cannot take (it would be written through to a file
  // named after the memfd in the working directory's root).
  static const std::string* output_path = [] {
    char dir[] = "/tmp/kvcal-fuzz-safetensors-XXXXXX";
    FUZZ_CHECK(::mkdtemp(dir) != nullptr);
    return new std::string(std::string(dir) + "/copy.safetensors");
  }();

  // The header on its own, as the format defines it.
  std::optional<bool> direct_ok;
  uint64_t header_len = 0;
  if (size >= 8) {
    for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | data[i];
    if (header_len <= size - 8) {
      const absl::string_view json(reinterpret_cast<const char*>(data) + 8,
                                   header_len);
      const uint64_t data_size = size - 8 - header_len;
      absl::StatusOr<SafetensorsHeader> header =
          ParseSafetensorsHeader(json, data_size);
      direct_ok = header.ok();
      if (header.ok()) {
        CheckHeader(*header, data_size);
      } else {
        FUZZ_CHECK(header.status().code() ==
                   absl::StatusCode::kInvalidArgument);
      }
    } else {
      direct_ok = false;
    }
  } else {
    direct_ok = false;
  }

  // The same bytes as a file.
  input->Set(data, size);
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(input->path());
  FUZZ_CHECK(file.ok() == *direct_ok);
  if (!file.ok()) return;
  FUZZ_CHECK(file->file_size() == size);
  uint64_t checksum = 0;
  std::vector<TensorToWrite> tensors;
  for (const TensorInfo& t : file->tensors()) {
    const absl::Span<const std::byte> bytes = file->Data(t);
    FUZZ_CHECK(bytes.size() == t.size());
    // Inside the file: reading every byte of the mapping must not fault.
    FUZZ_CHECK(8 + header_len + t.end <= size);
    for (std::byte b : bytes) checksum += static_cast<uint8_t>(b);
    const TensorInfo* found = file->Find(t.name);
    FUZZ_CHECK(found != nullptr && found->begin == t.begin &&
               found->end == t.end);
    tensors.push_back({t.name, t.dtype, t.shape, bytes});
  }
  (void)checksum;

  // Written back, it reads back the same.
  FUZZ_CHECK(WriteSafetensors(*output_path, tensors, file->metadata(),
                              /*block_bytes=*/7)
                 .ok());
  absl::StatusOr<SafetensorsFile> copy = SafetensorsFile::Open(*output_path);
  FUZZ_CHECK(copy.ok());
  FUZZ_CHECK(copy->metadata() == file->metadata());
  FUZZ_CHECK(copy->tensors().size() == file->tensors().size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorInfo& a = file->tensors()[i];
    const TensorInfo* b = copy->Find(a.name);
    FUZZ_CHECK(b != nullptr);
    FUZZ_CHECK(b->dtype == a.dtype && b->shape == a.shape &&
               b->size() == a.size());
    const absl::Span<const std::byte> x = file->Data(a);
    const absl::Span<const std::byte> y = copy->Data(*b);
    FUZZ_CHECK(x.size() == y.size() &&
               (x.empty() || std::memcmp(x.data(), y.data(), x.size()) == 0));
  }
}

}  // namespace
}  // namespace kvcal

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvcal::Run(data, size);
  return 0;
}
