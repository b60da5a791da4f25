"""MSE parity on raw values: kvcal's MSE scale against llm-compressor's
shrink-factor grid search run on the same raw values (docs/observers.md's goal:
the error of kvcal's scale within 1.02x of the search's for >= 99% of
scales, within 1.05x for all).

    python tests/python/mse_parity.py [--batches 16] [--batch-size 2] [--seq 256]

measures it on SmolLM2-135M-Instruct (GPL-3 text, smollm2.py) against a
local worker (KVCAL_BUILD_DIR, default build/) and prints the figures per
tensor and per head; test_anchor.py asserts the goal on a smaller run."""
import numpy as np
import torch

QMAX = 448.0
GRID, MAX_SHRINK, NORM, PATIENCE = 100, 0.20, 2.4, 5


def _errors(x, absmax):
    """x: [groups, n] float32, absmax: [groups] -> [steps, groups] float64
    errors sum |fq(x) - x|^norm at range p * absmax, p = 1 - i / grid."""
    steps = int(np.floor(MAX_SHRINK * GRID))
    out = torch.empty(steps, x.shape[0], dtype=torch.float64)
    for i in range(steps):
        p = np.float32(1.0 - i / GRID)
        scale = (torch.tensor(p, dtype=torch.float32) * absmax) / QMAX  # float32, as kvcal
        s = scale.view(-1, 1)
        q = (x / s).clamp(-QMAX, QMAX).to(torch.float8_e4m3fn).float() * s
        out[i] = (q - x).abs_().pow_(NORM).sum(dim=1, dtype=torch.float64)
    return out


def _search(errors):
    """llm-compressor's search over the error rows: the best step with
    patience (stop after PATIENCE steps without improvement)."""
    best = []
    for g in range(errors.shape[1]):
        b, bi, bad = float("inf"), 0, 0
        for i in range(errors.shape[0]):
            e = float(errors[i, g])
            if e < b:
                b, bi, bad = e, i, 0
            else:
                bad += 1
                if bad >= PATIENCE:
                    break
        best.append(bi)
    return best


def error_at(x, scales):
    s = torch.as_tensor(np.asarray(scales, dtype=np.float32)).view(-1, 1)
    q = (x / s).clamp(-QMAX, QMAX).to(torch.float8_e4m3fn).float() * s
    return (q - x).abs_().pow_(NORM).sum(dim=1, dtype=torch.float64).numpy()


def ratios(values, kvcal_scales):
    """values: [groups, n] float32 raw values (one row per scale); returns
    (ratio to the patience search, ratio to the grid's minimum) per row."""
    x = torch.as_tensor(values, dtype=torch.float32)
    absmax = x.abs().amax(dim=1)
    errors = _errors(x, absmax)
    chosen = _search(errors)
    searched = errors[chosen, torch.arange(x.shape[0])].numpy()
    minimum = errors.min(dim=0).values.numpy()
    ours = error_at(x, kvcal_scales)
    return ours / searched, ours / minimum


def rows(recorded, layer, role, granularity):
    """The raw values of (layer, role) over all recorded forwards: one row
    per head ([heads, n]) or a single row."""
    t = torch.cat([f[layer][role].float().transpose(0, 1).reshape(f[layer][role].shape[1], -1)
                   for f in recorded], dim=1)
    return t.reshape(1, -1) if granularity == "tensor" else t


def parity(client, recorded, layers):
    """{granularity: (ratios to the search, ratios to the grid minimum)};
    `layers`: a count (all of them) or the layer indices to check."""
    layers = range(layers) if isinstance(layers, int) else layers
    out = {}
    for granularity in ("tensor", "head"):
        scales = client.finalize(observer="mse", granularity=granularity)
        to_search, to_min = [], []
        for layer in layers:
            for role in "qkv":
                got = scales[f"model.layers.{layer}.self_attn.{role}_scale"].reshape(-1)
                a, b = ratios(rows(recorded, layer, role, granularity), got)
                to_search.extend(a)
                to_min.extend(b)
        out[granularity] = (np.array(to_search), np.array(to_min))
    return out


def summary(r):
    return (f"{len(r)} scales, {100 * np.mean(r <= 1.02):.1f}% within 1.02x, "
            f"worst {r.max():.4f}x, best {r.min():.4f}x")


def main():
    import argparse
    import os
    import sys
    import tempfile

    sys.path.insert(0, os.path.dirname(__file__))
    import kvcal
    import kvcal.torch
    import smollm2
    from conftest import Worker
    from tiny_llama import record_rotary_and_v

    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    a = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    model, tokenizer = smollm2.load()
    batches = smollm2.token_batches(tokenizer, smollm2.CALIBRATION_FILES, a.batches,
                                    a.batch_size, a.seq)
    worker = Worker(tempfile.mkdtemp(prefix="kvcal-parity-")).start()
    try:
        client = kvcal.Client(worker.target)
        client.create_session(model.config)
        with kvcal.Producer(client) as producer:
            with record_rotary_and_v(model) as recorded, kvcal.torch.capture(model, producer):
                for ids in batches:
                    with torch.no_grad():
                        model(ids, use_cache=False, logits_to_keep=1)
        for granularity, (to_search, to_min) in parity(
                client, recorded, model.config.num_hidden_layers).items():
            print(f"per {granularity}: vs llm-compressor's search on raw values: "
                  f"{summary(to_search)}; vs the grid's raw minimum: {summary(to_min)}")
        client.delete()
    finally:
        worker.stop()


if __name__ == "__main__":
    main()
