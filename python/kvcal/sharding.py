"""kvcal's sharding rule (docs/wire-contract.md "Sharding"), the same as the
C++ client's client/rpc/sharding.h: layer L of session S goes to the worker id W
with the highest SplitMix64(FNV-1a-64(utf8(S) ++ 0x00 ++ le32(L) ++ utf8(W)))
(rendezvous hashing; ties to the bytewise smaller id). tests/data/
shard_vectors.json pins it for both clients.

    owners = layer_owners("run7", 32, ["kvcal-worker-0", "kvcal-worker-1"])
"""
from __future__ import annotations

import logging
import os
import socket
from typing import List, Sequence

from kvcal._ranges import check_endpoint, parse_host_port

log = logging.getLogger("kvcal")

_MASK = (1 << 64) - 1


def fnv1a64(data: bytes) -> int:
    h = 0xcbf29ce484222325
    for b in data:
        h = ((h ^ b) * 0x100000001b3) & _MASK
    return h


def splitmix64(seed: int) -> int:
    """The first output of SplitMix64 seeded with `seed`."""
    z = (seed + 0x9e3779b97f4a7c15) & _MASK
    z = ((z ^ (z >> 30)) * 0xbf58476d1ce4e5b9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94d049bb133111eb) & _MASK
    return z ^ (z >> 31)


def rendezvous_score(session_id: str, layer: int, worker_id: str) -> int:
    key = session_id.encode() + b"\0" + int(layer).to_bytes(4, "little") + worker_id.encode()
    return splitmix64(fnv1a64(key))


def layer_owner(session_id: str, layer: int, worker_ids: Sequence[str]) -> int:
    """Index in worker_ids of the worker holding the layer."""
    best, best_score = 0, None
    for i, w in enumerate(worker_ids):
        score = rendezvous_score(session_id, layer, w)
        if best_score is None or score > best_score or (
                score == best_score and w.encode() < worker_ids[best].encode()):
            best, best_score = i, score
    return best


def layer_owners(session_id: str, num_layers: int, worker_ids: Sequence[str]) -> List[int]:
    return [layer_owner(session_id, layer, worker_ids) for layer in range(num_layers)]


def expand_endpoint(endpoint: str) -> List[str]:
    """"dns:///host:port": every address host resolves to, sorted; "file:PATH":
    the endpoints listed in that file (one per line or comma-separated, '#'
    comments); "host[:port]" checked, with port 50051 when it has none (a
    ValueError for a port outside 1..65535, an IPv6 address without
    brackets); another gRPC target ("unix:...") as it is. As the C++
    client's ExpandEndpoint."""
    if endpoint.startswith("file:"):
        path = endpoint[len("file:"):]
        out: List[str] = []
        with open(path) as f:
            for line in f:
                for e in line.split("#", 1)[0].split(","):
                    e = e.strip()
                    if e:
                        if e.startswith("file:"):
                            raise ValueError(f"kvcal: {path}: endpoint files do not nest")
                        out += expand_endpoint(e)
        if not out:
            raise ValueError(f"kvcal: {path} lists no endpoint")
        return out
    if not endpoint.startswith("dns:///"):
        return [check_endpoint(endpoint)]
    target = endpoint[len("dns:///"):]
    host, port, defaulted = parse_host_port(target)
    if defaulted:
        log.warning("kvcal: %s has no port: using port %d (the default port)", endpoint, port)
    addresses = set()
    for family, _, _, _, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        if family == socket.AF_INET6:
            addresses.add(f"[{sockaddr[0]}]:{port}")
        elif family == socket.AF_INET:
            addresses.add(f"{sockaddr[0]}:{port}")
    if not addresses:
        raise ValueError(f"kvcal: {host} has no addresses")
    return sorted(addresses)


def expand_endpoints(targets) -> List[str]:
    """A target string ("a:1,b:2", "dns:///...", "file:...") or a list of them."""
    if isinstance(targets, (str, os.PathLike)):
        targets = [os.fspath(targets)]
    out: List[str] = []
    for t in targets:
        for e in str(t).split(","):
            e = e.strip()
            if e:
                out += expand_endpoint(e)
    return out
