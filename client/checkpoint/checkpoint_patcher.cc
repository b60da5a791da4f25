// PatchCheckpoint (checkpoint_patcher.h): discover, plan, stage, verify,
// commit, and the recovery of an interrupted patch. The config.json each
// target gets and the checks against vLLM's rules are in patch_config.cc.
// Over 600 lines on purpose: the remaining steps share the patch's private
// state (Steps, the journal, FilePlan, Checkpoint, PatchPlan, Staged,
// PatchProgress) and its crash-safety argument (the journal as commit point,
// the step numbers the fault-injection test kills at) reads in one place;
// each function is under 80 lines.
#include "client/checkpoint/checkpoint_patcher.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <regex>
#include <set>
#include <system_error>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "client/checkpoint/checkpoint_lock.h"
#include "client/checkpoint/model_config.h"
#include "client/checkpoint/patch_config.h"
#include "client/checkpoint/safetensors.h"
#include "client/checkpoint/scales_file.h"
#include "client/checkpoint/vllm_rules.h"
#include "nlohmann/json.hpp"
#include "util/file_io.h"
#include "util/status_macros.h"
#include "util/strings.h"

namespace kvcal {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;
using patch_internal::CheckScalesForVllm;
using patch_internal::CheckVllmUsesTheScales;
using patch_internal::NewTensor;
using patch_internal::UpdateConfig;

constexpr char kJournalName[] = "COMMIT";
constexpr char kConfigName[] = "config.json";
constexpr char kSingleFileName[] = "model.safetensors";

// Numbers the steps of a patch and hands each to the caller's hook (a test
// seam: the fault-injection test kills the process at a chosen step).
class Steps {
 public:
  explicit Steps(const std::function<void(int)>& hook) : hook_(hook) {}
  void Step() {
    ++step_;
    if (hook_) hook_(step_);
  }

 private:
  const std::function<void(int)>& hook_;
  int step_ = 0;
};

// The commit journal: the files to rename from the staging directory into
// the checkpoint, in order. Written at the commit point; read by recovery.
struct PatchJournal {
  std::vector<std::string> renames;

  std::string Serialize() const {
    return Json{{"renames", renames}}.dump() + "\n";
  }
  static absl::StatusOr<PatchJournal> Parse(const fs::path& path) {
    auto corrupt = [&](absl::string_view what) {
      return absl::DataLossError(absl::StrCat(
          path.string(), ": the journal of an interrupted kvcal patch is ",
          what,
          "; the checkpoint may be half patched: compare it with a copy or "
          "restore it, then remove the .kvcal-patch directory"));
    };
    KVCAL_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path.string()));
    Json json = Json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (json.is_discarded() || !json.is_object()) {
      return corrupt("not a JSON object");
    }
    auto it = json.find("renames");
    if (it == json.end() || !it->is_array() || it->empty()) {
      return corrupt("missing its list of renames");
    }
    PatchJournal journal;
    for (const Json& name : *it) {
      if (!name.is_string() ||
          !CheckShardFileName(name.get<std::string>()).ok()) {
        return corrupt(absl::StrCat("naming ", name.dump(),
                                    ", not a file of the checkpoint"));
      }
      journal.renames.push_back(name.get<std::string>());
    }
    return journal;
  }
};

// The staging directory's entries other than the lock file: what an
// interrupted patch left (staged files, a journal).
absl::StatusOr<std::vector<fs::path>> StagedEntries(const fs::path& staging) {
  std::vector<fs::path> entries;
  std::error_code ec;
  if (!fs::exists(staging, ec)) return entries;
  for (const fs::directory_entry& e : fs::directory_iterator(staging, ec)) {
    if (e.path().filename() != kCheckpointLockName) entries.push_back(e.path());
  }
  if (ec)
    return FilesystemError(absl::StrCat("cannot list ", staging.string()), ec);
  return entries;
}

// Removes everything in the staging directory but the lock file (whose
// holder, this process, removes it when it releases the lock).
absl::Status ClearStaging(const fs::path& staging) {
  KVCAL_ASSIGN_OR_RETURN(std::vector<fs::path> entries, StagedEntries(staging));
  std::error_code ec;
  for (const fs::path& entry : entries) {
    fs::remove_all(entry, ec);
    if (ec)
      return FilesystemError(absl::StrCat("cannot remove ", entry.string()),
                             ec);
  }
  return absl::OkStatus();
}

// The command that completes a committed patch: patch runs recovery first
// (the journal's renames), then patches the same scales again, which writes
// the same bytes.
std::string CompletionCommand(const PatchOptions& options) {
  std::string command = absl::StrCat(
      "kvcal patch --checkpoint ", ShellQuote(options.checkpoint_dir),
      " --scales ", ShellQuote(options.scales_path));
  if (options.target != PatchTarget::kCompressedTensors) {
    absl::StrAppend(&command, " --target ",
                    std::string(PatchTargetName(options.target)));
  }
  if (options.kv_cache != PatchKvCache::kFp8) {
    absl::StrAppend(&command, " --kv-cache-dtype ",
                    std::string(PatchKvCacheName(options.kv_cache)));
  }
  return command;
}

