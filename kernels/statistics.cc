#include "kernels/statistics.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>

#include "absl/strings/str_cat.h"
#include "kernels/element_math.h"
#include "util/hash.h"
#include "util/status_macros.h"

namespace kvcal {

float HeadStatistics::absmax() const {
  if (finite_count == 0) return 0.0f;
  return std::max(std::fabs(min), std::fabs(max));
}

void HeadStatistics::Add(float x, uint64_t batch,
                         uint32_t log2_bins_per_octave) {
  if (CountIfNonFinite(x, nan_count, inf_count)) return;
  x = CanonicalZero(x);  // min and max see -0.0 as +0.0, as every backend does
  if (x < min) min = x;
  if (x > max) max = x;
  ++finite_count;
  sum += x;
  sum_squares += static_cast<double>(x) * x;
  batches[batch].Add(x);
  if (!histogram.empty()) {
    ++histogram[HistogramBin(x, log2_bins_per_octave)];
    const float a = std::fabs(x);
    MergeTail(&a, 1);
  }
}

void HeadStatistics::MergeTail(const float* values, size_t n) {
  if (n == 0) return;
  // Fast rejection: when the tail is full, only values above its smallest
  // entry can enter (equal values leave the multiset unchanged).
  const bool full = tail.size() >= kTailCapacity;
  const float floor_value = full ? tail.back() : 0.0f;
  bool any = false;
  for (size_t i = 0; i < n && !any; ++i) {
    any = !full || values[i] > floor_value;
  }
  if (!any) return;
  tail.insert(tail.end(), values, values + n);
  const size_t keep = std::min<size_t>(tail.size(), kTailCapacity);
  std::partial_sort(tail.begin(), tail.begin() + static_cast<ptrdiff_t>(keep),
                    tail.end(), std::greater<float>());
  tail.resize(keep);
}

void HeadStatistics::Merge(const HeadStatistics& other) {
  if (other.min < min) min = other.min;
  if (other.max > max) max = other.max;
  finite_count += other.finite_count;
  nan_count += other.nan_count;
  inf_count += other.inf_count;
  sum += other.sum;
  sum_squares += other.sum_squares;
  for (size_t i = 0; i < histogram.size() && i < other.histogram.size(); ++i) {
    histogram[i] += other.histogram[i];
  }
  MergeTail(other.tail.data(), other.tail.size());
  for (const auto& [batch, extrema] : other.batches) {
    batches[batch].Merge(extrema);
  }
}

SessionStatistics::SessionStatistics(const Geometry& geometry)
    : geometry_(geometry) {
  size_t offset = 0;
  for (Role role : geometry_.roles()) {
    role_offset_[RoleIndex(role)] = offset;
    offset += geometry_.heads(role);
  }
  heads_per_layer_ = offset;
  heads_.resize(heads_per_layer_ * geometry_.num_layers);
  Reset();
}

void SessionStatistics::Reset() {
  const uint32_t bins = geometry_.histogram_bins();
  for (HeadStatistics& h : heads_) {
    h = HeadStatistics();
    h.histogram.assign(bins, 0);
  }
}

absl::Status SessionStatistics::Merge(const SessionStatistics& other) {
  if (!(other.geometry_ == geometry_)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot merge statistics of geometry {", other.geometry_.DebugString(),
        "} into {", geometry_.DebugString(), "}"));
  }
  for (size_t i = 0; i < heads_.size(); ++i) heads_[i].Merge(other.heads_[i]);
  return absl::OkStatus();
}

uint64_t SessionStatistics::finite_values() const {
  uint64_t n = 0;
  for (const HeadStatistics& h : heads_) n += h.finite_count;
  return n;
}

