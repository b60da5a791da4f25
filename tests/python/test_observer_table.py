"""The one table of observers: the options on the Observer values of
proto/kvcal/v1/calibration.proto (label, needs_histograms, simplicity) that
the worker's auto (proto/names.h ObserverTable), kvcal-calibrate's list and
its --observer help, and the docs derive from. An observer added to the
proto without its row, or whose row says something the worker does not do,
fails here."""
import os

import numpy as np
import pytest

import kvcal
from kvcal import names
from kvcal.calibrate import choice
from kvcal.v1 import pb

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GEOMETRY = dict(num_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def test_every_observer_value_has_its_row():
    values = [v for v in pb.Observer.DESCRIPTOR.values
              if v.name not in ("OBSERVER_UNSPECIFIED", "OBSERVER_AUTO")]
    rows = {row.name: row for row in names.OBSERVER_TABLE}
    assert len(rows) == len(values) == 5
    for v in values:
        options = v.GetOptions()
        name = options.Extensions[pb.canonical_name]
        assert name in rows, f"{v.name} has no simplicity option: it is in no observer list"
        assert options.Extensions[pb.label], f"{v.name} has no label"
    ranks = [row.simplicity for row in names.OBSERVER_TABLE]
    assert ranks == sorted(set(ranks)), "each observer its own place, simplest first"
    auto = pb.Observer.DESCRIPTOR.values_by_name["OBSERVER_AUTO"].GetOptions()
    assert auto.Extensions[pb.simplicity] == 0


def test_clients_derive_their_lists_from_it():
    assert choice.OBSERVER_ORDER == ("static_minmax", "minmax", "memoryless_minmax", "mse",
                                     "percentile")
    assert choice.OBSERVER_LABELS["minmax"] == "EMA min-max"
    from kvcal.calibrate.cli import _parser

    help_text = " ".join(_parser().format_help().split())
    assert f"a comma list of {', '.join(choice.OBSERVER_ORDER)}" in help_text


def test_the_docs_define_every_observer():
    with open(os.path.join(ROOT, "docs", "observers.md"), encoding="utf-8") as f:
        text = f.read()
    for row in names.OBSERVER_TABLE:
        assert f"`{row.name}`" in text, f"docs/observers.md does not define {row.name}"


@pytest.mark.parametrize("histograms", [0, 16])
def test_needs_histograms_is_what_the_worker_does(worker, histograms):
    client = kvcal.Client(worker.target)
    client.create_session(geometry=GEOMETRY, histograms=histograms)
    rng = np.random.default_rng(7)
    with kvcal.Producer(client) as producer:
        for layer in range(GEOMETRY["num_layers"]):
            for role, heads in (("q", 4), ("k", 2), ("v", 2)):
                producer.put(layer, role, rng.standard_normal((1, heads, 16, 8)).astype(np.float32))
    for row in names.OBSERVER_TABLE:
        if histograms == 0 and row.needs_histograms:
            with pytest.raises(kvcal.KvcalError, match="FAILED_PRECONDITION"):
                client.finalize(observer=row.name)
        else:
            scales = client.finalize(observer=row.name)
            assert scales is not None
    client.delete()