absl::StatusOr<Json> ReadJsonFile(const fs::path& path) {
  KVCAL_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path.string()));
  Json json = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded() || !json.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path.string(), ": not a JSON object"));
  }
  return json;
}

// One file of the output: where its tensors come from and what changes.
struct FilePlan {
  std::string name;            // relative to the checkpoint
  std::string source;          // full path, empty for a new file
  std::set<std::string> drop;  // source tensors left out
  bool add_scales = false;
};

// Reports the bytes the long steps have staged and verified.
class PatchProgress {
 public:
  PatchProgress(const std::function<void(uint64_t, uint64_t)>& callback,
                uint64_t bytes_to_write, uint64_t bytes_to_verify)
      : callback_(callback), total_(bytes_to_write + bytes_to_verify) {}
  void Add(uint64_t bytes) {
    done_ = std::min(total_, done_ + bytes);
    if (callback_) callback_(done_, total_);
  }

 private:
  const std::function<void(uint64_t, uint64_t)>& callback_;
  uint64_t total_;
  uint64_t done_ = 0;
};

bool IsSafetensorsName(const std::string& name) {
  return name.size() > 12 && name.ends_with(".safetensors");
}

absl::Status WriteStagedFile(const FilePlan& plan,
                             const std::vector<NewTensor>& scales,
                             const fs::path& staged, PatchProgress& progress) {
  std::optional<SafetensorsFile> source;
  std::vector<TensorToWrite> tensors;
  std::map<std::string, std::string> metadata = {{"format", "pt"}};
  if (!plan.source.empty()) {
    KVCAL_ASSIGN_OR_RETURN(source, SafetensorsFile::Open(plan.source));
    metadata = source->metadata();
    for (const TensorInfo& t : source->tensors()) {
      if (plan.drop.count(t.name)) continue;
      tensors.push_back({t.name, t.dtype, t.shape, source->Data(t)});
    }
  }
  if (plan.add_scales) {
    for (const NewTensor& s : scales) {
      tensors.push_back(
          {s.name, "F32", s.shape,
           absl::Span<const std::byte>(
               reinterpret_cast<const std::byte*>(s.values.data()),
               s.values.size() * sizeof(float))});
    }
  }
  return WriteSafetensors(staged.string(), tensors, metadata, size_t{8} << 20,
                          [&](uint64_t bytes) { progress.Add(bytes); });
}

// Byte-for-byte check of a staged file against its source and the scales.
absl::Status VerifyStagedFile(const FilePlan& plan,
                              const std::vector<NewTensor>& scales,
                              const fs::path& staged, PatchProgress& progress,
                              PatchReport& report) {
  KVCAL_ASSIGN_OR_RETURN(SafetensorsFile out, SafetensorsFile::Open(staged));
  size_t expected = plan.add_scales ? scales.size() : 0;
  if (!plan.source.empty()) {
    KVCAL_ASSIGN_OR_RETURN(SafetensorsFile in,
                           SafetensorsFile::Open(plan.source));
    for (const TensorInfo& t : in.tensors()) {
      if (plan.drop.count(t.name)) continue;
      ++expected;
      const TensorInfo* o = out.Find(t.name);
      if (o == nullptr || o->dtype != t.dtype || o->shape != t.shape ||
          o->size() != t.size() ||
          std::memcmp(out.Data(*o).data(), in.Data(t).data(), t.size()) != 0) {
        return absl::DataLossError(absl::StrCat(
            "verification failed: tensor '", t.name, "' in ", staged.string(),
            " differs from ", plan.source, "; nothing was committed"));
      }
      ++report.tensors_verified;
      report.bytes_verified += t.size();
      progress.Add(t.size());
    }
  }
  if (plan.add_scales) {
    for (const NewTensor& s : scales) {
      const TensorInfo* o = out.Find(s.name);
      if (o == nullptr || o->size() != s.values.size() * sizeof(float) ||
          std::memcmp(out.Data(*o).data(), s.values.data(), o->size()) != 0) {
        return absl::DataLossError(absl::StrCat(
            "verification failed: scale '", s.name, "' in ", staged.string()));
      }
    }
  }
  if (out.tensors().size() != expected) {
    return absl::DataLossError(
        absl::StrCat("verification failed: ", staged.string(), " holds ",
                     out.tensors().size(), " tensors, expected ", expected));
  }
  return absl::OkStatus();
}

