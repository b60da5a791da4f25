"""Argument checks of the Python client, with the ranges and the words of
the kvcal CLI (util/cli.h, util/host_port.h in the repository): a value
outside its meaning is a ValueError (a value of the wrong type a TypeError)
naming the argument and what is valid, raised before anything is sent.

    chunk_bytes = check_int("Producer", "chunk_bytes", chunk_bytes, CHUNK_BYTES)
"""
from __future__ import annotations

import logging
import math
import numbers
import re
from typing import NamedTuple, Optional, Tuple

# A worker's port when an address names none (kvcal-worker --listen's
# default is 127.0.0.1:50051).
DEFAULT_PORT = 50051

log = logging.getLogger("kvcal")


class IntRange(NamedTuple):
    min: int
    max: Optional[int]  # None: no upper bound
    note: str = ""

    def describe(self) -> str:
        out = f"{self.min} or more" if self.max is None else f"{self.min}..{self.max}"
        return f"{out} ({self.note})" if self.note else out


class RealRange(NamedTuple):
    min: float
    max: float  # math.inf: no upper bound
    min_open: bool = False
    max_open: bool = False
    zero_means: str = ""  # set: 0 is valid too (the worker's default)

    def describe(self) -> str:
        if math.isinf(self.max):
            out = f"{'>' if self.min_open else '>='} {self.min:g}"
        else:
            out = (f"{'(' if self.min_open else '['}{self.min:g}, {self.max:g}"
                   f"{')' if self.max_open else ']'}")
        return f"{out}, or 0 for {self.zero_means}" if self.zero_means else out


# The ranges the CLI checks (client/cli/options.cc, cmd_session.cc, kernels/scale_math.cc's
# ScaleOptions::Validate for the Finalize options).
CHUNK_BYTES = IntRange(1, 1 << 30)
WINDOW = IntRange(1, 1024)
HISTOGRAMS_MAX = 128
AVERAGING_CONSTANT = RealRange(0, 1, True, False, "the worker's default, 0.01")
PERCENTILE = RealRange(0, 100, True, False, "the worker's default, 99.99")
MARGIN = RealRange(0, math.inf, True, True, "the worker's default, 1")
MSE_GRID = IntRange(0, (1 << 32) - 1, "0 = the worker's default, 100")
MSE_MAX_SHRINK = RealRange(0, 1, True, True, "the worker's default, 0.2")
MSE_NORM = RealRange(0, math.inf, True, True, "the worker's default, 2.4")
MSE_PATIENCE = IntRange(0, (1 << 32) - 1, "0 = the worker's default, 5")
UINT64 = IntRange(0, (1 << 64) - 1)


def _name(owner: str, name: str) -> str:
    return f"kvcal: {owner} {name}" if owner else f"kvcal: {name}"


def check_int(owner: str, name: str, value, valid: IntRange) -> int:
    """`value` as an int, if it is a whole number in `valid`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{_name(owner, name)}={value!r} is not a whole number: want "
                        f"{valid.describe()}")
    value = int(value)
    if value < valid.min or (valid.max is not None and value > valid.max):
        raise ValueError(f"{_name(owner, name)}={value} is out of range: want "
                         f"{valid.describe()}")
    return value


def check_real(owner: str, name: str, value, valid: RealRange) -> float:
    """`value` as a float, if it is a finite number in `valid`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{_name(owner, name)}={value!r} is not a number: want {valid.describe()}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{_name(owner, name)}={value} is not a finite number: want "
                         f"{valid.describe()}")
    if value == 0 and valid.zero_means:
        return value
    above = value > valid.min if valid.min_open else value >= valid.min
    below = value < valid.max if valid.max_open else value <= valid.max
    if not (above and below):
        raise ValueError(f"{_name(owner, name)}={value:g} is out of range: want "
                         f"{valid.describe()}")
    return value