NonFiniteHeads FindNonFiniteHeads(const SessionStatistics& stats,
                                  const std::vector<uint32_t>& layers,
                                  size_t limit) {
  NonFiniteHeads out;
  const Geometry& g = stats.geometry();
  auto visit = [&](uint32_t layer) {
    for (Role role : g.roles()) {
      for (uint32_t h = 0; h < g.heads(role); ++h) {
        const HeadStatistics& s = stats.head(layer, role, h);
        if (s.nonfinite_count() == 0) continue;
        ++out.total_heads;
        if (out.heads.size() < limit) {
          out.heads.push_back({layer, role, h, s.nan_count, s.inf_count});
        }
      }
    }
  };
  if (layers.empty()) {
    for (uint32_t l = 0; l < g.num_layers; ++l) visit(l);
  } else {
    for (uint32_t l : layers) visit(l);
  }
  return out;
}

uint64_t SessionStatistics::nonfinite_values() const {
  uint64_t n = 0;
  for (const HeadStatistics& h : heads_) n += h.nonfinite_count();
  return n;
}

namespace {

constexpr uint32_t kMagic = 0x5343564b;  // "KVCS" little-endian
constexpr uint32_t kVersion = 1;

class Writer {
 public:
  template <typename T>
  void Put(T value) {
    static_assert(std::is_trivially_copyable_v<T>);
    char bytes[sizeof(T)];
    std::memcpy(bytes, &value, sizeof(T));  // little-endian hosts only
    out_.append(bytes, sizeof(T));
  }
  std::string& str() { return out_; }

 private:
  std::string out_;
};

class Reader {
 public:
  explicit Reader(absl::string_view in) : in_(in) {}
  template <typename T>
  absl::Status Get(T* value, absl::string_view what) {
    if (in_.size() - pos_ < sizeof(T)) {
      return absl::InvalidArgumentError(
          absl::StrCat("statistics state is truncated at byte ", pos_,
                       " while reading ", what));
    }
    std::memcpy(value, in_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return absl::OkStatus();
  }
  size_t remaining() const { return in_.size() - pos_; }
  size_t pos() const { return pos_; }

 private:
  absl::string_view in_;
  size_t pos_ = 0;
};

absl::Status Corrupt(size_t at, absl::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat("statistics state is corrupt at byte ", at, ": ", what));
}

// The state's geometry and each head's counts, extrema and sums: the fields
// in the order the state stores them, with the names its errors use. The
// writer and the reader walk the same lists, so the two cannot disagree.
template <typename G, typename Visit>  // G: Geometry or const Geometry
void GeometryFields(G& g, Visit&& visit) {
  visit(g.num_layers, "num_layers");
  visit(g.num_attention_heads, "num_attention_heads");
  visit(g.num_key_value_heads, "num_key_value_heads");
  visit(g.head_dim, "head_dim");
  visit(g.bins_per_octave, "bins_per_octave");
  visit(g.role_mask, "role_mask");
}

template <typename H, typename Visit>  // H: HeadStatistics, maybe const
void HeadScalarFields(H& h, Visit&& visit) {
  visit(h.min, "min");
  visit(h.max, "max");
  visit(h.finite_count, "finite count");
  visit(h.nan_count, "nan count");
  visit(h.inf_count, "inf count");
  visit(h.sum, "sum");
  visit(h.sum_squares, "sum of squares");
}

// A visitor for the lists above that reads each field into place, keeping
// the first error in `status` (and reading nothing after it).
auto FieldReader(Reader& r, absl::Status& status) {
  return [&r, &status](auto& value, absl::string_view what) {
    if (status.ok()) status = r.Get(&value, what);
  };
}

}  // namespace

std::string SessionStatistics::Serialize() const {
  Writer w;
  w.Put(kMagic);
  w.Put(kVersion);
  const auto put = [&w](auto value, absl::string_view) { w.Put(value); };
  GeometryFields(geometry_, put);
  const bool histograms = geometry_.has_histograms();
  for (const HeadStatistics& h : heads_) {
    HeadScalarFields(h, put);
    if (histograms) {
      uint32_t used = 0;
      for (uint64_t c : h.histogram) used += c != 0;
      w.Put(used);
      for (uint32_t bin = 0; bin < h.histogram.size(); ++bin) {
        if (h.histogram[bin] == 0) continue;
        w.Put(bin);
        w.Put(h.histogram[bin]);
      }
      w.Put(static_cast<uint32_t>(h.tail.size()));
      for (float v : h.tail) w.Put(v);
    }
    w.Put(static_cast<uint32_t>(h.batches.size()));
    for (const auto& [batch, extrema] : h.batches) {
      w.Put(batch);
      w.Put(extrema.min);
      w.Put(extrema.max);
    }
  }
  w.Put(Fnv1a64(w.str()));
  return std::move(w.str());
}