absl::Status VerifyFileCopy(const fs::path& source, const fs::path& copy,
                            PatchProgress& progress, PatchReport& report) {
  KVCAL_ASSIGN_OR_RETURN(SafetensorsFile in, SafetensorsFile::Open(source));
  KVCAL_ASSIGN_OR_RETURN(SafetensorsFile out, SafetensorsFile::Open(copy));
  for (const TensorInfo& t : in.tensors()) {
    const TensorInfo* o = out.Find(t.name);
    if (o == nullptr || o->size() != t.size() ||
        std::memcmp(out.Data(*o).data(), in.Data(t).data(), t.size()) != 0) {
      return absl::DataLossError(absl::StrCat("verification failed: tensor '",
                                              t.name, "' in ", copy.string()));
    }
    ++report.tensors_verified;
    report.bytes_verified += t.size();
    progress.Add(t.size());
  }
  return absl::OkStatus();
}

// Step 1, discover: what the checkpoint holds, file by file. Reads config.json,
// the index (if any) and every shard's header; writes nothing.
struct Checkpoint {
  fs::path dir;
  Json config;
  ModelGeometry geometry;
  bool sharded = false;
  Json index;                            // when sharded
  std::vector<std::string> shard_names;  // in first-appearance order
  // Per shard: the names and byte sizes of its tensors.
  std::map<std::string, std::map<std::string, uint64_t>> tensors_in_file;
  std::vector<VllmScaleTensor> existing_scales;
  // Before ".layers.{L}.self_attn." ("model" for Llama).
  std::string prefix;
};

// The index's shard list, checked: every entry a plain file name.
absl::Status ReadIndex(
    const fs::path& index_path, Checkpoint& c,
    std::map<std::string, std::vector<std::string>>& listed) {
  KVCAL_ASSIGN_OR_RETURN(c.index, ReadJsonFile(index_path));
  if (!c.index.contains("weight_map") || !c.index["weight_map"].is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(index_path.string(), ": no weight_map object"));
  }
  for (const auto& [name, file] : c.index["weight_map"].items()) {
    if (!file.is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat(index_path.string(), ": weight_map entry '", name,
                       "' is not a file name"));
    }
    const std::string f = file.get<std::string>();
    if (absl::Status s = CheckShardFileName(f); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(index_path.string(),
                                                     ": weight_map entry '",
                                                     name, "': ", s.message()));
    }
    if (!listed.count(f)) c.shard_names.push_back(f);
    listed[f].push_back(name);
  }
  return absl::OkStatus();
}

absl::StatusOr<Checkpoint> Discover(const fs::path& dir) {
  Checkpoint c;
  c.dir = dir;
  const fs::path config_path = dir / kConfigName;
  KVCAL_ASSIGN_OR_RETURN(c.config, ReadJsonFile(config_path));
  absl::StatusOr<ModelGeometry> geometry = ModelGeometryFromConfig(c.config);
  if (!geometry.ok()) {
    return absl::Status(
        geometry.status().code(),
        absl::StrCat(config_path.string(), ": ", geometry.status().message()));
  }
  c.geometry = *std::move(geometry);

  std::error_code ec;
  const fs::path index_path = dir / kIndexName;
  c.sharded = fs::exists(index_path, ec);
  std::map<std::string, std::vector<std::string>> listed;  // by the index
  if (c.sharded) {
    KVCAL_RETURN_IF_ERROR(ReadIndex(index_path, c, listed));
  } else if (fs::exists(dir / kSingleFileName, ec)) {
    c.shard_names.push_back(kSingleFileName);
  } else {
    return absl::NotFoundError(absl::StrCat(
        dir.string(), " has neither ", kIndexName, " nor ", kSingleFileName));
  }
  // Open every shard once: validates each header and gives the names.
  std::vector<std::string> all_names;
  for (const std::string& shard : c.shard_names) {
    KVCAL_ASSIGN_OR_RETURN(SafetensorsFile file,
                           SafetensorsFile::Open((dir / shard).string()));
    std::map<std::string, uint64_t>& names = c.tensors_in_file[shard];
    for (const TensorInfo& t : file.tensors()) {
      names[t.name] = t.size();
      if (IsVllmScaleName(t.name)) {
        c.existing_scales.push_back(
            {t.name, t.shape,
             file.ReadFloats(t).value_or(std::vector<float>{})});
      }
      all_names.push_back(t.name);
    }
    for (const std::string& name : listed[shard]) {
      if (!names.count(name)) {
        return absl::InvalidArgumentError(
            absl::StrCat(index_path.string(), ": weight_map puts '", name,
                         "' in ", shard, ", which does not hold it"));
      }
    }
  }
  c.prefix = AttentionPrefix(all_names);
  return c;
}

// Step 2, plan: the new config.json, the scale tensors under the target's
// names, what each output file holds, and what --out copies. Checks that
// vLLM 0.34 will use every scale as written; writes nothing.
struct PatchPlan {
  Json config;  // updated
  std::vector<NewTensor> new_tensors;
  std::set<std::string> new_names;
  std::vector<FilePlan> files;
  // With --out: the other entries of the checkpoint, copied as they are.
  std::vector<std::string> copies;
  uint64_t bytes_to_write = 0;
  uint64_t bytes_to_verify = 0;
};

