#include "client/calibration_client.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <map>
#include <set>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kernels/status_macros.h"

namespace kvcal {
namespace {

constexpr absl::Duration kRpcTimeout = absl::Seconds(60);

void AddCounters(const v1::Session& from, v1::Session& to) {
  to.set_chunks_applied(to.chunks_applied() + from.chunks_applied());
  to.set_values_ingested(to.values_ingested() + from.values_ingested());
  to.set_bytes_ingested(to.bytes_ingested() + from.bytes_ingested());
  to.set_nonfinite_values(to.nonfinite_values() + from.nonfinite_values());
  to.set_state_bytes(to.state_bytes() + from.state_bytes());
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ExpandEndpoint(
    absl::string_view endpoint) {
  constexpr absl::string_view kDns = "dns:///";
  if (!absl::StartsWith(endpoint, kDns))
    return std::vector<std::string>{std::string(endpoint)};
  const absl::string_view target = endpoint.substr(kDns.size());
  const size_t colon = target.rfind(':');
  if (colon == absl::string_view::npos || colon == 0 ||
      colon + 1 == target.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", endpoint, "' must be dns:///host:port"));
  }
  const std::string host(target.substr(0, colon));
  const std::string port(target.substr(colon + 1));
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (const int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &found);
      rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve ", host, ": ", gai_strerror(rc)));
  }
  std::set<std::string> addresses;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    char text[INET6_ADDRSTRLEN] = {};
    const void* raw =
        a->ai_family == AF_INET
            ? static_cast<const void*>(
                  &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr)
            : static_cast<const void*>(
                  &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr);
    if (inet_ntop(a->ai_family, raw, text, sizeof(text)) == nullptr) continue;
    addresses.insert(a->ai_family == AF_INET6
                         ? absl::StrCat("[", text, "]:", port)
                         : absl::StrCat(text, ":", port));
  }
  freeaddrinfo(found);
  if (addresses.empty()) {
    return absl::UnavailableError(absl::StrCat(host, " has no addresses"));
  }
  // Sorted, so every client that resolves the same set shards alike.
  return std::vector<std::string>(addresses.begin(), addresses.end());
}

size_t CalibrationClient::WorkerFor(absl::string_view session_id,
                                    uint32_t layer, size_t workers) {
  if (workers <= 1) return 0;
  uint64_t hash = 0xcbf29ce484222325ull;
  auto mix = [&](unsigned char byte) {
    hash ^= byte;
    hash *= 0x100000001b3ull;
  };
  for (char c : session_id) mix(static_cast<unsigned char>(c));
  for (int i = 0; i < 4; ++i) mix(static_cast<unsigned char>(layer >> (8 * i)));
  return static_cast<size_t>(hash % workers);
}

absl::StatusOr<CalibrationClient> CalibrationClient::Connect(
    const std::vector<std::string>& endpoints, ConnectionOptions options) {
  CalibrationClient client;
  client.options_ = std::move(options);
  for (const std::string& list : endpoints) {
    for (absl::string_view e : absl::StrSplit(list, ',', absl::SkipEmpty())) {
      KVCAL_ASSIGN_OR_RETURN(std::vector<std::string> expanded,
                             ExpandEndpoint(e));
      for (std::string& endpoint : expanded) {
        Worker w;
        w.endpoint = std::move(endpoint);
        KVCAL_ASSIGN_OR_RETURN(w.channel,
                               MakeChannel(w.endpoint, client.options_));
        w.stub = v1::Calibration::NewStub(w.channel);
        client.workers_.push_back(std::move(w));
      }
    }
  }
  if (client.workers_.empty()) {
    return absl::InvalidArgumentError("no server given (--server host:port)");
  }
  return client;
}

absl::StatusOr<v1::Session> CalibrationClient::CreateSession(
    v1::CreateSessionRequest request) {
  v1::Session first;
  for (size_t i = 0; i < workers_.size(); ++i) {
    grpc::ClientContext context;
    PrepareContext(context, options_, kRpcTimeout, /*wait_for_ready=*/true);
    v1::Session session;
    KVCAL_RETURN_IF_ERROR(ToAbslStatus(
        workers_[i].stub->CreateSession(&context, request, &session),
        absl::StrCat("CreateSession on ", workers_[i].endpoint)));
    if (i == 0) {
      first = session;
      request.set_session_id(session.session_id());
    }
  }
  return first;
}

absl::StatusOr<v1::Session> CalibrationClient::GetSession(
    const std::string& session_id) {
  v1::Session total;
  for (size_t i = 0; i < workers_.size(); ++i) {
    grpc::ClientContext context;
    PrepareContext(context, options_, kRpcTimeout);
    v1::GetSessionRequest request;
    request.set_session_id(session_id);
    v1::Session session;
    KVCAL_RETURN_IF_ERROR(
        ToAbslStatus(workers_[i].stub->GetSession(&context, request, &session),
                     absl::StrCat("GetSession on ", workers_[i].endpoint)));
    if (i == 0) {
      total = session;
      total.clear_producers();
      total.set_chunks_applied(0);
      total.set_values_ingested(0);
      total.set_bytes_ingested(0);
      total.set_nonfinite_values(0);
      total.set_state_bytes(0);
    }
    AddCounters(session, total);
    for (const v1::ProducerWatermark& p : session.producers()) {
      v1::ProducerWatermark* out = total.add_producers();
      *out = p;
      if (workers_.size() > 1) {
        out->set_producer_id(absl::StrCat("w", i, "/", p.producer_id()));
      }
    }
  }
  return total;
}

absl::StatusOr<std::vector<v1::Session>> CalibrationClient::ListSessions() {
  std::map<std::string, v1::Session> by_id;
  for (const Worker& w : workers_) {
    grpc::ClientContext context;
    PrepareContext(context, options_, kRpcTimeout);
    v1::ListSessionsResponse response;
    KVCAL_RETURN_IF_ERROR(ToAbslStatus(
        w.stub->ListSessions(&context, v1::ListSessionsRequest(), &response),
        absl::StrCat("ListSessions on ", w.endpoint)));
    for (const v1::Session& s : response.sessions()) {
      auto [it, inserted] = by_id.emplace(s.session_id(), s);
      if (!inserted) AddCounters(s, it->second);
    }
  }
  std::vector<v1::Session> sessions;
  for (auto& [id, s] : by_id) sessions.push_back(std::move(s));
  return sessions;
}

absl::Status CalibrationClient::DeleteSession(const std::string& session_id) {
  for (const Worker& w : workers_) {
    grpc::ClientContext context;
    PrepareContext(context, options_, kRpcTimeout);
    v1::DeleteSessionRequest request;
    request.set_session_id(session_id);
    v1::DeleteSessionResponse response;
    KVCAL_RETURN_IF_ERROR(
        ToAbslStatus(w.stub->DeleteSession(&context, request, &response),
                     absl::StrCat("DeleteSession on ", w.endpoint)));
  }
  return absl::OkStatus();
}

absl::StatusOr<UploadResult> CalibrationClient::Upload(
    const std::string& session_id, absl::Span<const ChunkView> chunks,
    UploaderOptions options) {
  options.session_id = session_id;
  if (!options.counters) options.counters = std::make_shared<UploadCounters>();
  std::vector<std::vector<ChunkView>> per_worker(workers_.size());
  for (const ChunkView& c : chunks) {
    per_worker[WorkerFor(session_id, c.layer, workers_.size())].push_back(c);
  }
  std::vector<absl::StatusOr<UploadResult>> results(
      workers_.size(), absl::StatusOr<UploadResult>(UploadResult{}));
  std::vector<std::thread> threads;
  for (size_t i = 0; i < workers_.size(); ++i) {
    if (per_worker[i].empty()) continue;
    threads.emplace_back([&, i] {
      Uploader uploader(workers_[i].channel, options_, options);
      results[i] = uploader.Upload(per_worker[i]);
    });
  }
  for (std::thread& t : threads) t.join();
  UploadResult total;
  for (size_t i = 0; i < workers_.size(); ++i) {
    if (!results[i].ok()) {
      return absl::Status(results[i].status().code(),
                          absl::StrCat(workers_[i].endpoint, ": ",
                                       results[i].status().message()));
    }
    const UploadResult& r = *results[i];
    total.chunks += r.chunks;
    total.chunks_skipped += r.chunks_skipped;
    total.chunks_sent += r.chunks_sent;
    total.chunks_applied += r.chunks_applied;
    total.chunks_duplicate += r.chunks_duplicate;
    total.bytes += r.bytes;
    total.reconnects += r.reconnects;
  }
  return total;
}

absl::StatusOr<v1::FinalizeResponse> CalibrationClient::Finalize(
    v1::FinalizeRequest request) {
  std::vector<uint32_t> layers(request.layers().begin(),
                               request.layers().end());
  if (layers.empty()) {
    KVCAL_ASSIGN_OR_RETURN(v1::Session session,
                           GetSession(request.session_id()));
    for (uint32_t l = 0; l < session.num_layers(); ++l) layers.push_back(l);
  }
  std::vector<std::vector<uint32_t>> per_worker(workers_.size());
  for (uint32_t l : layers) {
    per_worker[WorkerFor(request.session_id(), l, workers_.size())].push_back(
        l);
  }
  v1::FinalizeResponse total;
  for (size_t i = 0; i < workers_.size(); ++i) {
    if (per_worker[i].empty()) continue;  // empty would mean "all layers"
    v1::FinalizeRequest part = request;
    part.clear_layers();
    for (uint32_t l : per_worker[i]) part.add_layers(l);
    grpc::ClientContext context;
    PrepareContext(context, options_, kRpcTimeout);
    v1::FinalizeResponse response;
    KVCAL_RETURN_IF_ERROR(
        ToAbslStatus(workers_[i].stub->Finalize(&context, part, &response),
                     absl::StrCat("Finalize on ", workers_[i].endpoint)));
    for (v1::LayerScales& l : *response.mutable_layers()) {
      *total.add_layers() = std::move(l);
    }
  }
  std::sort(total.mutable_layers()->begin(), total.mutable_layers()->end(),
            [](const v1::LayerScales& a, const v1::LayerScales& b) {
              return a.layer() < b.layer();
            });
  return total;
}

}  // namespace kvcal
