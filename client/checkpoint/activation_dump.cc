#include "client/checkpoint/activation_dump.h"

#include <algorithm>
#include <filesystem>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "client/checkpoint/tensor_names.h"
#include "util/status_macros.h"

namespace kvcal {

namespace {

// The *.safetensors files of `dir`, sorted by name.
absl::StatusOr<std::vector<std::string>> ListDumpFiles(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return absl::NotFoundError(
        absl::StrCat("dump directory ", dir, " not found"));
  }
  std::vector<std::string> names;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.ends_with(".safetensors") && e.is_regular_file()) {
      names.push_back(name);
    }
  }
  std::sort(names.begin(), names.end());
  if (names.empty()) {
    return absl::NotFoundError(
        absl::StrCat("dump directory ", dir, " has no *.safetensors files"));
  }
  return names;
}

// A dump file's __metadata__: its batch (`index` in the sorted file list
// when not given) and its layout (tokens_heads_dim when not given).
struct DumpFileMetadata {
  uint64_t batch = 0;
  Layout layout = Layout::kTokensHeadsDim;
};

absl::StatusOr<DumpFileMetadata> ReadDumpMetadata(const SafetensorsFile& file,
                                                  const std::string& path,
                                                  uint64_t index) {
  DumpFileMetadata out{.batch = index};
  if (auto it = file.metadata().find("batch"); it != file.metadata().end()) {
    if (!absl::SimpleAtoi(it->second, &out.batch)) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": __metadata__ batch '", it->second, "' is not a number"));
    }
  }
  if (auto it = file.metadata().find("layout"); it != file.metadata().end()) {
    if (it->second == "heads_tokens_dim") {
      out.layout = Layout::kHeadsTokensDim;
    } else if (it->second != "tokens_heads_dim") {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": __metadata__ layout '", it->second,
                       "' (expected tokens_heads_dim or heads_tokens_dim)"));
    }
  }
  return out;
}

absl::StatusOr<DType> ActivationDType(const std::string& path,
                                      const TensorInfo& t) {
  if (t.dtype == "F32") return DType::kF32;
  if (t.dtype == "F16") return DType::kF16;
  if (t.dtype == "BF16") return DType::kBf16;
  return absl::InvalidArgumentError(
      absl::StrCat(path, ": tensor '", t.name, "' has dtype ", t.dtype,
                   "; activations must be F32, F16 or BF16"));
}

// Tensor `t` of the dump file `file_name` (at `path`), checked: its name, dtype
// and rank, and with `geometry` that it is a valid chunk.
absl::StatusOr<DumpTensor> ReadDumpTensor(const SafetensorsFile& file,
                                          const std::string& path,
                                          const std::string& file_name,
                                          const DumpFileMetadata& metadata,
                                          const TensorInfo& t,
                                          const Geometry* geometry) {
  const absl::StatusOr<LayerRole> name = ParseActivationTensorName(t.name);
  if (!name.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", name.status().message()));
  }
  DumpTensor d;
  d.file = file_name;
  d.name = t.name;
  d.batch = metadata.batch;
  d.layer = name->layer;
  d.role = name->role;
  KVCAL_ASSIGN_OR_RETURN(d.dtype, ActivationDType(path, t));
  d.layout = metadata.layout;
  d.shape = t.shape;
  d.data = file.Data(t);
  const bool heads_first = d.layout == Layout::kHeadsTokensDim;
  if (heads_first ? t.shape.size() != 4 : t.shape.size() < 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": tensor '", t.name, "' has rank ", t.shape.size(),
        heads_first ? "; layout heads_tokens_dim needs [batch, heads, seq, "
                      "head_dim]"
                    : "; needs [tokens, heads, head_dim]"));
  }
  if (geometry != nullptr) {
    auto extent = ValidateChunk(*geometry, d.View());
    if (!extent.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": tensor '", t.name, "': ", extent.status().message()));
    }
  }
  return d;
}

}  // namespace

absl::StatusOr<ActivationDump> ActivationDump::Open(const std::string& dir,
                                                    const Geometry* geometry) {
  KVCAL_ASSIGN_OR_RETURN(const std::vector<std::string> names,
                         ListDumpFiles(dir));
  ActivationDump dump;
  for (size_t i = 0; i < names.size(); ++i) {
    const std::string path = (std::filesystem::path(dir) / names[i]).string();
    KVCAL_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Open(path));
    KVCAL_ASSIGN_OR_RETURN(const DumpFileMetadata metadata,
                           ReadDumpMetadata(file, path, i));
    for (const TensorInfo& t : file.tensors()) {
      KVCAL_ASSIGN_OR_RETURN(
          DumpTensor d,
          ReadDumpTensor(file, path, names[i], metadata, t, geometry));
      dump.total_bytes_ += t.size();
      dump.tensors_.push_back(std::move(d));
    }
    dump.files_.push_back(std::move(file));
  }
  return dump;
}

}  // namespace kvcal