std::vector<NewTensor> ScaleTensors(const CalibratedScales& scales,
                                    PatchTarget target,
                                    const std::string& prefix) {
  std::vector<NewTensor> tensors;
  for (const auto& [layer, roles] : scales.layers) {
    for (Role role : kAllRoles) {
      const std::vector<float>& values = roles[RoleIndex(role)];
      const std::string name = CheckpointScaleName(target, prefix, layer, role);
      if (values.empty() || name.empty()) continue;
      NewTensor t;
      t.name = name;
      t.values = values;
      if (scales.granularity == Granularity::kPerHead) {
        t.shape = {values.size(), 1, 1};
      } else if (target == PatchTarget::kCompressedTensors) {
        t.shape = {1};
      }  // ModelOpt and Quark store scalars.
      tensors.push_back(std::move(t));
    }
  }
  return tensors;
}

// The files to write: a sharded checkpoint gets the scales shard (carrying
// over an earlier one's other tensors) and rewrites only the shards that
// hold tensors of the new names; a single file is rewritten whole.
std::vector<FilePlan> PlanFiles(const Checkpoint& c,
                                const std::set<std::string>& new_names,
                                PatchReport& report) {
  std::vector<FilePlan> plans;
  if (!c.sharded) {
    FilePlan single{
        kSingleFileName, (c.dir / kSingleFileName).string(), {}, true};
    for (const auto& [name, bytes] : c.tensors_in_file.at(kSingleFileName)) {
      if (new_names.count(name)) single.drop.insert(name);
    }
    report.replaced_tensors = single.drop.size();
    plans.push_back(std::move(single));
    return plans;
  }
  FilePlan scales_shard{kScalesShardName, "", {}, true};
  for (const std::string& shard : c.shard_names) {
    std::set<std::string> drop;
    for (const auto& [name, bytes] : c.tensors_in_file.at(shard)) {
      if (new_names.count(name)) drop.insert(name);
    }
    report.replaced_tensors += drop.size();
    if (shard == kScalesShardName) {
      scales_shard.source = (c.dir / shard).string();
      scales_shard.drop = std::move(drop);
    } else if (!drop.empty()) {
      plans.push_back(
          {shard, (c.dir / shard).string(), std::move(drop), false});
    }
  }
  plans.push_back(std::move(scales_shard));
  return plans;
}

// Bytes of the source tensors `plan` keeps (from the headers Discover read).
uint64_t KeptBytes(const Checkpoint& c, const FilePlan& plan) {
  if (plan.source.empty()) return 0;
  uint64_t kept = 0;
  for (const auto& [name, bytes] : c.tensors_in_file.at(plan.name)) {
    if (!plan.drop.count(name)) kept += bytes;
  }
  return kept;
}

absl::StatusOr<PatchPlan> Plan(const Checkpoint& c,
                               const CalibratedScales& scales,
                               const PatchOptions& options,
                               PatchReport& report) {
  PatchPlan plan;
  KVCAL_RETURN_IF_ERROR(
      CheckScalesForVllm(scales, c.geometry, options.target, options.kv_cache));
  plan.config = c.config;
  KVCAL_RETURN_IF_ERROR(UpdateConfig(plan.config, options.target,
                                     options.kv_cache, scales, c.dir));
  plan.new_tensors = ScaleTensors(scales, options.target, c.prefix);
  for (const NewTensor& t : plan.new_tensors) plan.new_names.insert(t.name);
  report.scale_tensors = plan.new_tensors.size();
  KVCAL_RETURN_IF_ERROR(CheckVllmUsesTheScales(
      plan.config, c.geometry, scales, options.target, options.kv_cache,
      c.existing_scales, plan.new_tensors, report));
  plan.files = PlanFiles(c, plan.new_names, report);

  uint64_t scale_bytes = 0;
  for (const NewTensor& t : plan.new_tensors) {
    scale_bytes += t.values.size() * sizeof(float);
  }
  std::set<std::string> written;
  for (const FilePlan& f : plan.files) {
    const uint64_t kept = KeptBytes(c, f);
    plan.bytes_to_write += kept + (f.add_scales ? scale_bytes : 0);
    plan.bytes_to_verify += kept;
    written.insert(f.name);
  }
  if (!options.out_dir.empty()) {
    std::error_code ec;
    for (const fs::directory_entry& entry : fs::directory_iterator(c.dir, ec)) {
      const std::string name = entry.path().filename().string();
      if (name == kPatchStagingDir || written.count(name) ||
          name == kIndexName || name == kConfigName ||
          (c.sharded && name == kScalesShardName)) {
        continue;
      }
      plan.copies.push_back(name);
      if (entry.is_regular_file(ec)) {
        const uint64_t size = entry.file_size(ec);
        plan.bytes_to_write += ec ? 0 : size;
        if (IsSafetensorsName(name)) plan.bytes_to_verify += ec ? 0 : size;
      }
    }
    if (ec)
      return FilesystemError(absl::StrCat("cannot list ", c.dir.string()), ec);
  }
  return plan;
}

