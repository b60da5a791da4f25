// Writes calibrated KV-cache scales into a Hugging Face safetensors
// checkpoint so that vLLM loads them (docs/formats.md).
//
//   kvcal::PatchOptions options{.checkpoint_dir = "model",
//                               .scales_path = "scales.safetensors"};
//   KVCAL_ASSIGN_OR_RETURN(kvcal::PatchReport report,
//                          kvcal::PatchCheckpoint(options));
//
// Sharded checkpoints (model.safetensors.index.json) get one new shard,
// kvcal-kv-scales.safetensors, and an updated index; an existing shard is
// rewritten (streaming, without them) only when it already holds scale
// tensors of the names being written. A single-file checkpoint is rewritten
// streaming with the scales added. config.json gets its quantization_config
// updated, every other field and the key order preserved.
//
// In place (no out_dir), the patch is crash-safe: every new file is written
// and fsynced into CHECKPOINT/.kvcal-patch/, every original tensor of every
// rewritten file is compared byte for byte with the source, then a journal
// (COMMIT) is fsynced (the commit point) and the files are renamed into
// place: tensor files, then the index, then config.json, so each
// intermediate state loads. Killed before the commit point, the checkpoint
// is unchanged; after it, the next PatchCheckpoint or
// RecoverInterruptedPatch completes the renames. With out_dir, the patched
// copy is built in OUT_DIR.kvcal-partial and renamed to OUT_DIR at the end.
//
// The steps, each a function in checkpoint_patcher.cc: discover (read
// config.json, the index and every shard header), plan (the new config, the
// scale tensors under the target's names, each output file's contents; vLLM
// 0.34's rules checked), stage (write and fsync into the staging
// directory), verify (byte for byte), commit (journal, then renames).
//
// One writer per checkpoint: the whole patch, from the first read of
// config.json to the last rename, holds the checkpoint's lock
// (checkpoint_lock.h; a shared one on the source with out_dir). Recovery of
// an interrupted patch runs only under the exclusive lock, so it never
// touches a live patch's staging area. A failure before the commit point
// removes what was staged (the checkpoint is unchanged); a failure after it
// names the journal and the command that completes the patch.
//
// A corrupt journal is a DATA_LOSS error that says what to do, never a
// crash. PatchOptions::on_step is a test seam: the fault-injection test kills
// the process at each step in turn.
#ifndef KVCAL_CLIENT_CHECKPOINT_CHECKPOINT_PATCHER_H_
#define KVCAL_CLIENT_CHECKPOINT_CHECKPOINT_PATCHER_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/checkpoint/checkpoint_lock.h"
#include "client/checkpoint/tensor_names.h"

namespace kvcal {

inline constexpr char kScalesShardName[] = "kvcal-kv-scales.safetensors";
inline constexpr char kPatchStagingDir[] = ".kvcal-patch";
inline constexpr char kIndexName[] = "model.safetensors.index.json";

// OK when `name`, a shard file named by the index's weight_map, is a plain
// file name inside the checkpoint directory: not empty, not "." or "..", no
// '/' or NUL. An index is untrusted input: "../x" or "/abs/path" would make
// the reader open, and the patcher rewrite, files outside the checkpoint.
absl::Status CheckShardFileName(absl::string_view name);

// The KV cache a patched checkpoint declares, which vLLM 0.34 then runs
// with `--kv-cache-dtype auto`: fp8 (e4m3), or NVFP4, whose per-layer
// global scale is 1 / k_scale (1 / v_scale) from the same per-tensor scales
// (ModelOpt writes amax / 448 for both). NVFP4 is declared by a ModelOpt
// config only (--target modelopt), with per-tensor scales.
enum class PatchKvCache { kFp8, kNvfp4 };
// "fp8" or "nvfp4" (`kvcal patch --kv-cache-dtype`).
absl::StatusOr<PatchKvCache> ParsePatchKvCache(absl::string_view name);
absl::string_view PatchKvCacheName(PatchKvCache kv_cache);

struct PatchOptions {
  std::string checkpoint_dir;
  std::string scales_path;
  // Empty: patch in place.
  std::string out_dir;
  PatchTarget target = PatchTarget::kCompressedTensors;
  // Called with 1, 2, ... at each step of the patch (tests only).
  std::function<void(int step)> on_step;
  // Called as the long steps advance, from the calling thread: bytes staged
  // (written, or copied with out_dir) plus bytes verified so far, and their
  // total (known once the patch is planned).
  std::function<void(uint64_t done_bytes, uint64_t total_bytes)> on_progress;
  // How long to wait for the checkpoint's lock while another process holds
  // it; zero: refuse at once, naming the holder.
  absl::Duration lock_timeout = absl::ZeroDuration();
  // Called once when waiting for the lock, with the holder's description.
  std::function<void(const std::string& holder)> on_lock_wait;
  // A lock the caller already holds, from LockCheckpointForPatch with these
  // options (`kvcal calibrate` takes it before it reads config.json); then
  // PatchCheckpoint takes none itself.
  const CheckpointLock* lock = nullptr;
  // The KV cache the patched config.json declares.
  PatchKvCache kv_cache = PatchKvCache::kFp8;
};

// The lock PatchCheckpoint takes for `options`: exclusive in place; shared
// on the source with out_dir (several copies may be made at once), unless
// the source holds an interrupted patch, which only an exclusive holder may
// complete or discard.
absl::StatusOr<CheckpointLock> LockCheckpointForPatch(
    const PatchOptions& options);

struct PatchReport {
  std::string output_dir;
  bool sharded = false;
  // File names (relative to output_dir) written or rewritten.
  std::vector<std::string> files_written;
  // Scale tensors written, and how many same-named ones they replaced.
  uint64_t scale_tensors = 0;
  uint64_t replaced_tensors = 0;
  // Original tensors compared byte for byte before committing.
  uint64_t tensors_verified = 0;
  uint64_t bytes_verified = 0;
  // Set when an interrupted earlier patch was completed or rolled back first.
  std::string recovered;
  // What vLLM 0.34 will do that the user should know: a role the scales
  // file lacks (vLLM then uses 1.0), a flag vLLM needs, backends.
  std::vector<std::string> warnings;
};

[[nodiscard]] absl::StatusOr<PatchReport> PatchCheckpoint(
    const PatchOptions& options);

// Completes (journal present) or discards (no journal) an interrupted
// in-place patch of `checkpoint_dir`, under the checkpoint's lock (refused
// while another process holds it). Returns what it did, empty if nothing.
absl::StatusOr<std::string> RecoverInterruptedPatch(
    const std::string& checkpoint_dir);

}  // namespace kvcal

#endif  // KVCAL_CLIENT_CHECKPOINT_CHECKPOINT_PATCHER_H_
