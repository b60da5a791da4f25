// The scales file `kvcal finalize` writes and `kvcal patch` reads: a small
// safetensors file holding one F32 tensor per (layer, role) under its
// compressed-tensors checkpoint name,
// `model.layers.{L}.self_attn.{q,k,v}_scale`, shape [1] per tensor or [heads,
// 1, 1] per head, and a `__metadata__` that records how the scales were made.
//
//   kvcal::CalibratedScales scales;
//   scales.granularity = kvcal::Granularity::kPerHead;
//   scales.layers[0][kvcal::RoleIndex(kvcal::Role::kK)] = {0.01f, 0.02f};
//   KVCAL_RETURN_IF_ERROR(
//       kvcal::WriteScalesFile("scales.safetensors", scales));
//   KVCAL_ASSIGN_OR_RETURN(auto back,
//                          kvcal::ReadScalesFile("scales.safetensors"));
#ifndef KVCAL_CLIENT_CHECKPOINT_SCALES_FILE_H_
#define KVCAL_CLIENT_CHECKPOINT_SCALES_FILE_H_

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/checkpoint/tensor_names.h"
#include "kernels/scale_math.h"
#include "kernels/types.h"

namespace kvcal {

struct CalibratedScales {
  Granularity granularity = Granularity::kPerTensor;
  // llm-compressor's observer name ("static_minmax", "mse", ...).
  std::string observer = "static_minmax";
  // Per layer, indexed by RoleIndex; an empty vector = no scale for the role.
  std::map<uint32_t, std::array<std::vector<float>, 3>> layers;
  // Everything else recorded in __metadata__ (session, options, counts...).
  std::map<std::string, std::string> metadata;
};

[[nodiscard]] absl::Status WriteScalesFile(const std::string& path,
                                           const CalibratedScales& scales);
// Checks names, dtype (F32), shapes (one granularity throughout) and that
// every scale is finite and > 0.
absl::StatusOr<CalibratedScales> ReadScalesFile(const std::string& path);

// "tensor" / "head" (proto/names.h).
std::string GranularityName(Granularity granularity);

}  // namespace kvcal

#endif  // KVCAL_CLIENT_CHECKPOINT_SCALES_FILE_H_