def check_histograms(value) -> int:
    """Histogram bins per octave: 0 (none) or a power of two up to 128."""
    valid = f"a power of two 1..{HISTOGRAMS_MAX}, or 0 for no histograms"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"kvcal: histograms={value!r} is not {valid}")
    value = int(value)
    if value < 0 or value > HISTOGRAMS_MAX or value & (value - 1):
        raise ValueError(f"kvcal: histograms={value} is not {valid}")
    return value


def check_timeout(owner: str, name: str, value, allow_none: bool = True) -> Optional[float]:
    """Seconds: a finite number > 0 (or None: no limit, where allowed)."""
    if value is None and allow_none:
        return None
    want = "seconds > 0" + (", or None for no limit" if allow_none else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{_name(owner, name)}={value!r} is not a number: want {want}")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{_name(owner, name)}={value:g} is out of range: want {want}")
    return value


_HOST_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
_IPV6 = re.compile(r"^[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*(%[A-Za-z0-9._-]+)?$")


def parse_host_port(text: str, default_port: Optional[int] = DEFAULT_PORT,
                    min_port: int = 1) -> Tuple[str, int, bool]:
    """(host, port, port_defaulted) of "host:port", "[v6]:port", and, with a
    default port, "host" and "[v6]"; ValueError for what the C++ ParseHostPort
    refuses (util/host_port.h): a port that is not a number in
    min_port..65535, no host, an IPv6 address without brackets."""
    ports = f"{min_port}..65535"
    want = "HOST or HOST:PORT" if default_port is not None else "HOST:PORT"
    if not text:
        raise ValueError(f"kvcal: empty address: want {want}")
    port_text = None
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            raise ValueError(f"kvcal: '{text}' has no closing ']'")
        host = text[1:close]
        if not _IPV6.match(host):
            raise ValueError(f"kvcal: '{host}' in brackets is not an IPv6 address")
        rest = text[close + 1:]
        if rest:
            if not rest.startswith(":"):
                raise ValueError(f"kvcal: '{text}': want [IPv6]:PORT, found '{rest}' after ']'")
            port_text = rest[1:]
    else:
        if text.count(":") >= 2:
            raise ValueError(f"kvcal: '{text}': an IPv6 address goes in brackets, followed by "
                             f"the port, e.g. [::1]:{DEFAULT_PORT}")
        host, sep, port_part = text.partition(":")
        if sep:
            port_text = port_part
        if not host:
            raise ValueError(f"kvcal: no host before ':{port_part}': want {want}")
        if not _HOST_NAME.match(host):
            raise ValueError(f"kvcal: '{host}' is not a host name or address "
                             f"(letters, digits, '.', '-', '_')")
    if port_text is not None:
        if not port_text:
            raise ValueError(f"kvcal: '{text}': no port after ':': want a port in {ports}")
        if not port_text.isdigit() or not port_text.isascii():
            raise ValueError(f"kvcal: '{text}': port '{port_text}' is not a number: want {ports}")
        port = int(port_text)
        if port < min_port or port > 65535:
            raise ValueError(f"kvcal: '{text}': port {port_text} is out of range: want {ports}")
        return host, port, False
    if default_port is None:
        raise ValueError(f"kvcal: '{text}' has no port: want {want}")
    return host, default_port, True


def format_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# gRPC targets with another scheme, passed to gRPC as they are.
_SCHEMES = ("unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:", "xds:", "dns:")


def has_target_scheme(target: str) -> bool:
    return not target.startswith("dns:///") and target.startswith(_SCHEMES)


def check_endpoint(endpoint: str) -> str:
    """A worker address to dial, checked, with the default port when it has
    none (logged once per call, as the CLI says it on stderr)."""
    if has_target_scheme(endpoint):
        return endpoint
    host, port, defaulted = parse_host_port(endpoint)
    full = format_host_port(host, port)
    if defaulted:
        log.warning("kvcal: %s has no port: using %s (the default port)", endpoint, full)
    return full
