// Activation dumps: what `kvcal push` reads and streams.
//
//   KVCAL_ASSIGN_OR_RETURN(kvcal::ActivationDump dump,
//                          kvcal::ActivationDump::Open("dumps/"));
//   for (const kvcal::DumpTensor& t : dump.tensors()) {
//     // t.data is a span into the mapped file: nothing is copied.
//   }
//
// A directory of *.safetensors files, read in name order, one calibration
// batch per file (its position in that order) unless its __metadata__ has
// `batch`. Tensor names model.layers.{L}.self_attn.{q,k,v}; dtype F32, F16 or
// BF16; shape [tokens, heads, head_dim] (any number of leading token dims),
// or [batch, heads, seq, head_dim] when __metadata__ has
// `layout: heads_tokens_dim`. Files stay memory-mapped while the dump lives.
#ifndef KVCAL_CLIENT_CHECKPOINT_ACTIVATION_DUMP_H_
#define KVCAL_CLIENT_CHECKPOINT_ACTIVATION_DUMP_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/checkpoint/safetensors.h"
#include "kernels/types.h"

namespace kvcal {

// One activation tensor of a dump: a chunk header (head_offset 0: every
// head of the role), where it was read from, and its bytes (not owned).
struct DumpTensor : ChunkHeader {
  std::string file;  // file name within the dump directory
  std::string name;
  absl::Span<const std::byte> data;

  // The whole tensor as one chunk (all its heads, not owned).
  ChunkView View() const { return ChunkView{*this, data, {}}; }
};

class ActivationDump {
 public:
  // Opens and validates every file. With `geometry`, also checks each
  // tensor against it (layer range, heads, head_dim).
  [[nodiscard]] static absl::StatusOr<ActivationDump> Open(
      const std::string& dir, const Geometry* geometry = nullptr);

  // In file-name order, then in each file's data order.
  const std::vector<DumpTensor>& tensors() const { return tensors_; }
  size_t file_count() const { return files_.size(); }
  uint64_t total_bytes() const { return total_bytes_; }

 private:
  std::vector<SafetensorsFile> files_;
  std::vector<DumpTensor> tensors_;
  uint64_t total_bytes_ = 0;
};

}  // namespace kvcal

#endif  // KVCAL_CLIENT_CHECKPOINT_ACTIVATION_DUMP_H_
