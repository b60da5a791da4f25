// Integration tests of kvcal-worker: a real worker process on loopback, the
// CPU backend, generated gRPC stubs.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/scale_math.h"
#include "kvcal/v1/calibration.grpc.pb.h"
#include "proto/names.h"
#include "tests/service/rpc_helpers.h"
#include "tests/service/worker_process.h"
#include "tests/test_certs.h"
#include "tests/wait_until.h"

namespace kvcal {
namespace {

namespace pb = ::kvcal::v1;
using ::kvcal::testing::ExportStatistics;
using ::kvcal::testing::GetSession;
using ::kvcal::testing::IngestAll;
using ::kvcal::testing::StreamResult;
using ::kvcal::testing::WaitUntil;
using ::kvcal::testing::WorkerProcess;
using ::testing::HasSubstr;

constexpr uint32_t kLayers = 2;
constexpr uint32_t kQHeads = 4;
constexpr uint32_t kKvHeads = 2;
constexpr uint32_t kHeadDim = 8;

pb::CreateSessionRequest CreateRequest(const std::string& id,
                                       uint32_t bins = 16) {
  return kvcal::testing::CreateSessionRequest(
      id, {kLayers, kQHeads, kKvHeads, kHeadDim, bins});
}

// Heavy-tailed values: a normal scaled per head, with rare large outliers.
std::vector<float> RandomValues(size_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) {
    x = normal(rng);
    if (uniform(rng) < 0.002f) x *= 40.0f;
  }
  return v;
}

pb::IngestRequest Chunk(const std::string& session, const std::string& producer,
                        uint64_t sequence, uint64_t batch, uint32_t layer,
                        pb::Role role, uint64_t tokens, uint64_t seed) {
  const uint32_t heads = role == pb::ROLE_Q ? kQHeads : kKvHeads;
  pb::IngestRequest r;
  r.set_session_id(session);
  r.set_producer_id(producer);
  r.set_sequence(sequence);
  r.set_batch(batch);
  r.set_layer(layer);
  r.set_role(role);
  r.set_dtype(pb::DTYPE_F32);
  r.set_layout(pb::LAYOUT_TOKENS_HEADS_DIM);
  r.add_shape(tokens);
  r.add_shape(heads);
  r.add_shape(kHeadDim);
  const std::vector<float> values =
      RandomValues(tokens * heads * kHeadDim, seed, 1.0f + layer);
  r.set_data(values.data(), values.size() * sizeof(float));
  return r;
}

// Every (layer, role) of batches [0, batches), `tokens` tokens each.
std::vector<pb::IngestRequest> Workload(const std::string& session, int batches,
                                        uint64_t tokens) {
  std::vector<pb::IngestRequest> chunks;
  uint64_t seed = 1;
  for (int b = 0; b < batches; ++b) {
    for (uint32_t layer = 0; layer < kLayers; ++layer) {
      for (pb::Role role : {pb::ROLE_Q, pb::ROLE_K, pb::ROLE_V}) {
        chunks.push_back(
            Chunk(session, "p", 0, b, layer, role, tokens, seed++));
      }
    }
  }
  return chunks;
}

// Numbers chunks 1..n for one producer.
std::vector<pb::IngestRequest> Numbered(std::vector<pb::IngestRequest> chunks,
                                        const std::string& producer,
                                        uint64_t first = 1) {
  for (pb::IngestRequest& c : chunks) {
    c.set_producer_id(producer);
    c.set_sequence(first++);
  }
  return chunks;
}

class WorkerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(worker_.ok()) << worker_.error();
    stub_ = pb::Calibration::NewStub(worker_.Channel());
  }

  pb::Session Create(const std::string& id, uint32_t bins = 16) {
    grpc::ClientContext context;
    pb::Session session;
    grpc::Status status =
        stub_->CreateSession(&context, CreateRequest(id, bins), &session);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return session;
  }

  std::string Export(const std::string& id) {
    return ExportStatistics(stub_.get(), id);
  }

  pb::Session Get(const std::string& id) {
    grpc::Status status;
    pb::Session session = GetSession(stub_.get(), id, &status);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return session;
  }

  absl::StatusOr<pb::FinalizeResponse> Finalize(pb::FinalizeRequest request) {
    grpc::ClientContext context;
    pb::FinalizeResponse response;
    grpc::Status status = stub_->Finalize(&context, request, &response);
    if (!status.ok()) {
      return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                          status.error_message());
    }
    return response;
  }

  WorkerProcess worker_;
  std::unique_ptr<pb::Calibration::Stub> stub_;
};

TEST_F(WorkerTest, CreateIsIdempotentAndConflictsAreRejected) {
  pb::Session first = Create("run-1");
  EXPECT_EQ(first.session_id(), "run-1");
  EXPECT_THAT(first.roles(),
              ::testing::ElementsAre(pb::ROLE_Q, pb::ROLE_K, pb::ROLE_V));
  EXPECT_EQ(first.backend(), "cpu");
  // Identical parameters (roles listed differently) return the session.
  pb::CreateSessionRequest same = CreateRequest("run-1");
  same.add_roles(pb::ROLE_V);
  same.add_roles(pb::ROLE_Q);
  same.add_roles(pb::ROLE_K);
  same.add_roles(pb::ROLE_Q);
  {
    grpc::ClientContext context;
    pb::Session session;
    ASSERT_TRUE(stub_->CreateSession(&context, same, &session).ok());
    EXPECT_EQ(session.session_id(), "run-1");
  }
  {
    grpc::ClientContext context;
    pb::Session session;
    grpc::Status status =
        stub_->CreateSession(&context, CreateRequest("run-1", 32), &session);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::ALREADY_EXISTS);
    EXPECT_THAT(status.error_message(), HasSubstr("run-1"));
  }
  // The server picks an id.
  pb::Session picked = Create("");
  EXPECT_FALSE(picked.session_id().empty());
  EXPECT_NE(picked.session_id(), "run-1");
}

