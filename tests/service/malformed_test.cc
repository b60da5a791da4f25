// Hostile and broken requests against a real kvcal-worker on loopback: one
// table row per malformed request, across every RPC. Each row asserts the
// exact gRPC status code (and a message substring where one is meaningful),
// and that the session the worker already holds is byte-identical afterwards
// (ExportState before and after, the whole SessionState serialization).
//
// The worker runs with a 1 MiB message limit, a memory budget and two tenants
// (--auth-token-file), so size limits and bad tokens are rows like any other.
#include <grpcpp/grpcpp.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvcal/v1/calibration.grpc.pb.h"
#include "tests/service/rpc_helpers.h"
#include "tests/service/worker_process.h"

namespace kvcal {
namespace {

namespace pb = ::kvcal::v1;
using ::kvcal::testing::WorkerProcess;
using ::testing::HasSubstr;

constexpr uint32_t kLayers = 2;
constexpr uint32_t kQHeads = 4;
constexpr uint32_t kKvHeads = 2;
constexpr uint32_t kHeadDim = 8;
constexpr uint32_t kBins = 16;
constexpr char kSession[] = "target";
constexpr char kProducer[] = "p";
// The target holds chunks 1..3 of producer "p" (layer 0, Q, K and V).
constexpr uint64_t kNextSequence = 4;
constexpr char kAliceToken[] = "alice-token-0123456789";
constexpr char kBobToken[] = "bob-token-9876543210";
constexpr size_t kMaxMessageBytes = size_t{1} << 20;
// Over the limit by a margin (not 2x): gRPC receives the whole message
// before it refuses it, so the rows move no more bytes than they need.
constexpr size_t kOverLimitBytes = kMaxMessageBytes + (64 << 10);

// --- request builders --------------------------------------------------------

pb::CreateSessionRequest Create(const std::string& id) {
  return kvcal::testing::CreateSessionRequest(
      id, {kLayers, kQHeads, kKvHeads, kHeadDim, kBins});
}

// A valid next chunk of producer "p" for the target: 3 tokens of layer 0, K.
pb::IngestRequest Chunk(uint64_t sequence = kNextSequence) {
  pb::IngestRequest r;
  r.set_session_id(kSession);
  r.set_producer_id(kProducer);
  r.set_sequence(sequence);
  r.set_batch(1);
  r.set_layer(0);
  r.set_role(pb::ROLE_K);
  r.set_dtype(pb::DTYPE_F32);
  r.set_layout(pb::LAYOUT_TOKENS_HEADS_DIM);
  const uint64_t tokens = 3;
  r.add_shape(tokens);
  r.add_shape(kKvHeads);
  r.add_shape(kHeadDim);
  std::vector<float> values(tokens * kKvHeads * kHeadDim);
  for (size_t i = 0; i < values.size(); ++i) {
    values[i] = std::sin(0.37f * static_cast<float>(i + sequence)) * 3.0f;
  }
  r.set_data(values.data(), values.size() * sizeof(float));
  return r;
}

pb::FinalizeRequest Finalize() {
  pb::FinalizeRequest r;
  r.set_session_id(kSession);
  r.set_allow_missing(true);
  return r;
}

// --- calls -------------------------------------------------------------------

// Who calls: alice owns the target; bob is another tenant.
enum class Caller { kAlice, kBob, kNoToken, kWrongToken, kBasicScheme };

void Authorize(grpc::ClientContext* context, Caller caller) {
  switch (caller) {
    case Caller::kAlice:
      context->AddMetadata("authorization",
                           std::string("Bearer ") + kAliceToken);
      break;
    case Caller::kBob:
      context->AddMetadata("authorization", std::string("Bearer ") + kBobToken);
      break;
    case Caller::kNoToken:
      break;
    case Caller::kWrongToken:
      context->AddMetadata("authorization", "Bearer not-a-token");
      break;
    case Caller::kBasicScheme:
      context->AddMetadata("authorization",
                           std::string("Basic ") + kAliceToken);
      break;
  }
  // Generous: under ThreadSanitizer on a loaded 2-core CI machine every
  // call is many times slower; a call that needs it is stuck, not slow.
  context->set_deadline(std::chrono::system_clock::now() +
                        std::chrono::seconds(90));
}

// Sends `chunks` on one Ingest stream; returns the stream's final status.
grpc::Status IngestStream(
    pb::Calibration::Stub* stub, const std::vector<pb::IngestRequest>& chunks,
    Caller caller = Caller::kAlice,
    std::vector<pb::IngestResponse>* responses = nullptr) {
  grpc::ClientContext context;
  Authorize(&context, caller);
  auto stream = stub->Ingest(&context);
  std::vector<pb::IngestResponse> received;
  std::thread reader([&] {
    pb::IngestResponse response;
    while (stream->Read(&response)) received.push_back(response);
  });
  for (const pb::IngestRequest& chunk : chunks) {
    if (!stream->Write(chunk)) break;
  }
  stream->WritesDone();
  reader.join();
  if (responses != nullptr) *responses = received;
  return stream->Finish();
}

struct Outcome {
  grpc::Status status;
  // Extra checks of a row beyond the status (empty = none).
  std::string problem;
};

using Call = std::function<Outcome(pb::Calibration::Stub*)>;

template <typename Request, typename Response>
Outcome Unary(grpc::Status (pb::Calibration::Stub::*method)(
                  grpc::ClientContext*, const Request&, Response*),
              pb::Calibration::Stub* stub, const Request& request,
              Caller caller = Caller::kAlice) {
  grpc::ClientContext context;
  Authorize(&context, caller);
  Response response;
  return {(stub->*method)(&context, request, &response), ""};
}

Call CreateCall(pb::CreateSessionRequest r, Caller caller = Caller::kAlice) {
  return [r, caller](pb::Calibration::Stub* stub) {
    return Unary(&pb::Calibration::Stub::CreateSession, stub, r, caller);
  };
}
Call GetCall(const std::string& id, Caller caller = Caller::kAlice) {
  return [id, caller](pb::Calibration::Stub* stub) {
    pb::GetSessionRequest r;
    r.set_session_id(id);
    return Unary(&pb::Calibration::Stub::GetSession, stub, r, caller);
  };
}
Call DeleteCall(const std::string& id, Caller caller = Caller::kAlice) {
  return [id, caller](pb::Calibration::Stub* stub) {
    pb::DeleteSessionRequest r;
    r.set_session_id(id);
    return Unary(&pb::Calibration::Stub::DeleteSession, stub, r, caller);
  };
}
Call ExportCall(const std::string& id, Caller caller = Caller::kAlice) {
  return [id, caller](pb::Calibration::Stub* stub) {
    pb::ExportStateRequest r;
    r.set_session_id(id);
    return Unary(&pb::Calibration::Stub::ExportState, stub, r, caller);
  };
}
Call FinalizeCall(pb::FinalizeRequest r, Caller caller = Caller::kAlice) {
  return [r, caller](pb::Calibration::Stub* stub) {
    return Unary(&pb::Calibration::Stub::Finalize, stub, r, caller);
  };
}
Call IngestCall(pb::IngestRequest r, Caller caller = Caller::kAlice) {
  return [r, caller](pb::Calibration::Stub* stub) {
    return Outcome{IngestStream(stub, {r}, caller), ""};
  };
}

// The target's exported state (the base of every ImportState row).
pb::SessionState ExportTarget(pb::Calibration::Stub* stub) {
  grpc::ClientContext context;
  Authorize(&context, Caller::kAlice);
  pb::ExportStateRequest request;
  request.set_session_id(kSession);
  pb::SessionState state;
  const grpc::Status status = stub->ExportState(&context, request, &state);
  EXPECT_TRUE(status.ok()) << status.error_message();
  return state;
}

// ImportState of the target's own state, altered by `mutate`, into `id`.
// When `id` is not the target, the row also checks that no session `id` was
// left behind.
Call ImportCall(const std::string& id,
                std::function<void(pb::SessionState*)> mutate,
                Caller caller = Caller::kAlice) {
  return [id, mutate, caller](pb::Calibration::Stub* stub) {
    pb::ImportStateRequest r;
    r.set_session_id(id);
    *r.mutable_state() = ExportTarget(stub);
    r.set_import_id("malformed-" + id.substr(0, 16));
    mutate(r.mutable_state());
    Outcome outcome =
        Unary(&pb::Calibration::Stub::ImportState, stub, r, caller);
    if (!outcome.status.ok() && id != kSession && id.size() <= 128 &&
        !id.empty()) {
      const Outcome get = GetCall(id)(stub);
      if (get.status.error_code() != grpc::StatusCode::NOT_FOUND) {
        outcome.problem =
            "a failed ImportState left session '" + id +
            "' behind (GetSession: " + std::to_string(get.status.error_code()) +
            ")";
      }
    }
    return outcome;
  };
}

// --- the table ---------------------------------------------------------------

struct Row {
  std::string name;
  Call call;
  grpc::StatusCode code;
  std::string message;  // expected substring; empty = not checked
};

// GoogleTest prints a failing row by its name, not as raw bytes.
void PrintTo(const Row& row, std::ostream* os) { *os << row.name; }

std::string Repeat(char c, size_t n) { return std::string(n, c); }

std::vector<Row> Rows() {
  using grpc::StatusCode;
  std::vector<Row> rows;
  auto add = [&rows](std::string name, Call call, StatusCode code,
                     std::string message = "") {
    rows.push_back(
        {std::move(name), std::move(call), code, std::move(message)});
  };
  auto create = [](std::function<void(pb::CreateSessionRequest*)> mutate) {
    pb::CreateSessionRequest r = Create("fresh");
    mutate(&r);
    return CreateCall(r);
  };
  auto chunk = [](std::function<void(pb::IngestRequest*)> mutate) {
    pb::IngestRequest r = Chunk();
    mutate(&r);
    return IngestCall(r);
  };
  auto finalize = [](std::function<void(pb::FinalizeRequest*)> mutate) {
    pb::FinalizeRequest r = Finalize();
    mutate(&r);
    return FinalizeCall(r);
  };

  // CreateSession: wrong enums, out-of-range geometry, ids.
  add("CreateRoleUnspecified",
      create([](auto* r) { r->add_roles(pb::ROLE_UNSPECIFIED); }),
      StatusCode::INVALID_ARGUMENT, "ROLE_UNSPECIFIED");
  add("CreateRoleUnknown",
      create([](auto* r) { r->add_roles(static_cast<pb::Role>(7)); }),
      StatusCode::INVALID_ARGUMENT, "roles contains 7");
  add("CreateZeroLayers", create([](auto* r) { r->set_num_layers(0); }),
      StatusCode::INVALID_ARGUMENT, "num_layers");
  add("CreateTooManyLayers", create([](auto* r) { r->set_num_layers(4097); }),
      StatusCode::INVALID_ARGUMENT, "num_layers");
  add("CreateMaxUint32Heads", create([](auto* r) {
        r->set_num_attention_heads(std::numeric_limits<uint32_t>::max());
      }),
      StatusCode::INVALID_ARGUMENT, "num_attention_heads");
  add("CreateZeroHeadDim", create([](auto* r) { r->set_head_dim(0); }),
      StatusCode::INVALID_ARGUMENT, "head_dim");
  add("CreateHeadDim1025", create([](auto* r) { r->set_head_dim(1025); }),
      StatusCode::INVALID_ARGUMENT, "head_dim");
  add("CreateHeadsNotMultiple", create([](auto* r) {
        r->set_num_attention_heads(6);
        r->set_num_key_value_heads(4);
      }),
      StatusCode::INVALID_ARGUMENT, "multiple");
  add("CreateBinsNotPowerOfTwo",
      create([](auto* r) { r->set_histogram_bins_per_octave(3); }),
      StatusCode::INVALID_ARGUMENT, "histogram_bins_per_octave");
  add("CreateBins256",
      create([](auto* r) { r->set_histogram_bins_per_octave(256); }),
      StatusCode::INVALID_ARGUMENT, "histogram_bins_per_octave");
  add("CreateOverMemoryBudget", create([](auto* r) {
        r->set_num_layers(4096);
        r->set_num_attention_heads(1024);
        r->set_num_key_value_heads(1024);
        r->set_head_dim(1024);
        r->set_histogram_bins_per_octave(128);
      }),
      StatusCode::RESOURCE_EXHAUSTED, "budget");
  add("CreateId129Chars",
      create([](auto* r) { r->set_session_id(Repeat('a', 129)); }),
      StatusCode::INVALID_ARGUMENT, "at most 128");
  add("CreateIdWithSlash", create([](auto* r) { r->set_session_id("../etc"); }),
      StatusCode::INVALID_ARGUMENT, "0x2f");
  add("CreateExistingIdOtherGeometry", create([](auto* r) {
        r->set_session_id(kSession);
        r->set_head_dim(16);
      }),
      StatusCode::ALREADY_EXISTS, "different parameters");
  add(
      "CreateId128CharsIsAccepted",
      [](pb::Calibration::Stub* stub) {
        const std::string id = Repeat('b', 128);
        Outcome outcome = CreateCall(Create(id))(stub);
        const Outcome deleted = DeleteCall(id)(stub);
        if (!deleted.status.ok()) outcome.problem = "cannot delete it again";
        return outcome;
      },
      StatusCode::OK);

  // GetSession and ListSessions.
  add("GetEmptyId", GetCall(""), StatusCode::INVALID_ARGUMENT, "empty");
  add("GetUnknownId", GetCall("no-such-session"), StatusCode::NOT_FOUND,
      "not found");
  add("GetId129Chars", GetCall(Repeat('a', 129)), StatusCode::INVALID_ARGUMENT,
      "at most 128");
  add("GetId100KiB", GetCall(Repeat('a', 100 << 10)),
      StatusCode::INVALID_ARGUMENT, "at most 128");
  add("GetIdWithSpace", GetCall("tar get"), StatusCode::INVALID_ARGUMENT,
      "0x20");
  add("GetOtherTenantsSession", GetCall(kSession, Caller::kBob),
      StatusCode::NOT_FOUND, "not found");
  add(
      "ListWithoutToken",
      [](pb::Calibration::Stub* stub) {
        return Unary(&pb::Calibration::Stub::ListSessions, stub,
                     pb::ListSessionsRequest(), Caller::kNoToken);
      },
      StatusCode::UNAUTHENTICATED, "Bearer");
  add(
      "ListAsOtherTenantHidesTarget",
      [](pb::Calibration::Stub* stub) {
        grpc::ClientContext context;
        Authorize(&context, Caller::kBob);
        pb::ListSessionsResponse response;
        Outcome outcome{
            stub->ListSessions(&context, pb::ListSessionsRequest(), &response),
            ""};
        for (const pb::Session& s : response.sessions()) {
          if (s.session_id() == kSession) {
            outcome.problem = "bob's ListSessions shows alice's session";
          }
        }
        return outcome;
      },
      StatusCode::OK);

  // DeleteSession.
  add("DeleteEmptyId", DeleteCall(""), StatusCode::INVALID_ARGUMENT, "empty");
  add("DeleteUnknownId", DeleteCall("no-such-session"), StatusCode::NOT_FOUND,
      "not found");
  add("DeleteId129Chars", DeleteCall(Repeat('z', 129)),
      StatusCode::INVALID_ARGUMENT, "at most 128");
  add("DeleteOtherTenantsSession", DeleteCall(kSession, Caller::kBob),
      StatusCode::NOT_FOUND, "not found");
  add("DeleteWithoutToken", DeleteCall(kSession, Caller::kNoToken),
      StatusCode::UNAUTHENTICATED);

  // Ingest: every chunk below would be the producer's next sequence.
  add("IngestUnknownSession",
      chunk([](auto* r) { r->set_session_id("no-such-session"); }),
      StatusCode::NOT_FOUND, "not found");
  add("IngestEmptySessionId", chunk([](auto* r) { r->set_session_id(""); }),
      StatusCode::INVALID_ARGUMENT, "empty");
  add("IngestRoleUnspecified",
      chunk([](auto* r) { r->set_role(pb::ROLE_UNSPECIFIED); }),
      StatusCode::INVALID_ARGUMENT, "unknown role 0");
  add("IngestRoleUnknown",
      chunk([](auto* r) { r->set_role(static_cast<pb::Role>(9)); }),
      StatusCode::INVALID_ARGUMENT, "unknown role 9");
  add("IngestDTypeUnspecified",
      chunk([](auto* r) { r->set_dtype(pb::DTYPE_UNSPECIFIED); }),
      StatusCode::INVALID_ARGUMENT, "unknown dtype 0");
  add("IngestLayoutUnknown",
      chunk([](auto* r) { r->set_layout(static_cast<pb::Layout>(5)); }),
      StatusCode::INVALID_ARGUMENT, "unknown layout 5");
  add("IngestLayerOutOfRange", chunk([](auto* r) { r->set_layer(kLayers); }),
      StatusCode::INVALID_ARGUMENT, "out of range");
  add("IngestLayerMaxUint32", chunk([](auto* r) {
        r->set_layer(std::numeric_limits<uint32_t>::max());
      }),
      StatusCode::INVALID_ARGUMENT, "out of range");
  add("IngestRank1", chunk([](auto* r) {
        r->clear_shape();
        r->add_shape(48);
      }),
      StatusCode::INVALID_ARGUMENT, "rank");
  add("IngestShapeOverflows", chunk([](auto* r) {
        r->clear_shape();
        for (uint64_t d : {uint64_t{1} << 62, uint64_t{1} << 62,
                           uint64_t{kKvHeads}, uint64_t{kHeadDim}}) {
          r->add_shape(d);
        }
      }),
      StatusCode::INVALID_ARGUMENT, "overflows 64 bits");
  add("IngestHeadDimMismatch", chunk([](auto* r) { r->set_shape(2, 7); }),
      StatusCode::INVALID_ARGUMENT, "head_dim");
  add("IngestZeroHeads", chunk([](auto* r) { r->set_shape(1, 0); }),
      StatusCode::INVALID_ARGUMENT, "zero heads");
  add("IngestHeadsBeyondRole", chunk([](auto* r) { r->set_head_offset(1); }),
      StatusCode::INVALID_ARGUMENT, "exceed");
  add("IngestHeadOffsetMaxUint32", chunk([](auto* r) {
        r->set_head_offset(std::numeric_limits<uint32_t>::max());
      }),
      StatusCode::INVALID_ARGUMENT, "exceed");
  add("IngestDataOneByteShort",
      chunk([](auto* r) { r->mutable_data()->pop_back(); }),
      StatusCode::INVALID_ARGUMENT, "needs 192");
  add("IngestDataEmpty", chunk([](auto* r) { r->clear_data(); }),
      StatusCode::INVALID_ARGUMENT, "data is 0 bytes");
  add("IngestDTypeDisagreesWithData",
      chunk([](auto* r) { r->set_dtype(pb::DTYPE_BF16); }),
      StatusCode::INVALID_ARGUMENT, "bf16 needs 96");
  add("IngestSequenceGap",
      chunk([](auto* r) { r->set_sequence(kNextSequence + 2); }),
      StatusCode::FAILED_PRECONDITION, "expected sequence 4");
  add("IngestInvalidDuplicate", chunk([](auto* r) {
        r->set_sequence(1);
        r->set_role(pb::ROLE_UNSPECIFIED);
      }),
      StatusCode::INVALID_ARGUMENT, "chunk 1 from producer 'p'");
  add(
      "IngestHugeProducerIdSequence0IsADuplicate",
      [](pb::Calibration::Stub* stub) {
        pb::IngestRequest r = Chunk(0);
        r.set_producer_id(Repeat('P', 512 << 10));
        std::vector<pb::IngestResponse> responses;
        Outcome outcome{IngestStream(stub, {r}, Caller::kAlice, &responses),
                        ""};
        if (responses.size() != 1 || responses[0].applied()) {
          outcome.problem = "expected one unapplied acknowledgement";
        }
        return outcome;
      },
      StatusCode::OK);
  add("IngestProducerIdOverMessageLimit",
      chunk([](auto* r) { r->set_producer_id(Repeat('P', kOverLimitBytes)); }),
      StatusCode::RESOURCE_EXHAUSTED);
  add("IngestDataOverMessageLimit", chunk([](auto* r) {
        constexpr uint64_t kRowBytes = uint64_t{kKvHeads} * kHeadDim * 4;
        const uint64_t tokens = kOverLimitBytes / kRowBytes;
        r->clear_shape();
        for (uint64_t d : {tokens, uint64_t{kKvHeads}, uint64_t{kHeadDim}}) {
          r->add_shape(d);
        }
        r->set_data(std::string(tokens * kRowBytes, '\x01'));
      }),
      StatusCode::RESOURCE_EXHAUSTED);
  add(
      "IngestValidThenInvalidAppliesNothingAfter",
      [](pb::Calibration::Stub* stub) {
        // A valid duplicate (acknowledged, not applied) then a broken chunk.
        pb::IngestRequest broken = Chunk();
        broken.set_shape(0, 4);
        std::vector<pb::IngestResponse> responses;
        Outcome outcome{
            IngestStream(stub, {Chunk(2), broken}, Caller::kAlice, &responses),
            ""};
        if (responses.size() != 1 || responses[0].applied()) {
          outcome.problem = "expected one unapplied acknowledgement";
        }
        return outcome;
      },
      StatusCode::INVALID_ARGUMENT, "chunk 4 from producer 'p'");
  add("IngestWrongToken", IngestCall(Chunk(), Caller::kWrongToken),
      StatusCode::UNAUTHENTICATED, "invalid token");
  add("IngestAsOtherTenant", IngestCall(Chunk(), Caller::kBob),
      StatusCode::NOT_FOUND, "not found");

  // Finalize: wrong enums, out-of-range parameters, missing data.
  add("FinalizeObserverUnknown",
      finalize([](auto* r) { r->set_observer(static_cast<pb::Observer>(9)); }),
      StatusCode::INVALID_ARGUMENT, "unknown observer");
  add("FinalizeGranularityUnknown", finalize([](auto* r) {
        r->set_granularity(static_cast<pb::Granularity>(7));
      }),
      StatusCode::INVALID_ARGUMENT, "unknown granularity");
  add("FinalizeFormatUnknown",
      finalize([](auto* r) { r->set_format(static_cast<pb::Format>(99)); }),
      StatusCode::INVALID_ARGUMENT, "unknown format");
  add("FinalizePercentileAbove100",
      finalize([](auto* r) { r->set_percentile(100.5); }),
      StatusCode::INVALID_ARGUMENT, "percentile");
  add("FinalizeAveragingConstantAbove1",
      finalize([](auto* r) { r->set_averaging_constant(1.5f); }),
      StatusCode::INVALID_ARGUMENT, "averaging_constant");
  add("FinalizeMarginNaN", finalize([](auto* r) {
        r->set_margin(std::numeric_limits<float>::quiet_NaN());
      }),
      StatusCode::INVALID_ARGUMENT, "margin");
  add("FinalizeMarginNegative", finalize([](auto* r) { r->set_margin(-1.0f); }),
      StatusCode::INVALID_ARGUMENT, "margin");
  add("FinalizeMseMaxShrink1",
      finalize([](auto* r) { r->set_mse_max_shrink(1.0f); }),
      StatusCode::INVALID_ARGUMENT, "mse_max_shrink");
  add("FinalizeMseNormInfinite", finalize([](auto* r) {
        r->set_mse_norm(std::numeric_limits<float>::infinity());
      }),
      StatusCode::INVALID_ARGUMENT, "mse_norm");
  add("FinalizeLayerOutOfRange",
      finalize([](auto* r) { r->add_layers(kLayers); }),
      StatusCode::INVALID_ARGUMENT, "out of range");
  add("FinalizeMissingHeads",
      finalize([](auto* r) { r->set_allow_missing(false); }),
      StatusCode::FAILED_PRECONDITION, "have no data");
  add("FinalizeUnknownSession",
      finalize([](auto* r) { r->set_session_id("no-such-session"); }),
      StatusCode::NOT_FOUND, "not found");

  // ExportState.
  add("ExportEmptyId", ExportCall(""), StatusCode::INVALID_ARGUMENT, "empty");
  add("ExportUnknownId", ExportCall("no-such-session"), StatusCode::NOT_FOUND,
      "not found");
  add("ExportOtherTenantsSession", ExportCall(kSession, Caller::kBob),
      StatusCode::NOT_FOUND, "not found");

  // ImportState: into the target (merge) and into new ids (create).
  add("ImportHeadDimMismatch",
      ImportCall(kSession, [](auto* s) { s->set_head_dim(16); }),
      StatusCode::INVALID_ARGUMENT, "geometry");
  add("ImportBinsMismatch",
      ImportCall(kSession,
                 [](auto* s) { s->set_histogram_bins_per_octave(8); }),
      StatusCode::INVALID_ARGUMENT, "geometry");
  add("ImportRolesMismatch",
      ImportCall(kSession,
                 [](auto* s) {
                   s->clear_roles();
                   s->add_roles(pb::ROLE_K);
                   s->add_roles(pb::ROLE_V);
                 }),
      StatusCode::INVALID_ARGUMENT, "geometry");
  add("ImportRoleUnknown",
      ImportCall(kSession,
                 [](auto* s) { s->add_roles(static_cast<pb::Role>(5)); }),
      StatusCode::INVALID_ARGUMENT, "roles contains 5");
  add("ImportTruncatedStatistics",
      ImportCall(kSession,
                 [](auto* s) {
                   s->mutable_statistics()->resize(s->statistics().size() / 2);
                 }),
      StatusCode::INVALID_ARGUMENT, "statistics state");
  add("ImportStatisticsShorterThanHeader",
      ImportCall(kSession,
                 [](auto* s) { s->mutable_statistics()->resize(20); }),
      StatusCode::INVALID_ARGUMENT, "truncated");
  add("ImportEmptyStatistics",
      ImportCall(kSession, [](auto* s) { s->clear_statistics(); }),
      StatusCode::INVALID_ARGUMENT, "truncated");
  add("ImportCorruptedStatistics",
      ImportCall(kSession,
                 [](auto* s) {
                   (*s->mutable_statistics())[s->statistics().size() / 2] ^=
                       0x40;
                 }),
      StatusCode::INVALID_ARGUMENT, "checksum");
  add("ImportStatisticsOfAnotherGeometry",
      ImportCall("import-new-1",
                 [](auto* s) { s->set_num_layers(kLayers + 1); }),
      StatusCode::INVALID_ARGUMENT, "does not match");
  add("ImportFormatVersion2",
      ImportCall(kSession, [](auto* s) { s->set_format_version(2); }),
      StatusCode::INVALID_ARGUMENT, "format_version");
  add("ImportProducerWithEmptyId",
      ImportCall(kSession,
                 [](auto* s) { s->add_producers()->set_sequence(99); }),
      StatusCode::INVALID_ARGUMENT, "empty id");
  add("ImportInvalidGeometryIntoNewId",
      ImportCall("import-new-2", [](auto* s) { s->set_head_dim(0); }),
      StatusCode::INVALID_ARGUMENT, "head_dim");
  add("ImportEmptySessionId", ImportCall("", [](auto*) {}),
      StatusCode::INVALID_ARGUMENT, "empty");
  add("ImportId129Chars", ImportCall(Repeat('i', 129), [](auto*) {}),
      StatusCode::INVALID_ARGUMENT, "at most 128");
  add("ImportOverMessageLimit",
      ImportCall(kSession,
                 [](auto* s) {
                   s->mutable_statistics()->append(
                       std::string(kOverLimitBytes, 'x'));
                 }),
      StatusCode::RESOURCE_EXHAUSTED);
  add("ImportBasicScheme",
      ImportCall(
          kSession, [](auto*) {}, Caller::kBasicScheme),
      StatusCode::UNAUTHENTICATED, "Bearer");

  // Tokens on the remaining RPCs.
  add("GetWrongToken", GetCall(kSession, Caller::kWrongToken),
      StatusCode::UNAUTHENTICATED, "invalid token");
  add("ExportWithoutToken", ExportCall(kSession, Caller::kNoToken),
      StatusCode::UNAUTHENTICATED);
  add("FinalizeBasicScheme", FinalizeCall(Finalize(), Caller::kBasicScheme),
      StatusCode::UNAUTHENTICATED);
  add("CreateWrongToken", CreateCall(Create("fresh"), Caller::kWrongToken),
      StatusCode::UNAUTHENTICATED, "invalid token");
  return rows;
}

// --- the worker and the target session ---------------------------------------

class MalformedTest : public ::testing::TestWithParam<Row> {
 protected:
  static void SetUpTestSuite() {
    tokens_ = std::filesystem::temp_directory_path() /
              ("kvcal-malformed-tokens-" + std::to_string(getpid()));
    {
      std::ofstream out(tokens_);
      out << "alice:" << kAliceToken << "\nbob:" << kBobToken << "\n";
    }
    worker_ = new WorkerProcess(
        {"--max-message-bytes", std::to_string(kMaxMessageBytes),
         "--auth-token-file", tokens_.string(), "--memory-budget-bytes",
         std::to_string(uint64_t{1} << 30)});
    if (!worker_->ok()) return;
    stub_ = pb::Calibration::NewStub(worker_->Channel()).release();

    // The target: chunks 1..3 of producer "p", layer 0 Q, K and V (so layer
    // 1 is missing, which the FinalizeMissingHeads row relies on).
    grpc::ClientContext context;
    Authorize(&context, Caller::kAlice);
    pb::Session session;
    setup_status_ = stub_->CreateSession(&context, Create(kSession), &session);
    if (!setup_status_.ok()) return;
    std::vector<pb::IngestRequest> chunks;
    uint64_t sequence = 1;
    for (pb::Role role : {pb::ROLE_Q, pb::ROLE_K, pb::ROLE_V}) {
      pb::IngestRequest r = Chunk(sequence++);
      r.set_role(role);
      const uint32_t heads = role == pb::ROLE_Q ? kQHeads : kKvHeads;
      r.set_shape(1, heads);
      std::vector<float> values(3 * heads * kHeadDim);
      for (size_t i = 0; i < values.size(); ++i) {
        values[i] = std::cos(0.11f * static_cast<float>(i)) * (1.0f + i % 5);
      }
      r.set_data(values.data(), values.size() * sizeof(float));
      chunks.push_back(std::move(r));
    }
    setup_status_ = IngestStream(stub_, chunks);
  }

