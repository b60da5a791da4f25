"""One names table for every client: the spellings Python accepts are the
C++ CLI's (both read the options on the enum values of
proto/kvcal/v1/calibration.proto), what the scales file records parses back
in the CLI, and the options a scales file records are the worker's resolved
ones (FinalizeResponse.resolved), not a copy of the defaults."""
import json
import subprocess

import numpy as np
import pytest
from safetensors import safe_open

import kvcal
from kvcal import names
from kvcal.names import FORMATS, GRANULARITIES, OBSERVERS
from kvcal.v1 import pb

# Every spelling users meet -> the value it names.
SPELLINGS = [
    ("observer", "static-minmax", "static_minmax"), ("observer", "static_minmax", "static_minmax"),
    ("observer", "static", "static_minmax"), ("observer", "OBSERVER_STATIC_MINMAX", "static_minmax"),
    ("observer", "minmax", "minmax"), ("observer", "minmax-ema", "minmax"),
    ("observer", "ema", "minmax"), ("observer", "Memoryless", "memoryless_minmax"),
    ("observer", "MSE", "mse"), ("observer", "percentile", "percentile"),
    ("granularity", "attn_head", "head"), ("granularity", "per-tensor", "tensor"),
    ("format", "fp8", "float8_e4m3fn"), ("format", "fp8-e4m3fn", "float8_e4m3fn"),
    ("format", "e5m2", "float8_e5m2"), ("format", "FP8_E4M3FNUZ", "float8_e4m3fnuz"),
]
RESOLVE = {"observer": names.resolve_observer, "granularity": names.resolve_granularity,
           "format": names.resolve_format}


@pytest.mark.parametrize("what,spelling,canonical", SPELLINGS)
def test_python_accepts_every_spelling(what, spelling, canonical):
    assert RESOLVE[what](spelling) == canonical


def test_table_is_the_protos():
    assert OBSERVERS == {"static_minmax": pb.OBSERVER_STATIC_MINMAX, "minmax": pb.OBSERVER_MINMAX_EMA,
                         "memoryless_minmax": pb.OBSERVER_MEMORYLESS_MINMAX, "mse": pb.OBSERVER_MSE,
                         "percentile": pb.OBSERVER_PERCENTILE, "auto": pb.OBSERVER_AUTO}
    assert GRANULARITIES == {"tensor": pb.GRANULARITY_PER_TENSOR, "head": pb.GRANULARITY_PER_HEAD}
    with pytest.raises(ValueError, match="unknown observer 'max'"):
        names.resolve_observer("max")
    # kvcal.client keeps the tables it always had, the same objects.
    assert kvcal.client.OBSERVERS is OBSERVERS and kvcal.client.FORMATS is FORMATS


def test_producer_tables_take_every_spelling_and_number():
    roles = names.wire_numbers("Role")
    assert roles["q"] == roles[pb.ROLE_Q] == pb.ROLE_Q and roles["role_v"] == pb.ROLE_V
    layouts = names.wire_numbers("Layout")
    for spelling in ("hf", "heads_tokens_dim", "LAYOUT_HEADS_TOKENS_DIM"):
        assert layouts[names.normalise(spelling)] == pb.LAYOUT_HEADS_TOKENS_DIM
    assert layouts["vllm"] == pb.LAYOUT_TOKENS_HEADS_DIM


def _session(worker, sid):
    client = kvcal.Client(worker.target)
    client.create_session(session_id=sid, geometry={"num_layers": 2, "num_attention_heads": 4,
                                                    "num_key_value_heads": 2, "head_dim": 8})
    rng = np.random.default_rng(7)
    with kvcal.Producer(client) as producer:
        for layer in range(2):
            for role, heads in (("q", 4), ("k", 2), ("v", 2)):
                producer.put(layer, role, rng.standard_normal((1, heads, 5, 8)).astype(np.float32))
    return client


@pytest.mark.parametrize("spelling", ["minmax", "static_minmax", "memoryless", "MSE"])
def test_cli_finalize_takes_the_names_config_json_records(worker, kvcal_cli, tmp_path, spelling):
    """`kvcal finalize --observer minmax` (what config.json records) works,
    and its scales equal the Python client's for the same spelling."""
    sid = f"names-{spelling.lower()}"
    client = _session(worker, sid)
    out = tmp_path / "scales.safetensors"
    run = subprocess.run([kvcal_cli, "finalize", "--server", worker.target, "--session", sid,
                          "--observer", spelling, "--granularity", "attn_head", "--output", str(out)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    expected = client.finalize(observer=spelling, granularity="attn_head")
    with safe_open(str(out), "np") as f:
        meta = f.metadata()
        assert meta["observer"] == names.resolve_observer(spelling)
        assert meta["granularity"] == "head"
        for name, value in expected.items():
            np.testing.assert_array_equal(f.get_tensor(name), value)
    client.delete()


def test_scales_record_the_workers_resolved_options(worker):
    """The options recorded with the scales come from the worker's echo of
    the resolved request: a value the caller set is kept, the rest are the
    worker's defaults (ScaleOptions), which this test does not copy."""
    client = _session(worker, "names-resolved")
    response = client.finalize_response(observer="percentile", percentile=99.5)
    assert response.HasField("resolved")
    resolved = response.resolved
    assert resolved.observer == pb.OBSERVER_PERCENTILE
    assert resolved.percentile == pytest.approx(99.5)
    assert resolved.format == pb.FORMAT_FP8_E4M3FN  # UNSPECIFIED resolved
    assert resolved.granularity == pb.GRANULARITY_PER_TENSOR
    assert resolved.averaging_constant > 0 and resolved.margin > 0 and resolved.mse_grid > 0
    scales = client.finalize(observer="percentile", percentile=99.5)
    options = json.loads(scales.metadata["observer_options"])
    assert options["percentile"] == pytest.approx(99.5)
    assert options["mse_grid"] == resolved.mse_grid
    assert options["margin"] == pytest.approx(resolved.margin)
    client.delete()
