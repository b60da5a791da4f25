"""kvcal.LocalStatistics (the engine in the producer's process, the
extension kvcal._engine) against a worker fed the same batches as
activations.

The exactness test sends the same batches (heavy-tailed, outlier heads,
NaN/Inf sprinkled, GQA, bf16 and f32, two producers interleaving their
batches) to one session as chunks (kvcal.Producer) and accumulates them
locally (one LocalStatistics per producer), imports both states into a
second session, and requires:
- every finalized scale and absmax bit-identical, for every observer
  (static_minmax, minmax (EMA), memoryless_minmax, mse, percentile) and
  granularity (tensor, head);
- the two sessions' exported statistics equal field by field (min, max,
  counts, histograms, tails, per-batch min/max) but for the float64 sums,
  which may differ by summation order (chunking): bounded here, and read by
  no observer.
Also: four threads accumulating at once leave a single thread's state; bad
input is refused with the worker's words and changes nothing; a state of
other options is refused by ImportState; torch CUDA tensors on the CUDA
backend equal the CPU engine (skips without a CUDA device: not run yet).
"""
import struct

import numpy as np
import pytest

import kvcal
from kvcal.client import KvcalError

torch = pytest.importorskip("torch")

GEOMETRY = dict(num_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=16)
OBSERVERS = ["static_minmax", "minmax", "memoryless_minmax", "mse", "percentile"]


# -- the engine's serialized statistics (kernels/statistics.h, version 1) ------
def parse_statistics(blob):
    """[(min, max, finite, nan, inf, sum, sum_sq, bins, tail, batches)] per
    (layer, role, head) in the file's order."""
    off = 0

    def take(fmt):
        nonlocal off
        values = struct.unpack_from("<" + fmt, blob, off)
        off += struct.calcsize("<" + fmt)
        return values

    magic, version, layers, heads, kv_heads, _dim, bpo, role_mask = take("8I")
    assert magic == 0x5343564B and version == 1
    out = []
    for _layer in range(layers):
        for bit, n in ((1, heads), (2, kv_heads), (4, kv_heads)):
            if not role_mask & bit:
                continue
            for _h in range(n):
                head = list(take("ffQQQdd"))
                bins, tail = (), ()
                if bpo:
                    (n_bins,) = take("I")
                    bins = take("IQ" * n_bins)
                    (n_tail,) = take("I")
                    tail = take(f"{n_tail}f")
                (n_batches,) = take("I")
                batches = take("Qff" * n_batches)
                out.append(head + [bins, tail, batches])
    assert off + 8 == len(blob), "trailing bytes"
    return out


# -- data -----------------------------------------------------------------------
def make_batch(rng, batch, dtype, tokens):
    """{(layer, role): tensor [tokens, heads, head_dim]} of one batch:
    Student-t (df 2) values, one outlier head and channel per layer, a few
    NaN and Inf values."""
    out = {}
    for layer in range(GEOMETRY["num_layers"]):
        for role, heads in (("q", 8), ("k", 2), ("v", 2)):
            x = rng.standard_t(2, (tokens, heads, GEOMETRY["head_dim"])).astype(np.float32)
            x *= 0.5 + layer + 0.3 * batch
            x[:, (layer + batch) % heads, :] *= 20.0  # an outlier head
            x[:, :, (3 * layer) % GEOMETRY["head_dim"]] *= 8.0  # an outlier channel
            if role == "k" and batch % 2 == 0:
                x[0, 0, 0] = np.nan
                x[1, heads - 1, 2] = np.inf
            out[(layer, role)] = torch.from_numpy(x).to(dtype)
    return out


def producer_batches(seed, batch_numbers):
    rng = np.random.default_rng(seed)
    return [(b, make_batch(rng, b, torch.bfloat16 if b % 2 else torch.float32, 37 + 5 * b))
            for b in batch_numbers]


def exact_bits(response):
    """{(layer, role): (scale bits, absmax bits, count, nonfinite)}."""
    out = {}
    for layer in response.layers:
        for name in "qkv":
            role = getattr(layer, name)
            out[(layer.layer, name)] = (
                np.asarray(role.scale, dtype=np.float32).view(np.uint32).tolist(),
                np.asarray(role.absmax, dtype=np.float32).view(np.uint32).tolist(),
                role.count, role.nonfinite)
    return out


@pytest.fixture
def two_sessions(worker):
    wired, local = kvcal.Client(worker.target), kvcal.Client(worker.target)
    wired.create_session(geometry=GEOMETRY)
    local.create_session(geometry=GEOMETRY)
    yield wired, local
    wired.delete()
    local.delete()