// The index after the patch: replaced names leave their shards, the new
// names point at the scales shard, total_size follows the staged files.
absl::StatusOr<Json> UpdatedIndex(const Checkpoint& c, const PatchPlan& plan,
                                  const fs::path& staging) {
  Json index = c.index;
  Json& weight_map = index["weight_map"];
  Json updated = Json::object();
  for (const auto& [name, file] : weight_map.items()) {
    if (!plan.new_names.count(name) &&
        file.get<std::string>() != kScalesShardName) {
      updated[name] = file;
    }
  }
  for (const NewTensor& t : plan.new_tensors) {
    updated[t.name] = kScalesShardName;
  }
  // Carried-over tensors of an earlier kvcal scales shard stay listed.
  if (auto it = c.tensors_in_file.find(kScalesShardName);
      it != c.tensors_in_file.end()) {
    for (const auto& [name, bytes] : it->second) {
      if (!plan.new_names.count(name)) updated[name] = kScalesShardName;
    }
  }
  weight_map = std::move(updated);
  std::set<std::string> files;
  for (const auto& [name, file] : weight_map.items()) {
    files.insert(file.get<std::string>());
  }
  std::set<std::string> rewritten;
  for (const FilePlan& f : plan.files) rewritten.insert(f.name);
  uint64_t total = 0;
  for (const std::string& f : files) {
    const fs::path p = rewritten.count(f) ? staging / f : c.dir / f;
    KVCAL_ASSIGN_OR_RETURN(SafetensorsFile file,
                           SafetensorsFile::Open(p.string()));
    for (const TensorInfo& t : file.tensors()) total += t.size();
  }
  if (!index.contains("metadata") || !index["metadata"].is_object()) {
    index["metadata"] = Json::object();
  }
  index["metadata"]["total_size"] = total;
  return index;
}

// Step 3, stage: every output file written and fsynced into the staging
// directory (CHECKPOINT/.kvcal-patch, or OUT.kvcal-partial with --out).
struct Staged {
  bool in_place = true;
  fs::path out_dir;
  fs::path staging;
  // With --out: the flock on OUT.kvcal-partial, held until the patch ends.
  std::shared_ptr<FileDescriptor> claim;
};

