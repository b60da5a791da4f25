"""kvcal.Client over several workers: the same sharding rule as the C++
client (tests/data/shard_vectors.json, shared with tests/client/
client_unit_test.cc), identical scales with one worker or many, and the clear
errors for another worker set or two workers with one id."""
import json
import os

import numpy as np
import pytest

import kvcal
from kvcal import sharding
from test_producer import GEOMETRY, make_batches, push

VECTORS = os.path.join(os.path.dirname(__file__), "..", "data", "shard_vectors.json")


@pytest.fixture(scope="module")
def vectors():
    with open(VECTORS) as f:
        return json.load(f)


def test_fnv1a64_matches_published_vectors(vectors):
    assert len(vectors["fnv1a64_published"]) == 3
    for text, want in vectors["fnv1a64_published"].items():
        assert sharding.fnv1a64(text.encode()) == int(want, 16), text


def test_splitmix64_matches_published_sequence(vectors):
    v = vectors["splitmix64_published"]
    state, gamma = v["seed"], int(v["gamma"], 16)
    for want in v["outputs"]:
        assert sharding.splitmix64(state) == int(want, 16)
        state = (state + gamma) % (1 << 64)


def test_every_layer_goes_where_the_shared_vectors_say(vectors):
    assert len(vectors["cases"]) >= 10
    for case in vectors["cases"]:
        ids = case["worker_ids"]
        assert sharding.layer_owners(case["session"], case["num_layers"], ids) == case["owners"]
        for layer in (0, 1):
            for w, want in zip(ids, case["scores_layers_0_1"][layer]):
                assert sharding.rendezvous_score(case["session"], layer, w) == int(want, 16)


def test_endpoint_forms(tmp_path):
    listing = tmp_path / "workers.txt"
    listing.write_text("# workers\n127.0.0.1:1, 127.0.0.1:2\n\n127.0.0.1:3\n")
    assert sharding.expand_endpoints(["a:1,b:2", f"file:{listing}"]) == [
        "a:1", "b:2", "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
    assert sharding.expand_endpoints("dns:///localhost:50051")[0].endswith(":50051")
    # No port: 50051 (as the CLI's --server); a port that is not one: refused.
    assert sharding.expand_endpoints("dns:///localhost")[0].endswith(":50051")
    with pytest.raises(ValueError, match="port 'abc' is not a number"):
        sharding.expand_endpoints("dns:///nohost:abc")


def workers(make_worker, names, **kwargs):
    return [make_worker(extra_args=["--worker-id", n], **kwargs) for n in names]


def test_several_workers_give_the_scales_of_one(make_worker):
    data = make_batches(11, layers=GEOMETRY["num_layers"])
    one = kvcal.Client(make_worker().target)
    one.create_session(geometry=GEOMETRY, session_id="ref")
    push(one, data)
    ws = workers(make_worker, ["c", "a", "b"])
    client = kvcal.Client([w.target for w in ws])
    assert client.worker_ids == ["a", "b", "c"]
    session = client.create_session(geometry=GEOMETRY, session_id="sharded")
    assert list(session.shard_map.worker_ids) == ["a", "b", "c"]
    assert list(session.shard_map.layer_owners) == sharding.layer_owners(
        "sharded", GEOMETRY["num_layers"], ["a", "b", "c"])
    push(client, data)
    # Each layer's data sits on its owner only.
    for i, w in enumerate(client.workers):
        held = w.status("sharded").values_ingested
        owns = i in session.shard_map.layer_owners
        assert (held > 0) == owns, (w.worker_id, held)
    for observer, granularity in [("mse", "head"), ("static_minmax", "tensor"), ("minmax", "head")]:
        want = one.finalize(observer, granularity, session_id="ref")
        got = client.finalize(observer, granularity, session_id="sharded")
        assert sorted(got) == sorted(want)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])
    assert client.status("sharded").values_ingested == one.status("ref").values_ingested


def test_another_worker_set_or_duplicate_ids_are_refused(make_worker):
    a, b, c = workers(make_worker, ["a", "b", "c"])
    two = kvcal.Client(f"{a.target},{b.target}")
    two.create_session(geometry=GEOMETRY, session_id="set")
    three = kvcal.Client([a.target, b.target, c.target], session_id="set")
    with pytest.raises(ValueError, match=r"added \[c\]"):
        kvcal.Producer(three)
    with pytest.raises(ValueError, match=r"added \[c\]"):
        three.finalize()
    with pytest.raises(kvcal.KvcalError, match=r"FAILED_PRECONDITION.*added \[c\]"):
        three.create_session(geometry=GEOMETRY, session_id="set")
    d = make_worker(extra_args=["--worker-id", "a"])
    with pytest.raises(ValueError, match="both report worker id 'a'"):
        kvcal.Client([a.target, d.target])
