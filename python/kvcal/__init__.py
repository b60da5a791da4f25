"""kvcal: calibrate FP8 KV-cache and query scales from a PyTorch job.

    import kvcal, kvcal.torch

    client = kvcal.Client("127.0.0.1:50051")
    client.create_session(model.config)
    with kvcal.Producer(client) as producer, kvcal.torch.capture(model, producer):
        for input_ids in batches:
            model(input_ids)                      # one forward = one batch
    scales = client.finalize(observer="static_minmax", granularity="head")
    scales.save("scales.safetensors")             # then: kvcal patch --checkpoint M --scales ...
    # In a running vLLM engine (an RL loop recalibrating every step):
    #   kvcal.vllm.update_attention_scales(model, scales)

kvcal.torch and kvcal.vllm import torch; the rest needs only grpcio,
protobuf and numpy.
"""
from kvcal.client import (DEFAULT_HISTOGRAMS, Client, Geometry,  # noqa: F401
                          KvcalError)
from kvcal.producer import Producer, ProducerError  # noqa: F401
from kvcal.scales import Scales  # noqa: F401

__version__ = "0.1.0"
__all__ = ["Client", "Geometry", "KvcalError", "Producer", "ProducerError", "Scales",
           "DEFAULT_HISTOGRAMS"]


def __getattr__(name):  # kvcal.torch / kvcal.vllm on first use
    if name in ("torch", "vllm"):
        import importlib

        return importlib.import_module(f"kvcal.{name}")
    raise AttributeError(f"module 'kvcal' has no attribute {name!r}")
