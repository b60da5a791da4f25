// Client pieces that need no worker: chunk splitting, the sharding hash,
// the progress line, CLI name parsing.
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <set>

#include "client/rpc/calibration_client.h"
#include "client/rpc/calibration_job.h"
#include "client/rpc/progress.h"
#include "client/rpc/sharding.h"
#include "client/rpc/uploader.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "proto/names.h"

namespace kvcal {
namespace {

using ::testing::HasSubstr;

// Checks that `parts` cover `chunk` exactly: every element once, with the
// right head offsets, each part within the limit.
void ExpectExactCover(const ChunkView& chunk,
                      const std::vector<ChunkView>& parts, size_t max_bytes) {
  size_t bytes = 0;
  const std::byte* cursor = chunk.data.data();
  for (const ChunkView& p : parts) {
    EXPECT_LE(p.data.size(),
              std::max<size_t>(max_bytes, chunk.shape.back() * 4));
    EXPECT_EQ(p.data.data(), cursor) << "parts must be contiguous and in order";
    cursor += p.data.size();
    bytes += p.data.size();
    uint64_t elements = 1;
    for (uint64_t d : p.shape) elements *= d;
    EXPECT_EQ(elements * DTypeSize(p.dtype), p.data.size());
    EXPECT_EQ(p.batch, chunk.batch);
    EXPECT_EQ(p.layer, chunk.layer);
    EXPECT_EQ(p.shape.back(), chunk.shape.back());
  }
  EXPECT_EQ(bytes, chunk.data.size());
}

TEST(SplitChunkTest, SmallChunkIsKept) {
  std::vector<float> data(4 * 2 * 8);
  ChunkView c{
      {.shape = {4, 2, 8}},
      absl::MakeConstSpan(reinterpret_cast<const std::byte*>(data.data()),
                          data.size() * 4),
      {}};
  EXPECT_EQ(SplitChunk(c, 1 << 20).size(), 1u);
}

TEST(SplitChunkTest, TokensHeadsDimSplitsIntoTokenRanges) {
  std::vector<float> data(10 * 2 * 8);
  ChunkView c{
      {.layer = 3,
       .shape = {2, 5, 2, 8},  // two leading token dims
       .batch = 9},
      absl::MakeConstSpan(reinterpret_cast<const std::byte*>(data.data()),
                          data.size() * 4),
      {}};
  const auto parts = SplitChunk(c, 3 * 2 * 8 * 4);  // three tokens per part
  ASSERT_EQ(parts.size(), 4u);
  EXPECT_EQ(parts[0].shape, (std::vector<uint64_t>{3, 2, 8}));
  EXPECT_EQ(parts[3].shape, (std::vector<uint64_t>{1, 2, 8}));
  ExpectExactCover(c, parts, 3 * 2 * 8 * 4);
}

TEST(SplitChunkTest, OversizedTokenSplitsItsHeads) {
  std::vector<uint16_t> data(3 * 5 * 8);
  ChunkView c{
      {.dtype = DType::kBf16, .shape = {3, 5, 8}, .head_offset = 4},
      absl::MakeConstSpan(reinterpret_cast<const std::byte*>(data.data()),
                          data.size() * 2),
      {}};
  const auto parts = SplitChunk(c, 2 * 8 * 2);  // two heads of one token
  ASSERT_EQ(parts.size(), 9u);                  // 3 tokens x (2 + 2 + 1) heads
  EXPECT_EQ(parts[0].head_offset, 4u);
  EXPECT_EQ(parts[1].head_offset, 6u);
  EXPECT_EQ(parts[2].head_offset, 8u);
  EXPECT_EQ(parts[2].shape, (std::vector<uint64_t>{1, 1, 8}));
  ExpectExactCover(c, parts, 2 * 8 * 2);
}

TEST(SplitChunkTest, HeadsTokensDimSplitsBatchThenHeadsThenSequence) {
  std::vector<float> data(2 * 3 * 4 * 8);
  ChunkView c{
      {.layout = Layout::kHeadsTokensDim, .shape = {2, 3, 4, 8}},
      absl::MakeConstSpan(reinterpret_cast<const std::byte*>(data.data()),
                          data.size() * 4),
      {}};
  // Whole batch entries.
  auto parts = SplitChunk(c, 3 * 4 * 8 * 4);
  ASSERT_EQ(parts.size(), 2u);
  EXPECT_EQ(parts[1].shape, (std::vector<uint64_t>{1, 3, 4, 8}));
  ExpectExactCover(c, parts, 3 * 4 * 8 * 4);
  // Head ranges of one entry.
  parts = SplitChunk(c, 2 * 4 * 8 * 4);
  ASSERT_EQ(parts.size(), 4u);
  EXPECT_EQ(parts[1].shape, (std::vector<uint64_t>{1, 1, 4, 8}));
  EXPECT_EQ(parts[1].head_offset, 2u);
  ExpectExactCover(c, parts, 2 * 4 * 8 * 4);
  // Sequence ranges of one head.
  parts = SplitChunk(c, 3 * 8 * 4);
  ASSERT_EQ(parts.size(), 2u * 3 * 2);
  EXPECT_EQ(parts[1].shape, (std::vector<uint64_t>{1, 1, 1, 8}));
  EXPECT_EQ(parts[2].head_offset, 1u);
  ExpectExactCover(c, parts, 3 * 8 * 4);
}

TEST(SplitChunkTest, WholeSequencesAreNeverCutByTokens) {
  std::vector<float> data(2 * 3 * 4 * 8);
  ChunkView c{
      {.layout = Layout::kHeadsTokensDim, .shape = {2, 3, 4, 8}},
      absl::MakeConstSpan(reinterpret_cast<const std::byte*>(data.data()),
                          data.size() * 4),
      {}};
  // Below one head of one sequence: one (entry, head) per part, whole.
  auto parts = SplitChunk(c, 3 * 8 * 4, /*whole_sequences=*/true);
  ASSERT_EQ(parts.size(), 2u * 3);
  EXPECT_EQ(parts[4].shape, (std::vector<uint64_t>{1, 1, 4, 8}));
  EXPECT_EQ(parts[4].head_offset, 1u);
  ExpectExactCover(c, parts, 4 * 8 * 4);
  // Above it: head ranges as without whole_sequences.
  parts = SplitChunk(c, 2 * 4 * 8 * 4, /*whole_sequences=*/true);
  ASSERT_EQ(parts.size(), 4u);
  ExpectExactCover(c, parts, 2 * 4 * 8 * 4);
  // [tokens, heads, dim] is one sequence: sent whole.
  ChunkView t{
      {.shape = {12, 2, 8}},
      absl::MakeConstSpan(reinterpret_cast<const std::byte*>(data.data()),
                          12 * 2 * 8 * 4),
      {}};
  parts = SplitChunk(t, 64, /*whole_sequences=*/true);
  ASSERT_EQ(parts.size(), 1u);
  EXPECT_EQ(parts[0].shape, t.shape);
}

// tests/data/shard_vectors.json (written by make_shard_vectors.py, which
// checks itself against the published FNV-1a and SplitMix64 vectors); the
// Python client's test reads the same file.
nlohmann::json ShardVectors() {
  std::ifstream in(KVCAL_SHARD_VECTORS);
  EXPECT_TRUE(in) << "cannot read " << KVCAL_SHARD_VECTORS;
  return nlohmann::json::parse(in);
}

uint64_t Hex(const nlohmann::json& value) {
  return std::stoull(value.get<std::string>(), nullptr, 16);
}

TEST(ShardingTest, Fnv1a64MatchesPublishedVectors) {
  const nlohmann::json vectors = ShardVectors();
  ASSERT_EQ(vectors["fnv1a64_published"].size(), 3u);
  for (const auto& [text, want] : vectors["fnv1a64_published"].items()) {
    EXPECT_EQ(Fnv1a64(text), Hex(want)) << "'" << text << "'";
  }
}

TEST(ShardingTest, SplitMix64MatchesPublishedSequence) {
  const nlohmann::json v = ShardVectors()["splitmix64_published"];
  uint64_t state = v["seed"].get<uint64_t>();
  ASSERT_EQ(v["outputs"].size(), 5u);
  for (const nlohmann::json& want : v["outputs"]) {
    // The generator's k-th output is the finalizer of seed + k * gamma.
    EXPECT_EQ(SplitMix64(state), Hex(want));
    state += Hex(v["gamma"]);
  }
}

TEST(ShardingTest, EveryLayerGoesWhereTheSharedVectorsSay) {
  const nlohmann::json vectors = ShardVectors();
  ASSERT_GE(vectors["cases"].size(), 10u);
  for (const nlohmann::json& c : vectors["cases"]) {
    const std::string session = c["session"];
    const auto ids = c["worker_ids"].get<std::vector<std::string>>();
    const auto want = c["owners"].get<std::vector<uint32_t>>();
    EXPECT_EQ(LayerOwners(session, c["num_layers"].get<uint32_t>(), ids), want)
        << session << " over " << ids.size() << " workers";
    for (uint32_t layer = 0; layer < 2; ++layer) {
      for (size_t w = 0; w < ids.size(); ++w) {
        EXPECT_EQ(RendezvousScore(session, layer, ids[w]),
                  Hex(c["scores_layers_0_1"][layer][w]));
      }
    }
  }
}

TEST(ShardingTest, AddingAWorkerMovesOnlyTheLayersItWins) {
  std::vector<std::string> ids = {"kvcal-worker-0", "kvcal-worker-1",
                                  "kvcal-worker-2", "kvcal-worker-3"};
  constexpr uint32_t kLayers = 4096;
  const std::vector<uint32_t> before = LayerOwners("run7", kLayers, ids);
  ids.push_back("kvcal-worker-4");
  const std::vector<uint32_t> after = LayerOwners("run7", kLayers, ids);
  uint32_t moved = 0;
  for (uint32_t l = 0; l < kLayers; ++l) {
    if (after[l] == before[l]) continue;
    ++moved;
    EXPECT_EQ(after[l], 4u) << "layer " << l << " moved between old workers";
  }
  // Expected kLayers / 5; a wide band, so the test pins the property, not
  // the value.
  EXPECT_GT(moved, kLayers / 5 - kLayers / 20);
  EXPECT_LT(moved, kLayers / 5 + kLayers / 20);
  std::vector<uint32_t> per_worker(5, 0);
  for (uint32_t owner : after) ++per_worker[owner];
  for (uint32_t n : per_worker) EXPECT_GT(n, kLayers / 5 - kLayers / 20);
}

TEST(ShardingTest, OrderOfIdsDoesNotMatterOnlyTheirNames) {
  const std::vector<std::string> a = {"x", "y", "z"};
  const std::vector<std::string> b = {"z", "x", "y"};
  for (uint32_t l = 0; l < 64; ++l) {
    EXPECT_EQ(a[LayerOwner("s", l, a)], b[LayerOwner("s", l, b)]);
  }
}

TEST(EndpointTest, FileListsEndpointsAndIsReadAgain) {
  const std::string path =
      ::testing::TempDir() + "/kvcal-endpoints-" + std::to_string(getpid());
  std::ofstream(path) << "# workers\n127.0.0.1:1, 127.0.0.1:2\n\n127.0.0.1:3\n";
  auto endpoints = ExpandEndpoint("file:" + path);
  ASSERT_TRUE(endpoints.ok()) << endpoints.status();
  EXPECT_EQ(*endpoints, (std::vector<std::string>{"127.0.0.1:1", "127.0.0.1:2",
                                                  "127.0.0.1:3"}));
  std::ofstream(path) << "127.0.0.1:4\n";
  endpoints = ExpandEndpoint("file:" + path);
  ASSERT_TRUE(endpoints.ok());
  EXPECT_EQ(*endpoints, (std::vector<std::string>{"127.0.0.1:4"}));
  std::ofstream(path) << "# nothing\n";
  EXPECT_THAT(ExpandEndpoint("file:" + path).status().message(),
              HasSubstr("lists no endpoint"));
  std::remove(path.c_str());
}

TEST(ProgressTest, LineShowsBytesChunksRateAndEta) {
  const std::string line = ProgressReporter::Line(
      "push", 1 << 20, 4 << 20, 10, 40, absl::Seconds(1), /*bar=*/true);
  EXPECT_THAT(line, HasSubstr("[######"));
  EXPECT_THAT(line, HasSubstr("25%"));
  EXPECT_THAT(line, HasSubstr("1.0/4.0 MiB"));
  EXPECT_THAT(line, HasSubstr("10/40 chunks"));
  EXPECT_THAT(line, HasSubstr("1.0 MiB/s"));
  EXPECT_THAT(line, HasSubstr("ETA 3s"));
  EXPECT_THAT(
      ProgressReporter::Line("push", 0, 0, 0, 0, absl::Seconds(1), false),
      ::testing::Not(HasSubstr("[")));
}

TEST(ProgressTest, LineWithoutUnitShowsBytesOnly) {
  const std::string line =
      ProgressReporter::Line("patch", 3 << 20, 6 << 20, 0, 0, absl::Seconds(3),
                             /*bar=*/false, /*unit=*/"");
  EXPECT_THAT(line, HasSubstr("50% 3.0/6.0 MiB, 1.0 MiB/s, ETA 3s"));
  EXPECT_THAT(ProgressReporter::Line("inspect", 0, 0, 2, 5, absl::Seconds(1),
                                     false, "files"),
              HasSubstr("2/5 files"));
}

TEST(CliNamesTest, ParsesObserversGranularitiesFormats) {
  EXPECT_EQ(*ParseObserver("minmax-ema"), v1::OBSERVER_MINMAX_EMA);
  EXPECT_EQ(*ParseObserver("percentile"), v1::OBSERVER_PERCENTILE);
  EXPECT_EQ(*ParseObserver("auto"), v1::OBSERVER_AUTO);
  EXPECT_THAT(std::string(ParseObserver("max").status().message()),
              HasSubstr("unknown observer 'max'"));
  EXPECT_EQ(*ParseGranularity("head"), v1::GRANULARITY_PER_HEAD);
  EXPECT_EQ(*ParseFormat("fp8-e4m3fnuz"), v1::FORMAT_FP8_E4M3FNUZ);
  EXPECT_FALSE(ParseFormat("fp4").ok());
  EXPECT_FALSE(ParseObserver("").ok());
  EXPECT_FALSE(ParseObserver("OBSERVER_UNSPECIFIED").ok());
}

// Every spelling users meet: what the CLI prints, what config.json and the
// scales file record (llm-compressor's names), what compressed-tensors
// writes as a strategy, the proto value names, in any case.
TEST(CliNamesTest, AcceptsEverySpellingUsersMeet) {
  const std::vector<std::pair<std::string, v1::Observer>> observers = {
      {"static-minmax", v1::OBSERVER_STATIC_MINMAX},
      {"static_minmax", v1::OBSERVER_STATIC_MINMAX},
      {"static", v1::OBSERVER_STATIC_MINMAX},
      {"OBSERVER_STATIC_MINMAX", v1::OBSERVER_STATIC_MINMAX},
      {"minmax", v1::OBSERVER_MINMAX_EMA},
      {"minmax-ema", v1::OBSERVER_MINMAX_EMA},
      {"minmax_ema", v1::OBSERVER_MINMAX_EMA},
      {"ema", v1::OBSERVER_MINMAX_EMA},
      {"memoryless_minmax", v1::OBSERVER_MEMORYLESS_MINMAX},
      {"Memoryless", v1::OBSERVER_MEMORYLESS_MINMAX},
      {"MSE", v1::OBSERVER_MSE},
  };
  for (const auto& [spelling, want] : observers) {
    absl::StatusOr<v1::Observer> got = ParseObserver(spelling);
    ASSERT_TRUE(got.ok()) << spelling << ": " << got.status();
    EXPECT_EQ(*got, want) << spelling;
  }
  EXPECT_EQ(*ParseGranularity("attn_head"), v1::GRANULARITY_PER_HEAD);
  EXPECT_EQ(*ParseGranularity("per-tensor"), v1::GRANULARITY_PER_TENSOR);
  EXPECT_EQ(*ParseFormat("float8_e4m3fn"), v1::FORMAT_FP8_E4M3FN);
  EXPECT_EQ(*ParseFormat("fp8"), v1::FORMAT_FP8_E4M3FN);
  EXPECT_EQ(*ParseFormat("e5m2"), v1::FORMAT_FP8_E5M2);
  EXPECT_EQ(*ParseRole("K"), v1::ROLE_K);
}

// The table itself: every value but UNSPECIFIED has a canonical name, what
// FinalizeToFile records parses back to the value, and no spelling names
// two values (which would make parsing depend on declaration order).
TEST(CliNamesTest, TableIsCompleteAndUnambiguous) {
  for (const google::protobuf::EnumDescriptor* type :
       {v1::Observer_descriptor(), v1::Granularity_descriptor(),
        v1::Format_descriptor(), v1::Role_descriptor(),
        v1::DType_descriptor()}) {
    std::map<std::string, int> owner;
    for (int i = 0; i < type->value_count(); ++i) {
      const google::protobuf::EnumValueDescriptor* value = type->value(i);
      if (value->number() == 0) continue;
      const auto& options = value->options();
      EXPECT_FALSE(options.GetExtension(v1::canonical_name).empty())
          << value->full_name() << " has no canonical name";
      std::vector<std::string> spellings = {
          options.GetExtension(v1::canonical_name),
          options.GetExtension(v1::cli_name), value->name()};
      for (int a = 0; a < options.ExtensionSize(v1::alias); ++a) {
        spellings.push_back(options.GetExtension(v1::alias, a));
      }
      for (std::string s : spellings) {
        if (s.empty()) continue;
        for (char& c : s) c = c == '-' ? '_' : static_cast<char>(tolower(c));
        auto [it, inserted] = owner.emplace(s, value->number());
        EXPECT_TRUE(inserted || it->second == value->number())
            << "'" << s << "' names two values of " << type->full_name();
      }
      for (const std::string& s : {CanonicalName(type, value->number()),
                                   CliName(type, value->number())}) {
        absl::StatusOr<int> back = ParseName(type, "value", s);
        ASSERT_TRUE(back.ok()) << s << ": " << back.status();
        EXPECT_EQ(*back, value->number()) << s;
      }
    }
  }
  // The engine's own labels in its messages are spellings of the table too.
  for (Role role : kAllRoles) {
    EXPECT_EQ(static_cast<int>(*ParseRole(RoleName(role))),
              static_cast<int>(role));
  }
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBf16}) {
    absl::StatusOr<int> back =
        ParseName(v1::DType_descriptor(), "dtype", DTypeName(dtype));
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, static_cast<int>(dtype));
  }
}

}  // namespace
}  // namespace kvcal

