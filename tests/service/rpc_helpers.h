// Small RPC helpers shared by the tests that talk to a real kvcal-worker
// (worker, malformed-request and load tests).
//
//   auto request = kvcal::testing::CreateSessionRequest("s", {2, 4, 2, 8, 16});
//   grpc::Status status;
//   kvcal::v1::Session s = kvcal::testing::GetSession(stub, "s", &status);
#ifndef KVCAL_TESTS_SERVICE_RPC_HELPERS_H_
#define KVCAL_TESTS_SERVICE_RPC_HELPERS_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "kvcal/v1/calibration.grpc.pb.h"

namespace kvcal::testing {

struct TestGeometry {
  uint32_t layers;
  uint32_t q_heads;
  uint32_t kv_heads;
  uint32_t head_dim;
  uint32_t bins_per_octave;
};

inline v1::CreateSessionRequest CreateSessionRequest(const std::string& id,
                                                     const TestGeometry& g) {
  v1::CreateSessionRequest r;
  r.set_session_id(id);
  r.set_num_layers(g.layers);
  r.set_num_attention_heads(g.q_heads);
  r.set_num_key_value_heads(g.kv_heads);
  r.set_head_dim(g.head_dim);
  r.set_histogram_bins_per_octave(g.bins_per_octave);
  return r;
}

inline v1::Session GetSession(v1::Calibration::Stub* stub,
                              const std::string& id, grpc::Status* status) {
  grpc::ClientContext context;
  v1::GetSessionRequest request;
  request.set_session_id(id);
  v1::Session session;
  *status = stub->GetSession(&context, request, &session);
  return session;
}

// The session's serialized statistics (ExportState must succeed).
inline std::string ExportStatistics(v1::Calibration::Stub* stub,
                                    const std::string& id) {
  grpc::ClientContext context;
  v1::ExportStateRequest request;
  request.set_session_id(id);
  v1::SessionState state;
  grpc::Status status = stub->ExportState(&context, request, &state);
  EXPECT_TRUE(status.ok()) << status.error_message();
  return state.statistics();
}

// What one Ingest stream answered.
struct StreamResult {
  std::vector<v1::IngestResponse> responses;
  grpc::Status status;
};

// Sends `chunks` on one Ingest stream (with `token` as the bearer token,
// if any) while a second thread reads every acknowledgement.
inline StreamResult IngestAll(v1::Calibration::Stub* stub,
                              const std::vector<v1::IngestRequest>& chunks,
                              const std::string& token = "") {
  grpc::ClientContext context;
  if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
  auto stream = stub->Ingest(&context);
  StreamResult result;
  std::thread reader([&] {
    v1::IngestResponse response;
    while (stream->Read(&response)) result.responses.push_back(response);
  });
  for (const v1::IngestRequest& chunk : chunks) {
    if (!stream->Write(chunk)) break;
  }
  stream->WritesDone();
  reader.join();
  result.status = stream->Finish();
  return result;
}

}  // namespace kvcal::testing

#endif  // KVCAL_TESTS_SERVICE_RPC_HELPERS_H_
