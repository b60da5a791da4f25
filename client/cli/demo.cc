// `kvcal demo`: a whole calibration on a generated model, in seconds.
#include <stdlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/checkpoint/checkpoint_inspect.h"
#include "client/checkpoint/checkpoint_patcher.h"
#include "client/checkpoint/demo_model.h"
#include "client/cli/kvcal_cli.h"
#include "client/rpc/calibration_client.h"
#include "client/rpc/calibration_job.h"
#include "client/rpc/local_worker.h"
#include "proto/names.h"
#include "util/status_macros.h"

namespace kvcal {
namespace {

using Json = nlohmann::ordered_json;

// Median over all scales (every layer, role and head) of mse / minmax.
double MedianRatio(const v1::FinalizeResponse& a,
                   const v1::FinalizeResponse& b) {
  std::vector<double> ratios;
  for (int i = 0; i < a.layers_size() && i < b.layers_size(); ++i) {
    const v1::LayerScales& la = a.layers(i);
    const v1::LayerScales& lb = b.layers(i);
    for (const auto* pair : {&la.q(), &la.k(), &la.v()}) {
      const v1::RoleScales& other = pair == &la.q()   ? lb.q()
                                    : pair == &la.k() ? lb.k()
                                                      : lb.v();
      for (int h = 0; h < pair->scale_size() && h < other.scale_size(); ++h) {
        ratios.push_back(other.scale(h) / pair->scale(h));
      }
    }
  }
  if (ratios.empty()) return 0;
  std::nth_element(ratios.begin(), ratios.begin() + ratios.size() / 2,
                   ratios.end());
  return ratios[ratios.size() / 2];
}

// `requested`, or a new /tmp directory; never one that already holds a
// demo's model/ or dumps/.
absl::StatusOr<std::string> DemoDirectory(std::string requested) {
  if (requested.empty()) {
    char tmpl[] = "/tmp/kvcal-demo-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) {
      return absl::InternalError(
          absl::StrCat("mkdtemp: ", std::strerror(errno)));
    }
    return std::string(tmpl);
  }
  std::error_code ec;
  if (std::filesystem::exists(requested + "/model", ec) ||
      std::filesystem::exists(requested + "/dumps", ec)) {
    return absl::AlreadyExistsError(absl::StrCat(
        requested, " already holds model/ or dumps/; pick an empty --dir"));
  }
  return requested;
}

// Step 4: per-tensor scales (what docs/quality.md and `kvcal report`
// recommend; every vLLM attention backend loads them) under static min-max
// and MSE, each written to DIR/scales-OBSERVER.safetensors (and shown on
// `out` when not null). Sets `ratio` to the median MSE / static-minmax
// scale; returns the JSON of both.
absl::StatusOr<Json> FinalizeBothObservers(CalibrationClient& client,
                                           const std::string& session_id,
                                           const std::string& dir,
                                           std::ostream* out, double& ratio) {
  Json observers = Json::array();
  std::vector<v1::FinalizeResponse> responses;
  for (v1::Observer observer : {v1::OBSERVER_STATIC_MINMAX, v1::OBSERVER_MSE}) {
    v1::FinalizeRequest request;
    request.set_session_id(session_id);
    request.set_granularity(v1::GRANULARITY_PER_TENSOR);
    request.set_observer(observer);
    const std::string name = CanonicalName(observer);
    const std::string path =
        absl::StrCat(dir, "/scales-", name, ".safetensors");
    KVCAL_ASSIGN_OR_RETURN(FinalizeSummary f,
                           FinalizeToFile(client, request, path));
    if (out != nullptr) {
      *out << "[4/6] per-tensor scales, observer " << name << " -> " << path
           << "\n"
           << FinalizeTable(f.response);
    }
    observers.push_back({{"observer", name},
                         {"scales", path},
                         {"layers", FinalizeJson(f.response)}});
    responses.push_back(std::move(f.response));
  }
  ratio = MedianRatio(responses[0], responses[1]);
  return observers;
}

// Step 1: a small Llama-style checkpoint in DIR/model and its activation
// dumps in DIR/dumps.
absl::Status WriteDemoInputs(const std::string& model_dir,
                             const std::string& dump_dir, std::ostream* out) {
  DemoModelOptions model;
  model.geometry = {.num_layers = 4,
                    .num_attention_heads = 8,
                    .num_key_value_heads = 2,
                    .head_dim = 64};
  model.intermediate_size = 1024;
  model.vocab_size = 1024;
  DemoDumpOptions dumps{.batches = 4, .tokens = 256};
  KVCAL_RETURN_IF_ERROR(WriteDemoCheckpoint(model_dir, model));
  KVCAL_RETURN_IF_ERROR(WriteDemoDumps(dump_dir, model, dumps));
  if (out != nullptr) {
    *out << absl::StrFormat(
        "[1/6] wrote a Llama-style checkpoint (%u layers, %u query heads, %u "
        "KV heads, head_dim %u; two shards + index) to %s\n"
        "      and %u batches x %u tokens of Q/K/V activations (Student-t "
        "tails, outlier heads, outlier K channels) to %s\n",
        model.geometry.num_layers, model.geometry.num_attention_heads,
        model.geometry.num_key_value_heads, model.geometry.head_dim, model_dir,
        dumps.batches, dumps.tokens, dump_dir);
  }
  return absl::OkStatus();
}

// Step 2: a local worker (`binary`, or the one next to kvcal).
absl::StatusOr<std::unique_ptr<LocalWorker>> StartDemoWorker(
    const DemoArgs& args) {
  LocalWorker::Options options;
  options.binary = args.worker;
  if (options.binary.empty()) {
    KVCAL_ASSIGN_OR_RETURN(options.binary, FindWorkerBinary());
  }
  options.backend = args.backend;
  return LocalWorker::Start(options);
}

// Step 5: patch the checkpoint in place with `scales`, then inspect it.
absl::StatusOr<InspectReport> PatchAndInspect(const std::string& model_dir,
                                              const std::string& scales,
                                              std::ostream* out) {
  PatchOptions patch;
  patch.checkpoint_dir = model_dir;
  patch.scales_path = scales;
  KVCAL_ASSIGN_OR_RETURN(PatchReport patched, PatchCheckpoint(patch));
  if (out != nullptr) {
    *out << absl::StrFormat(
        "[5/6] patched %s in place: wrote %s; %u original tensors verified "
        "byte for byte\n",
        model_dir, absl::StrJoin(patched.files_written, ", "),
        patched.tensors_verified);
  }
  KVCAL_ASSIGN_OR_RETURN(InspectReport inspect, InspectCheckpoint(model_dir));
  if (out != nullptr) {
    *out << "[6/6] kvcal inspect " << model_dir << "\n" << inspect.ToText();
  }
  return inspect;
}

// The closing lines: the time taken, how the worker stopped, where the
// results are.
void PrintDemoEnd(std::ostream& out, absl::Duration took,
                  const absl::Status& stopped, const std::string& dir,
                  const std::string& model_dir, const std::string& dump_dir) {
  out << absl::StrFormat(
      "done in %.1fs; worker stopped (%s).\n"
      "  checkpoint: %s\n"
      "  scales:     %s/scales-{static_minmax,mse}.safetensors\n"
      "  dumps:      %s\n"
      "  try:        kvcal inspect %s\n",
      absl::ToDoubleSeconds(took),
      stopped.ok() ? "SIGTERM, exit 0" : std::string(stopped.message()),
      model_dir, dir, dump_dir, model_dir);
}

// Step 3: the dumps in small chunks (so that the demo shows splitting).
absl::StatusOr<PushSummary> PushDemoDumps(CalibrationClient& client,
                                          const std::string& session_id,
                                          const std::string& dump_dir,
                                          std::ostream* steps) {
  UploaderOptions upload;
  upload.producer_id = "demo";
  upload.max_chunk_bytes = 64 << 10;
  KVCAL_ASSIGN_OR_RETURN(PushSummary pushed,
                         PushDump(client, session_id, dump_dir, upload,
                                  /*progress=*/steps != nullptr));
  if (steps) {
    *steps << absl::StrFormat(
        "[3/6] pushed %u tensors as %u chunks (%.1f MiB) in %.2fs\n",
        pushed.tensors, pushed.upload.chunks, pushed.upload.bytes / 1048576.0,
        absl::ToDoubleSeconds(pushed.elapsed));
  }
  return pushed;
}

// After step 4: what the two observers' scales say, and when per head is
// worth it.
void PrintGranularityAdvice(std::ostream& out, double ratio) {
  out << absl::StrFormat(
      "      median mse/static-minmax scale ratio: %.3f (MSE clips the heavy "
      "tails)\n"
      "      per tensor loads on every vLLM attention backend; per head "
      "(--granularity head) starts only on FlashAttention 3 (Hopper), so "
      "take it only where `kvcal report` shows it helps your model\n",
      ratio);
}

}  // namespace

