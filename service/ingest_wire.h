// An IngestRequest read straight from gRPC's receive buffer: every field but
// `data` is parsed into a message; `data` stays where gRPC received it, as
// views into the buffer's slices (no copy), which this object keeps alive.
//
//   ReceivedIngestRequest request;
//   reactor->StartRead(request.buffer());   // a raw (ByteBuffer) stream
//   ... in OnReadDone:
//   KVCAL_RETURN_IF_ERROR(request.Parse());
//   ChunkView chunk = ChunkFromProto(request.header());
//   chunk.pieces = request.data();
#ifndef KVCAL_SERVICE_INGEST_WIRE_H_
#define KVCAL_SERVICE_INGEST_WIRE_H_

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kvcal/v1/calibration.pb.h"

namespace kvcal::service {

class ReceivedIngestRequest {
 public:
  // Where a read puts the message.
  grpc::ByteBuffer* buffer() { return &buffer_; }
  // Bytes of the message as received.
  size_t wire_bytes() const { return buffer_.Length(); }

  // Parses the received message (once). InvalidArgument, naming the field,
  // for a message that is not a well-formed IngestRequest.
  [[nodiscard]] absl::Status Parse();

  const kvcal::v1::IngestRequest& header() const { return header_; }
  // The `data` field: views into the received slices, in order.
  const std::vector<absl::Span<const std::byte>>& data() const { return data_; }
  uint64_t data_bytes() const { return data_bytes_; }

  // Forgets the message, keeping the vectors' capacity for the next one.
  void Clear();

 private:
  grpc::ByteBuffer buffer_;
  std::vector<grpc::Slice> slices_;
  kvcal::v1::IngestRequest header_;
  std::string header_bytes_;
  std::vector<absl::Span<const std::byte>> data_;
  uint64_t data_bytes_ = 0;
};

}  // namespace kvcal::service

#endif  // KVCAL_SERVICE_INGEST_WIRE_H_
