"""The Python client refuses impossible arguments before it sends anything,
with the CLI's ranges and words (kvcal/_ranges.py; util/cli.h,
util/host_port.h): a ValueError (TypeError for a wrong type) naming the
argument and what is valid. Most calls below go to an address where no
worker listens: they would fail differently if the check let them through.
The CLI parity tests run the kvcal binary with the same values."""
import logging
import math
import subprocess

import pytest

import kvcal
from kvcal import _ranges, sharding

NOWHERE = "127.0.0.1:1"  # nothing listens on port 1
GEOMETRY = dict(num_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8)


@pytest.mark.parametrize("text, want", [
    ("127.0.0.1:50051", ("127.0.0.1", 50051, False)),
    ("worker-0", ("worker-0", 50051, True)),
    ("[::1]", ("::1", 50051, True)),
    ("[::1]:7000", ("::1", 7000, False)),
    ("[fe80::1%eth0]:1", ("fe80::1%eth0", 1, False)),
    ("localhost:65535", ("localhost", 65535, False)),
])
def test_host_port_accepted(text, want):
    assert _ranges.parse_host_port(text) == want


@pytest.mark.parametrize("text, message", [
    ("127.0.0.1:99999", "port 99999 is out of range: want 1..65535"),
    ("127.0.0.1:0", "port 0 is out of range: want 1..65535"),
    ("host:abc", "port 'abc' is not a number"),
    ("host:", "no port after ':'"),
    (":50051", "no host before ':50051'"),
    ("::1", "an IPv6 address goes in brackets"),
    ("::1:50051", "an IPv6 address goes in brackets"),
    ("[::1", "no closing ']'"),
    ("[host]:1", "is not an IPv6 address"),
    ("[::1]x", "found 'x' after ']'"),
    ("a b:1", "is not a host name"),
    ("", "empty address"),
])
def test_host_port_refused(text, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        _ranges.parse_host_port(text)


def test_listen_rules_allow_port_zero_and_require_a_port():
    assert _ranges.parse_host_port("0.0.0.0:0", default_port=None, min_port=0) == ("0.0.0.0", 0, False)
    with pytest.raises(ValueError, match="has no port"):
        _ranges.parse_host_port("0.0.0.0", default_port=None, min_port=0)


def test_endpoints_get_the_default_port_and_say_so(caplog):
    with caplog.at_level(logging.WARNING, logger="kvcal"):
        assert sharding.expand_endpoints("127.0.0.1,[::1]:7,unix:/run/w.sock") == [
            "127.0.0.1:50051", "[::1]:7", "unix:/run/w.sock"]
    assert "127.0.0.1 has no port: using 127.0.0.1:50051" in caplog.text
    with pytest.raises(ValueError, match="port 'abc' is not a number"):
        sharding.expand_endpoints("dns:///localhost:abc")
    with pytest.raises(ValueError, match="out of range"):
        sharding.expand_endpoints("a:1,b:70000")


def test_client_checks_its_arguments_before_connecting():
    with pytest.raises(ValueError, match="port 99999 is out of range"):
        kvcal.Client("127.0.0.1:99999")
    with pytest.raises(ValueError, match=r"Client timeout=0 is out of range: want seconds > 0"):
        kvcal.Client(NOWHERE, timeout=0)
    with pytest.raises(ValueError, match="timeout=nan"):
        kvcal.Client(NOWHERE, timeout=math.nan)
    with pytest.raises(ValueError, match=r"max_message_bytes=0 is out of range: want 65536\.\."):
        kvcal.Client(NOWHERE, max_message_bytes=0)
    with pytest.raises(TypeError, match="max_message_bytes='64' is not a whole number"):
        kvcal.Client(NOWHERE, max_message_bytes="64")
    client = kvcal.Client("127.0.0.1", timeout=None)  # the default port; no call made
    assert client.target == "127.0.0.1:50051"
    client.close()


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(chunk_bytes=0), ValueError, r"Producer chunk_bytes=0 is out of range: want 1\.\.1073741824"),
    (dict(chunk_bytes=-1), ValueError, "chunk_bytes=-1 is out of range"),
    (dict(chunk_bytes=(1 << 30) + 1), ValueError, "chunk_bytes=1073741825 is out of range"),
    (dict(chunk_bytes=1.5), TypeError, "chunk_bytes=1.5 is not a whole number"),
    (dict(chunk_bytes=True), TypeError, "chunk_bytes=True is not a whole number"),
    (dict(window=0), ValueError, r"Producer window=0 is out of range: want 1\.\.1024"),
    (dict(window=1025), ValueError, "window=1025 is out of range"),
    (dict(max_pending_chunks=0), ValueError, "max_pending_chunks=0 is out of range: want 1 or more"),
    (dict(max_pending_bytes=-5), ValueError, "max_pending_bytes=-5 is out of range"),
    (dict(start_sequence=0), ValueError, "start_sequence=0 is out of range"),
    (dict(reconnect_timeout=0), ValueError, "reconnect_timeout=0 is out of range"),
    (dict(durable_timeout=-1), ValueError, "durable_timeout=-1 is out of range"),
    (dict(durable_timeout=None), TypeError, "durable_timeout=None is not a number"),
])
def test_producer_checks_its_arguments_before_connecting(kwargs, error, message):
    client = kvcal.Client(NOWHERE, session_id="s", timeout=5)
    with pytest.raises(error, match=message):
        kvcal.Producer(client, **kwargs)
    client.close()


