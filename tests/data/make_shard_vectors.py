#!/usr/bin/env python3
"""Writes shard_vectors.json: the test vectors that pin kvcal's sharding rule
(docs/wire-contract.md "Sharding") for every client.

The hash primitives are pinned by published vectors, copied here from their
sources, not computed:
  - FNV-1a 64: the FNV reference test suite (Landon Curt Noll, isthe.com/chongo/
    tech/comp/fnv, test_fnv.c): "" -> cbf29ce484222325, "a" -> af63dc4c8601ec8c,
    "foobar" -> 85944171f73967e8.
  - SplitMix64 (Steele, Lea, Flood 2014; Vigna's splitmix64.c): the first five
    outputs of a generator seeded with 1234567 (the published Rosetta Code
    sequence).
The layer assignments below them are computed by this script's own small
implementation of the rule (independent of the C++ and Python clients) after
it has checked itself against those published vectors; the C++ test
(tests/client/client_unit_test.cc) and the Python test
(tests/python/test_sharding.py) check that both clients reproduce every one.

Run it again only when the rule changes (it never should: a change moves
layers of running sessions).
"""
import json
import os

MASK = (1 << 64) - 1
PUBLISHED_FNV1A64 = {"": 0xcbf29ce484222325, "a": 0xaf63dc4c8601ec8c,
                     "foobar": 0x85944171f73967e8}
PUBLISHED_SPLITMIX64_SEED = 1234567
PUBLISHED_SPLITMIX64 = [6457827717110365317, 3203168211198807973,
                        9817491932198370423, 4593380528125082431,
                        16408922859458223821]
GAMMA = 0x9e3779b97f4a7c15


def fnv1a64(data: bytes) -> int:
    h = 0xcbf29ce484222325
    for b in data:
        h = ((h ^ b) * 0x100000001b3) & MASK
    return h


def splitmix64(seed: int) -> int:
    z = (seed + GAMMA) & MASK
    z = ((z ^ (z >> 30)) * 0xbf58476d1ce4e5b9) & MASK
    z = ((z ^ (z >> 27)) * 0x94d049bb133111eb) & MASK
    return z ^ (z >> 31)


def score(session: str, layer: int, worker: str) -> int:
    key = session.encode() + b"\0" + layer.to_bytes(4, "little") + worker.encode()
    return splitmix64(fnv1a64(key))


def owner(session: str, layer: int, workers) -> int:
    workers = sorted(workers, key=str.encode)
    best = 0
    for i in range(1, len(workers)):  # strictly greater: ties stay with the smaller id
        if score(session, layer, workers[i]) > score(session, layer, workers[best]):
            best = i
    return best


def main():
    for text, want in PUBLISHED_FNV1A64.items():
        assert fnv1a64(text.encode()) == want, text
    for k, want in enumerate(PUBLISHED_SPLITMIX64):
        assert splitmix64((PUBLISHED_SPLITMIX64_SEED + k * GAMMA) & MASK) == want, k
    cases = []
    sets = [
        ["solo"],
        ["kvcal-worker-0", "kvcal-worker-1"],
        ["kvcal-worker-0", "kvcal-worker-1", "kvcal-worker-2", "kvcal-worker-3"],
        ["kvcal-worker-0", "kvcal-worker-1", "kvcal-worker-2", "kvcal-worker-3",
         "kvcal-worker-4"],
        ["a", "b", "c"],
        ["w0.example.org", "w1.example.org", "w2.example.org", "w3.example.org",
         "w4.example.org", "w5.example.org", "w6.example.org"],
    ]
    for session in ["run7", "s", "calib-llama-3.1-8b_2026.12.03"]:
        for workers in sets:
            layers = 80 if len(workers) >= 4 else 32
            scores = [[format(score(session, l, w), "016x") for w in sorted(workers)]
                      for l in range(2)]
            cases.append({"session": session, "worker_ids": sorted(workers),
                          "num_layers": layers,
                          "owners": [owner(session, l, workers) for l in range(layers)],
                          "scores_layers_0_1": scores})
    out = {
        "rule": "owner(S, L) = argmax over worker ids W (sorted bytewise; ties to the "
                "smaller id) of SplitMix64(FNV-1a-64(utf8(S) ++ 0x00 ++ le32(L) ++ utf8(W))), "
                "SplitMix64(x) being the first output of SplitMix64 seeded with x",
        "fnv1a64_published": {k: format(v, "016x") for k, v in PUBLISHED_FNV1A64.items()},
        "splitmix64_published": {"seed": PUBLISHED_SPLITMIX64_SEED, "gamma": format(GAMMA, "016x"),
                                 "outputs": [format(v, "016x") for v in PUBLISHED_SPLITMIX64]},
        "cases": cases,
    }
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shard_vectors.json")
    cases_text = ",\n  ".join(json.dumps(c) for c in out.pop("cases"))
    text = json.dumps(out, indent=1)
    with open(path, "w") as f:
        f.write(text[:-2] + ',\n "cases": [\n  ' + cases_text + "\n ]\n}\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
