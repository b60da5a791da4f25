#include "client/rpc/local_partials.h"

#include <map>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/local_statistics.h"
#include "util/status_macros.h"

namespace kvcal {

absl::StatusOr<std::vector<PartialUpload>> BuildPartials(
    const Geometry& geometry, bool reject_non_finite,
    absl::Span<const ChunkView> tensors,
    const std::set<uint64_t>& holdout_batches, uint64_t batches_per_partial) {
  if (batches_per_partial == 0) {
    return absl::InvalidArgumentError("batches per partial must be 1 or more");
  }
  std::map<uint64_t, std::vector<const ChunkView*>> by_batch;
  for (const ChunkView& t : tensors) {
    if (holdout_batches.count(t.batch) == 0) by_batch[t.batch].push_back(&t);
  }
  LocalStatisticsOptions options;
  options.reject_non_finite = reject_non_finite;
  options.backend_options.cpu_threads = 0;  // every core, as the worker
  KVCAL_ASSIGN_OR_RETURN(std::unique_ptr<LocalStatistics> local,
                         LocalStatistics::Create(geometry, options));
  std::vector<PartialUpload> partials;
  uint64_t in_group = 0;
  PartialUpload current;
  auto close_group = [&]() -> absl::Status {
    const LocalCounters counters = local->counters();
    KVCAL_ASSIGN_OR_RETURN(current.statistics, local->SerializedStatistics());
    current.tensors = counters.chunks_applied;
    current.values = counters.values_ingested;
    current.bytes = counters.bytes_ingested;
    partials.push_back(std::move(current));
    current = PartialUpload{};
    in_group = 0;
    return local->Reset();
  };
  for (const auto& [batch, batch_tensors] : by_batch) {
    for (const ChunkView* t : batch_tensors) {
      if (absl::Status s = local->Accumulate(*t); !s.ok()) {
        return absl::Status(
            s.code(), absl::StrCat("batch ", batch, " layer ", t->layer, " ",
                                   RoleName(t->role), ": ", s.message()));
      }
    }
    if (++in_group == batches_per_partial) {
      KVCAL_RETURN_IF_ERROR(close_group());
    }
  }
  if (in_group > 0) KVCAL_RETURN_IF_ERROR(close_group());
  return partials;
}

}  // namespace kvcal