def test_create_session_checks_histograms_and_budget():
    client = kvcal.Client(NOWHERE, timeout=5)
    for bad in (3, 256, -1):
        with pytest.raises(ValueError, match=f"histograms={bad} is not a power of two 1..128"):
            client.create_session(geometry=GEOMETRY, histograms=bad)
    with pytest.raises(ValueError, match="holdout_budget_bytes=-1 is out of range"):
        client.create_session(geometry=GEOMETRY, holdout_budget_bytes=-1)
    client.close()


FINALIZE_REFUSED = [
    ("averaging_constant", 2, "--averaging-constant"),
    ("averaging_constant", -0.5, "--averaging-constant"),
    ("percentile", 101, "--percentile"),
    ("percentile", -1, "--percentile"),
    ("margin", -1, "--margin"),
    ("margin", math.inf, "--margin"),
    ("mse_max_shrink", 1, "--mse-max-shrink"),
    ("mse_norm", -2, "--mse-norm"),
    ("mse_grid", -1, "--mse-grid"),
    ("mse_patience", -3, "--mse-patience"),
]


@pytest.mark.parametrize("name, value, flag", FINALIZE_REFUSED)
def test_finalize_checks_its_options(name, value, flag):
    client = kvcal.Client(NOWHERE, timeout=5)
    with pytest.raises(ValueError, match=f"finalize {name}="):
        client.finalize(session_id="s", **{name: value})
    client.close()


def test_finalize_zero_asks_for_the_workers_default():
    client = kvcal.Client(NOWHERE, timeout=5)
    request, *_ = client._finalize_request("s", averaging_constant=0, percentile=0, margin=0,
                                           mse_max_shrink=0, mse_norm=0)
    assert request.percentile == 0 and request.margin == 0
    request, *_ = client._finalize_request("s", percentile=100, averaging_constant=1,
                                           mse_max_shrink=0.5)
    assert request.percentile == 100
    client.close()


def test_put_checks_layer_batch_and_head_offset(worker):
    import numpy as np

    client = kvcal.Client(worker.target)
    client.create_session(geometry=GEOMETRY, session_id="put-args")
    tensor = np.ones((1, 2, 3, 8), dtype=np.float32)
    with kvcal.Producer(client) as producer:
        with pytest.raises(ValueError, match="put layer=-1 is out of range"):
            producer.put(-1, "k", tensor)
        with pytest.raises(ValueError, match="put batch=-2 is out of range"):
            producer.put(0, "k", tensor, batch=-2)
        with pytest.raises(ValueError, match="put head_offset=-1 is out of range"):
            producer.put(0, "k", tensor, head_offset=-1)
        assert producer.last_sequence == 0  # nothing was queued
    assert client.status().chunks_applied == 0
    client.close()


@pytest.mark.parametrize("name, value, flag", FINALIZE_REFUSED)
def test_the_cli_refuses_what_python_refuses(kvcal_cli, name, value, flag):
    """The same value is a usage error for `kvcal finalize` (exit 2, the flag
    named): one range, two clients."""
    proc = subprocess.run([kvcal_cli, "finalize", "--server", NOWHERE, "--session", "s",
                           "-o", "/nonexistent/x", flag, str(value)],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2, proc.stderr
    assert flag in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("flag, value, python", [
    ("--chunk-bytes", "0", dict(chunk_bytes=0)),
    ("--window", "0", dict(window=0)),
    ("--window", "1025", dict(window=1025)),
])
def test_push_ranges_match_the_producers(kvcal_cli, tmp_path, flag, value, python):
    proc = subprocess.run([kvcal_cli, "push", "--server", NOWHERE, "--session", "s", flag, value,
                           str(tmp_path)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and flag in proc.stderr, proc.stderr
    client = kvcal.Client(NOWHERE, session_id="s", timeout=5)
    with pytest.raises(ValueError):
        kvcal.Producer(client, **python)
    client.close()


def test_version_is_the_repositorys(kvcal_cli):
    import os

    root = os.path.join(os.path.dirname(__file__), "..", "..")
    with open(os.path.join(root, "VERSION")) as f:
        version = f.read().strip()
    assert kvcal.__version__ == version
    out = subprocess.run([kvcal_cli, "--version"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.startswith(f"kvcal {version} (commit "), out.stdout