namespace kvcal {
namespace {

TEST(ExpandEndpointTest, PlainAddressesAreCheckedAndGetTheDefaultPort) {
  auto host = ExpandEndpoint("worker-0");
  ASSERT_TRUE(host.ok()) << host.status();
  EXPECT_THAT(*host, ::testing::ElementsAre("worker-0:50051"));
  auto v6 = ExpandEndpoint("[::1]");
  ASSERT_TRUE(v6.ok()) << v6.status();
  EXPECT_THAT(*v6, ::testing::ElementsAre("[::1]:50051"));
  for (const char* bad : {"127.0.0.1:99999", "127.0.0.1:0", "host:abc",
                          ":50051", "::1", "a b:1", "[::1"}) {
    EXPECT_EQ(ExpandEndpoint(bad).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
  // Other gRPC schemes go to gRPC as they are.
  auto unix_socket = ExpandEndpoint("unix:/run/kvcal.sock");
  ASSERT_TRUE(unix_socket.ok());
  EXPECT_THAT(*unix_socket, ::testing::ElementsAre("unix:/run/kvcal.sock"));
}

TEST(ExpandEndpointTest, DnsNamesBecomeEveryAddressSorted) {
  auto plain = ExpandEndpoint("worker-0:50051");
  ASSERT_TRUE(plain.ok());
  EXPECT_THAT(*plain, ::testing::ElementsAre("worker-0:50051"));
  auto numeric = ExpandEndpoint("dns:///127.0.0.1:7000");
  ASSERT_TRUE(numeric.ok()) << numeric.status();
  EXPECT_THAT(*numeric, ::testing::ElementsAre("127.0.0.1:7000"));
  auto v6 = ExpandEndpoint("dns:///[::1]:7000");
  ASSERT_TRUE(v6.ok()) << v6.status();
  EXPECT_THAT(*v6, ::testing::ElementsAre("[::1]:7000"));
  // Without brackets the port cannot be told from the address.
  EXPECT_THAT(ExpandEndpoint("dns:///::1:7000").status().message(),
              HasSubstr("in brackets"));
  // localhost may resolve to 127.0.0.1 and ::1: each address once, sorted.
  auto local = ExpandEndpoint("dns:///localhost:7000");
  ASSERT_TRUE(local.ok()) << local.status();
  EXPECT_TRUE(std::is_sorted(local->begin(), local->end()));
  EXPECT_THAT(*local, ::testing::Contains("127.0.0.1:7000"));
  // No port: 50051, as for a plain HOST; a port that is not one is refused.
  auto default_port = ExpandEndpoint("dns:///127.0.0.1");
  ASSERT_TRUE(default_port.ok()) << default_port.status();
  EXPECT_THAT(*default_port, ::testing::ElementsAre("127.0.0.1:50051"));
  EXPECT_EQ(ExpandEndpoint("dns:///localhost:http").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ExpandEndpoint("dns:///localhost:70000").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ExpandEndpoint("dns:///host.invalid.:7000").status().code(),
            absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace kvcal

namespace kvcal {
namespace {

// gRPC 1.51's messages for each way a connection fails, as kvcal status
// printed them before (captured from real runs against kvcal-worker), and
// the one line a person reads now.
TEST(CondenseConnectionErrorTest, NamesTheAddressAndTheCause) {
  struct Case {
    const char* grpc;
    const char* condensed;
  };
  for (const Case& c : {
           Case{"ListSessions on 127.0.0.1:1: failed to connect to all "
                "addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Failed to "
                "connect to remote host: Connection refused",
                "127.0.0.1:1: connection refused (is a kvcal-worker "
                "listening there?)"},
           Case{"ListSessions on 127.0.0.1:50997: failed to connect to all "
                "addresses; last error: UNKNOWN: ipv4:127.0.0.1:50997: Ssl "
                "handshake failed: SSL_ERROR_SSL: error:0A000086:SSL "
                "routines::certificate verify failed",
                "127.0.0.1:50997: TLS: the worker's certificate is not signed "
                "by the CA in --tls-ca, or does not name this address"},
           Case{"ListSessions on 127.0.0.1:50996: failed to connect to all "
                "addresses; last error: UNKNOWN: ipv4:127.0.0.1:50996: Ssl "
                "handshake failed: SSL_ERROR_SSL: error:0A00010B:SSL "
                "routines::wrong version number",
                "127.0.0.1:50996: TLS handshake failed: the worker does not "
                "speak TLS (leave out --tls-ca)"},
           Case{"ListSessions on 127.0.0.1:50997: failed to connect to all "
                "addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:50997: "
                "Socket closed",
                "127.0.0.1:50997: the worker closed the connection during the "
                "handshake (does it want TLS, --tls-ca, or a client "
                "certificate, --tls-cert and --tls-key?)"},
           Case{"ListSessions on nosuchhost.invalid:50997: DNS resolution "
                "failed for nosuchhost.invalid:50997: C-ares status is not "
                "ARES_SUCCESS qtype=AAAA name=nosuchhost.invalid "
                "is_balancer=0: Domain name not found",
                "nosuchhost.invalid:50997: cannot resolve the host name"},
           Case{"ListSessions on [::1]:1: failed to connect to all addresses; "
                "last error: UNKNOWN: ipv6:%5B::1%5D:1: Failed to connect to "
                "remote host: Connection refused",
                "[::1]:1: connection refused (is a kvcal-worker listening "
                "there?)"},
           Case{"ListSessions on unix:/tmp/x.sock: failed to connect to all "
                "addresses; last error: UNKNOWN: unix:/tmp/x.sock: No such "
                "file or directory",
                "unix:/tmp/x.sock: no such socket"},
           Case{"ListSessions on 127.0.0.1:50051: recvmsg:Connection reset "
                "by peer",
                "127.0.0.1:50051: the connection was reset (did the worker "
                "stop or restart?)"},
           Case{"GetSession on w1 (10.0.0.7:50051): Deadline Exceeded",
                "10.0.0.7:50051: no answer before the deadline (is a "
                "kvcal-worker listening there?)"},
       }) {
    EXPECT_EQ(CondenseConnectionError(c.grpc), c.condensed);
  }
  // Anything else is left as it is: the worker's own messages are one line
  // already.
  for (const std::string own :
       {"GetSession on 127.0.0.1:5: NOT_FOUND: session 'x' not found",
        "ImportState on 127.0.0.1:5: cannot open /s/x: No such file or "
        "directory"}) {
    EXPECT_EQ(CondenseConnectionError(own), own);
  }
}

}  // namespace
}  // namespace kvcal
