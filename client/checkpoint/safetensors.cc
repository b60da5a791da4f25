#include "client/checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/element_math.h"
#include "nlohmann/json.hpp"
#include "util/status_macros.h"

namespace kvcal {
namespace {

using Json = nlohmann::ordered_json;

// Largest header we accept; the format's own reference limit is 100 MB.
constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;

}  // namespace

std::optional<size_t> SafetensorsDTypeSize(absl::string_view dtype) {
  static const auto* const kSizes =
      new std::map<std::string, size_t, std::less<>>{
          {"F64", 8},  {"F32", 4},     {"F16", 2},     {"BF16", 2},
          {"I64", 8},  {"I32", 4},     {"I16", 2},     {"I8", 1},
          {"U64", 8},  {"U32", 4},     {"U16", 2},     {"U8", 1},
          {"BOOL", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"F8_E8M0", 1}};
  auto it = kSizes->find(dtype);
  if (it == kSizes->end()) return std::nullopt;
  return it->second;
}

uint64_t TensorInfo::elements() const {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;
  return n;
}

namespace {

// The header's JSON object, refusing a duplicate top-level key (nlohmann
// keeps the last of duplicates; a parser callback sees every key).
absl::StatusOr<Json> ParseHeaderObject(absl::string_view json) {
  std::set<std::string> seen;
  std::string duplicate;
  Json::parser_callback_t callback = [&](int depth, Json::parse_event_t event,
                                         Json& parsed) {
    if (event == Json::parse_event_t::key && depth == 1) {
      const std::string& key = parsed.get_ref<const std::string&>();
      if (!seen.insert(key).second && duplicate.empty()) duplicate = key;
    }
    return true;
  };
  Json header = Json::parse(json.begin(), json.end(), callback,
                            /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) {
    return absl::InvalidArgumentError(
        "header is not a JSON object (file is not safetensors or is corrupt)");
  }
  if (!duplicate.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", duplicate, "' appears twice in the header"));
  }
  return header;
}

// __metadata__: an object of strings.
absl::Status ParseMetadata(const Json& entry,
                           std::map<std::string, std::string>& metadata) {
  if (!entry.is_object()) {
    return absl::InvalidArgumentError("__metadata__ is not an object");
  }
  for (const auto& [key, value] : entry.items()) {
    if (!value.is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat("__metadata__ entry '", key, "' is not a string"));
    }
    metadata[key] = value.get<std::string>();
  }
  return absl::OkStatus();
}

// One tensor's entry, checked on its own: known dtype, a shape that does
// not overflow, data_offsets within the data and as long as the shape needs.
absl::StatusOr<TensorInfo> ParseTensorEntry(const std::string& name,
                                            const Json& entry,
                                            uint64_t data_size) {
  if (!entry.is_object() || !entry.contains("dtype") ||
      !entry.contains("shape") || !entry.contains("data_offsets") ||
      !entry["dtype"].is_string() || !entry["shape"].is_array() ||
      !entry["data_offsets"].is_array() || entry["data_offsets"].size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", name,
        "': entry needs dtype (string), shape (array) and data_offsets "
        "([begin, end])"));
  }
  TensorInfo info;
  info.name = name;
  info.dtype = entry["dtype"].get<std::string>();
  const std::optional<size_t> element_size = SafetensorsDTypeSize(info.dtype);
  if (!element_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", name, "': unknown dtype '", info.dtype, "'"));
  }
  uint64_t elements = 1;
  for (const Json& d : entry["shape"]) {
    if (!d.is_number_unsigned()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", name, "': shape has a non-integer or negative entry"));
    }
    const uint64_t dim = d.get<uint64_t>();
    if (dim != 0 && elements > UINT64_MAX / dim) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", name, "': shape overflows"));
    }
    elements *= dim;
    info.shape.push_back(dim);
  }
  for (const Json& o : entry["data_offsets"]) {
    if (!o.is_number_unsigned()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", name, "': data_offsets are not unsigned integers"));
    }
  }
  info.begin = entry["data_offsets"][0].get<uint64_t>();
  info.end = entry["data_offsets"][1].get<uint64_t>();
  if (info.begin > info.end || info.end > data_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", name, "': data_offsets [", info.begin, ", ", info.end,
        ") out of range of the ", data_size, "-byte data buffer"));
  }
  if (elements > UINT64_MAX / *element_size ||
      elements * *element_size != info.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", name, "': shape ", ShapeString(info.shape),
                     " ", info.dtype, " needs ", elements * *element_size,
                     " bytes, data_offsets give ", info.size()));
  }
  return info;
}