TEST_F(WorkerTest, CreateRejectsBadParameters) {
  struct Case {
    std::string name;
    std::function<void(pb::CreateSessionRequest&)> mutate;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"zero layers", [](auto& r) { r.set_num_layers(0); }, "num_layers"},
      {"too many layers", [](auto& r) { r.set_num_layers(4097); },
       "num_layers"},
      {"zero heads", [](auto& r) { r.set_num_attention_heads(0); },
       "num_attention_heads"},
      {"gqa not divisible", [](auto& r) { r.set_num_key_value_heads(3); },
       "multiple"},
      {"head_dim", [](auto& r) { r.set_head_dim(1025); }, "head_dim"},
      {"bins not power of two",
       [](auto& r) { r.set_histogram_bins_per_octave(12); },
       "histogram_bins_per_octave"},
      {"bins too many", [](auto& r) { r.set_histogram_bins_per_octave(256); },
       "histogram_bins_per_octave"},
      {"unspecified role", [](auto& r) { r.add_roles(pb::ROLE_UNSPECIFIED); },
       "ROLE_UNSPECIFIED"},
      {"unknown role", [](auto& r) { r.add_roles(static_cast<pb::Role>(9)); },
       "roles"},
      {"bad id", [](auto& r) { r.set_session_id("has space"); }, "session_id"},
      {"long id", [](auto& r) { r.set_session_id(std::string(129, 'a')); },
       "128"},
  };
  for (const Case& c : cases) {
    pb::CreateSessionRequest request = CreateRequest("ok-id");
    c.mutate(request);
    grpc::ClientContext context;
    pb::Session session;
    grpc::Status status = stub_->CreateSession(&context, request, &session);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << c.name;
    EXPECT_THAT(status.error_message(), HasSubstr(c.message)) << c.name;
  }
  grpc::ClientContext context;
  pb::ListSessionsResponse list;
  ASSERT_TRUE(stub_->ListSessions(&context, {}, &list).ok());
  EXPECT_EQ(list.sessions_size(), 0) << "no session may be created";
}

