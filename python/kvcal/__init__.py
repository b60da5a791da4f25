"""kvcal: calibrate FP8 KV-cache and query scales from a PyTorch job.

    import kvcal, kvcal.torch

    client = kvcal.Client("127.0.0.1:50051")
    client.create_session(model.config)
    with kvcal.Producer(client) as producer, kvcal.torch.capture(model, producer):
        for input_ids in batches:
            model(input_ids)                      # one forward = one batch
    scales = client.finalize(observer="static_minmax", granularity="tensor")
    scales.save("scales.safetensors")             # then: kvcal patch --checkpoint M --scales ...
    # In a running vLLM engine (an RL loop recalibrating every step):
    #   kvcal.vllm.update_attention_scales(model, scales)

kvcal.torch and kvcal.vllm import torch; the rest needs only grpcio,
protobuf and numpy. kvcal.calibrate_model(MODEL_DIR, DATASET, ...) is the
kvcal-calibrate command as a function (docs/calibrate.md).
"""
import importlib

# Imported on first use (PEP 562), so that the console scripts `kvcal` and
# `kvcal-worker` (kvcal._binaries) start without loading grpc and numpy.
_LAZY = {"Client": "kvcal.client", "Geometry": "kvcal.client", "KvcalError": "kvcal.client",
         "DEFAULT_HISTOGRAMS": "kvcal.client", "Producer": "kvcal.producer",
         "ProducerError": "kvcal.producer", "WorkerProducer": "kvcal.producer",
         "ShardedProducer": "kvcal.producer", "Scales": "kvcal.scales",
         # the statistics engine in this process (the extension kvcal._engine)
         "LocalStatistics": "kvcal.producer.statistics",
         # kvcal-calibrate as a function (torch is imported when it runs)
         "calibrate_model": "kvcal.calibrate", "CalibrationResult": "kvcal.calibrate"}


def _version():
    try:  # an installed package: setup.py wrote it from VERSION
        from kvcal._version import __version__ as version
        return version
    except ImportError:  # a checkout: the repository's VERSION file
        import os

        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "VERSION")
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            return "unknown"


__version__ = _version()
__all__ = ["Client", "Geometry", "KvcalError", "Producer", "ProducerError", "WorkerProducer",
           "ShardedProducer", "Scales", "DEFAULT_HISTOGRAMS", "LocalStatistics"]


def __getattr__(name):  # the API above, and kvcal.torch / kvcal.vllm, on first use
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in ("torch", "vllm"):
        return importlib.import_module(f"kvcal.{name}")
    raise AttributeError(f"module 'kvcal' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