  static void TearDownTestSuite() {
    delete stub_;
    stub_ = nullptr;
    delete worker_;
    worker_ = nullptr;
    std::error_code ignored;
    std::filesystem::remove(tokens_, ignored);
  }

  void SetUp() override {
    ASSERT_TRUE(worker_->ok()) << worker_->error();
    ASSERT_TRUE(setup_status_.ok()) << setup_status_.error_message();
  }

  // The target's whole SessionState, serialized.
  static std::string TargetState() {
    grpc::ClientContext context;
    Authorize(&context, Caller::kAlice);
    pb::ExportStateRequest request;
    request.set_session_id(kSession);
    pb::SessionState state;
    const grpc::Status status = stub_->ExportState(&context, request, &state);
    EXPECT_TRUE(status.ok()) << status.error_message();
    std::string bytes;
    EXPECT_TRUE(state.SerializeToString(&bytes));
    return bytes;
  }

  static inline WorkerProcess* worker_ = nullptr;
  static inline pb::Calibration::Stub* stub_ = nullptr;
  static inline grpc::Status setup_status_;
  static inline std::filesystem::path tokens_;
};

TEST_P(MalformedTest, ExactStatusAndSessionUnchanged) {
  const Row& row = GetParam();
  const std::string before = TargetState();
  ASSERT_FALSE(before.empty());

  const Outcome outcome = row.call(stub_);

  EXPECT_EQ(outcome.status.error_code(), row.code)
      << "message: " << outcome.status.error_message();
  if (!row.message.empty()) {
    EXPECT_THAT(outcome.status.error_message(), HasSubstr(row.message));
  }
  EXPECT_EQ(outcome.problem, "");
  const std::string after = TargetState();
  EXPECT_TRUE(after == before)
      << "the target session's state changed (" << before.size() << " -> "
      << after.size() << " bytes)";
}

TEST(MalformedTableTest, CoversEveryRpcWithAtLeast40Rows) {
  const std::vector<Row> rows = Rows();
  EXPECT_GE(rows.size(), 40u);
  for (const char* rpc : {"Create", "Get", "List", "Delete", "Ingest",
                          "Finalize", "Export", "Import"}) {
    int n = 0;
    for (const Row& row : rows) n += row.name.rfind(rpc, 0) == 0;
    EXPECT_GE(n, 1) << rpc;
  }
}

INSTANTIATE_TEST_SUITE_P(Table, MalformedTest, ::testing::ValuesIn(Rows()),
                         [](const ::testing::TestParamInfo<Row>& param) {
                           return param.param.name;
                         });

}  // namespace
}  // namespace kvcal