TEST_F(WorkerTest, GetListDelete) {
  Create("a");
  Create("b");
  {
    grpc::ClientContext context;
    pb::ListSessionsResponse list;
    ASSERT_TRUE(stub_->ListSessions(&context, {}, &list).ok());
    ASSERT_EQ(list.sessions_size(), 2);
    EXPECT_EQ(list.sessions(0).session_id(), "a");
    EXPECT_EQ(list.sessions(1).session_id(), "b");
  }
  {
    grpc::ClientContext context;
    pb::DeleteSessionRequest request;
    request.set_session_id("a");
    pb::DeleteSessionResponse response;
    ASSERT_TRUE(stub_->DeleteSession(&context, request, &response).ok());
  }
  for (const std::string& id : {std::string("a"), std::string("missing")}) {
    grpc::ClientContext context;
    pb::GetSessionRequest request;
    request.set_session_id(id);
    pb::Session session;
    EXPECT_EQ(stub_->GetSession(&context, request, &session).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
  for (const std::string& id : {std::string(""), std::string("bad/id")}) {
    grpc::ClientContext context;
    pb::GetSessionRequest request;
    request.set_session_id(id);
    pb::Session session;
    EXPECT_EQ(stub_->GetSession(&context, request, &session).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
  }
}

TEST_F(WorkerTest, ExactlyOnceWithDuplicatesAndResends) {
  Create("s");
  const auto chunks = Numbered(Workload("s", 2, 5), "rank0");
  StreamResult first = IngestAll(stub_.get(), chunks);
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  ASSERT_EQ(first.responses.size(), chunks.size());
  for (size_t i = 0; i < chunks.size(); ++i) {
    EXPECT_EQ(first.responses[i].producer_id(), "rank0");
    EXPECT_EQ(first.responses[i].sequence(), i + 1);
    EXPECT_TRUE(first.responses[i].applied());
    EXPECT_EQ(first.responses[i].watermark(), i + 1);
  }
  const std::string state = Export("s");
  pb::Session session = Get("s");
  EXPECT_EQ(session.chunks_applied(), chunks.size());
  ASSERT_EQ(session.producers_size(), 1);
  EXPECT_EQ(session.producers(0).sequence(), chunks.size());

  // Resending everything (a client that lost its acks) changes nothing.
  StreamResult again = IngestAll(stub_.get(), chunks);
  ASSERT_TRUE(again.status.ok());
  for (const auto& r : again.responses) {
    EXPECT_FALSE(r.applied());
    EXPECT_EQ(r.watermark(), chunks.size());
  }
  EXPECT_EQ(Export("s"), state);
  EXPECT_EQ(Get("s").chunks_applied(), chunks.size());

  // Sequence 0 is always a duplicate and registers no producer.
  auto zero = Workload("s", 1, 1);
  zero.resize(1);
  zero[0].set_producer_id("newcomer");
  zero[0].set_sequence(0);
  StreamResult z = IngestAll(stub_.get(), zero);
  ASSERT_TRUE(z.status.ok());
  ASSERT_EQ(z.responses.size(), 1u);
  EXPECT_FALSE(z.responses[0].applied());
  EXPECT_EQ(z.responses[0].watermark(), 0u);
  EXPECT_EQ(Get("s").producers_size(), 1);
  EXPECT_EQ(Export("s"), state);

  // From a known producer it is acknowledged with that producer's watermark
  // (docs/wire-contract.md: a duplicate is acknowledged with the producer's
  // watermark).
  auto known = Workload("s", 1, 1);
  known.resize(1);
  known[0].set_producer_id(chunks[0].producer_id());
  known[0].set_sequence(0);
  StreamResult k = IngestAll(stub_.get(), known);
  ASSERT_TRUE(k.status.ok());
  ASSERT_EQ(k.responses.size(), 1u);
  EXPECT_FALSE(k.responses[0].applied());
  EXPECT_EQ(k.responses[0].watermark(), chunks.size());
  EXPECT_EQ(Export("s"), state);
}

TEST_F(WorkerTest, GapEndsTheStreamNamingTheExpectedSequence) {
  Create("s");
  auto chunks = Numbered(Workload("s", 1, 3), "p");
  chunks[2].set_sequence(5);  // 1, 2, then a gap
  StreamResult result = IngestAll(stub_.get(), chunks);
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(result.status.error_message(), HasSubstr("expected sequence 3"));
  EXPECT_THAT(result.status.error_message(), HasSubstr("producer 'p'"));
  EXPECT_EQ(result.responses.size(), 2u) << "chunks before the gap are acked";
  EXPECT_EQ(Get("s").chunks_applied(), 2u);
  // The client resumes from the watermark.
  std::vector<pb::IngestRequest> rest(chunks.begin() + 2, chunks.end());
  rest = Numbered(rest, "p", 3);
  StreamResult resumed = IngestAll(stub_.get(), rest);
  ASSERT_TRUE(resumed.status.ok()) << resumed.status.error_message();
  EXPECT_EQ(Get("s").chunks_applied(), chunks.size());
}

TEST_F(WorkerTest, InvalidChunksAreRejectedAndChangeNothing) {
  Create("s");
  ASSERT_TRUE(
      IngestAll(stub_.get(), Numbered(Workload("s", 1, 4), "p")).status.ok());
  const std::string before = Export("s");
  const uint64_t next = Get("s").producers(0).sequence() + 1;

  struct Case {
    std::string name;
    std::function<void(pb::IngestRequest&)> mutate;
    grpc::StatusCode code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"unknown session", [](auto& r) { r.set_session_id("nope"); },
       grpc::StatusCode::NOT_FOUND, "not found"},
      {"bad session id", [](auto& r) { r.set_session_id("a b"); },
       grpc::StatusCode::INVALID_ARGUMENT, "session_id"},
      {"empty session id", [](auto& r) { r.set_session_id(""); },
       grpc::StatusCode::INVALID_ARGUMENT, "session_id"},
      {"unknown role", [](auto& r) { r.set_role(static_cast<pb::Role>(7)); },
       grpc::StatusCode::INVALID_ARGUMENT, "role"},
      {"unspecified dtype", [](auto& r) { r.set_dtype(pb::DTYPE_UNSPECIFIED); },
       grpc::StatusCode::INVALID_ARGUMENT, "dtype"},
      {"unknown layout",
       [](auto& r) { r.set_layout(static_cast<pb::Layout>(3)); },
       grpc::StatusCode::INVALID_ARGUMENT, "layout"},
      {"layer out of range", [](auto& r) { r.set_layer(kLayers); },
       grpc::StatusCode::INVALID_ARGUMENT, "layer 2"},
      {"heads beyond", [](auto& r) { r.set_head_offset(1); },
       grpc::StatusCode::INVALID_ARGUMENT, "heads"},
      {"head_dim mismatch",
       [](auto& r) {
         r.set_shape(2, kHeadDim / 2);
         r.set_shape(0, r.shape(0) * 2);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "head_dim"},
      {"rank 1",
       [](auto& r) {
         r.clear_shape();
         r.add_shape(r.data().size() / 4);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "rank"},
      {"rank 3 for HEADS_TOKENS_DIM",
       [](auto& r) { r.set_layout(pb::LAYOUT_HEADS_TOKENS_DIM); },
       grpc::StatusCode::INVALID_ARGUMENT, "rank 4"},
      {"overflowing shape", [](auto& r) { r.set_shape(0, uint64_t{1} << 62); },
       grpc::StatusCode::INVALID_ARGUMENT, "overflows"},
      {"short data",
       [](auto& r) { r.mutable_data()->resize(r.data().size() - 2); },
       grpc::StatusCode::INVALID_ARGUMENT, "bytes"},
      {"zero heads",
       [](auto& r) {
         r.set_shape(1, 0);
         r.clear_data();
       },
       grpc::StatusCode::INVALID_ARGUMENT, "zero heads"},
  };
  for (const Case& c : cases) {
    pb::IngestRequest chunk = Chunk("s", "p", next, 9, 0, pb::ROLE_K, 3, 77);
    c.mutate(chunk);
    StreamResult result = IngestAll(stub_.get(), {chunk});
    EXPECT_EQ(result.status.error_code(), c.code) << c.name;
    EXPECT_THAT(result.status.error_message(), HasSubstr(c.message)) << c.name;
    if (chunk.session_id() == "s") {
      EXPECT_THAT(result.status.error_message(),
                  HasSubstr("chunk " + std::to_string(next)))
          << c.name;
    }
    EXPECT_EQ(Export("s"), before) << c.name;
  }
  EXPECT_EQ(Get("s").producers(0).sequence(), next - 1);

  // A role the session does not collect.
  pb::CreateSessionRequest qk = CreateRequest("qk");
  qk.add_roles(pb::ROLE_Q);
  qk.add_roles(pb::ROLE_K);
  grpc::ClientContext context;
  pb::Session session;
  ASSERT_TRUE(stub_->CreateSession(&context, qk, &session).ok());
  pb::IngestRequest v = Chunk("qk", "p", 1, 0, 0, pb::ROLE_V, 3, 5);
  StreamResult result = IngestAll(stub_.get(), {v});
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(result.status.error_message(), HasSubstr("not collected"));

  // A chunk whose token count is 0 is valid and advances the watermark.
  pb::IngestRequest empty = Chunk("s", "p", next, 9, 0, pb::ROLE_K, 0, 1);
  StreamResult e = IngestAll(stub_.get(), {empty});
  ASSERT_TRUE(e.status.ok()) << e.status.error_message();
  EXPECT_TRUE(e.responses.at(0).applied());
  EXPECT_EQ(Export("s"), before);
}

// Applies `chunks` to a local CPU backend: the reference for Finalize.
SessionStatistics LocalStatistics(const std::vector<pb::IngestRequest>& chunks,
                                  uint32_t bins) {
  Geometry g{kLayers, kQHeads, kKvHeads, kHeadDim, bins, 0b111};
  auto backend = CreateCpuBackend(g);
  EXPECT_TRUE(backend.ok());
  for (const pb::IngestRequest& r : chunks) {
    ChunkView chunk;
    chunk.layer = r.layer();
    chunk.role = static_cast<Role>(r.role());
    chunk.dtype = static_cast<DType>(r.dtype());
    chunk.layout = static_cast<Layout>(r.layout());
    chunk.shape.assign(r.shape().begin(), r.shape().end());
    chunk.batch = r.batch();
    chunk.head_offset = r.head_offset();
    chunk.data = absl::Span<const std::byte>(
        reinterpret_cast<const std::byte*>(r.data().data()), r.data().size());
    EXPECT_TRUE((*backend)->Accumulate(chunk).ok());
  }
  return *(*backend)->Snapshot();
}

void ExpectScalesEqual(const pb::FinalizeResponse& response,
                       const ScaleResult& expected, const std::string& what) {
  ASSERT_EQ(response.layers_size(), static_cast<int>(expected.layers.size()))
      << what;
  for (int l = 0; l < response.layers_size(); ++l) {
    const pb::LayerScales& got = response.layers(l);
    EXPECT_EQ(got.layer(), expected.layers[l].layer) << what;
    const pb::RoleScales* roles[] = {&got.q(), &got.k(), &got.v()};
    for (Role role : kAllRoles) {
      const RoleScales& want = *expected.layers[l].role(role);
      const pb::RoleScales& have = *roles[RoleIndex(role)];
      EXPECT_THAT(have.scale(), ::testing::ElementsAreArray(want.scale))
          << what << " layer " << l << " " << RoleName(role);
      EXPECT_THAT(have.absmax(), ::testing::ElementsAreArray(want.absmax))
          << what;
      EXPECT_EQ(have.count(), want.count) << what;
      EXPECT_EQ(have.nonfinite(), want.nonfinite) << what;
    }
  }
}

TEST_F(WorkerTest, FinalizeMatchesTheEngineScaleMath) {
  Create("s", 64);
  auto chunks = Numbered(Workload("s", 3, 40), "p");
  // A NaN and an Inf in one chunk: excluded and counted.
  std::string& data = *chunks[0].mutable_data();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  std::memcpy(data.data(), &nan, 4);
  std::memcpy(data.data() + 4, &inf, 4);
  ASSERT_TRUE(IngestAll(stub_.get(), chunks).status.ok());
  EXPECT_EQ(Get("s").nonfinite_values(), 2u);
  const SessionStatistics local = LocalStatistics(chunks, 64);

  struct Variant {
    pb::Observer observer;
    pb::Granularity granularity;
    pb::Format format;
    bool q_per_kv_group;
  };
  const std::vector<Variant> variants = {
      {pb::OBSERVER_UNSPECIFIED, pb::GRANULARITY_UNSPECIFIED,
       pb::FORMAT_UNSPECIFIED, false},
      {pb::OBSERVER_STATIC_MINMAX, pb::GRANULARITY_PER_HEAD,
       pb::FORMAT_FP8_E4M3FN, false},
      {pb::OBSERVER_MINMAX_EMA, pb::GRANULARITY_PER_HEAD,
       pb::FORMAT_FP8_E4M3FNUZ, true},
      {pb::OBSERVER_MEMORYLESS_MINMAX, pb::GRANULARITY_PER_TENSOR,
       pb::FORMAT_FP8_E5M2, false},
      {pb::OBSERVER_MSE, pb::GRANULARITY_PER_HEAD, pb::FORMAT_FP8_E4M3FN,
       false},
      {pb::OBSERVER_PERCENTILE, pb::GRANULARITY_PER_TENSOR, pb::FORMAT_INT8,
       false},
  };
  for (const Variant& v : variants) {
    pb::FinalizeRequest request;
    request.set_session_id("s");
    request.set_observer(v.observer);
    request.set_granularity(v.granularity);
    request.set_format(v.format);
    request.set_q_per_kv_group(v.q_per_kv_group);
    absl::StatusOr<pb::FinalizeResponse> response = Finalize(request);
    ASSERT_TRUE(response.ok()) << response.status();
    ScaleOptions options;
    if (v.observer) options.observer = static_cast<Observer>(v.observer);
    if (v.granularity) {
      options.granularity = static_cast<Granularity>(v.granularity);
    }
    if (v.format) options.format = static_cast<Format>(v.format);
    options.q_per_kv_group = v.q_per_kv_group;
    absl::StatusOr<ScaleResult> expected = ComputeScales(local, options);
    ASSERT_TRUE(expected.ok());
    ExpectScalesEqual(*response, *expected,
                      CanonicalName(static_cast<pb::Observer>(v.observer)));
  }
  // Per head q_per_kv_group gives one Q scale per KV head.
  pb::FinalizeRequest grouped;
  grouped.set_session_id("s");
  grouped.set_granularity(pb::GRANULARITY_PER_HEAD);
  grouped.set_q_per_kv_group(true);
  auto g = Finalize(grouped);
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->layers(0).q().scale_size(), static_cast<int>(kKvHeads));
  EXPECT_EQ(g->layers(0).k().scale_size(), static_cast<int>(kKvHeads));

  // Only some layers (what a sharding client asks).
  pb::FinalizeRequest one_layer;
  one_layer.set_session_id("s");
  one_layer.add_layers(1);
  auto ol = Finalize(one_layer);
  ASSERT_TRUE(ol.ok());
  ASSERT_EQ(ol->layers_size(), 1);
  EXPECT_EQ(ol->layers(0).layer(), 1u);
}

TEST_F(WorkerTest, FinalizeErrors) {
  Create("empty", 0);
  Create("partial", 0);
  pb::FinalizeRequest request;
  request.set_session_id("empty");
  EXPECT_THAT(Finalize(request).status().message(),
              HasSubstr("no finite values"));
  // Only layer 0 Q has data.
  auto chunks = Numbered(Workload("partial", 1, 2), "p");
  chunks.resize(1);
  ASSERT_TRUE(IngestAll(stub_.get(), chunks).status.ok());
  request.set_session_id("partial");
  absl::StatusOr<pb::FinalizeResponse> missing = Finalize(request);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(missing.status().message(), HasSubstr("(0, K, 0)"));
  request.set_allow_missing(true);
  absl::StatusOr<pb::FinalizeResponse> allowed = Finalize(request);
  ASSERT_TRUE(allowed.ok()) << allowed.status();
  ASSERT_EQ(allowed->layers_size(), static_cast<int>(kLayers));
  EXPECT_EQ(allowed->layers(0).q().scale_size(), 1);
  EXPECT_EQ(allowed->layers(0).k().scale_size(), 0);
  EXPECT_EQ(allowed->layers(1).q().scale_size(), 0);
  // Histogram observers on a session without histograms.
  request.set_observer(pb::OBSERVER_MSE);
  EXPECT_THAT(Finalize(request).status().message(), HasSubstr("histograms"));
  // Out-of-range parameters, even for an observer that does not use them.
  pb::FinalizeRequest bad;
  bad.set_session_id("partial");
  bad.set_allow_missing(true);
  bad.set_percentile(101);
  EXPECT_EQ(Finalize(bad).status().code(), absl::StatusCode::kInvalidArgument);
  bad.set_percentile(0);
  bad.set_averaging_constant(1.5f);
  EXPECT_THAT(Finalize(bad).status().message(),
              HasSubstr("averaging_constant"));
  bad.set_averaging_constant(0);
  bad.set_observer(static_cast<pb::Observer>(17));
  EXPECT_THAT(Finalize(bad).status().message(), HasSubstr("observer"));
}

TEST_F(WorkerTest, ConcurrentStreamsEqualOneStream) {
  const auto workload = Workload("x", 4, 16);
  Create("single");
  std::vector<pb::IngestRequest> single = workload;
  for (auto& c : single) c.set_session_id("single");
  ASSERT_TRUE(IngestAll(stub_.get(), Numbered(single, "only")).status.ok());
  pb::FinalizeRequest request;
  request.set_granularity(pb::GRANULARITY_PER_HEAD);
  request.set_observer(pb::OBSERVER_MINMAX_EMA);
  request.set_session_id("single");
  auto reference = Finalize(request);
  ASSERT_TRUE(reference.ok());
  request.set_observer(pb::OBSERVER_PERCENTILE);
  auto reference_pct = Finalize(request);
  ASSERT_TRUE(reference_pct.ok());

  for (int streams : {2, 8}) {
    const std::string id = "multi-" + std::to_string(streams);
    Create(id);
    std::vector<std::vector<pb::IngestRequest>> parts(streams);
    std::mt19937 rng(streams);
    for (pb::IngestRequest c : workload) {
      c.set_session_id(id);
      parts[rng() % streams].push_back(c);
    }
    std::vector<std::thread> threads;
    std::vector<grpc::Status> statuses(streams);
    for (int s = 0; s < streams; ++s) {
      threads.emplace_back([&, s] {
        statuses[s] = IngestAll(stub_.get(),
                                Numbered(parts[s], "rank" + std::to_string(s)))
                          .status;
      });
    }
    for (auto& t : threads) t.join();
    for (const auto& st : statuses) ASSERT_TRUE(st.ok()) << st.error_message();
    request.set_session_id(id);
    request.set_observer(pb::OBSERVER_MINMAX_EMA);
    auto got = Finalize(request);
    ASSERT_TRUE(got.ok());
    // The echoed request names this session; everything else must match.
    ASSERT_EQ(got->resolved().session_id(), id);
    got->mutable_resolved()->set_session_id(reference->resolved().session_id());
    EXPECT_EQ(got->SerializeAsString(), reference->SerializeAsString())
        << streams << " streams";
    request.set_observer(pb::OBSERVER_PERCENTILE);
    auto got_pct = Finalize(request);
    ASSERT_TRUE(got_pct.ok());
    got_pct->mutable_resolved()->set_session_id(
        reference_pct->resolved().session_id());
    EXPECT_EQ(got_pct->SerializeAsString(), reference_pct->SerializeAsString());
    EXPECT_EQ(Get(id).chunks_applied(), workload.size());
  }
}

TEST_F(WorkerTest, ExportImportRestoresAndMergesExactly) {
  Create("src");
  const auto chunks = Numbered(Workload("src", 2, 8), "p");
  ASSERT_TRUE(IngestAll(stub_.get(), chunks).status.ok());
  pb::SessionState state;
  {
    grpc::ClientContext context;
    pb::ExportStateRequest request;
    request.set_session_id("src");
    ASSERT_TRUE(stub_->ExportState(&context, request, &state).ok());
  }
  auto import = [&](const std::string& id, const std::string& import_id,
                    const pb::SessionState& s) {
    grpc::ClientContext context;
    pb::ImportStateRequest request;
    request.set_session_id(id);
    request.set_import_id(import_id);
    *request.mutable_state() = s;
    pb::Session session;
    grpc::Status status = stub_->ImportState(&context, request, &session);
    return std::make_pair(status, session);
  };
  auto [status, restored] = import("copy", "imp-1", state);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(restored.chunks_applied(), chunks.size());
  ASSERT_EQ(restored.producers_size(), 1);
  EXPECT_EQ(restored.producers(0).sequence(), chunks.size());
  EXPECT_EQ(Export("copy"), Export("src"));
  // A retried import with the same id changes nothing.
  auto [again, same] = import("copy", "imp-1", state);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(same.chunks_applied(), chunks.size());
  EXPECT_EQ(Export("copy"), Export("src"));
  // A new id merges: counters add.
  auto [merged_status, merged] = import("copy", "imp-2", state);
  ASSERT_TRUE(merged_status.ok());
  EXPECT_EQ(merged.chunks_applied(), 2 * chunks.size());
  // Mismatched geometry and corrupt statistics: INVALID_ARGUMENT, no change.
  const std::string before = Export("copy");
  pb::SessionState other = state;
  other.set_head_dim(16);
  EXPECT_EQ(import("copy", "x", other).first.error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  pb::SessionState corrupt = state;
  (*corrupt.mutable_statistics())[40] ^= 0x5a;
  auto [corrupt_status, ignored] = import("copy", "y", corrupt);
  EXPECT_EQ(corrupt_status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  pb::SessionState truncated = state;
  truncated.mutable_statistics()->resize(truncated.statistics().size() / 2);
  EXPECT_EQ(import("copy", "z", truncated).first.error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(import("fresh", "z", truncated).first.error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Export("copy"), before);
  grpc::ClientContext context;
  pb::GetSessionRequest get;
  get.set_session_id("fresh");
  pb::Session s;
  EXPECT_EQ(stub_->GetSession(&context, get, &s).error_code(),
            grpc::StatusCode::NOT_FOUND);
}

TEST_F(WorkerTest, HealthAndReflectionAnswer) {
  grpc::GenericStub generic(worker_.Channel());
  // grpc.health.v1.Health/Check with service "" -> status SERVING (1).
  {
    grpc::ClientContext context;
    grpc::ByteBuffer request;
    grpc::ByteBuffer response;
    grpc::Slice empty("", 0);
    request = grpc::ByteBuffer(&empty, 1);
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    grpc::Status status;
    generic.UnaryCall(&context, "/grpc.health.v1.Health/Check",
                      grpc::StubOptions(), &request, &response,
                      [&](grpc::Status s) {
                        std::lock_guard<std::mutex> lock(mu);
                        status = s;
                        done = true;
                        cv.notify_one();
                      });
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done; });
    ASSERT_TRUE(status.ok()) << status.error_message();
    std::vector<grpc::Slice> slices;
    ASSERT_TRUE(response.Dump(&slices).ok());
    std::string bytes;
    for (auto& slice : slices) {
      bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
    }
    EXPECT_EQ(bytes, std::string("\x08\x01", 2)) << "SERVING";
  }
  // Reflection: list_services (field 7) names kvcal.v1.Calibration.
  {
    grpc::ClientContext context;
    grpc::CompletionQueue cq;
    auto call = generic.PrepareCall(
        &context,
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
    void* tag;
    bool ok;
    call->StartCall(reinterpret_cast<void*>(1));
    ASSERT_TRUE(cq.Next(&tag, &ok) && ok);
    grpc::Slice list_services(std::string("\x3a\x00", 2));
    grpc::ByteBuffer request(&list_services, 1);
    call->Write(request, reinterpret_cast<void*>(2));
    ASSERT_TRUE(cq.Next(&tag, &ok) && ok);
    grpc::ByteBuffer response;
    call->Read(&response, reinterpret_cast<void*>(3));
    ASSERT_TRUE(cq.Next(&tag, &ok) && ok);
    std::vector<grpc::Slice> slices;
    ASSERT_TRUE(response.Dump(&slices).ok());
    std::string bytes;
    for (auto& slice : slices) {
      bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
    }
    EXPECT_THAT(bytes, HasSubstr("kvcal.v1.Calibration"));
    call->WritesDone(reinterpret_cast<void*>(4));
    cq.Next(&tag, &ok);
    grpc::Status status;
    call->Finish(&status, reinterpret_cast<void*>(5));
    cq.Next(&tag, &ok);
    cq.Shutdown();
    while (cq.Next(&tag, &ok)) {
    }
  }
}

TEST_F(WorkerTest, SigtermDrainsAndExitsZero) {
  Create("s");
  auto chunks = Numbered(Workload("s", 4, 64), "p");
  StreamResult result = IngestAll(stub_.get(), chunks);
  ASSERT_TRUE(result.status.ok());
  // A stream left open across SIGTERM is ended by the drain. One chunk (a
  // duplicate) and its acknowledgement make sure the worker has the stream
  // before the signal: a call still on its way when the server shuts down
  // ends CANCELLED instead (also retried by producers).
  grpc::ClientContext context;
  auto open_stream = stub_->Ingest(&context);
  ASSERT_TRUE(open_stream->Write(chunks[0]));
  pb::IngestResponse ack;
  ASSERT_TRUE(open_stream->Read(&ack));
  EXPECT_FALSE(ack.applied());
  const int status = worker_.SignalAndWait(SIGTERM, std::chrono::seconds(30));
  ASSERT_NE(status, -1) << "worker did not exit after SIGTERM";
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << worker_.ReadLog();
  EXPECT_THAT(worker_.ReadLog(), HasSubstr("received SIGTERM"));
  EXPECT_EQ(open_stream->Finish().error_code(), grpc::StatusCode::UNAVAILABLE)
      << "an open stream ends with UNAVAILABLE so that its producer resumes";
}

// --- Auth -------------------------------------------------------------------

std::string WriteFile(const std::filesystem::path& path,
                      const std::string& text) {
  std::ofstream(path) << text;
  return path.string();
}

TEST(WorkerAuthTest, TokensAreRequiredWhenConfigured) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("kvcal-auth-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  const std::string tokens = WriteFile(
      dir / "tokens", "# tenants\nteam-a:alpha-secret\nbare-secret\n");
  WorkerProcess worker({"--auth-token-file", tokens});
  ASSERT_TRUE(worker.ok()) << worker.error();
  auto stub = pb::Calibration::NewStub(worker.Channel());
  auto create = [&](const std::string& header) {
    grpc::ClientContext context;
    if (!header.empty()) context.AddMetadata("authorization", header);
    pb::Session session;
    return stub->CreateSession(&context, CreateRequest(""), &session);
  };
  EXPECT_EQ(create("").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(create("Bearer wrong").error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(create("Basic alpha-secret").error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(create("Bearer alpha-secret").ok());
  EXPECT_TRUE(create("bearer bare-secret").ok())
      << "scheme is case-insensitive";
  // Sessions belong to the tenant that created them.
  {
    grpc::ClientContext context;
    context.AddMetadata("authorization", "Bearer alpha-secret");
    pb::Session session;
    ASSERT_TRUE(
        stub->CreateSession(&context, CreateRequest("team-run"), &session)
            .ok());
  }
  {
    grpc::ClientContext context;
    context.AddMetadata("authorization", "Bearer bare-secret");
    pb::GetSessionRequest get;
    get.set_session_id("team-run");
    pb::Session session;
    EXPECT_EQ(stub->GetSession(&context, get, &session).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
  {
    grpc::ClientContext context;
    context.AddMetadata("authorization", "Bearer bare-secret");
    pb::ListSessionsResponse list;
    ASSERT_TRUE(stub->ListSessions(&context, {}, &list).ok());
    for (const auto& s : list.sessions()) EXPECT_NE(s.session_id(), "team-run");
  }
  StreamResult foreign = IngestAll(
      stub.get(), Numbered(Workload("team-run", 1, 1), "p"), "bare-secret");
  EXPECT_EQ(foreign.status.error_code(), grpc::StatusCode::NOT_FOUND);
  StreamResult own = IngestAll(
      stub.get(), Numbered(Workload("team-run", 1, 1), "p"), "alpha-secret");
  EXPECT_TRUE(own.status.ok()) << own.status.error_message();
  // Ingest without a token ends at once; nothing is applied.
  StreamResult denied =
      IngestAll(stub.get(), Numbered(Workload("s", 1, 1), "p"));
  EXPECT_EQ(denied.status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  // Tokens never reach the log.
  EXPECT_THAT(worker.ReadLog(), ::testing::Not(HasSubstr("alpha-secret")));
  // Health answers without a token (Kubernetes probes send none).
  grpc::GenericStub generic(worker.Channel());
  grpc::ClientContext context;
  grpc::Slice empty("", 0);
  grpc::ByteBuffer request(&empty, 1);
  grpc::ByteBuffer response;
  std::promise<grpc::Status> done;
  generic.UnaryCall(&context, "/grpc.health.v1.Health/Check",
                    grpc::StubOptions(), &request, &response,
                    [&](grpc::Status s) { done.set_value(s); });
  EXPECT_TRUE(done.get_future().get().ok());
  std::filesystem::remove_all(dir);
}

// --- TLS --------------------------------------------------------------------

std::string ReadText(const std::filesystem::path& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

class WorkerTlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("kvcal-tls-" + std::to_string(getpid()));
    std::filesystem::create_directories(dir_);
    // A CA, a server certificate for 127.0.0.1 and a client certificate.
    ASSERT_TRUE(kvcal::testing::MakeTestCertificates(dir_)) << "openssl failed";
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string path(const std::string& name) { return (dir_ / name).string(); }

  std::filesystem::path dir_;
};

TEST_F(WorkerTlsTest, ServesTlsAndMutualTls) {
  {
    WorkerProcess worker(
        {"--tls-cert", path("server.pem"), "--tls-key", path("server.key")});
    ASSERT_TRUE(worker.ok()) << worker.error();
    grpc::SslCredentialsOptions options;
    options.pem_root_certs = ReadText(dir_ / "ca.pem");
    auto stub =
        pb::Calibration::NewStub(worker.Channel(grpc::SslCredentials(options)));
    grpc::ClientContext context;
    pb::ListSessionsResponse list;
    EXPECT_TRUE(stub->ListSessions(&context, {}, &list).ok());
    // A plaintext client cannot talk to it.
    auto plain = pb::Calibration::NewStub(worker.Channel());
    grpc::ClientContext plain_context;
    plain_context.set_deadline(std::chrono::system_clock::now() +
                               std::chrono::seconds(5));
    EXPECT_FALSE(plain->ListSessions(&plain_context, {}, &list).ok());
  }
  {
    WorkerProcess worker({"--tls-cert", path("server.pem"), "--tls-key",
                          path("server.key"), "--tls-client-ca",
                          path("ca.pem")});
    ASSERT_TRUE(worker.ok()) << worker.error();
    grpc::SslCredentialsOptions with_cert;
    with_cert.pem_root_certs = ReadText(dir_ / "ca.pem");
    with_cert.pem_cert_chain = ReadText(dir_ / "client.pem");
    with_cert.pem_private_key = ReadText(dir_ / "client.key");
    auto stub = pb::Calibration::NewStub(
        worker.Channel(grpc::SslCredentials(with_cert)));
    grpc::ClientContext context;
    pb::ListSessionsResponse list;
    EXPECT_TRUE(stub->ListSessions(&context, {}, &list).ok());
    grpc::SslCredentialsOptions without_cert;
    without_cert.pem_root_certs = with_cert.pem_root_certs;
    auto anonymous = pb::Calibration::NewStub(
        worker.Channel(grpc::SslCredentials(without_cert)));
    grpc::ClientContext anonymous_context;
    anonymous_context.set_deadline(std::chrono::system_clock::now() +
                                   std::chrono::seconds(5));
    EXPECT_FALSE(anonymous->ListSessions(&anonymous_context, {}, &list).ok())
        << "mutual TLS must refuse a client without a certificate";
  }
}

}  // namespace
}  // namespace kvcal

namespace kvcal {
namespace {

// --- Durable sessions (--state-dir) -----------------------------------------

class DurableTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("kvcal-state-" + std::to_string(getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::unique_ptr<WorkerProcess> StartWorker(int interval_ms) {
    auto worker = std::make_unique<WorkerProcess>(std::vector<std::string>{
        "--state-dir", (dir_ / "state").string(), "--snapshot-interval-ms",
        std::to_string(interval_ms)});
    EXPECT_TRUE(worker->ok()) << worker->error();
    return worker;
  }

  // Polls until the producer's durable sequence reaches `sequence`.
  static bool WaitDurable(pb::Calibration::Stub* stub, const std::string& id,
                          uint64_t sequence) {
    return WaitUntil(
        [&] {
          grpc::Status status;
          pb::Session s = GetSession(stub, id, &status);
          return status.ok() && s.producers_size() == 1 &&
                 s.producers(0).durable_sequence() >= sequence;
        },
        std::chrono::seconds(10));
  }

  void CreateOn(pb::Calibration::Stub* stub, const std::string& id) {
    grpc::ClientContext context;
    pb::Session session;
    ASSERT_TRUE(
        stub->CreateSession(&context, CreateRequest(id), &session).ok());
  }

  std::filesystem::path dir_;
};

TEST_F(DurableTest, KilledWorkerRestoresEverythingThatWasDurable) {
  std::string statistics;
  const auto chunks = Numbered(Workload("s", 2, 16), "p");
  {
    auto worker = StartWorker(50);
    auto stub = pb::Calibration::NewStub(worker->Channel());
    CreateOn(stub.get(), "s");
    ASSERT_TRUE(IngestAll(stub.get(), chunks).status.ok());
    ASSERT_TRUE(WaitDurable(stub.get(), "s", chunks.size()))
        << "durable watermark never reached the watermark";
    statistics = ExportStatistics(stub.get(), "s");
    // A later duplicate reports the durable watermark.
    auto dup = chunks;
    dup.resize(1);
    StreamResult again = IngestAll(stub.get(), dup);
    ASSERT_EQ(again.responses.size(), 1u);
    EXPECT_EQ(again.responses[0].durable_watermark(), chunks.size());
    ASSERT_NE(worker->SignalAndWait(SIGKILL, std::chrono::seconds(10)), -1);
  }
  auto worker = StartWorker(50);
  auto stub = pb::Calibration::NewStub(worker->Channel());
  grpc::Status status;
  pb::Session restored = GetSession(stub.get(), "s", &status);
  ASSERT_TRUE(status.ok()) << status.error_message() << worker->ReadLog();
  EXPECT_EQ(restored.chunks_applied(), chunks.size());
  ASSERT_EQ(restored.producers_size(), 1);
  EXPECT_EQ(restored.producers(0).sequence(), chunks.size());
  EXPECT_EQ(restored.producers(0).durable_sequence(), chunks.size());
  EXPECT_EQ(ExportStatistics(stub.get(), "s"), statistics);
}

TEST_F(DurableTest, SigtermWritesStateAndDeleteRemovesIt) {
  {
    // An interval far longer than the test: only SIGTERM writes.
    auto worker = StartWorker(3600000);
    auto stub = pb::Calibration::NewStub(worker->Channel());
    CreateOn(stub.get(), "kept");
    CreateOn(stub.get(), "dropped");
    ASSERT_TRUE(IngestAll(stub.get(), Numbered(Workload("kept", 1, 4), "p"))
                    .status.ok());
    grpc::ClientContext context;
    pb::DeleteSessionRequest request;
    request.set_session_id("dropped");
    pb::DeleteSessionResponse response;
    ASSERT_TRUE(stub->DeleteSession(&context, request, &response).ok());
    const int exit = worker->SignalAndWait(SIGTERM, std::chrono::seconds(30));
    ASSERT_TRUE(WIFEXITED(exit) && WEXITSTATUS(exit) == 0) << worker->ReadLog();
  }
  EXPECT_TRUE(std::filesystem::exists(dir_ / "state" / "kept.kvstate"));
  EXPECT_FALSE(std::filesystem::exists(dir_ / "state" / "dropped.kvstate"));
  auto worker = StartWorker(3600000);
  auto stub = pb::Calibration::NewStub(worker->Channel());
  grpc::Status status;
  EXPECT_EQ(GetSession(stub.get(), "kept", &status).chunks_applied(), 6u);
  GetSession(stub.get(), "dropped", &status);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
}

// SIGTERM while a producer keeps writing: the drain finishes the stream with
// a read still outstanding, and chunks keep arriving. Nothing acknowledged
// may be lost and the worker must exit 0 (a chunk read after the stream
// finished once was applied by a reactor gRPC had already deleted).
TEST_F(DurableTest, SigtermMidStreamKeepsEverythingAcknowledged) {
  const auto chunks = Numbered(Workload("s", 400, 8), "p");
  for (int round = 0; round < 20; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    std::filesystem::remove_all(dir_ / "state");
    uint64_t acknowledged = 0;
    {
      auto worker = StartWorker(3600000);
      auto stub = pb::Calibration::NewStub(worker->Channel());
      CreateOn(stub.get(), "s");
      grpc::ClientContext context;
      auto stream = stub->Ingest(&context);
      std::atomic<uint64_t> acked{0};
      std::thread reader([&] {
        pb::IngestResponse response;
        while (stream->Read(&response)) acked = response.watermark();
      });
      std::thread writer([&] {
        for (const pb::IngestRequest& chunk : chunks) {
          if (!stream->Write(chunk)) return;
        }
        stream->WritesDone();
      });
      // Signal once the worker is well into the stream, at a different point
      // each round.
      WaitUntil(
          [&] {
            return acked.load() >= 50u + 97u * static_cast<uint64_t>(round);
          },
          std::chrono::seconds(20), /*poll=*/std::chrono::nanoseconds(0));
      const int exit = worker->SignalAndWait(SIGTERM, std::chrono::seconds(30));
      writer.join();
      reader.join();
      stream->Finish();
      acknowledged = acked.load();
      ASSERT_GT(acknowledged, 0u);
      ASSERT_TRUE(WIFEXITED(exit) && WEXITSTATUS(exit) == 0)
          << "exit status " << exit << "\n"
          << worker->ReadLog();
    }
    auto worker = StartWorker(3600000);
    auto stub = pb::Calibration::NewStub(worker->Channel());
    grpc::Status status;
    pb::Session restored = GetSession(stub.get(), "s", &status);
    ASSERT_TRUE(status.ok()) << status.error_message() << worker->ReadLog();
    ASSERT_EQ(restored.producers_size(), 1);
    EXPECT_GE(restored.producers(0).sequence(), acknowledged);
    EXPECT_EQ(restored.chunks_applied(), restored.producers(0).sequence());
  }
}

TEST_F(DurableTest, CorruptStateIsMovedAsideAndTheWorkerStarts) {
  std::filesystem::create_directories(dir_ / "state");
  std::ofstream(dir_ / "state" / "broken.kvstate") << "KVCALSS1 garbage";
  {
    auto worker = StartWorker(50);
    auto stub = pb::Calibration::NewStub(worker->Channel());
    CreateOn(stub.get(), "good");
    ASSERT_TRUE(IngestAll(stub.get(), Numbered(Workload("good", 1, 2), "p"))
                    .status.ok());
    ASSERT_TRUE(WaitDurable(stub.get(), "good", 6));
    EXPECT_THAT(worker->ReadLog(), HasSubstr("moved aside"));
  }
  bool moved = false;
  for (const auto& entry :
       std::filesystem::directory_iterator(dir_ / "state")) {
    moved |=
        entry.path().filename().string().starts_with("broken.kvstate.corrupt-");
  }
  EXPECT_TRUE(moved);
  // A truncated good file is also set aside, not fatal.
  const auto good = dir_ / "state" / "good.kvstate";
  std::filesystem::resize_file(good, std::filesystem::file_size(good) / 2);
  auto worker = StartWorker(50);
  auto stub = pb::Calibration::NewStub(worker->Channel());
  grpc::Status status;
  GetSession(stub.get(), "good", &status);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(worker->ReadLog(), HasSubstr("truncated"));
}

TEST_F(DurableTest, UnwritableStateDirKeepsServingWithoutDurability) {
  auto worker = StartWorker(50);
  auto stub = pb::Calibration::NewStub(worker->Channel());
  CreateOn(stub.get(), "s");
  ASSERT_TRUE(
      IngestAll(stub.get(), Numbered(Workload("s", 1, 2), "p")).status.ok());
  ASSERT_TRUE(WaitDurable(stub.get(), "s", 6));
  // Replace the directory by a file: every later write fails.
  std::filesystem::remove_all(dir_ / "state");
  std::ofstream(dir_ / "state") << "not a directory";
  auto more = Numbered(Workload("s", 1, 2), "p", 7);
  for (auto& c : more) c.set_batch(5);
  StreamResult result = IngestAll(stub.get(), more);
  ASSERT_TRUE(result.status.ok()) << "ingest must keep working";
  // The persister tries to write the changed session and fails.
  ASSERT_TRUE(worker->WaitForLog("cannot persist session 's'"))
      << worker->ReadLog();
  grpc::Status status;
  pb::Session s = GetSession(stub.get(), "s", &status);
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(s.producers(0).sequence(), 12u);
  EXPECT_EQ(s.producers(0).durable_sequence(), 6u)
      << "durable watermark must not advance";
}

}  // namespace
}  // namespace kvcal
