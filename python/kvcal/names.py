"""kvcal.names: the names of the wire enums, from the one names table.

Every spelling of an observer, granularity, format, role or layout that
kvcal accepts comes from the options on the enum values of
proto/kvcal/v1/calibration.proto ((canonical_name), (cli_name), (alias)),
which the C++ CLI and the worker read too (proto/names.h):

    from kvcal import names
    names.OBSERVERS["mse"]                    # canonical name -> wire number
    names.resolve_observer("static-minmax")   # any spelling -> "static_minmax"
    names.wire_numbers("Role")["k"]           # any spelling or number -> number

Spellings are normalised before they are looked up: lower case, '-' as '_'.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Mapping, Tuple, Union

from kvcal.v1 import pb


def _canonical(value) -> str:
    options = value.GetOptions()
    return options.Extensions[pb.canonical_name] or value.name


def _values(enum_name: str):
    return [v for v in pb.DESCRIPTOR.enum_types_by_name[enum_name].values if v.number != 0]


def canonical(enum_name: str) -> Dict[str, int]:
    """Canonical name -> wire number for the enum `enum_name` (its values
    other than UNSPECIFIED), in the proto's order."""
    return {_canonical(v): v.number for v in _values(enum_name)}


def spellings(enum_name: str) -> Dict[str, str]:
    """Every accepted spelling (normalised) -> canonical name: the canonical
    name, the CLI name, the aliases and the proto value name."""
    out: Dict[str, str] = {}
    for v in _values(enum_name):
        options = v.GetOptions()
        for n in (_canonical(v), options.Extensions[pb.cli_name], v.name,
                  *options.Extensions[pb.alias]):
            if n:
                out[normalise(n)] = _canonical(v)
    return out


def wire_numbers(enum_name: str) -> Dict[Union[str, int], int]:
    """Every spelling (normalised) and every wire number -> wire number."""
    numbers = canonical(enum_name)
    table: Dict[Union[str, int], int] = {
        spelling: numbers[name] for spelling, name in spellings(enum_name).items()}
    table.update({n: n for n in numbers.values()})
    return table


def normalise(spelling: str) -> str:
    """How a spelling is looked up: lower case, '_' for '-' (the CLI spells
    names with hyphens)."""
    return str(spelling).lower().replace("-", "_")


def resolve(name: str, table: Mapping[str, int], spelled: Mapping[str, str], what: str) -> str:
    """The canonical name `name` spells in `table` (canonical names) with
    `spelled` (spellings(...)); ValueError naming `what` and the canonical
    names otherwise."""
    key = normalise(name)
    key = spelled.get(key, key)
    if key not in table:
        raise ValueError(f"kvcal: unknown {what} {name!r} (one of {', '.join(table)})")
    return key


# llm-compressor's observer names (what the scales file and config.json
# record) and the other names of each value.
OBSERVERS = canonical("Observer")
GRANULARITIES = canonical("Granularity")
FORMATS = canonical("Format")
OBSERVER_SPELLINGS = spellings("Observer")
GRANULARITY_SPELLINGS = spellings("Granularity")
FORMAT_SPELLINGS = spellings("Format")


@dataclass(frozen=True)
class ObserverInfo:
    """One row of the proto's observer table (the options on the Observer
    enum values)."""
    name: str               # canonical: what scales files record
    cli: str                # how the CLI prints it
    label: str              # what the report and kvcal-calibrate print
    needs_histograms: bool  # Finalize refuses it on a session without them
    simplicity: int         # 1 = the simplest


def _observer_table() -> Tuple[ObserverInfo, ...]:
    rows = []
    for v in _values("Observer"):
        options = v.GetOptions()
        simplicity = options.Extensions[pb.simplicity]
        if simplicity <= 0:
            continue  # auto: not an observer of its own
        name = _canonical(v)
        rows.append(ObserverInfo(name, options.Extensions[pb.cli_name] or name,
                                 options.Extensions[pb.label] or name,
                                 bool(options.Extensions[pb.needs_histograms]), simplicity))
    return tuple(sorted(rows, key=lambda r: r.simplicity))


# Every observer (auto aside), the simplest first: the one list that
# kvcal-calibrate scores and its --observer help names.
OBSERVER_TABLE = _observer_table()


def resolve_observer(name: str) -> str:
    return resolve(name, OBSERVERS, OBSERVER_SPELLINGS, "observer")


def resolve_granularity(name: str) -> str:
    return resolve(name, GRANULARITIES, GRANULARITY_SPELLINGS, "granularity")


def resolve_format(name: str) -> str:
    return resolve(name, FORMATS, FORMAT_SPELLINGS, "format")
