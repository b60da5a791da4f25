#!/usr/bin/env python3
"""Calibrates FP8 KV-cache and query scales of a tiny random Llama with kvcal.

Builds a small LlamaForCausalLM from a LlamaConfig with random weights (no
download), saves it, runs a few batches of token ids through it under
kvcal.torch.capture, finalizes per tensor (static min-max: what
docs/quality.md and `kvcal report` recommend, and it loads on every vLLM
attention backend; per head starts only on FlashAttention 3, Hopper), writes
the scales file and patches the saved model with `kvcal patch`. The worker
and the CLI are the wheel's or a checkout's build (kvcal._binaries.find).

    python python/examples/calibrate_tiny_llama.py                # starts a local worker
    python python/examples/calibrate_tiny_llama.py --target HOST:PORT --out DIR
"""
import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch
import transformers

import kvcal
import kvcal.torch
from kvcal import _binaries


def binary(name, build_dir):
    """BUILD_DIR's program when --build-dir is given, else the wheel's or
    the checkout's (kvcal._binaries.find); None when there is none."""
    if build_dir:
        return os.path.join(build_dir, "client" if name == "kvcal" else "service", name)
    try:
        return _binaries.find(name)
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        return None


def start_local_worker(build_dir, workdir):
    binary_path = binary("kvcal-worker", build_dir)
    if binary_path is None or not os.path.exists(binary_path):
        sys.exit(f"no worker at {binary_path}: build it (./run build) or pass --target")
    port_file = os.path.join(workdir, "worker.port")
    proc = subprocess.Popen([binary_path, "--listen", "127.0.0.1:0", "--port-file", port_file,
                             "--backend", "cpu"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(1000):
        if os.path.exists(port_file) and open(port_file).read().strip():
            return proc, f"127.0.0.1:{open(port_file).read().strip()}"
        if proc.poll() is not None:
            sys.exit("kvcal-worker exited at start")
        time.sleep(0.01)
    sys.exit("kvcal-worker did not start")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", help="worker host:port (default: start one from the build)")
    parser.add_argument("--out", help="output directory (default: a new temporary one)")
    parser.add_argument("--build-dir", help="a kvcal build directory (default: the wheel's "
                        "binaries, or the checkout's build/)")
    parser.add_argument("--kvcal", help="the kvcal CLI (default: BUILD_DIR/client/kvcal)")
    parser.add_argument("--batches", type=int, default=8)
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="kvcal-tiny-llama-")
    os.makedirs(out, exist_ok=True)
    start = time.monotonic()
    timings = {}

    # 1. A tiny Llama with grouped-query attention, random weights, saved as safetensors.
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=4, num_attention_heads=8,
                                      num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(config).eval()
    model_dir = os.path.join(out, "model")
    model.save_pretrained(model_dir)
    timings["build and save the model"] = time.monotonic() - start

    worker = None
    target = args.target
    if target is None:
        worker, target = start_local_worker(args.build_dir, out)
    try:
        # 2. Capture post-RoPE q, k and v of every layer, one batch per forward.
        client = kvcal.Client(target)
        client.create_session(model.config)
        with kvcal.Producer(client) as producer, kvcal.torch.capture(model, producer):
            with torch.no_grad():
                for _ in range(args.batches):
                    model(torch.randint(0, config.vocab_size, (4, 64)), use_cache=False)
        timings["capture"] = time.monotonic() - start - sum(timings.values())
        status = client.status()
        print(f"session {status.session_id}: {status.values_ingested} values in "
              f"{status.chunks_applied} chunks")

        # 3. Scales per tensor (static min-max), as a scales file and as vLLM
        # tensors. granularity="head" gives one per head: worth it only where
        # an evaluation shows it, and vLLM starts such a checkpoint only on
        # FlashAttention 3 (README.md "Per tensor or per head").
        scales = client.finalize(observer="static_minmax", granularity="tensor")
        scales_path = os.path.join(out, "scales.safetensors")
        scales.save(scales_path)
        print(f"layer 0 k_scale: {scales['model.layers.0.self_attn.k_scale'].reshape(-1)}")
        # A running vLLM engine takes them with
        # kvcal.vllm.update_attention_scales(model, scales) (python/README.md).
        client.delete()
    finally:
        if worker is not None:
            worker.send_signal(signal.SIGTERM)
            worker.wait()

    # 4. Patch the saved checkpoint so vLLM loads the scales.
    cli = args.kvcal or binary("kvcal", args.build_dir)
    if cli is not None and os.path.exists(cli):
        patched = os.path.join(out, "model-fp8kv")
        shutil.rmtree(patched, ignore_errors=True)
        subprocess.run([cli, "patch", "--checkpoint", model_dir, "--scales", scales_path,
                        "--out", patched], check=True)
        print(f"patched checkpoint: {patched}")
    else:
        print(f"no kvcal CLI; patch with: kvcal patch --checkpoint {model_dir} --scales {scales_path}")
    timings["finalize and patch"] = time.monotonic() - start - sum(timings.values())
    print("  ".join(f"{k}: {v:.1f} s" for k, v in timings.items()))
    print(f"done in {time.monotonic() - start:.1f} s (after imports); files in {out}")


if __name__ == "__main__":
    main()
