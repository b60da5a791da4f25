// Ingest throughput of kvcal-worker over loopback, next to a trivial gRPC
// sink that receives the same messages and acknowledges each without doing
// anything, measured in the same run. Prints GB/s for both and the ratio.
// Two sinks: "sink" receives typed IngestRequest messages (protobuf parses
// each into a message, copying the data once: what a typed handler costs);
// "raw sink" receives the bytes as gRPC hands them over (a ByteBuffer, no
// parse, no copy: gRPC alone). The worker reads Ingest raw and accumulates
// the data in place (service/ingest_wire.h). Also per chunk: the process's
// minor page faults (getrusage; client and server share the process, so
// both sides count) for each kind of run.
//
//   kvcal_bench_ingest [--chunks N] [--streams 1,4] [--bins 16,0]
//                      [--backend cpu] [--reps 3]
//                      [--cpu-threads N (worker default)]
//
// Both tables are printed for each histogram resolution of --bins (bins per
// octave): 16 (what the percentile and MSE observers need; the engine's
// accumulate is then a large share of the worker's time) and 0 (moments and
// min/max only: the transport dominates, which is what shared memory
// changes).
// Each stream count runs `reps` rounds, sink then worker, each round into a
// fresh session; the table gives the medians, their ratio and the range of
// the per-round ratios.
//
// A second table compares, in the same rounds, the worker's in-band ingest
// with same-host shared memory (docs/shared_memory.md): each stream writes
// its chunks into a ring of `window` slots in a POSIX shared-memory object
// (the producer's copy is timed), registers it and sends references; the
// worker reads the producer's pages in place. A third run sends the same
// references without the copy ("in place": a producer whose tensors are
// allocated in the region). `--shm-window N` (8, a multiple of 4).
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "client/rpc/shared_memory_ring.h"
#include "kernels/backend_factory.h"
#include "kvcal/v1/calibration.grpc.pb.h"
#include "service/worker.h"

namespace {

namespace pb = ::kvcal::v1;
using Clock = std::chrono::steady_clock;

// Acknowledges every chunk at once: the cost of gRPC and protobuf alone.
class SinkReactor final
    : public grpc::ServerBidiReactor<pb::IngestRequest, pb::IngestResponse> {
 public:
  SinkReactor() { StartRead(&request_); }
  void OnReadDone(bool ok) override {
    if (!ok) {
      std::lock_guard<std::mutex> lock(mu_);
      read_done_ = true;
      MaybeFinishLocked();
      return;
    }
    pb::IngestResponse response;
    response.set_producer_id(request_.producer_id());
    response.set_sequence(request_.sequence());
    response.set_applied(true);
    response.set_watermark(request_.sequence());
    bool write = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      writes_.push_back(std::move(response));
      write = !writing_;
      writing_ = true;
    }
    if (write) StartWrite(&writes_.front());
    StartRead(&request_);
  }
  void OnWriteDone(bool ok) override {
    bool write = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      writes_.pop_front();
      writing_ = ok && !writes_.empty();
      write = writing_;
      if (!write) MaybeFinishLocked();
    }
    if (write) StartWrite(&writes_.front());
  }
  void OnDone() override { delete this; }

 private:
  void MaybeFinishLocked() {
    if (read_done_ && !writing_ && !finished_) {
      finished_ = true;
      Finish(grpc::Status::OK);
    }
  }
  pb::IngestRequest request_;
  std::mutex mu_;
  std::deque<pb::IngestResponse> writes_;
  bool writing_ = false;
  bool read_done_ = false;
  bool finished_ = false;
};

class SinkService final : public pb::Calibration::CallbackService {
  grpc::ServerBidiReactor<pb::IngestRequest, pb::IngestResponse>* Ingest(
      grpc::CallbackServerContext*) override {
    return new SinkReactor();
  }
};

// Acknowledges every message with one fixed, pre-serialized response,
// without looking at it.
class RawSinkReactor final : public grpc::ServerGenericBidiReactor {
 public:
  explicit RawSinkReactor(const grpc::ByteBuffer& ack) : ack_(ack) {
    StartRead(&request_);
  }
  void OnReadDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!ok) {
      read_done_ = true;
      MaybeFinishLocked();
      return;
    }
    ++unacked_;
    if (!writing_) {
      writing_ = true;
      --unacked_;
      StartWrite(&ack_);
    }
    request_.Clear();
    StartRead(&request_);
  }
  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
    if (ok && unacked_ > 0) {
      --unacked_;
      writing_ = true;
      StartWrite(&ack_);
      return;
    }
    MaybeFinishLocked();
  }
  void OnDone() override { delete this; }

 private:
  void MaybeFinishLocked() {
    if (read_done_ && !writing_ && !finished_) {
      finished_ = true;
      Finish(grpc::Status::OK);
    }
  }
  const grpc::ByteBuffer& ack_;
  grpc::ByteBuffer request_;
  std::mutex mu_;
  int unacked_ = 0;
  bool writing_ = false;
  bool read_done_ = false;
  bool finished_ = false;
};

