// `kvcal calibrate`: create, push, finalize, patch and inspect in one go,
// holding the checkpoint's lock from the first read of config.json to the
// patch's last rename.
#include <iostream>
#include <string>

#include "absl/time/time.h"
#include "client/checkpoint/checkpoint_lock.h"
#include "client/cli/kvcal_cli.h"
#include "client/rpc/calibration_job.h"
#include "util/file_io.h"
#include "util/status_macros.h"

namespace kvcal {
namespace {

using Json = nlohmann::ordered_json;

}  // namespace

absl::StatusOr<CommandResult> RunCalibrate(Args a) {
  if (a.resume && a.session.empty()) {
    return absl::InvalidArgumentError(
        "--resume needs --session: the id of the run to continue");
  }
  KVCAL_ASSIGN_OR_RETURN(PatchTarget target, ParsePatchTarget(a.target));
  if (!a.output.empty()) KVCAL_RETURN_IF_ERROR(CheckOutputPath(a.output));
  // One writer per checkpoint, from the first read of config.json to the
  // patch's last rename.
  PatchOptions patch = MakePatchOptions(a, target, "");
  KVCAL_ASSIGN_OR_RETURN(CheckpointLock lock, LockCheckpointForPatch(patch));
  patch.lock = &lock;
  KVCAL_ASSIGN_OR_RETURN(CalibrationClient client, Connect(a.connection));
  if (a.config.empty()) a.config = a.checkpoint + "/config.json";
  KVCAL_ASSIGN_OR_RETURN(
      v1::Session s,
      CreateSessionFromConfig(client, a.config, a.session, a.histograms,
                              /*holdout_budget_bytes=*/0, a.reject_non_finite));
  if (!a.json) std::cout << "session " << s.session_id() << "\n";
  KVCAL_ASSIGN_OR_RETURN(PushSummary p,
                         PushDump(client, s.session_id(), a.dump_dir,
                                  MakeUploaderOptions(a), /*progress=*/true));
  if (!a.json) std::cout << PushText(p);
  KVCAL_ASSIGN_OR_RETURN(v1::FinalizeRequest request,
                         MakeFinalizeRequest(a.finalize, s.session_id()));
  if (a.output.empty())
    a.output = "kvcal-scales-" + s.session_id() + ".safetensors";
  KVCAL_ASSIGN_OR_RETURN(FinalizeSummary f,
                         FinalizeToFile(client, request, a.output));
  if (!a.json)
    std::cout << FinalizeTable(f.response) << "wrote " << a.output << "\n";
  patch.scales_path = a.output;
  KVCAL_ASSIGN_OR_RETURN(PatchReport report, PatchWithProgress(patch));
  if (!a.json) std::cout << PatchText(report);
  // A Quark model needs --kv-cache-dtype fp8 (the patch says so); predict
  // that run.
  VllmLoadOptions vllm;
  if (target == PatchTarget::kQuark) vllm.kv_cache_dtype = "fp8";
  KVCAL_ASSIGN_OR_RETURN(InspectReport inspect,
                         InspectWithProgress(report.output_dir, vllm));
  if (!a.json) PrintInspect(inspect, "calibrate");
  return CommandResult{Json{{"session", SessionJson(s)},
                            {"push", PushJson(p)},
                            {"scales", a.output},
                            {"layers", FinalizeJson(f.response)},
                            {"patch", PatchJson(report)},
                            {"inspect", inspect.ToJson()}},
                       inspect.ok() ? 0 : 1};
}

CLI::App* AddCalibrateCommand(CLI::App& app, Args& a) {
  CLI::App* sub = app.add_subcommand(
      "calibrate", "create, push, finalize and patch in one go");
  AddConnection(sub, a.connection, &a.notices);
  sub->add_option("--checkpoint", a.checkpoint, "MODEL_DIR to patch")
      ->required();
  sub->add_option("--config", a.config,
                  "config.json (default: MODEL_DIR/config.json)");
  sub->add_option("--session", a.session,
                  "session id (default: the worker picks)");
  sub->add_option("--histograms", a.histograms,
                  "bins per octave (power of two 1..128; 0 = none)")
      ->check(HistogramBins())
      ->capture_default_str();
  sub->add_option("--producer", a.producer, "producer name")
      ->capture_default_str();
  sub->add_option("--chunk-bytes", a.chunk_bytes, "chunk size limit")
      ->check(ChunkBytes())
      ->capture_default_str();
  sub->add_flag("--shm", a.shm,
                "same-host shared memory for the push (see push --shm)");
  AddLocalStatisticsFlags(sub, a);
  sub->add_flag("--resume", a.resume,
                "continue an interrupted run of the same --session and dump: "
                "the session is reused and the push skips what the workers "
                "already applied (see push --resume)");
  sub->add_flag("--reject-non-finite", a.reject_non_finite,
                "refuse chunks holding NaN or Inf (see create)");
  AddFinalize(sub, a.finalize);
  sub->add_option("-o,--output", a.output,
                  "scales file (default: ./kvcal-scales-SESSION.safetensors)");
  sub->add_option("--out", a.out_dir, "write a patched copy here");
  sub->add_option("--target", a.target, "compressed-tensors|modelopt|quark")
      ->check(Named(ParsePatchTarget, kPatchTargets))
      ->capture_default_str();
  AddLockTimeout(sub, a);
  sub->add_option("DUMP_DIR", a.dump_dir, "directory of *.safetensors dumps")
      ->required();
  AddJsonFlag(sub, a);
  return sub;
}

}  // namespace kvcal