def test_local_statistics_equal_the_workers(two_sessions):
    wired, local_session = two_sessions
    # Two producers, batches interleaved: a holds the even batches, b the odd.
    a = producer_batches(1, [0, 2, 4])
    b = producer_batches(2, [1, 3, 5])

    # As activations, the two producers' chunks interleaved on the worker;
    # b's cut into small chunks (chunking changes no statistic but the sums).
    with kvcal.Producer(wired, producer_id="a") as pa, \
            kvcal.Producer(wired, producer_id="b", chunk_bytes=1024) as pb_:
        for (ba, ta), (bb, tb) in zip(a, b):
            for key in ta:
                pa.put(*key, ta[key], batch=ba, layout="tokens_heads_dim")
                pb_.put(*key, tb[key], batch=bb, layout="tokens_heads_dim")

    # Locally, one LocalStatistics per producer, from the session's options.
    la = kvcal.LocalStatistics.for_session(local_session)
    lb = kvcal.LocalStatistics.for_session(local_session, threads=1)
    assert la.backend == "cpu"
    for (ba, ta), (bb, tb) in zip(a, b):
        for key in ta:
            la.accumulate(*key, ta[key], batch=ba)
            # b's f32 batches as numpy, its bf16 ones as a heads_tokens_dim
            # view of tokens_heads_dim memory (read in place, transposed).
            t = tb[key]
            if t.dtype == torch.float32:
                lb.accumulate(*key, t.numpy(), batch=bb)
            else:
                lb.accumulate(*key, t.transpose(0, 1).unsqueeze(0), batch=bb,
                              layout="heads_tokens_dim")
    state_a, state_b = la.export_state(), lb.export_state()
    local_session.import_state(state_a, import_id="a")
    local_session.import_state(state_b, import_id="b")
    local_session.import_state(state_a, import_id="a")  # a retry: applied once

    got, want = local_session.status(), wired.status()
    assert got.values_ingested == want.values_ingested > 0
    assert got.bytes_ingested == want.bytes_ingested
    assert got.nonfinite_values == want.nonfinite_values > 0
    assert la.counters["chunks_applied"] == len(a) * 9

    compared = 0
    for observer in OBSERVERS:
        for granularity in ("tensor", "head"):
            w = exact_bits(wired.finalize_response(observer=observer, granularity=granularity))
            l_ = exact_bits(local_session.finalize_response(observer=observer,
                                                            granularity=granularity))
            assert l_ == w, (observer, granularity)
            compared += sum(len(v[0]) for v in w.values())
    assert compared == 5 * (3 * 3 + 3 * (8 + 2 + 2))

    # The statistics themselves: all but the float64 sums identical.
    mine = parse_statistics(local_session.export_state().statistics)
    theirs = parse_statistics(wired.export_state().statistics)
    assert len(mine) == len(theirs) == 3 * 12
    worst = 0.0
    for m, t in zip(mine, theirs):
        assert m[:5] == t[:5] and m[7:] == t[7:]
        assert len(m[9]) == 6 * 3  # one (batch, min, max) per batch
        for i in (5, 6):
            worst = max(worst, abs(m[i] - t[i]) / max(abs(t[i]), 1e-30))
    assert worst < 1e-12, worst


def test_threads_accumulating_at_once():
    """accumulate() releases the GIL and the engine is thread-safe: four
    threads accumulating one producer's tensors at once leave the state a
    single thread leaves (all but the float64 sums, whose order differs)."""
    import threading

    batches = producer_batches(3, [0, 1, 2, 3])
    items = [(key, t, b) for b, tensors in batches for key, t in tensors.items()]
    geometry = kvcal.Geometry(**GEOMETRY)
    alone, shared = kvcal.LocalStatistics(geometry), kvcal.LocalStatistics(geometry)
    for key, t, b in items:
        alone.accumulate(*key, t, batch=b)
    errors = []

    def run(part):
        try:
            for key, t, b in items[part::4]:
                shared.accumulate(*key, t, batch=b)
        except BaseException as e:  # noqa: reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert shared.counters == alone.counters
    mine = parse_statistics(shared.export_state().statistics)
    theirs = parse_statistics(alone.export_state().statistics)
    for m, t in zip(mine, theirs):
        assert m[:5] == t[:5] and m[7:] == t[7:]