// With --out, one patch at a time builds OUT.kvcal-partial (two copies of
// one source may run at once under the source's shared lock): an exclusive
// flock on the directory itself, which stays with it when it is renamed to
// OUT. A leftover of a dead run is not locked and is reused.
absl::StatusOr<std::shared_ptr<FileDescriptor>> ClaimOutputStaging(
    const fs::path& partial, const fs::path& out, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    if (::mkdir(partial.c_str(), 0755) != 0 && errno != EEXIST) {
      return ErrnoError("cannot create", partial.string(),
                        absl::StatusCode::kFailedPrecondition);
    }
    auto fd = std::make_shared<FileDescriptor>(::open(
        partial.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (fd->get() < 0) {
      if (errno == ENOENT) continue;  // renamed or removed by its owner
      if (errno == ENOTDIR || errno == ELOOP) {
        return absl::FailedPreconditionError(absl::StrCat(
            partial.string(),
            " exists and is not a directory; kvcal builds the --out copy "
            "there: move it away"));
      }
      return ErrnoError("cannot open", partial.string(),
                        absl::StatusCode::kFailedPrecondition);
    }
    if (::flock(fd->get(), LOCK_EX | LOCK_NB) == 0) {
      struct stat mine, now;
      if (::fstat(fd->get(), &mine) == 0 &&
          ::lstat(partial.c_str(), &now) == 0 && mine.st_dev == now.st_dev &&
          mine.st_ino == now.st_ino) {
        return fd;
      }
      continue;
    }
    if (errno != EWOULDBLOCK) {
      return ErrnoError("cannot lock", partial.string(),
                        absl::StatusCode::kFailedPrecondition);
    }
    if (absl::Now() >= deadline) {
      return absl::FailedPreconditionError(
          absl::StrCat("another kvcal patch is writing ", out.string(), " (",
                       partial.string(),
                       " is locked); run again when it has finished, or pass "
                       "--lock-timeout SECONDS to wait"));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

absl::StatusOr<Staged> Stage(const Checkpoint& c, const PatchOptions& options,
                             Steps& crash, PatchReport& report) {
  Staged staged;
  staged.in_place = options.out_dir.empty();
  std::string out = options.out_dir;
  while (out.size() > 1 && out.back() == '/') out.pop_back();  // "copy/"
  staged.out_dir = staged.in_place ? c.dir : fs::path(out);
  staged.staging = staged.in_place ? c.dir / kPatchStagingDir
                                   : fs::path(out + ".kvcal-partial");
  report.output_dir = staged.out_dir.string();
  std::error_code ec;
  if (!staged.in_place) {
    if (staged.staging.has_parent_path()) {
      fs::create_directories(staged.staging.parent_path(), ec);
    }
    KVCAL_ASSIGN_OR_RETURN(staged.claim,
                           ClaimOutputStaging(staged.staging, staged.out_dir,
                                              options.lock_timeout));
    if (fs::exists(staged.out_dir, ec) && !fs::is_empty(staged.out_dir, ec)) {
      fs::remove_all(staged.staging, ec);  // ours, locked
      return absl::AlreadyExistsError(absl::StrCat("output directory ",
                                                   staged.out_dir.string(),
                                                   " exists and is not empty"));
    }
    // What a dead run left: its files go, the (locked) directory stays.
    for (const fs::directory_entry& e :
         fs::directory_iterator(staged.staging, ec)) {
      fs::remove_all(e.path(), ec);
    }
  }
  // In place, the staging directory holds the lock file already.
  fs::create_directories(staged.staging, ec);
  if (ec) {
    return FilesystemError(
        absl::StrCat("cannot create ", staged.staging.string()), ec);
  }
  crash.Step();
  return staged;
}

absl::Status StageFiles(const Checkpoint& c, const PatchPlan& plan,
                        const Staged& staged, Steps& crash,
                        PatchProgress& progress, PatchReport& report) {
  for (const FilePlan& f : plan.files) {
    KVCAL_RETURN_IF_ERROR(WriteStagedFile(f, plan.new_tensors,
                                          staged.staging / f.name, progress));
    report.files_written.push_back(f.name);
    crash.Step();
  }
  if (c.sharded) {
    KVCAL_ASSIGN_OR_RETURN(Json index, UpdatedIndex(c, plan, staged.staging));
    KVCAL_RETURN_IF_ERROR(WriteOutputFile(
        (staged.staging / kIndexName).string(), index.dump(2) + "\n"));
    report.files_written.push_back(kIndexName);
    crash.Step();
  }
  KVCAL_RETURN_IF_ERROR(WriteOutputFile((staged.staging / kConfigName).string(),
                                        plan.config.dump(2) + "\n"));
  report.files_written.push_back(kConfigName);
  crash.Step();

  // With --out, everything else is copied beside the new files.
  if (!staged.in_place) {
    for (const std::string& name : plan.copies) {
      KVCAL_RETURN_IF_ERROR(CopyFileOrTreeSynced(
          c.dir / name, staged.staging / name,
          [&progress](uint64_t bytes) { progress.Add(bytes); }));
    }
    crash.Step();
  }
  return absl::OkStatus();
}

// Step 4, verify: every kept tensor of every rewritten or copied file equals
// its source byte for byte, and the scales are what was planned.
absl::Status Verify(const Checkpoint& c, const PatchPlan& plan,
                    const Staged& staged, PatchProgress& progress,
                    PatchReport& report) {
  for (const FilePlan& f : plan.files) {
    KVCAL_RETURN_IF_ERROR(VerifyStagedFile(
        f, plan.new_tensors, staged.staging / f.name, progress, report));
  }
  for (const std::string& name : plan.copies) {
    if (IsSafetensorsName(name)) {
      KVCAL_RETURN_IF_ERROR(VerifyFileCopy(c.dir / name, staged.staging / name,
                                           progress, report));
    }
  }
  return absl::OkStatus();
}

// Step 5, commit. In place: the journal is the commit point, then the
// renames (new shard first, config.json last: every state in between
// loads); with --out: one rename of the staging directory. `committed` says
// whether a failure came after the commit point.
absl::Status Commit(const Checkpoint& c, const PatchPlan& plan,
                    const Staged& staged, Steps& crash, bool& committed) {
  committed = false;
  if (!staged.in_place) {
    std::error_code ec;
    KVCAL_RETURN_IF_ERROR(SyncDirectory(staged.staging.string()));
    if (fs::exists(staged.out_dir, ec)) {
      fs::remove(staged.out_dir, ec);  // empty, checked
    }
    KVCAL_RETURN_IF_ERROR(RenamePath(staged.staging, staged.out_dir));
    committed = true;
    const fs::path parent = staged.out_dir.parent_path();
    return SyncDirectory(parent.empty() ? std::string(".") : parent.string());
  }
  PatchJournal journal;
  for (const FilePlan& f : plan.files) {
    // The new shard first: nothing references it yet.
    if (f.name == kScalesShardName) journal.renames.push_back(f.name);
  }
  for (const FilePlan& f : plan.files) {
    if (f.name != kScalesShardName) journal.renames.push_back(f.name);
  }
  if (c.sharded) journal.renames.push_back(kIndexName);
  journal.renames.push_back(kConfigName);
  const fs::path& staging = staged.staging;
  KVCAL_RETURN_IF_ERROR(SyncDirectory(staging.string()));
  // Temporary file, fsync, rename, fsync of the directory: the journal is
  // there whole or not at all.
  KVCAL_RETURN_IF_ERROR(
      WriteOutputFile((staging / kJournalName).string(), journal.Serialize()));
  committed = true;
  crash.Step();  // committed: from here on, recovery rolls forward
  for (const std::string& name : journal.renames) {
    KVCAL_RETURN_IF_ERROR(RenamePath(staging / name, c.dir / name));
    crash.Step();
  }
  KVCAL_RETURN_IF_ERROR(SyncDirectory(c.dir.string()));
  // The journal last: until it is gone, a rerun completes the renames.
  KVCAL_RETURN_IF_ERROR(ClearStaging(staging));
  return SyncDirectory(c.dir.string());
}

// Completes or discards what an interrupted patch left in the staging
// directory; the caller holds the exclusive lock. `rerun`: the command that
// retries, for the message when completing fails.
absl::StatusOr<std::string> RecoverLocked(const fs::path& dir,
                                          const std::string& rerun) {
  const fs::path staging = dir / kPatchStagingDir;
  KVCAL_ASSIGN_OR_RETURN(std::vector<fs::path> left, StagedEntries(staging));
  if (left.empty()) return std::string();
  const fs::path journal = staging / kJournalName;
  std::error_code ec;
  std::string what;
  if (fs::exists(journal, ec)) {
    KVCAL_ASSIGN_OR_RETURN(PatchJournal committed,
                           PatchJournal::Parse(journal));
    auto failed = [&](const absl::Status& status) {
      return absl::Status(
          status.code(),
          absl::StrCat("cannot complete the interrupted patch of ",
                       dir.string(), " that its journal ", journal.string(),
                       " records: ", status.message(),
                       "; fix the cause, then run `", rerun,
                       "` again: it completes the renames the journal lists"));
    };
    for (const std::string& name : committed.renames) {
      const fs::path from = staging / name;
      if (fs::exists(from, ec)) {
        if (absl::Status s = RenamePath(from, dir / name); !s.ok()) {
          return failed(s);
        }
      }
    }
    if (absl::Status s = SyncDirectory(dir.string()); !s.ok()) {
      return failed(s);
    }
    what = "completed an interrupted patch (its journal was committed)";
  } else {
    what = "discarded an interrupted patch that had not committed";
  }
  KVCAL_RETURN_IF_ERROR(ClearStaging(staging));
  KVCAL_RETURN_IF_ERROR(SyncDirectory(dir.string()));
  return what;
}

// A patch that failed: before the commit point, what was staged goes and
// the checkpoint is unchanged; after it, the journal stays and the message
// says how to complete the renames.
absl::Status PatchFailed(const absl::Status& status, bool committed,
                         const Staged& staged, const fs::path& dir,
                         const std::string& rerun) {
  std::error_code ec;
  if (!committed) {
    // Nothing changed: what was staged goes (a partial file included).
    if (staged.in_place) {
      (void)ClearStaging(staged.staging);
    } else {
      fs::remove_all(staged.staging, ec);
    }
    return absl::Status(
        status.code(),
        absl::StrCat(status.message(), "; ",
                     staged.in_place ? dir.string() : staged.out_dir.string(),
                     staged.in_place ? " is unchanged" : " was not created",
                     " and the staged files were removed"));
  }
  if (staged.in_place) {
    return absl::Status(
        status.code(),
        absl::StrCat(
            "the patch of ", dir.string(),
            " committed but did not complete: ", status.message(),
            "; its journal ", (staged.staging / kJournalName).string(),
            " lists the renames left (the checkpoint loads meanwhile, each "
            "file old or new). Fix the cause, then run `",
            rerun, "`: it completes them first"));
  }
  return status;
}

}  // namespace

absl::StatusOr<PatchKvCache> ParsePatchKvCache(absl::string_view name) {
  if (name == "fp8") return PatchKvCache::kFp8;
  if (name == "nvfp4") return PatchKvCache::kNvfp4;
  if (name == "nvfp4_4over6") {
    // utils/torch_utils.py MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP: a checkpoint
    // declares fp8 or nvfp4; 4over6 is a store variant chosen at start.
    return absl::InvalidArgumentError(
        "a checkpoint cannot declare nvfp4_4over6 (vLLM 0.34 maps a ModelOpt "
        "KV-cache algorithm to fp8 or nvfp4 only): patch with "
        "--kv-cache-dtype nvfp4 and start vLLM with --kv-cache-dtype "
        "nvfp4_4over6, which uses the same scales");
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown KV cache dtype '", name, "' (fp8 or nvfp4)"));
}

absl::string_view PatchKvCacheName(PatchKvCache kv_cache) {
  return kv_cache == PatchKvCache::kNvfp4 ? "nvfp4" : "fp8";
}

absl::Status CheckShardFileName(absl::string_view name) {
  if (name.empty() || name == "." || name == ".." ||
      name.find_first_of(absl::string_view("/\0", 2)) != name.npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard file name '", name,
                     "' is not a plain file name in the checkpoint directory"));
  }
  if (name == kJournalName || name == kCheckpointLockName ||
      absl::EndsWith(name, kOutputTempSuffix)) {
    // Staged beside the journal and the lock, it would replace them.
    return absl::InvalidArgumentError(absl::StrCat(
        "shard file name '", name, "' is one kvcal reserves for its patches"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> RecoverInterruptedPatch(
    const std::string& checkpoint_dir) {
  std::error_code ec;
  if (!fs::exists(fs::path(checkpoint_dir) / kPatchStagingDir, ec)) {
    return std::string();
  }
  KVCAL_ASSIGN_OR_RETURN(CheckpointLock lock,
                         CheckpointLock::Acquire(checkpoint_dir, {}));
  return RecoverLocked(checkpoint_dir, absl::StrCat("kvcal patch --checkpoint ",
                                                    ShellQuote(checkpoint_dir),
                                                    " --scales SCALES"));
}

absl::StatusOr<CheckpointLock> LockCheckpointForPatch(
    const PatchOptions& options) {
  CheckpointLockOptions lock_options{.timeout = options.lock_timeout,
                                     .shared = !options.out_dir.empty(),
                                     .on_wait = options.on_lock_wait};
  if (lock_options.shared) {
    // Only an exclusive holder may complete or discard an interrupted patch
    // of the source.
    KVCAL_ASSIGN_OR_RETURN(
        std::vector<fs::path> left,
        StagedEntries(fs::path(options.checkpoint_dir) / kPatchStagingDir));
    if (!left.empty()) lock_options.shared = false;
  }
  return CheckpointLock::Acquire(options.checkpoint_dir, lock_options);
}

absl::StatusOr<PatchReport> PatchCheckpoint(const PatchOptions& options) {
  Steps crash(options.on_step);
  PatchReport report;
  const fs::path dir(options.checkpoint_dir);
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return absl::NotFoundError(
        fs::exists(dir, ec)
            ? absl::StrCat("checkpoint ", dir.string(), " is not a directory")
            : absl::StrCat("checkpoint directory ", dir.string(),
                           " not found"));
  }
  // From before the first read of config.json to the last rename.
  std::optional<CheckpointLock> own_lock;
  const CheckpointLock* lock = options.lock;
  if (lock == nullptr) {
    KVCAL_ASSIGN_OR_RETURN(own_lock, LockCheckpointForPatch(options));
    lock = &*own_lock;
  } else if (lock->checkpoint_dir() != options.checkpoint_dir ||
             (options.out_dir.empty() && !lock->exclusive())) {
    return absl::InternalError(absl::StrCat(
        "PatchOptions::lock is not an exclusive lock on ", dir.string()));
  }
  const std::string rerun = CompletionCommand(options);
  if (!lock->stale_holder().empty()) {
    report.recovered = absl::StrCat("took over a stale lock (its holder, ",
                                    lock->stale_holder(), ", is gone)");
  }
  if (lock->exclusive()) {
    KVCAL_ASSIGN_OR_RETURN(std::string recovered, RecoverLocked(dir, rerun));
    if (!recovered.empty()) {
      report.recovered = report.recovered.empty()
                             ? recovered
                             : absl::StrCat(report.recovered, "; ", recovered);
    }
  }
  KVCAL_ASSIGN_OR_RETURN(CalibratedScales scales,
                         ReadScalesFile(options.scales_path));
  KVCAL_ASSIGN_OR_RETURN(Checkpoint checkpoint, Discover(dir));
  report.sharded = checkpoint.sharded;
  KVCAL_ASSIGN_OR_RETURN(PatchPlan plan,
                         Plan(checkpoint, scales, options, report));
  PatchProgress progress(options.on_progress, plan.bytes_to_write,
                         plan.bytes_to_verify);
  KVCAL_ASSIGN_OR_RETURN(Staged staged,
                         Stage(checkpoint, options, crash, report));
  bool committed = false;
  absl::Status status =
      StageFiles(checkpoint, plan, staged, crash, progress, report);
  if (status.ok()) {
    status = Verify(checkpoint, plan, staged, progress, report);
  }
  if (status.ok()) {
    crash.Step();
    status = Commit(checkpoint, plan, staged, crash, committed);
  }
  if (!status.ok()) {
    return PatchFailed(status, committed, staged, dir, rerun);
  }
  crash.Step();
  return report;
}

}  // namespace kvcal
