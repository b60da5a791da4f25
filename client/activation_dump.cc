#include "client/activation_dump.h"

#include <algorithm>
#include <filesystem>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "client/tensor_names.h"
#include "util/status_macros.h"

namespace kvcal {

absl::StatusOr<ActivationDump> ActivationDump::Open(const std::string& dir,
                                                    const Geometry* geometry) {
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
  ActivationDump dump;
  for (size_t i = 0; i < names.size(); ++i) {
    const std::string path = (fs::path(dir) / names[i]).string();
    KVCAL_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Open(path));
    uint64_t batch = i;
    Layout layout = Layout::kTokensHeadsDim;
    if (auto it = file.metadata().find("batch"); it != file.metadata().end()) {
      if (!absl::SimpleAtoi(it->second, &batch)) {
        return absl::InvalidArgumentError(absl::StrCat(
            path, ": __metadata__ batch '", it->second, "' is not a number"));
      }
    }
    if (auto it = file.metadata().find("layout"); it != file.metadata().end()) {
      if (it->second == "heads_tokens_dim") {
        layout = Layout::kHeadsTokensDim;
      } else if (it->second != "tokens_heads_dim") {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": __metadata__ layout '", it->second,
                         "' (expected tokens_heads_dim or heads_tokens_dim)"));
      }
    }
    for (const TensorInfo& t : file.tensors()) {
      const absl::StatusOr<LayerRole> name = ParseActivationTensorName(t.name);
      if (!name.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": ", name.status().message()));
      }
      DumpTensor d;
      d.file = names[i];
      d.name = t.name;
      d.batch = batch;
      d.layer = name->layer;
      d.role = name->role;
      if (t.dtype == "F32") {
        d.dtype = DType::kF32;
      } else if (t.dtype == "F16") {
        d.dtype = DType::kF16;
      } else if (t.dtype == "BF16") {
        d.dtype = DType::kBf16;
      } else {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": tensor '", t.name, "' has dtype ", t.dtype,
                         "; activations must be F32, F16 or BF16"));
      }
      d.layout = layout;
      d.shape = t.shape;
      d.data = file.Data(t);
      if (layout == Layout::kHeadsTokensDim ? t.shape.size() != 4
                                            : t.shape.size() < 2) {
        return absl::InvalidArgumentError(absl::StrCat(
            path, ": tensor '", t.name, "' has rank ", t.shape.size(),
            layout == Layout::kHeadsTokensDim
                ? "; layout heads_tokens_dim needs [batch, heads, seq, "
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
      dump.total_bytes_ += t.size();
      dump.tensors_.push_back(std::move(d));
    }
    dump.files_.push_back(std::move(file));
  }
  return dump;
}

}  // namespace kvcal