namespace {

// The state's magic, version and checksum, then its geometry (validated).
absl::StatusOr<Geometry> ReadStateHeader(Reader& r, absl::string_view body,
                                         uint64_t checksum) {
  uint32_t magic = 0, version = 0;
  KVCAL_RETURN_IF_ERROR(r.Get(&magic, "magic"));
  KVCAL_RETURN_IF_ERROR(r.Get(&version, "version"));
  if (magic != kMagic) {
    return absl::InvalidArgumentError(
        "statistics state does not start with the KVCS magic");
  }
  if (version != kVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("statistics state has version ", version,
                     "; this build reads ", kVersion));
  }
  if (Fnv1a64(body) != checksum) {
    return absl::InvalidArgumentError(
        "statistics state checksum mismatch (corrupted or truncated)");
  }
  Geometry g;
  absl::Status status;
  GeometryFields(g, FieldReader(r, status));
  KVCAL_RETURN_IF_ERROR(status);
  if (absl::Status s = g.Validate(); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("statistics state has invalid geometry: ", s.message()));
  }
  return g;
}

// One head's counts, extrema and sums, checked against each other.
absl::Status ReadHeadScalars(Reader& r, HeadStatistics& h) {
  absl::Status status;
  HeadScalarFields(h, FieldReader(r, status));
  KVCAL_RETURN_IF_ERROR(status);
  // Sums of finite floats stay finite in double (|x|^2 < 2^256 per value),
  // and no sum of squares is negative; anything else was not written here.
  if (!std::isfinite(h.sum) || !std::isfinite(h.sum_squares) ||
      h.sum_squares < 0.0 ||
      (h.finite_count == 0 && (h.sum != 0.0 || h.sum_squares != 0.0))) {
    return Corrupt(r.pos(), "sums not finite or inconsistent with the count");
  }
  if (h.finite_count > 0) {
    if (IsNonFinite(h.min) || IsNonFinite(h.max) || h.min > h.max) {
      return Corrupt(r.pos(), "min/max inconsistent with a finite count");
    }
  } else if (!(h.min == std::numeric_limits<float>::infinity() &&
               h.max == -std::numeric_limits<float>::infinity())) {
    return Corrupt(r.pos(), "min/max set on a head without values");
  }
  return absl::OkStatus();
}

// One head's sparse histogram (ascending non-empty bins summing to the
// finite count) and its tail (descending, as long as the count allows).
absl::Status ReadHeadHistogram(Reader& r, uint32_t bins, HeadStatistics& h) {
  uint32_t used = 0;
  KVCAL_RETURN_IF_ERROR(r.Get(&used, "histogram size"));
  if (used > bins) return Corrupt(r.pos(), "too many histogram bins");
  uint64_t total = 0;
  int64_t previous = -1;
  for (uint32_t i = 0; i < used; ++i) {
    uint32_t bin = 0;
    uint64_t count = 0;
    KVCAL_RETURN_IF_ERROR(r.Get(&bin, "histogram bin"));
    KVCAL_RETURN_IF_ERROR(r.Get(&count, "histogram count"));
    if (bin >= bins || static_cast<int64_t>(bin) <= previous || count == 0) {
      return Corrupt(r.pos(), "histogram bins out of order or empty");
    }
    previous = bin;
    h.histogram[bin] = count;
    if (__builtin_add_overflow(total, count, &total)) {
      return Corrupt(r.pos(), "histogram counts overflow");
    }
  }
  if (total != h.finite_count) {
    return Corrupt(r.pos(), "histogram total differs from finite count");
  }
  uint32_t tail_size = 0;
  KVCAL_RETURN_IF_ERROR(r.Get(&tail_size, "tail size"));
  if (tail_size > kTailCapacity || tail_size > h.finite_count ||
      tail_size < std::min<uint64_t>(h.finite_count, kTailCapacity)) {
    return Corrupt(r.pos(), "tail size inconsistent with finite count");
  }
  h.tail.resize(tail_size);
  for (uint32_t i = 0; i < tail_size; ++i) {
    KVCAL_RETURN_IF_ERROR(r.Get(&h.tail[i], "tail value"));
    if (!(h.tail[i] >= 0.0f) || IsNonFinite(h.tail[i]) ||
        (i > 0 && h.tail[i] > h.tail[i - 1])) {
      return Corrupt(r.pos(), "tail values not finite, >= 0, descending");
    }
  }
  return absl::OkStatus();
}

