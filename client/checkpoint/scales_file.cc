#include "client/checkpoint/scales_file.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "client/checkpoint/safetensors.h"
#include "client/checkpoint/tensor_names.h"
#include "proto/names.h"
#include "proto/wire_enums.h"
#include "util/status_macros.h"

namespace kvcal {
namespace {}  // namespace

std::string GranularityName(Granularity granularity) {
  return CanonicalName(ToWire(granularity));
}

absl::Status WriteScalesFile(const std::string& path,
                             const CalibratedScales& scales) {
  std::vector<TensorToWrite> tensors;
  for (const auto& [layer, roles] : scales.layers) {
    for (Role role : kAllRoles) {
      const std::vector<float>& values = roles[RoleIndex(role)];
      if (values.empty()) continue;
      TensorToWrite t;
      t.name = ScaleTensorName(layer, role);
      t.dtype = "F32";
      t.shape = scales.granularity == Granularity::kPerHead
                    ? std::vector<uint64_t>{values.size(), 1, 1}
                    : std::vector<uint64_t>{1};
      if (scales.granularity == Granularity::kPerTensor && values.size() != 1) {
        return absl::InvalidArgumentError(absl::StrCat(
            t.name, ": per-tensor scale has ", values.size(), " values"));
      }
      t.data = absl::Span<const std::byte>(
          reinterpret_cast<const std::byte*>(values.data()),
          values.size() * sizeof(float));
      tensors.push_back(std::move(t));
    }
  }
  std::map<std::string, std::string> metadata = scales.metadata;
  metadata["kvcal_scales_version"] = "1";
  metadata["granularity"] = std::string(GranularityName(scales.granularity));
  metadata["observer"] = scales.observer;
  return WriteSafetensors(path, tensors, metadata);
}

absl::StatusOr<CalibratedScales> ReadScalesFile(const std::string& path) {
  KVCAL_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Open(path));
  CalibratedScales scales;
  scales.metadata = file.metadata();
  auto granularity = scales.metadata.find("granularity");
  if (granularity == scales.metadata.end() ||
      (granularity->second != "tensor" && granularity->second != "head")) {
    return absl::InvalidArgumentError(absl::StrCat(
        path,
        ": __metadata__ has no granularity (tensor|head); not a kvcal "
        "scales file"));
  }
  scales.granularity = granularity->second == "head" ? Granularity::kPerHead
                                                     : Granularity::kPerTensor;
  if (auto it = scales.metadata.find("observer"); it != scales.metadata.end()) {
    scales.observer = it->second;
  }
  for (const TensorInfo& t : file.tensors()) {
    const absl::StatusOr<LayerRole> name = ParseScaleTensorName(t.name);
    if (!name.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": ", name.status().message()));
    }
    if (t.dtype != "F32") {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": tensor '", t.name, "' is ", t.dtype, ", scales are F32"));
    }
    const bool per_head_shape = t.shape.size() == 3 && t.shape[1] == 1 &&
                                t.shape[2] == 1 && t.shape[0] >= 1;
    const bool per_tensor_shape = t.shape.size() == 1 && t.shape[0] == 1;
    if (scales.granularity == Granularity::kPerHead ? !per_head_shape
                                                    : !per_tensor_shape) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor '", t.name,
                       "' has a shape that does not match "
                       "granularity ",
                       granularity->second, " ([1] or [heads,1,1])"));
    }
    std::vector<float>& values =
        scales.layers[name->layer][RoleIndex(name->role)];
    values.resize(t.elements());
    std::memcpy(values.data(), file.Data(t).data(), t.size());
    for (float v : values) {
      if (!std::isfinite(v) || v <= 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": tensor '", t.name, "' holds ", v,
                         "; every scale must be finite and > 0"));
      }
    }
  }
  if (scales.layers.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": no scales"));
  }
  return scales;
}

}  // namespace kvcal
