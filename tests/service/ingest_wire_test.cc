// ReceivedIngestRequest: an IngestRequest read from a ByteBuffer of several
// slices (cut at every offset) gives the message's fields and its data as
// views into the slices, unchanged; a truncated or foreign message is
// InvalidArgument naming the field.
#include "service/ingest_wire.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"

namespace kvcal::service {
namespace {

namespace pb = ::kvcal::v1;
using ::testing::HasSubstr;

pb::IngestRequest Sample() {
  pb::IngestRequest r;
  r.set_session_id("s1");
  r.set_producer_id("rank0");
  r.set_sequence(300);
  r.set_batch(7);
  r.set_layer(3);
  r.set_role(pb::ROLE_V);
  r.set_dtype(pb::DTYPE_BF16);
  r.set_layout(pb::LAYOUT_TOKENS_HEADS_DIM);
  r.add_shape(5);
  r.add_shape(2);
  r.add_shape(4);
  r.set_head_offset(1);
  std::string data(80, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 7);
  r.set_data(data);
  r.add_shard_worker_ids("w0");
  return r;
}

// The message's bytes as a ByteBuffer of slices cut at `cuts`.
void Fill(const std::string& bytes, const std::vector<size_t>& cuts,
          grpc::ByteBuffer* out) {
  std::vector<grpc::Slice> slices;
  size_t at = 0;
  for (size_t cut : cuts) {
    slices.emplace_back(bytes.data() + at, cut - at);
    at = cut;
  }
  slices.emplace_back(bytes.data() + at, bytes.size() - at);
  grpc::ByteBuffer buffer(slices.data(), slices.size());
  out->Swap(&buffer);
}

TEST(IngestWireTest, EveryCutGivesTheSameMessageAndData) {
  const pb::IngestRequest sample = Sample();
  const std::string bytes = sample.SerializeAsString();
  pb::IngestRequest header = sample;
  header.clear_data();
  for (size_t a = 1; a < bytes.size(); a += 3) {
    for (size_t b = a; b < bytes.size(); b += 11) {
      ReceivedIngestRequest request;
      Fill(bytes, {a, b}, request.buffer());
      ASSERT_TRUE(request.Parse().ok()) << a << " " << b;
      EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(
          request.header(), header))
          << request.header().DebugString();
      std::string data;
      for (const auto& piece : request.data()) {
        data.append(reinterpret_cast<const char*>(piece.data()), piece.size());
      }
      EXPECT_EQ(data, sample.data());
      EXPECT_EQ(request.data_bytes(), sample.data().size());
      EXPECT_EQ(request.wire_bytes(), bytes.size());
      request.Clear();
      EXPECT_TRUE(request.data().empty());
    }
  }
}

TEST(IngestWireTest, TruncatedOrForeignMessagesAreRejected) {
  const std::string bytes = Sample().SerializeAsString();
  ReceivedIngestRequest request;
  Fill(bytes.substr(0, bytes.size() - 30), {10}, request.buffer());
  EXPECT_THAT(request.Parse().ToString(),
              HasSubstr("field 11 (data) is truncated"));
  // A group (wire type 3) is no field of IngestRequest.
  Fill(std::string("\x0b\x0c", 2), {1}, request.buffer());
  EXPECT_EQ(request.Parse().code(), absl::StatusCode::kInvalidArgument);
  // A string field that is not UTF-8 fails protobuf's parse of the rest.
  Fill(std::string("\x0a\x02\xff\xfe", 4), {}, request.buffer());
  EXPECT_THAT(request.Parse().ToString(), HasSubstr("do not parse"));
}

}  // namespace
}  // namespace kvcal::service
