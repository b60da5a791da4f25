// `kvcal create`, `push`, `status` and `finalize`: a session on the
// workers.
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "client/cli/kvcal_cli.h"
#include "client/rpc/calibration_client.h"
#include "client/rpc/calibration_job.h"
#include "util/cli.h"
#include "util/status_macros.h"

namespace kvcal {
namespace {

using Json = nlohmann::ordered_json;

// Chunks in flight per worker; with --shm also the shared-memory ring's
// slots.
const cli::IntRange kWindowRange{1, 1024, ""};

}  // namespace

Json PushJson(const PushSummary& p) {
  const double seconds = absl::ToDoubleSeconds(p.elapsed);
  return {{"files", p.files},
          {"tensors", p.tensors},
          {"chunks", p.upload.chunks},
          {"holdout_batches", p.holdout_batches},
          {"chunks_skipped", p.upload.chunks_skipped},
          {"chunks_sent", p.upload.chunks_sent},
          {"chunks_applied", p.upload.chunks_applied},
          {"chunks_duplicate", p.upload.chunks_duplicate},
          {"bytes", p.upload.bytes},
          {"local_statistics_messages", p.upload.partials},
          {"local_statistics_bytes", p.upload.partial_bytes},
          {"reconnects", p.upload.reconnects},
          {"shared_memory", p.upload.shared_memory},
          {"seconds", seconds},
          {"mib_per_second", seconds > 0 ? static_cast<double>(p.upload.bytes) /
                                               seconds / (1 << 20)
                                         : 0.0},
          {"nonfinite_values", p.after ? p.after->nonfinite_values() : 0},
          {"nonfinite_heads",
           p.after ? NonFiniteHeadsJson(p.after->nonfinite_heads())
                   : Json::array()}};
}

std::string PushText(const PushSummary& p) {
  const Json j = PushJson(p);
  return absl::StrFormat(
             "pushed %u chunks (%.1f MiB) from %u files in %.2fs (%.1f MiB/s); "
             "%u applied, %u duplicates, %u skipped, %u reconnects%s\n",
             p.upload.chunks, p.upload.bytes / 1048576.0, p.files,
             j["seconds"].get<double>(), j["mib_per_second"].get<double>(),
             p.upload.chunks_applied, p.upload.chunks_duplicate,
             p.upload.chunks_skipped, p.upload.reconnects,
             p.upload.shared_memory ? "; by shared memory" : "") +
         (p.upload.partials > 0
              ? absl::StrFormat(
                    "  of them %u local-statistics messages (%.1f MiB) "
                    "instead of the activations' chunks\n",
                    p.upload.partials, p.upload.partial_bytes / 1048576.0)
              : "") +
         NonFiniteText(p);
}

absl::StatusOr<CommandResult> RunCreate(const Args& a) {
  KVCAL_ASSIGN_OR_RETURN(CalibrationClient client, Connect(a.connection));
  KVCAL_ASSIGN_OR_RETURN(
      v1::Session s,
      CreateSessionFromConfig(client, a.config, a.session, a.histograms,
                              a.holdout_budget_bytes, a.reject_non_finite));
  if (!a.json) {
    std::cout << absl::StrFormat(
        "session %s: %u layers, %u query heads, %u KV heads, head_dim %u, "
        "%u bins/octave, on %u worker(s)%s\n",
        s.session_id(), s.num_layers(), s.num_attention_heads(),
        s.num_key_value_heads(), s.head_dim(), s.histogram_bins_per_octave(),
        client.worker_count(),
        s.reject_non_finite() ? "; chunks with NaN or Inf are refused" : "");
  }
  return CommandResult{SessionJson(s)};
}

absl::StatusOr<CommandResult> RunPush(const Args& a) {
  KVCAL_ASSIGN_OR_RETURN(CalibrationClient client, Connect(a.connection));
  KVCAL_ASSIGN_OR_RETURN(
      PushSummary p,
      PushDump(client, a.session, a.dump_dir, MakeUploaderOptions(a),
               /*progress=*/true, a.holdout_batches));
  if (!a.json) std::cout << PushText(p);
  return CommandResult{PushJson(p)};
}

absl::StatusOr<CommandResult> RunStatus(const Args& a) {
  KVCAL_ASSIGN_OR_RETURN(CalibrationClient client, Connect(a.connection));
  std::vector<v1::Session> sessions;
  if (a.session.empty()) {
    KVCAL_ASSIGN_OR_RETURN(sessions, client.ListSessions());
  } else {
    KVCAL_ASSIGN_OR_RETURN(v1::Session s, client.GetSession(a.session));
    sessions.push_back(std::move(s));
  }
  Json list = Json::array();
  for (const v1::Session& s : sessions) {
    list.push_back(SessionJson(s));
    if (a.json) continue;
    std::cout << absl::StrFormat(
        "%s: %u layers x %u/%u heads x %u, %u chunks, %u values (%.1f MiB), "
        "%u non-finite, backend %s\n",
        s.session_id(), s.num_layers(), s.num_attention_heads(),
        s.num_key_value_heads(), s.head_dim(), s.chunks_applied(),
        s.values_ingested(), s.bytes_ingested() / 1048576.0,
        s.nonfinite_values(), s.backend());
    for (const v1::ProducerWatermark& p : s.producers()) {
      std::cout << "  producer " << p.producer_id() << ": watermark "
                << p.sequence() << "\n";
    }
  }
  if (!a.json && sessions.empty()) std::cout << "no sessions\n";
  return CommandResult{a.session.empty() ? Json{{"sessions", list}} : list[0]};
}

absl::StatusOr<CommandResult> RunFinalize(const Args& a) {
  KVCAL_ASSIGN_OR_RETURN(CalibrationClient client, Connect(a.connection));
  KVCAL_ASSIGN_OR_RETURN(v1::FinalizeRequest request,
                         MakeFinalizeRequest(a.finalize, a.session));
  KVCAL_ASSIGN_OR_RETURN(FinalizeSummary f,
                         FinalizeToFile(client, request, a.output));
  if (!a.json) {
    std::cout << FinalizeTable(f.response) << EvaluationTable(f.response)
              << "wrote " << a.output << " (" << f.scales.observer << ", per "
              << a.finalize.granularity << ", " << f.scales.metadata["format"]
              << ")\n";
  }
  Json result{
      {"output", a.output},
      {"observer", f.scales.observer},
      {"granularity", a.finalize.granularity},
      {"layers", FinalizeJson(f.response)},
      {"nonfinite_heads", NonFiniteHeadsJson(f.response.nonfinite_heads())},
      {"nonfinite_heads_total", f.response.nonfinite_heads_total()}};
  if (f.response.has_evaluation()) {
    result["evaluation"] = EvaluationJson(f.response.evaluation());
    Json candidates = Json::array();
    for (const v1::Evaluation& c : f.response.candidates()) {
      candidates.push_back(EvaluationJson(c));
    }
    if (!candidates.empty()) result["candidates"] = std::move(candidates);
  }
  return CommandResult{std::move(result)};
}

namespace {

// A subcommand about one session (or, where --session may be left out, all
// of them): the connection flags and --session, described by `session_help`.
CLI::App* AddSessionCommand(CLI::App& app, Args& a, const std::string& name,
                            const std::string& description,
                            const std::string& session_help, bool required) {
  CLI::App* sub = app.add_subcommand(name, description);
  AddConnection(sub, a.connection, &a.notices);
  CLI::Option* session = sub->add_option("--session", a.session, session_help);
  if (required) session->required();
  return sub;
}

}  // namespace

CLI::App* AddCreateCommand(CLI::App& app, Args& a) {
  CLI::App* sub = AddSessionCommand(
      app, a, "create",
      "create a session with the geometry of a Hugging Face config.json",
      "session id (default: the worker picks)", /*required=*/false);
  sub->add_option("--config", a.config, "MODEL_DIR/config.json")->required();
  sub->add_option("--histograms", a.histograms,
                  "histogram bins per octave (power of two 1..128; 0 = none)")
      ->check(HistogramBins())
      ->capture_default_str();
  sub->add_option("--holdout-budget-bytes", a.holdout_budget_bytes,
                  "bytes of held-out batches the worker keeps for "
                  "finalize --evaluate (0 = its default, 64 MiB)")
      ->check(
          cli::InRange(cli::IntRange{0, std::numeric_limits<uint64_t>::max(),
                                     "0 = the worker's default"}));
  sub->add_flag("--reject-non-finite", a.reject_non_finite,
                "the workers refuse any chunk holding NaN or Inf "
                "(INVALID_ARGUMENT naming the tensor; nothing of it is "
                "applied) instead of counting such values and leaving them "
                "out of the statistics (the default)");
  AddJsonFlag(sub, a);
  return sub;
}

CLI::App* AddPushCommand(CLI::App& app, Args& a) {
  CLI::App* sub = AddSessionCommand(
      app, a, "push", "stream an activation dump directory into a session",
      "session id", /*required=*/true);
  sub->add_option("--producer", a.producer,
                  "producer name (one per data-parallel rank)")
      ->capture_default_str();
  sub->add_option("--chunk-bytes", a.chunk_bytes,
                  "split tensors into chunks of at most this many bytes")
      ->check(ChunkBytes())
      ->capture_default_str();
  sub->add_option("--window", a.window, "chunks in flight per worker")
      ->check(cli::InRange(kWindowRange))
      ->capture_default_str();
  sub->add_flag("--resume", a.resume,
                "continue an interrupted push of the same dump: skip what the "
                "worker already applied");
  sub->add_flag("--shm", a.shm,
                "same-host shared memory: send chunks as references into a "
                "shared-memory ring the worker maps (in-band when the worker "
                "is on another host; docs/shared_memory.md)");
  AddLocalStatisticsFlags(sub, a);
  sub->add_option("--holdout-batches", a.holdout_batches,
                  "send the last N batches of the dump as held out: the "
                  "worker keeps them for `finalize --evaluate` and "
                  "`--observer auto` instead of calibrating on them")
      ->check(cli::InRange(
          cli::IntRange{0, std::numeric_limits<uint64_t>::max(), ""}))
      ->capture_default_str();
  sub->add_option("DUMP_DIR", a.dump_dir, "directory of *.safetensors dumps")
      ->required();
  AddJsonFlag(sub, a);
  return sub;
}

CLI::App* AddStatusCommand(CLI::App& app, Args& a) {
  CLI::App* sub =
      AddSessionCommand(app, a, "status", "show sessions and their counters",
                        "one session (default: all)", /*required=*/false);
  AddJsonFlag(sub, a);
  return sub;
}

CLI::App* AddFinalizeCommand(CLI::App& app, Args& a) {
  CLI::App* sub = AddSessionCommand(
      app, a, "finalize", "compute scales and write them to a scales file",
      "session id", /*required=*/true);
  AddFinalize(sub, a.finalize);
  sub->add_option("-o,--output", a.output, "scales.safetensors to write")
      ->required();
  AddJsonFlag(sub, a);
  return sub;
}

}  // namespace kvcal
