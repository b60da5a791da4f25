// Checks the KV-cache scales of a checkpoint the way vLLM will read them.
//
//   KVCAL_ASSIGN_OR_RETURN(kvcal::InspectReport report,
//                          kvcal::InspectCheckpoint("model"));
//   for (const std::string& e : report.errors) std::cerr << e << "\n";
//   return report.errors.empty() ? 0 : 1;
//
// Lists the q/k/v scales per layer under every naming vLLM reads, checks
// that every file the index names loads and holds what the index says, and
// predicts what vLLM 0.34 does with the scales (vllm_rules.h): whether it
// starts, on which attention backends, which scales it uses (per head: q
// reduced per KV group; ROCm: doubled where it doubles), which it drops and
// where it silently uses 1.0. Every such problem is an error.
#ifndef KVCAL_CLIENT_CHECKPOINT_CHECKPOINT_INSPECT_H_
#define KVCAL_CLIENT_CHECKPOINT_CHECKPOINT_INSPECT_H_

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/checkpoint/vllm_rules.h"
#include "nlohmann/json.hpp"

namespace kvcal {

struct InspectedScale {
  std::string tensor;  // empty when absent
  std::string file;
  std::vector<uint64_t> shape;
  std::vector<float> values;
};

struct InspectedLayer {
  uint32_t layer = 0;
  std::array<InspectedScale, 3> roles;  // Q, K, V
};

struct InspectReport {
  std::string checkpoint_dir;
  bool sharded = false;
  uint64_t tensor_count = 0;
  std::string quant_method;  // of config.json's quantization_config
  std::string strategy;      // kv_cache_scheme.strategy, if any
  std::vector<InspectedLayer> layers;
  // What vLLM 0.34 does with the scales (vllm_rules.h), under these options.
  VllmLoadOptions vllm_options;
  VllmPrediction vllm;
  // Everything that makes `kvcal inspect` exit non-zero: unreadable files,
  // and every way vLLM would refuse to start, drop a scale, use 1.0 for a
  // missing one or use a value that is not finite and > 0.
  std::vector<std::string> errors;
  std::vector<std::string> warnings;

  bool ok() const { return errors.empty(); }
  nlohmann::ordered_json ToJson() const;
  // FindingsText() + ErrorsText().
  std::string ToText() const;
  // What `kvcal inspect` prints on stdout: the checkpoint, vLLM's
  // prediction, the table of scales, the warnings, and "OK" when ok().
  std::string FindingsText() const;
  // What it prints on stderr: one "error: ..." line per error and "FAILED";
  // empty when ok().
  std::string ErrorsText() const;
};

// Fails only when the checkpoint cannot be read at all (no config.json, no
// tensor files); problems with the scales land in report.errors.
// `on_shard`, when set, is called after each tensor file is read with the
// files done, their total, and the bytes of the files done.
absl::StatusOr<InspectReport> InspectCheckpoint(
    const std::string& dir, const VllmLoadOptions& vllm = VllmLoadOptions(),
    const std::function<void(uint64_t files_done, uint64_t files_total,
                             uint64_t bytes_done)>& on_shard = {});

}  // namespace kvcal

#endif  // KVCAL_CLIENT_CHECKPOINT_CHECKPOINT_INSPECT_H_
