// libFuzzer target: everything that parses a session state a peer or a disk
// hands the worker.
//
// The first byte picks the entry point, the rest is its input:
//   0: SessionStatistics::Deserialize (the engine's versioned format). When
//      it parses, Serialize gives back the very same bytes, and the scale
//      math runs on the result without crashing.
//   1: StateStore::Parse (a --state-dir file), then what worker start-up
//      does with it: SnapshotFromProto and Session::FromSnapshot.
//   2: a kvcal.v1.SessionState message as ImportState receives it:
//      SnapshotFromProto, Session::FromSnapshot, and a merge into an existing
//      session of the same geometry.
// A restored session exports the statistics it was restored from, byte for
// byte; a merge into an empty session does too.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "google/protobuf/stubs/logging.h"
#include "kernels/statistics.h"
#include "kvcal/v1/calibration.pb.h"
#include "service/proto_convert.h"
#include "service/session.h"
#include "service/state_store.h"
#include "tests/fuzz/fuzz_util.h"

namespace kvcal {
namespace {

using service::Session;
using service::SessionSnapshot;

void CheckStatistics(absl::string_view bytes, unsigned selector) {
  absl::StatusOr<SessionStatistics> stats =
      SessionStatistics::Deserialize(bytes);
  if (!stats.ok()) {
    FUZZ_CHECK(stats.status().code() == absl::StatusCode::kInvalidArgument);
    return;
  }
  FUZZ_CHECK(stats->geometry().Validate().ok());
  FUZZ_CHECK(stats->Serialize() == bytes);
  fuzz::CheckScales(*stats, selector);
}

// Equal statistics; the double sums compare by value (a merge into an empty
// head turns -0.0 into 0.0 and quiets a signalling NaN).
bool SameStatistics(const std::string& a_bytes, const std::string& b_bytes) {
  absl::StatusOr<SessionStatistics> a = SessionStatistics::Deserialize(a_bytes);
  absl::StatusOr<SessionStatistics> b = SessionStatistics::Deserialize(b_bytes);
  FUZZ_CHECK(a.ok() && b.ok());
  if (!(a->geometry() == b->geometry())) return false;
  auto same = [](double x, double y) {
    return x == y || (std::isnan(x) && std::isnan(y));
  };
  for (size_t i = 0; i < a->num_heads_total(); ++i) {
    HeadStatistics x = a->heads()[i];
    HeadStatistics y = b->heads()[i];
    if (!same(x.sum, y.sum) || !same(x.sum_squares, y.sum_squares)) {
      return false;
    }
    x.sum = y.sum = x.sum_squares = y.sum_squares = 0.0;
    if (!(x == y)) return false;
  }
  return true;
}

service::SessionOptions CpuOptions() {
  service::SessionOptions options;
  options.backend = BackendKind::kCpu;
  options.backend_options.cpu_threads = 1;
  return options;
}

void CheckRestore(const kvcal::v1::SessionState& state, bool merge) {
  absl::StatusOr<SessionSnapshot> snapshot = service::SnapshotFromProto(state);
  if (!snapshot.ok()) {
    FUZZ_CHECK(snapshot.status().code() == absl::StatusCode::kInvalidArgument);
    return;
  }
  FUZZ_CHECK(snapshot->geometry.Validate().ok());
  absl::StatusOr<std::shared_ptr<Session>> session = Session::FromSnapshot(
      "fuzz", "default", *snapshot, CpuOptions(), "import-1");
  if (!session.ok()) {
    FUZZ_CHECK(session.status().code() == absl::StatusCode::kInvalidArgument);
    return;
  }
  absl::StatusOr<SessionSnapshot> exported = (*session)->Export();
  FUZZ_CHECK(exported.ok());
  FUZZ_CHECK(exported->geometry == snapshot->geometry);
  FUZZ_CHECK(SameStatistics(exported->statistics, snapshot->statistics));
  FUZZ_CHECK(exported->counters.chunks_applied ==
             snapshot->counters.chunks_applied);
  FUZZ_CHECK((*session)->Info().ok());
  if (!merge) return;

  // ImportState into an existing session: merges; a retry is a no-op.
  absl::StatusOr<std::shared_ptr<Session>> existing =
      Session::Create("existing", "default", snapshot->geometry, CpuOptions());
  FUZZ_CHECK(existing.ok());
  FUZZ_CHECK((*existing)->Merge(*snapshot, "import-1").ok());
  absl::StatusOr<SessionSnapshot> merged = (*existing)->Export();
  FUZZ_CHECK(merged.ok());
  FUZZ_CHECK(SameStatistics(merged->statistics, snapshot->statistics));
  FUZZ_CHECK((*existing)->Merge(*snapshot, "import-1").ok());
  absl::StatusOr<SessionSnapshot> again = (*existing)->Export();
  FUZZ_CHECK(again.ok());
  FUZZ_CHECK(again->statistics == merged->statistics);
  absl::StatusOr<SessionStatistics> stats =
      SessionStatistics::Deserialize(merged->statistics);
  FUZZ_CHECK(stats.ok());
  fuzz::CheckScales(*stats, static_cast<unsigned>(merged->statistics.size()));
}

void Run(const uint8_t* data, size_t size) {
  if (size == 0) return;
  const uint8_t mode = data[0] % 3;
  const std::string rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (mode) {
    case 0:
      CheckStatistics(rest, size > 1 ? data[1] : 0);
      break;
    case 1: {
      absl::StatusOr<kvcal::v1::SessionState> state =
          service::StateStore::Parse(rest);
      if (!state.ok()) {
        FUZZ_CHECK(state.status().code() == absl::StatusCode::kDataLoss);
        return;
      }
      // What Save writes, Parse reads back.
      absl::StatusOr<kvcal::v1::SessionState> again =
          service::StateStore::Parse(service::StateStore::Encode(*state));
      FUZZ_CHECK(again.ok());
      CheckRestore(*state, /*merge=*/false);
      break;
    }
    case 2: {
      kvcal::v1::SessionState state;
      if (!state.ParseFromString(rest)) return;
      CheckRestore(state, /*merge=*/true);
      break;
    }
  }
}

}  // namespace
}  // namespace kvcal

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  // Invalid UTF-8 in string fields is logged on every parse; keep the
  // fuzzer's output readable.
  google::protobuf::SetLogHandler(
      [](google::protobuf::LogLevel, const char*, int, const std::string&) {});
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvcal::Run(data, size);
  return 0;
}