def test_cuda_tensors_in_place_equal_cpu():
    """backend="cuda": torch CUDA tensors read in place on their device (after
    the current stream's work) give the CPU engine's statistics but for the
    sums. Skips without a CUDA device (never run so far: no GPU was lent)."""
    from kvcal.producer.statistics import load_engine

    if not torch.cuda.is_available() or load_engine().cuda_device_count() == 0:
        pytest.skip("no CUDA device")
    geometry = kvcal.Geometry(**GEOMETRY)
    cpu = kvcal.LocalStatistics(geometry)
    cuda = kvcal.LocalStatistics(geometry, backend="cuda", device=torch.cuda.current_device())
    assert cuda.backend == "cuda"
    for b, tensors in producer_batches(4, [0, 1, 2]):
        for key, t in tensors.items():
            cpu.accumulate(*key, t, batch=b)
            cuda.accumulate(*key, t.cuda(), batch=b)
    assert cuda.counters == cpu.counters
    mine = parse_statistics(cuda.export_state().statistics)
    theirs = parse_statistics(cpu.export_state().statistics)
    for m, t in zip(mine, theirs):
        assert m[:5] == t[:5] and m[7:] == t[7:]


def test_refusals_change_nothing(worker):
    client = kvcal.Client(worker.target)
    client.create_session(geometry=GEOMETRY, roles=("k", "v"), reject_non_finite=True)
    local = kvcal.LocalStatistics.for_session(client)
    good = torch.randn(5, 2, 16)
    local.accumulate(0, "k", good, batch=0)
    before = local.export_state()

    bad_nan = good.clone()
    bad_nan[2, 1, 3] = float("nan")
    cases = [
        (ValueError, "non-finite", lambda: local.accumulate(0, "k", bad_nan, batch=1)),
        (ValueError, "head_dim is 16", lambda: local.accumulate(0, "k", torch.randn(5, 2, 8),
                                                                batch=1)),
        (ValueError, "exceed the 2 K heads", lambda: local.accumulate(0, "k", good, batch=1,
                                                                      head_offset=1)),
        (ValueError, "layer 3 is out of range", lambda: local.accumulate(3, "v", good, batch=1)),
        (ValueError, "role Q is not collected", lambda: local.accumulate(0, "q", good, batch=1)),
        (ValueError, "needs rank 4", lambda: local.accumulate(0, "k", good, batch=1,
                                                              layout="heads_tokens_dim")),
        (ValueError, "role 'x'", lambda: local.accumulate(0, "x", good, batch=1)),
        (TypeError, "float64", lambda: local.accumulate(0, "k", good.double(), batch=1)),
        (ValueError, "batch=-1", lambda: local.accumulate(0, "k", good, batch=-1)),
    ]
    for error, text, call in cases:
        with pytest.raises(error) as e:
            call()
        assert text in str(e.value), (text, str(e.value))
        assert local.export_state() == before, text

    # A state of other options is refused by the worker, and changes nothing.
    other = kvcal.LocalStatistics(kvcal.Geometry(**GEOMETRY), histograms=32, roles=("k", "v"),
                                  reject_non_finite=True)
    other.accumulate(0, "k", good, batch=0)
    with pytest.raises(KvcalError, match="cannot import state of geometry"):
        client.import_state(other.export_state())
    assert client.status().values_ingested == 0
    client.import_state(before)
    assert client.status().values_ingested == good.numel()
    client.delete()


def test_engine_not_found_is_explained(monkeypatch, tmp_path):
    from kvcal.producer import statistics as local_statistics

    monkeypatch.setattr(local_statistics, "_engine_module", None)
    monkeypatch.setenv("KVCAL_BUILD_DIR", str(tmp_path))
    monkeypatch.setattr(local_statistics, "_REPO_ROOT", str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "kvcal._engine", raising=False)
    with pytest.raises(ImportError, match="kvcal._engine is not available"):
        local_statistics.load_engine()


def test_backend_choice():
    from kvcal.producer.statistics import load_engine

    geometry = kvcal.Geometry(**GEOMETRY)
    with pytest.raises(ValueError, match="unknown backend 'gpu': use auto, cpu or cuda"):
        kvcal.LocalStatistics(geometry, backend="gpu")
    has_device = load_engine().cuda_device_count() > 0
    assert kvcal.LocalStatistics(geometry, backend="auto").backend == (
        "cuda" if has_device else "cpu")
    if not has_device:
        with pytest.raises(RuntimeError, match="needs a GPU|not compiled into this build"):
            kvcal.LocalStatistics(geometry, backend="cuda")
