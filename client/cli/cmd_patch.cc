// `kvcal patch` and `kvcal inspect`: a checkpoint on disk, and the patch and
// inspection steps `kvcal calibrate` ends with.
#include <iostream>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "client/checkpoint/checkpoint_inspect.h"
#include "client/checkpoint/checkpoint_patcher.h"
#include "client/cli/kvcal_cli.h"
#include "client/rpc/progress.h"
#include "util/status_macros.h"

namespace kvcal {
namespace {

using Json = nlohmann::ordered_json;

absl::StatusOr<VllmLoadOptions> InspectOptions(const Args& a) {
  VllmLoadOptions options;
  KVCAL_ASSIGN_OR_RETURN(options.platform, ParseVllmPlatform(a.platform));
  options.kv_cache_dtype = a.kv_cache_dtype;
  return options;
}

}  // namespace

Json PatchJson(const PatchReport& r) {
  return {{"output_dir", r.output_dir},
          {"sharded", r.sharded},
          {"files_written", r.files_written},
          {"scale_tensors", r.scale_tensors},
          {"replaced_tensors", r.replaced_tensors},
          {"tensors_verified", r.tensors_verified},
          {"bytes_verified", r.bytes_verified},
          {"recovered", r.recovered},
          {"warnings", r.warnings}};
}

std::string PatchText(const PatchReport& r) {
  std::string out;
  if (!r.recovered.empty()) absl::StrAppend(&out, r.recovered, "\n");
  absl::StrAppend(&out, "patched ", r.output_dir, ": ", r.scale_tensors,
                  " scale tensors (", r.replaced_tensors, " replaced); wrote ",
                  absl::StrJoin(r.files_written, ", "), "; verified ",
                  r.tensors_verified, " original tensors (", r.bytes_verified,
                  " bytes) byte for byte\n");
  for (const std::string& w : r.warnings) {
    absl::StrAppend(&out, "warning: ", w, "\n");
  }
  return out;
}

absl::StatusOr<PatchReport> PatchWithProgress(PatchOptions options) {
  if (!options.on_lock_wait) {
    options.on_lock_wait = [&](const std::string& holder) {
      std::cerr << "kvcal: waiting up to "
                << absl::FormatDuration(options.lock_timeout) << " for "
                << options.checkpoint_dir << ", locked by " << holder << "\n";
    };
  }
  auto counters = std::make_shared<ProgressCounters>();
  ProgressReporter progress(
      "patch", {.unit = "", .quiet_for = absl::Seconds(1)}, counters);
  options.on_progress = [&](uint64_t done, uint64_t total) {
    counters->total_bytes = total;
    counters->bytes = done;
  };
  absl::StatusOr<PatchReport> report = PatchCheckpoint(options);
  progress.Finish();
  return report;
}

absl::StatusOr<InspectReport> InspectWithProgress(const std::string& dir,
                                                  const VllmLoadOptions& vllm) {
  auto counters = std::make_shared<ProgressCounters>();
  ProgressReporter progress(
      "inspect", {.unit = "files", .quiet_for = absl::Seconds(1)}, counters);
  absl::StatusOr<InspectReport> report = InspectCheckpoint(
      dir, vllm, [&](uint64_t files, uint64_t total_files, uint64_t bytes) {
        counters->total_items = total_files;
        counters->items = files;
        counters->total_bytes = bytes;  // the total is known at the end only
        counters->bytes = bytes;
      });
  progress.Finish();
  return report;
}

void PrintInspect(const InspectReport& report, absl::string_view command) {
  std::cout << report.FindingsText() << std::flush;
  for (absl::string_view line :
       absl::StrSplit(report.ErrorsText(), '\n', absl::SkipEmpty())) {
    std::cerr << "kvcal " << command << ": " << line << "\n";
  }
}

absl::StatusOr<CommandResult> RunPatch(const Args& a) {
  KVCAL_ASSIGN_OR_RETURN(PatchTarget target, ParsePatchTarget(a.target));
  PatchOptions options = MakePatchOptions(a, target, a.scales);
  // Args::kv_cache_dtype is shared with `kvcal inspect`, whose default is
  // "auto"; patch's default is fp8.
  if (a.kv_cache_dtype != "auto") {
    KVCAL_ASSIGN_OR_RETURN(options.kv_cache,
                           ParsePatchKvCache(a.kv_cache_dtype));
  }
  KVCAL_ASSIGN_OR_RETURN(PatchReport report, PatchWithProgress(options));
  if (!a.json) std::cout << PatchText(report);
  return CommandResult{PatchJson(report)};
}

absl::StatusOr<CommandResult> RunInspect(const Args& a) {
  KVCAL_ASSIGN_OR_RETURN(VllmLoadOptions options, InspectOptions(a));
  KVCAL_ASSIGN_OR_RETURN(InspectReport report,
                         InspectWithProgress(a.checkpoint, options));
  if (!a.json) PrintInspect(report, "inspect");
  return CommandResult{report.ToJson(), report.ok() ? 0 : 1};
}

CLI::App* AddPatchCommand(CLI::App& app, Args& a) {
  CLI::App* sub = app.add_subcommand(
      "patch", "write a scales file into a checkpoint so vLLM loads it");
  sub->add_option("--checkpoint", a.checkpoint, "MODEL_DIR")->required();
  sub->add_option("--scales", a.scales, "scales.safetensors from finalize")
      ->required();
  sub->add_option(
      "--out", a.out_dir,
      "write a patched copy here (default: patch in place, crash-safe)");
  sub->add_option("--target", a.target, "compressed-tensors|modelopt|quark")
      ->check(Named(ParsePatchTarget, kPatchTargets))
      ->capture_default_str();
  sub->add_option("--kv-cache-dtype", a.kv_cache_dtype,
                  "the KV cache the checkpoint declares, which vLLM runs "
                  "with --kv-cache-dtype auto: fp8, or nvfp4 (--target "
                  "modelopt, per-tensor scales)")
      ->check(Named(ParsePatchKvCache, "fp8, nvfp4"))
      ->default_str("fp8");
  AddLockTimeout(sub, a);
  AddJsonFlag(sub, a);
  return sub;
}

CLI::App* AddInspectCommand(CLI::App& app, Args& a) {
  CLI::App* sub = app.add_subcommand(
      "inspect",
      "check a checkpoint's KV-cache scales the way vLLM reads them");
  sub->add_option("MODEL_DIR", a.checkpoint, "checkpoint directory")
      ->required();
  sub->add_option("--kv-cache-dtype", a.kv_cache_dtype,
                  "the --kv-cache-dtype vLLM will run with (auto, fp8, ...)")
      ->capture_default_str();
  sub->add_option("--platform", a.platform,
                  "cuda, or rocm (fp8 e4m3fnuz hardware such as MI300)")
      ->check(Named(ParseVllmPlatform, "cuda, rocm"))
      ->capture_default_str();
  AddJsonFlag(sub, a);
  return sub;
}

}  // namespace kvcal