absl::StatusOr<CommandResult> RunDemo(const DemoArgs& args) {
  const absl::Time start = absl::Now();
  std::ostream& out = std::cout;
  const bool text = !args.json;
  std::ostream* const steps = text ? &out : nullptr;
  // Each step's line appears as it happens, in order with the progress
  // lines on stderr, even through a pipe.
  if (text) out << std::unitbuf;
  KVCAL_ASSIGN_OR_RETURN(const std::string dir, DemoDirectory(args.dir));
  const std::string model_dir = dir + "/model";
  const std::string dump_dir = dir + "/dumps";

  // 1. A small Llama-style model and its activation dumps.
  KVCAL_RETURN_IF_ERROR(WriteDemoInputs(model_dir, dump_dir, steps));

  // 2. A local worker and a session on it.
  KVCAL_ASSIGN_OR_RETURN(std::unique_ptr<LocalWorker> worker,
                         StartDemoWorker(args));
  // Held in an optional so its channel closes before the worker is stopped:
  // an open connection makes the worker's drain wait out its grace period.
  std::optional<CalibrationClient> client;
  KVCAL_ASSIGN_OR_RETURN(client,
                         CalibrationClient::Connect({worker->address()}, {}));
  KVCAL_ASSIGN_OR_RETURN(
      v1::Session session,
      CreateSessionFromConfig(*client, model_dir + "/config.json", "demo", 64));
  if (text) {
    out << absl::StrFormat(
        "[2/6] started %s on %s (backend %s, log %s); session '%s', 64 "
        "histogram bins per octave\n",
        worker->binary(), worker->address(), session.backend(),
        worker->log_path(), session.session_id());
  }

  // 3. Push.
  KVCAL_ASSIGN_OR_RETURN(
      const PushSummary pushed,
      PushDemoDumps(*client, session.session_id(), dump_dir, steps));

  // 4. Finalize per tensor with two observers.
  double ratio = 0;  // median mse / static-minmax scale
  KVCAL_ASSIGN_OR_RETURN(
      const Json observers,
      FinalizeBothObservers(*client, session.session_id(), dir, steps, ratio));
  if (text) PrintGranularityAdvice(out, ratio);

  // 5. Patch in place with the static min-max scales (the recommended
  // observer), then inspect.
  KVCAL_ASSIGN_OR_RETURN(
      InspectReport inspect,
      PatchAndInspect(model_dir, dir + "/scales-static_minmax.safetensors",
                      steps));

  // 6. Stop the worker.
  client.reset();
  const absl::Status stopped = worker->Stop();
  if (text) {
    PrintDemoEnd(out, absl::Now() - start, stopped, dir, model_dir, dump_dir);
  }
  KVCAL_RETURN_IF_ERROR(stopped);
  if (!inspect.ok()) {
    return absl::InternalError("the patched checkpoint failed inspection");
  }
  return CommandResult{
      Json{{"dir", dir},
           {"checkpoint", model_dir},
           {"dumps", dump_dir},
           {"worker", worker->binary()},
           {"backend", session.backend()},
           {"chunks", pushed.upload.chunks},
           {"bytes", pushed.upload.bytes},
           {"observers", observers},
           {"median_mse_over_minmax", ratio},
           {"inspect", inspect.ToJson()},
           {"seconds", absl::ToDoubleSeconds(absl::Now() - start)}}};
}

CLI::App* AddDemoCommand(CLI::App& app, Args& a) {
  CLI::App* sub = app.add_subcommand(
      "demo", "start a local worker, calibrate a generated model end to end");
  sub->add_option("--dir", a.demo.dir,
                  "where to write (default: a new /tmp dir)");
  sub->add_option("--worker", a.demo.worker,
                  "kvcal-worker binary (default: next to kvcal, then PATH)");
  sub->add_option("--backend", a.demo.backend, "worker backend: auto|cpu|cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  AddJsonFlag(sub, a);
  return sub;
}

}  // namespace kvcal