class RawSinkService final : public grpc::CallbackGenericService {
 public:
  RawSinkService() {
    pb::IngestResponse response;
    response.set_producer_id("bench-0");
    response.set_sequence(1);
    response.set_applied(true);
    response.set_watermark(1);
    bool own = false;
    (void)grpc::SerializationTraits<pb::IngestResponse>::Serialize(response,
                                                                   &ack_, &own);
  }
  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext*) override {
    return new RawSinkReactor(ack_);
  }

 private:
  grpc::ByteBuffer ack_;
};

int64_t MinorFaults() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt;
}

constexpr uint32_t kLayers = 32;
constexpr uint32_t kHeads = 8;
constexpr uint32_t kHeadDim = 128;
constexpr uint64_t kTokens = 2048;  // 2048 x 8 x 128 bf16 = 4 MiB

std::string RandomBf16(size_t values, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::string out(values * 2, '\0');
  for (size_t i = 0; i < values; ++i) {
    const float x = normal(rng);
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    const uint16_t bf16 = static_cast<uint16_t>(bits >> 16);
    std::memcpy(out.data() + 2 * i, &bf16, 2);
  }
  return out;
}

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

// Chunk `i` of stream `stream` without its bytes: a bf16 K chunk of
// [kTokens, kHeads, kHeadDim], layers in turn.
pb::IngestRequest ChunkRequest(const std::string& session, int stream,
                               uint64_t sequence, int i) {
  pb::IngestRequest request;
  request.set_session_id(session);
  request.set_producer_id("bench-" + std::to_string(stream));
  request.set_sequence(sequence);
  request.set_batch(static_cast<uint64_t>(i) / kLayers);
  request.set_layer(static_cast<uint32_t>(i) % kLayers);
  request.set_role(pb::ROLE_K);
  request.set_dtype(pb::DTYPE_BF16);
  request.set_layout(pb::LAYOUT_TOKENS_HEADS_DIM);
  request.add_shape(kTokens);
  request.add_shape(kHeads);
  request.add_shape(kHeadDim);
  return request;
}