// One head's per-batch extrema: ascending batches within the head's range.
absl::Status ReadHeadBatches(Reader& r, HeadStatistics& h) {
  uint32_t num_batches = 0;
  KVCAL_RETURN_IF_ERROR(r.Get(&num_batches, "batch count"));
  if (num_batches > r.remaining() / 16 || num_batches > h.finite_count) {
    return Corrupt(r.pos(), "batch count exceeds the state");
  }
  int64_t previous_batch_seen = 0;
  uint64_t previous_batch = 0;
  for (uint32_t i = 0; i < num_batches; ++i) {
    uint64_t batch = 0;
    MinMax extrema;
    KVCAL_RETURN_IF_ERROR(r.Get(&batch, "batch number"));
    KVCAL_RETURN_IF_ERROR(r.Get(&extrema.min, "batch min"));
    KVCAL_RETURN_IF_ERROR(r.Get(&extrema.max, "batch max"));
    if ((previous_batch_seen && batch <= previous_batch) ||
        IsNonFinite(extrema.min) || IsNonFinite(extrema.max) ||
        extrema.min > extrema.max || extrema.min < h.min ||
        extrema.max > h.max) {
      return Corrupt(r.pos(), "batch extrema out of order or range");
    }
    previous_batch_seen = 1;
    previous_batch = batch;
    h.batches.emplace_hint(h.batches.end(), batch, extrema);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<SessionStatistics> SessionStatistics::Deserialize(
    absl::string_view bytes) {
  if (bytes.size() < sizeof(uint64_t) + 8 * sizeof(uint32_t)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "statistics state is truncated: ", bytes.size(), " bytes"));
  }
  const absl::string_view body = bytes.substr(0, bytes.size() - 8);
  uint64_t checksum;
  std::memcpy(&checksum, bytes.data() + body.size(), sizeof(checksum));
  Reader r(body);
  KVCAL_ASSIGN_OR_RETURN(const Geometry g, ReadStateHeader(r, body, checksum));
  // Every head needs at least its fixed fields: reject absurd geometries
  // before allocating for them.
  constexpr size_t kFixedHeadBytes = 4 + 4 + 8 * 3 + 8 * 2 + 4;
  if (g.total_heads() > r.remaining() / kFixedHeadBytes) {
    return Corrupt(r.pos(), "geometry needs more heads than the state holds");
  }
  SessionStatistics stats(g);
  const uint32_t bins = g.histogram_bins();
  for (HeadStatistics& h : stats.heads_) {
    KVCAL_RETURN_IF_ERROR(ReadHeadScalars(r, h));
    if (g.has_histograms())
      KVCAL_RETURN_IF_ERROR(ReadHeadHistogram(r, bins, h));
    KVCAL_RETURN_IF_ERROR(ReadHeadBatches(r, h));
  }
  if (r.remaining() != 0) {
    return Corrupt(r.pos(), "trailing bytes after the last head");
  }
  return stats;
}

size_t EstimateStateBytes(const Geometry& geometry) {
  const size_t per_head =
      sizeof(HeadStatistics) +
      static_cast<size_t>(geometry.histogram_bins()) * sizeof(uint64_t) +
      (geometry.has_histograms() ? kTailCapacity * sizeof(float) : 0);
  return per_head * geometry.total_heads();
}

}  // namespace kvcal
