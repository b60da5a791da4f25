#include "service/ingest_wire.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace kvcal::service {
namespace {

// IngestRequest.data (calibration.proto).
constexpr uint32_t kDataField = 11;

// Reads the message's bytes across the slices.
class SliceCursor {
 public:
  explicit SliceCursor(const std::vector<grpc::Slice>& slices)
      : slices_(slices) {
    Settle();
  }

  bool done() const { return index_ == slices_.size(); }

  bool ReadByte(uint8_t* out) {
    if (done()) return false;
    *out = slices_[index_].begin()[offset_];
    Advance(1);
    return true;
  }

  bool ReadVarint(uint64_t* out) {
    uint64_t value = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t b = 0;
      if (!ReadByte(&b)) return false;
      value |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) {
        *out = value;
        return true;
      }
    }
    return false;
  }

  // Hands the next n bytes to `piece` as views, slice by slice.
  template <typename F>
  bool Take(uint64_t n, F piece) {
    while (n > 0) {
      if (done()) return false;
      const grpc::Slice& s = slices_[index_];
      const size_t take =
          static_cast<size_t>(std::min<uint64_t>(n, s.size() - offset_));
      piece(reinterpret_cast<const std::byte*>(s.begin()) + offset_, take);
      Advance(take);
      n -= take;
    }
    return true;
  }

 private:
  void Advance(size_t n) {
    offset_ += n;
    Settle();
  }
  // Moves past exhausted (and empty) slices.
  void Settle() {
    while (index_ < slices_.size() && offset_ >= slices_[index_].size()) {
      ++index_;
      offset_ = 0;
    }
  }

  const std::vector<grpc::Slice>& slices_;
  size_t index_ = 0;
  size_t offset_ = 0;
};

void AppendVarint(uint64_t value, std::string* out) {
  while (value >= 0x80) {
    out->push_back(static_cast<char>((value & 0x7f) | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
}

absl::Status Malformed(uint64_t field, absl::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat("the chunk message is not a valid IngestRequest: field ",
                   field, " ", what));
}

}  // namespace

absl::Status ReceivedIngestRequest::Parse() {
  slices_.clear();
  if (!buffer_.Dump(&slices_).ok()) {
    return absl::InvalidArgumentError("the chunk message cannot be read");
  }
  header_.Clear();
  header_bytes_.clear();
  data_.clear();
  data_bytes_ = 0;
  SliceCursor cursor(slices_);
  auto copy = [this](const std::byte* p, size_t n) {
    header_bytes_.append(reinterpret_cast<const char*>(p), n);
  };
  while (!cursor.done()) {
    uint64_t tag = 0;
    if (!cursor.ReadVarint(&tag)) return Malformed(0, "has a truncated tag");
    const uint64_t field = tag >> 3;
    const uint32_t wire_type = static_cast<uint32_t>(tag & 7);
    if (field == 0) return Malformed(0, "is not a field number");
    if (field == kDataField && wire_type == 2) {
      // The last occurrence wins, as protobuf parsing has it.
      uint64_t length = 0;
      if (!cursor.ReadVarint(&length)) {
        return Malformed(field, "(data) has a truncated length");
      }
      data_.clear();
      data_bytes_ = length;
      if (!cursor.Take(length, [this](const std::byte* p, size_t n) {
            data_.emplace_back(p, n);
          })) {
        return Malformed(field, "(data) is truncated");
      }
      continue;
    }
    // Any other field goes, re-encoded as it came, to the small message
    // that protobuf parses.
    AppendVarint(tag, &header_bytes_);
    uint64_t value = 0;
    switch (wire_type) {
      case 0:
        if (!cursor.ReadVarint(&value)) return Malformed(field, "is truncated");
        AppendVarint(value, &header_bytes_);
        break;
      case 1:
        if (!cursor.Take(8, copy)) return Malformed(field, "is truncated");
        break;
      case 2:
        if (!cursor.ReadVarint(&value)) return Malformed(field, "is truncated");
        AppendVarint(value, &header_bytes_);
        if (value > (uint64_t{1} << 31) || !cursor.Take(value, copy)) {
          return Malformed(field, "is truncated");
        }
        break;
      case 5:
        if (!cursor.Take(4, copy)) return Malformed(field, "is truncated");
        break;
      default:
        return Malformed(field, absl::StrCat("has wire type ", wire_type,
                                             ", which IngestRequest never "
                                             "uses"));
    }
  }
  if (!header_.ParseFromString(header_bytes_)) {
    return absl::InvalidArgumentError(
        "the chunk message is not a valid IngestRequest (its fields other "
        "than data do not parse)");
  }
  return absl::OkStatus();
}

void ReceivedIngestRequest::Clear() {
  buffer_.Clear();
  slices_.clear();
  header_.Clear();
  header_bytes_.clear();
  data_.clear();
  data_bytes_ = 0;
}

}  // namespace kvcal::service
