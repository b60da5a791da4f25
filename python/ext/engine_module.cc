// kvcal._engine: the statistics engine (kernels/local_statistics.h) as a
// CPython extension, for python/kvcal/producer/statistics.py, which is the API
// (this module takes wire numbers and raw buffers; that module checks and
// converts what users pass).
//
//   engine = _engine.Engine(num_layers, num_attention_heads,
//                           num_key_value_heads, head_dim, bins_per_octave,
//                           role_mask, reject_non_finite, backend, device,
//                           threads)
//   engine.accumulate(layer, role, dtype, layout, shape, head_offset, batch,
//                     buffer)        # a C-contiguous buffer, read in place
//   engine.accumulate_device(..., data_ptr, nbytes, ready_event)  # CUDA
//   statistics, nonfinite = engine.export()
//
// Refusals: InvalidArgument is ValueError, anything else RuntimeError, with
// the engine's message; nothing of a refused chunk is applied. Accumulating
// releases the GIL (the engine is thread-safe).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "kernels/backend_factory.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/local_statistics.h"

namespace py = pybind11;

namespace kvcal {
namespace {

[[noreturn]] void Raise(const absl::Status& status) {
  const std::string message(status.message());
  if (absl::IsInvalidArgument(status)) throw py::value_error(message);
  throw std::runtime_error(message);
}

void Check(const absl::Status& status) {
  if (!status.ok()) Raise(status);
}

// Wire numbers (calibration.proto) for the value types; out-of-range values
// reach ValidateChunk, which names them.
ChunkView MakeChunk(uint32_t layer, uint32_t role, uint32_t dtype,
                    uint32_t layout, std::vector<uint64_t> shape,
                    uint32_t head_offset, uint64_t batch) {
  ChunkView chunk;
  chunk.layer = layer;
  chunk.role = static_cast<Role>(role);
  chunk.dtype = static_cast<DType>(dtype);
  chunk.layout = static_cast<Layout>(layout);
  chunk.shape = std::move(shape);
  chunk.head_offset = head_offset;
  chunk.batch = batch;
  return chunk;
}

// A Py_buffer released on scope exit.
class Buffer {
 public:
  explicit Buffer(const py::object& object) {
    // C-contiguous, read-only is enough; the exporter refuses anything else
    // (BufferError naming why).
    if (PyObject_GetBuffer(object.ptr(), &view_, PyBUF_C_CONTIGUOUS) != 0) {
      throw py::error_already_set();
    }
  }
  ~Buffer() { PyBuffer_Release(&view_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  const std::byte* data() const {
    return static_cast<const std::byte*>(view_.buf);
  }
  size_t size() const { return static_cast<size_t>(view_.len); }

 private:
  Py_buffer view_{};
};

class Engine {
 public:
  Engine(uint32_t num_layers, uint32_t num_attention_heads,
         uint32_t num_key_value_heads, uint32_t head_dim,
         uint32_t bins_per_octave, uint32_t role_mask, bool reject_non_finite,
         const std::string& backend, int device, int threads) {
    Geometry geometry{.num_layers = num_layers,
                      .num_attention_heads = num_attention_heads,
                      .num_key_value_heads = num_key_value_heads,
                      .head_dim = head_dim,
                      .bins_per_octave = bins_per_octave,
                      .role_mask = role_mask};
    LocalStatisticsOptions options;
    options.reject_non_finite = reject_non_finite;
    absl::StatusOr<BackendKind> kind = ParseBackendKind(backend);
    if (!kind.ok()) Raise(kind.status());
    options.backend = *kind;
    options.backend_options.device = device;
    options.backend_options.cpu_threads = threads;
    absl::StatusOr<std::unique_ptr<LocalStatistics>> local =
        LocalStatistics::Create(geometry, options);
    if (!local.ok()) Raise(local.status());
    local_ = std::move(*local);
  }

  void Accumulate(uint32_t layer, uint32_t role, uint32_t dtype,
                  uint32_t layout, std::vector<uint64_t> shape,
                  uint32_t head_offset, uint64_t batch,
                  const py::object& data) {
    ChunkView chunk = MakeChunk(layer, role, dtype, layout, std::move(shape),
                                head_offset, batch);
    const Buffer buffer(data);
    chunk.data = absl::Span<const std::byte>(buffer.data(), buffer.size());
    absl::Status status;
    {
      py::gil_scoped_release release;
      status = local_->Accumulate(chunk);
    }
    Check(status);
  }

  // data_ptr: device memory of the backend's device (torch's data_ptr()),
  // nbytes of it; ready_event: a cudaEvent_t recorded after the data was
  // written (0: none).
  void AccumulateDevice(uint32_t layer, uint32_t role, uint32_t dtype,
                        uint32_t layout, std::vector<uint64_t> shape,
                        uint32_t head_offset, uint64_t batch,
                        uintptr_t data_ptr, uint64_t nbytes,
                        uintptr_t ready_event) {
    ChunkView chunk = MakeChunk(layer, role, dtype, layout, std::move(shape),
                                head_offset, batch);
    chunk.data = absl::Span<const std::byte>(
        reinterpret_cast<const std::byte*>(data_ptr),
        static_cast<size_t>(nbytes));
    absl::Status status;
    {
      py::gil_scoped_release release;
      status = local_->AccumulateDeviceData(
          chunk, reinterpret_cast<CUevent_st*>(ready_event));
    }
    Check(status);
  }

  // (SessionStatistics::Serialize() bytes, non-finite values) of one
  // snapshot.
  std::tuple<py::bytes, uint64_t> Export() {
    absl::StatusOr<SessionStatistics> stats;
    std::string bytes;
    {
      py::gil_scoped_release release;
      stats = local_->Snapshot();
      if (stats.ok()) bytes = stats->Serialize();
    }
    if (!stats.ok()) Raise(stats.status());
    return {py::bytes(bytes), stats->nonfinite_values()};
  }

  std::tuple<uint64_t, uint64_t, uint64_t> Counters() const {
    const LocalCounters c = local_->counters();
    return {c.chunks_applied, c.values_ingested, c.bytes_ingested};
  }

  void Reset() { Check(local_->Reset()); }

  std::string backend() const { return std::string(local_->backend_name()); }
  bool accepts_device_data() const { return local_->accepts_device_data(); }

 private:
  std::unique_ptr<LocalStatistics> local_;
};

}  // namespace
}  // namespace kvcal

PYBIND11_MODULE(_engine, m) {
  using kvcal::Engine;
  m.doc() =
      "kvcal's statistics engine (kernels/local_statistics.h); use "
      "kvcal.LocalStatistics";
  m.def("cuda_compiled", &kvcal::CudaBackendCompiled,
        "True when this build has the CUDA backend.");
  m.def("cuda_device_count", &kvcal::CudaDeviceCount,
        "Usable CUDA devices (0 without the backend, a driver or a GPU).");
  py::class_<Engine>(m, "Engine")
      .def(py::init<uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, uint32_t,
                    bool, const std::string&, int, int>(),
           py::arg("num_layers"), py::arg("num_attention_heads"),
           py::arg("num_key_value_heads"), py::arg("head_dim"),
           py::arg("bins_per_octave"), py::arg("role_mask"),
           py::arg("reject_non_finite"), py::arg("backend"), py::arg("device"),
           py::arg("threads"))
      .def("accumulate", &Engine::Accumulate, py::arg("layer"), py::arg("role"),
           py::arg("dtype"), py::arg("layout"), py::arg("shape"),
           py::arg("head_offset"), py::arg("batch"), py::arg("data"))
      .def("accumulate_device", &Engine::AccumulateDevice, py::arg("layer"),
           py::arg("role"), py::arg("dtype"), py::arg("layout"),
           py::arg("shape"), py::arg("head_offset"), py::arg("batch"),
           py::arg("data_ptr"), py::arg("nbytes"), py::arg("ready_event"))
      .def("export", &Engine::Export)
      .def("counters", &Engine::Counters)
      .def("reset", &Engine::Reset)
      .def_property_readonly("backend", &Engine::backend)
      .def_property_readonly("accepts_device_data",
                             &Engine::accepts_device_data);
}