// The tensors (sorted by offset) must tile the data buffer: no overlap, no
// gap, nothing after the last.
absl::Status CheckTiling(const std::vector<TensorInfo>& tensors,
                         uint64_t data_size) {
  uint64_t cursor = 0;
  for (const TensorInfo& t : tensors) {
    if (t.begin < cursor) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", t.name, "': data_offsets [", t.begin, ", ", t.end,
          ") overlap the previous tensor (which ends at ", cursor, ")"));
    }
    if (t.begin > cursor) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", t.name, "': gap in the data buffer at [",
                       cursor, ", ", t.begin, ")"));
    }
    cursor = t.end;
  }
  if (cursor != data_size) {
    return absl::InvalidArgumentError(absl::StrCat("tensors cover ", cursor,
                                                   " bytes of the ", data_size,
                                                   "-byte data buffer"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(absl::string_view json,
                                                         uint64_t data_size) {
  KVCAL_ASSIGN_OR_RETURN(const Json header, ParseHeaderObject(json));
  SafetensorsHeader result;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      KVCAL_RETURN_IF_ERROR(ParseMetadata(entry, result.metadata));
      continue;
    }
    KVCAL_ASSIGN_OR_RETURN(TensorInfo info,
                           ParseTensorEntry(name, entry, data_size));
    result.tensors.push_back(std::move(info));
  }
  std::sort(result.tensors.begin(), result.tensors.end(),
            [](const TensorInfo& a, const TensorInfo& b) {
              return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
            });
  KVCAL_RETURN_IF_ERROR(CheckTiling(result.tensors, data_size));
  return result;
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  FileDescriptor fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return ErrnoError("cannot open", path);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return ErrnoError("cannot stat", path);
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": truncated: ", size,
                     " bytes, shorter than the 8-byte header "
                     "length"));
  }
  SafetensorsFile file;
  file.path_ = path;
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd.get(), 0);
  if (map == MAP_FAILED) return ErrnoError("cannot mmap", path);
  file.map_ = static_cast<const std::byte*>(map);
  file.size_ = size;
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) {
    header_len = (header_len << 8) | static_cast<uint8_t>(file.map_[i]);
  }
  if (header_len > size - 8) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": header length ", header_len,
                     " runs past the end of the ", size, "-byte file"));
  }
  if (header_len > kMaxHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": header length ", header_len, " exceeds ", kMaxHeaderBytes));
  }
  file.data_offset_ = 8 + header_len;
  absl::string_view json(reinterpret_cast<const char*>(file.map_ + 8),
                         header_len);
  auto header = ParseSafetensorsHeader(json, size - file.data_offset_);
  if (!header.ok()) {
    return absl::Status(header.status().code(),
                        absl::StrCat(path, ": ", header.status().message()));
  }
  file.header_ = *std::move(header);
  for (size_t i = 0; i < file.header_.tensors.size(); ++i) {
    file.index_.emplace(file.header_.tensors[i].name, i);
  }
  return file;
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept {
  *this = std::move(other);
}

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    Release();
    path_ = std::move(other.path_);
    map_ = std::exchange(other.map_, nullptr);
    size_ = std::exchange(other.size_, 0);
    data_offset_ = other.data_offset_;
    header_ = std::move(other.header_);
    index_ = std::move(other.index_);
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() { Release(); }

void SafetensorsFile::Release() {
  if (map_ != nullptr) {
    ::munmap(const_cast<std::byte*>(map_), size_);
    map_ = nullptr;
  }
}

const TensorInfo* SafetensorsFile::Find(absl::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &header_.tensors[it->second];
}

absl::Span<const std::byte> SafetensorsFile::Data(
    const TensorInfo& tensor) const {
  return absl::Span<const std::byte>(map_ + data_offset_ + tensor.begin,
                                     tensor.size());
}

absl::Status WriteSafetensors(
    const std::string& path, absl::Span<const TensorToWrite> tensors,
    const std::map<std::string, std::string>& metadata, size_t block_bytes,
    const std::function<void(uint64_t bytes)>& on_block) {
  if (block_bytes == 0) block_bytes = 1;
  Json header = Json::object();
  if (!metadata.empty()) {
    Json meta = Json::object();
    for (const auto& [key, value] : metadata) meta[key] = value;
    header["__metadata__"] = std::move(meta);
  }
  uint64_t offset = 0;
  std::set<std::string, std::less<>> names;
  for (const TensorToWrite& t : tensors) {
    if (t.name == "__metadata__" || !names.insert(t.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot write tensor name '", t.name, "' twice"));
    }
    const std::optional<size_t> element_size = SafetensorsDTypeSize(t.dtype);
    if (!element_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", t.name, "': unknown dtype '", t.dtype, "'"));
    }
    uint64_t elements = 1;
    for (uint64_t d : t.shape) elements *= d;
    if (elements * *element_size != t.data.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", t.name, "': shape ", ShapeString(t.shape), " ", t.dtype,
          " needs ", elements * *element_size, " bytes, got ", t.data.size()));
    }
    header[t.name] = {{"dtype", t.dtype},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.data.size()}}};
    offset += t.data.size();
  }
  std::string json = header.dump();
  json.append((8 - json.size() % 8) % 8, ' ');
  unsigned char length[8];
  for (int i = 0; i < 8; ++i) {
    length[i] = static_cast<unsigned char>(uint64_t{json.size()} >> (8 * i));
  }
  return WriteOutputFile(path, [&](int fd, const std::string& temp) {
    KVCAL_RETURN_IF_ERROR(WriteAll(fd, length, 8, temp));
    KVCAL_RETURN_IF_ERROR(WriteAll(fd, json.data(), json.size(), temp));
    for (const TensorToWrite& t : tensors) {
      // Copy in bounded blocks: a source mapped from disk is paged in by the
      // kernel a block at a time; no heap buffer holds a whole tensor.
      for (size_t done = 0; done < t.data.size(); done += block_bytes) {
        const size_t n = std::min(block_bytes, t.data.size() - done);
        KVCAL_RETURN_IF_ERROR(WriteAll(fd, t.data.data() + done, n, temp));
        if (on_block) on_block(n);
      }
    }
    return absl::OkStatus();
  });
}

std::optional<std::vector<float>> SafetensorsFile::ReadFloats(
    const TensorInfo& t) const {
  absl::Span<const std::byte> data = Data(t);
  std::vector<float> values(t.elements());
  for (size_t i = 0; i < values.size(); ++i) {
    if (t.dtype == "F32") {
      std::memcpy(&values[i], data.data() + 4 * i, 4);
    } else if (t.dtype == "F16" || t.dtype == "BF16") {
      uint16_t bits;
      std::memcpy(&bits, data.data() + 2 * i, 2);
      values[i] = t.dtype == "F16" ? DecodeF16(bits) : DecodeBf16(bits);
    } else {
      return std::nullopt;
    }
  }
  return values;
}

}  // namespace kvcal