// Streams `chunks` chunks over `streams` concurrent streams; returns seconds.
double Run(const std::string& address, const std::string& session, int streams,
           int chunks, const std::vector<std::string>& payloads) {
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(64 << 20);
  args.SetMaxReceiveMessageSize(64 << 20);
  const auto start = Clock::now();
  std::vector<std::thread> threads;
  for (int s = 0; s < streams; ++s) {
    threads.emplace_back([&, s] {
      // One channel per stream, as separate producer processes would have
      // (distinct arguments keep gRPC from sharing a subchannel). Each
      // thread sets its own copy.
      grpc::ChannelArguments channel_args = args;
      channel_args.SetInt("kvcal.bench.stream", s);
      auto stub = pb::Calibration::NewStub(grpc::CreateCustomChannel(
          address, grpc::InsecureChannelCredentials(), channel_args));
      grpc::ClientContext context;
      auto stream = stub->Ingest(&context);
      std::thread reader([&] {
        pb::IngestResponse response;
        while (stream->Read(&response)) {
        }
      });
      const int mine = chunks / streams;
      for (int i = 0; i < mine; ++i) {
        pb::IngestRequest request =
            ChunkRequest(session, s, static_cast<uint64_t>(i) + 1, i);
        request.set_data(payloads[static_cast<size_t>(i) % payloads.size()]);
        if (!stream->Write(request)) break;
      }
      stream->WritesDone();
      reader.join();
      grpc::Status status = stream->Finish();
      if (!status.ok()) {
        std::fprintf(stderr, "stream %d failed: %s\n", s,
                     status.error_message().c_str());
      }
    });
  }
  for (auto& t : threads) t.join();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// As Run, but each stream sends references into its own shared-memory ring
// of `window` slots, reusing a slot once its chunk is acknowledged; the copy
// of the payload into the slot is part of the time.
double RunShm(const std::string& address, const std::string& session,
              int streams, int chunks, const std::vector<std::string>& payloads,
              size_t window, bool copy) {
  const auto start = Clock::now();
  std::vector<std::thread> threads;
  for (int s = 0; s < streams; ++s) {
    threads.emplace_back([&, s] {
      grpc::ChannelArguments channel_args;
      channel_args.SetInt("kvcal.bench.stream", s);
      auto channel = grpc::CreateCustomChannel(
          address, grpc::InsecureChannelCredentials(), channel_args);
      auto ring = kvcal::SharedMemoryRing::Create(window, payloads[0].size());
      if (!ring.ok()) {
        std::fprintf(stderr, "shm stream %d: %s\n", s,
                     ring.status().ToString().c_str());
        return;
      }
      if (absl::Status r = (*ring)->Register(channel, {}); !r.ok()) {
        std::fprintf(stderr, "shm stream %d: %s\n", s, r.ToString().c_str());
        return;
      }
      if (!copy) {
        // In place: the producer's tensors live in the region (slot i holds
        // payload i % payloads; window is a multiple of that), written once.
        for (size_t slot = 0; slot < window; ++slot) {
          const std::string& payload = payloads[slot % payloads.size()];
          std::memcpy((*ring)->slot(slot), payload.data(), payload.size());
        }
      }
      auto stub = pb::Calibration::NewStub(channel);
      grpc::ClientContext context;
      auto stream = stub->Ingest(&context);
      std::mutex mu;
      std::condition_variable acked_cv;
      uint64_t acked = 0;
      std::thread reader([&] {
        pb::IngestResponse response;
        while (stream->Read(&response)) {
          std::lock_guard<std::mutex> lock(mu);
          acked = response.sequence();
          acked_cv.notify_one();
        }
        std::lock_guard<std::mutex> lock(mu);
        acked = UINT64_MAX;  // the stream ended
        acked_cv.notify_one();
      });
      const int mine = chunks / streams;
      for (int i = 0; i < mine; ++i) {
        const uint64_t sequence = static_cast<uint64_t>(i) + 1;
        {
          std::unique_lock<std::mutex> lock(mu);
          acked_cv.wait(lock, [&] {
            return sequence - acked <= window || acked == UINT64_MAX;
          });
          if (acked == UINT64_MAX) break;
        }
        const size_t slot = static_cast<size_t>(i) % window;
        const std::string& payload =
            payloads[static_cast<size_t>(i) % payloads.size()];
        if (copy) {
          std::memcpy((*ring)->slot(slot), payload.data(), payload.size());
        }
        pb::IngestRequest request = ChunkRequest(session, s, sequence, i);
        pb::SharedMemoryReference* ref = request.mutable_shared_memory();
        ref->set_region_id((*ring)->region_id());
        ref->set_offset((*ring)->slot_offset(slot));
        ref->set_byte_size(payload.size());
        if (!stream->Write(request)) break;
      }
      stream->WritesDone();
      reader.join();
      grpc::Status status = stream->Finish();
      if (!status.ok()) {
        std::fprintf(stderr, "shm stream %d failed: %s\n", s,
                     status.error_message().c_str());
      }
    });
  }
  for (auto& t : threads) t.join();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  // As kvcal-worker's main() does (the sinks in this process gain as well).
  kvcal::service::RetainFreedHeapMemory();
  int chunks = 256;
  // 16 bins per octave (what percentile and MSE need), then none (the
  // transport alone: what shared memory changes).
  std::vector<uint32_t> bin_counts = {16, 0};
  std::vector<int> stream_counts = {1, 4};
  std::string backend = "cpu";
  int cpu_threads = kvcal::service::WorkerOptions().cpu_threads;
  int reps = 3;
  int shm_window = 8;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const std::string value = argv[i + 1];
    if (flag == "--chunks") {
      (void)absl::SimpleAtoi(value, &chunks);
    } else if (flag == "--bins") {
      bin_counts.clear();
      for (absl::string_view part : absl::StrSplit(value, ',')) {
        uint32_t n = 0;
        if (absl::SimpleAtoi(part, &n)) bin_counts.push_back(n);
      }
    } else if (flag == "--backend") {
      backend = value;
    } else if (flag == "--reps") {
      (void)absl::SimpleAtoi(value, &reps);
      reps = std::max(reps, 1);
    } else if (flag == "--shm-window") {
      (void)absl::SimpleAtoi(value, &shm_window);
      shm_window = std::max((shm_window + 3) / 4 * 4, 4);
    } else if (flag == "--cpu-threads") {
      (void)absl::SimpleAtoi(value, &cpu_threads);
    } else if (flag == "--streams") {
      stream_counts.clear();
      for (absl::string_view part : absl::StrSplit(value, ',')) {
        int n = 0;
        if (absl::SimpleAtoi(part, &n) && n > 0) stream_counts.push_back(n);
      }
    }
  }

  kvcal::service::WorkerOptions options;
  options.listen = "127.0.0.1:0";
  options.backend = *kvcal::ParseBackendKind(backend);
  options.cpu_threads = cpu_threads;
  auto worker = kvcal::service::Worker::Start(options);
  if (!worker.ok()) {
    std::fprintf(stderr, "worker: %s\n", worker.status().ToString().c_str());
    return 1;
  }
  // Both sinks listen on loopback and take messages as large as the worker.
  auto start_sink = [](int* port, auto&& register_service) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                             port);
    builder.SetMaxReceiveMessageSize(64 << 20);
    register_service(builder);
    return builder.BuildAndStart();
  };
  SinkService sink_service;
  int sink_port = 0;
  auto sink = start_sink(&sink_port, [&](grpc::ServerBuilder& b) {
    b.RegisterService(&sink_service);
  });
  RawSinkService raw_sink_service;
  int raw_sink_port = 0;
  auto raw_sink = start_sink(&raw_sink_port, [&](grpc::ServerBuilder& b) {
    b.RegisterCallbackGenericService(&raw_sink_service);
  });

  std::vector<std::string> payloads;
  for (int i = 0; i < 4; ++i) {
    payloads.push_back(RandomBf16(kTokens * kHeads * kHeadDim, 100 + i));
  }
  const double bytes_per_chunk = static_cast<double>(payloads[0].size());
  const std::string worker_address =
      "127.0.0.1:" + std::to_string((*worker)->port());
  const std::string sink_address = "127.0.0.1:" + std::to_string(sink_port);
  const std::string raw_sink_address =
      "127.0.0.1:" + std::to_string(raw_sink_port);

  int run = 0;  // sessions are named bench-<run>, one per timed run
  // The two tables (in-band against the sinks, shared memory against
  // in-band) for one histogram resolution.
  auto measure = [&](uint32_t bins) -> bool {
    std::printf(
        "kvcal ingest benchmark: %d chunks of %.0f MiB bf16 per run, "
        "backend %s, %u bins/octave, %u hardware threads\n",
        chunks, bytes_per_chunk / (1 << 20), backend.c_str(), bins,
        std::thread::hardware_concurrency());
    std::printf(
        "copies of the chunk data in the worker: 0 (read in place from gRPC's "
        "receive slices; a value split between two slices is assembled in an "
        "8-byte buffer); typed sink: 1 (protobuf parse into a std::string)\n");
    std::printf("%-8s %14s %14s %8s   %-16s %14s %9s   %s\n", "streams",
                "worker GB/s", "sink GB/s", "ratio", "per-round ratios",
                "raw sink GB/s", "raw ratio",
                "minor faults/chunk (worker, sink, raw sink)");
    struct ShmRow {
      int streams;
      double inband_gbs, shm_gbs, low, high, faults, inplace_gbs;
    };
    std::vector<ShmRow> shm_rows;
    for (int streams : stream_counts) {
      const int total = (chunks / streams) * streams;
      // Warm-up on the sink, then `reps` rounds that alternate sink and worker
      // so that drifting machine load touches both alike; medians reported.
      Run(sink_address, "warm-up", streams, streams * 2, payloads);
      Run(raw_sink_address, "warm-up", streams, streams * 2, payloads);
      std::vector<double> sink_seconds, worker_seconds, raw_seconds,
          shm_seconds, inplace_seconds;
      int64_t worker_faults = 0, sink_faults = 0, raw_faults = 0,
              shm_faults = 0;
      // A fresh session per run so every chunk is applied, not a duplicate;
      // its name, or "" (said on stderr) when the worker refuses it.
      const kvcal::Geometry geometry{kLayers,  kHeads, kHeads,
                                     kHeadDim, bins,   0b111};
      auto new_session = [&]() -> std::string {
        std::string name = "bench-" + std::to_string(run++);
        if (!(*worker)
                 ->service()
                 .registry()
                 .Create(kvcal::service::kDefaultTenant, name, geometry)
                 .ok()) {
          std::fprintf(stderr, "cannot create session %s\n", name.c_str());
          return "";
        }
        return name;
      };
      for (int rep = 0; rep < reps; ++rep) {
        const std::string session = new_session();
        if (session.empty()) return false;
        int64_t before = MinorFaults();
        sink_seconds.push_back(
            Run(sink_address, session, streams, total, payloads));
        sink_faults += MinorFaults() - before;
        before = MinorFaults();
        raw_seconds.push_back(
            Run(raw_sink_address, session, streams, total, payloads));
        raw_faults += MinorFaults() - before;
        before = MinorFaults();
        worker_seconds.push_back(
            Run(worker_address, session, streams, total, payloads));
        worker_faults += MinorFaults() - before;
        const std::string shm_session = new_session();
        if (shm_session.empty()) return false;
        before = MinorFaults();
        shm_seconds.push_back(RunShm(worker_address, shm_session, streams,
                                     total, payloads,
                                     static_cast<size_t>(shm_window),
                                     /*copy=*/true));
        shm_faults += MinorFaults() - before;
        const std::string inplace_session = new_session();
        if (inplace_session.empty()) return false;
        inplace_seconds.push_back(RunShm(worker_address, inplace_session,
                                         streams, total, payloads,
                                         static_cast<size_t>(shm_window),
                                         /*copy=*/false));
        auto info = (*worker)
                        ->service()
                        .registry()
                        .Get(kvcal::service::kDefaultTenant, shm_session)
                        .value()
                        ->Info();
        if (!info.ok() ||
            info->counters.chunks_applied != static_cast<uint64_t>(total)) {
          std::fprintf(stderr, "shared memory run applied %llu of %d chunks\n",
                       info.ok() ? static_cast<unsigned long long>(
                                       info->counters.chunks_applied)
                                 : 0ull,
                       total);
          return false;
        }
      }
      const double gb = total * bytes_per_chunk / 1e9;
      const double sink_median = Median(sink_seconds);
      const double worker_median = Median(worker_seconds);
      double low = 1e9, high = 0;
      for (int rep = 0; rep < reps; ++rep) {
        low = std::min(low, sink_seconds[rep] / worker_seconds[rep]);
        high = std::max(high, sink_seconds[rep] / worker_seconds[rep]);
      }
      const double raw_median = Median(raw_seconds);
      const double chunk_runs = static_cast<double>(total) * reps;
      char range[40];
      std::snprintf(range, sizeof(range), "%.3f..%.3f", low, high);
      std::printf(
          "%-8d %14.3f %14.3f %8.3f   %-16s %14.3f %9.3f   %.1f, %.1f, %.1f\n",
          streams, gb / worker_median, gb / sink_median,
          sink_median / worker_median, range, gb / raw_median,
          raw_median / worker_median, worker_faults / chunk_runs,
          sink_faults / chunk_runs, raw_faults / chunk_runs);
      double shm_low = 1e9, shm_high = 0;
      for (int rep = 0; rep < reps; ++rep) {
        shm_low = std::min(shm_low, worker_seconds[rep] / shm_seconds[rep]);
        shm_high = std::max(shm_high, worker_seconds[rep] / shm_seconds[rep]);
      }
      shm_rows.push_back({streams, gb / worker_median, gb / Median(shm_seconds),
                          shm_low, shm_high, shm_faults / chunk_runs,
                          gb / Median(inplace_seconds)});
    }
    std::printf(
        "\nsame-host shared memory (same rounds; ring of %d slots per stream, "
        "the producer's copy into the slot timed; worker copies: 0)\n",
        shm_window);
    std::printf("%-8s %14s %14s %10s   %-16s %13s %10s   %s\n", "streams",
                "in-band GB/s", "shm GB/s", "shm ratio", "per-round ratios",
                "in-place GB/s", "ratio", "minor faults/chunk (shm)");
    for (const ShmRow& r : shm_rows) {
      char range[40];
      std::snprintf(range, sizeof(range), "%.2f..%.2f", r.low, r.high);
      std::printf("%-8d %14.3f %14.3f %10.2f   %-16s %13.3f %10.2f   %.1f\n",
                  r.streams, r.inband_gbs, r.shm_gbs, r.shm_gbs / r.inband_gbs,
                  range, r.inplace_gbs, r.inplace_gbs / r.inband_gbs, r.faults);
    }
    std::printf("goal (issue 14): shm ratio >= 5 for 1 and 4 streams\n\n");
    return true;
  };
  for (uint32_t bins : bin_counts) {
    if (!measure(bins)) return 1;
  }
  sink->Shutdown();
  raw_sink->Shutdown();
  (*worker)->Shutdown(std::chrono::milliseconds(1000));
  return 0;
}
