"""kvcal.Client: sessions and scales on a kvcal worker.

    client = kvcal.Client("127.0.0.1:50051")
    client.create_session(model.config)          # geometry from the config
    ...                                          # stream with kvcal.Producer
    scales = client.finalize(observer="mse", granularity="head")
    scales["model.layers.0.self_attn.k_scale"]   # numpy float32, shape [kv_heads, 1, 1]
    scales.save("scales.safetensors")            # what `kvcal patch` reads
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, Iterable, Mapping, Optional, Sequence, Union

import grpc
import numpy as np

from kvcal.scales import Scales
from kvcal.v1 import pb, pb_grpc

# llm-compressor's observer names (what the scales file and config.json
# record), and the aliases accepted for them.
OBSERVERS = {
    "static_minmax": pb.OBSERVER_STATIC_MINMAX,
    "minmax": pb.OBSERVER_MINMAX_EMA,
    "memoryless_minmax": pb.OBSERVER_MEMORYLESS_MINMAX,
    "mse": pb.OBSERVER_MSE,
    "percentile": pb.OBSERVER_PERCENTILE,
}
_OBSERVER_ALIASES = {
    "static": "static_minmax",
    "ema": "minmax",
    "minmax_ema": "minmax",
    "memoryless": "memoryless_minmax",
}
GRANULARITIES = {"tensor": pb.GRANULARITY_PER_TENSOR, "head": pb.GRANULARITY_PER_HEAD}
_GRANULARITY_ALIASES = {"per_tensor": "tensor", "per_head": "head", "attn_head": "head"}
FORMATS = {
    "float8_e4m3fn": pb.FORMAT_FP8_E4M3FN,
    "float8_e4m3fnuz": pb.FORMAT_FP8_E4M3FNUZ,
    "float8_e5m2": pb.FORMAT_FP8_E5M2,
    "int8": pb.FORMAT_INT8,
}
_FORMAT_ALIASES = {"fp8": "float8_e4m3fn", "e4m3": "float8_e4m3fn", "fp8_e4m3fn": "float8_e4m3fn",
                   "e4m3fnuz": "float8_e4m3fnuz", "fp8_e4m3fnuz": "float8_e4m3fnuz",
                   "e5m2": "float8_e5m2", "fp8_e5m2": "float8_e5m2"}

# The CLI and the Python client default to 64 bins per octave (CONTRACT.md).
DEFAULT_HISTOGRAMS = 64


class KvcalError(RuntimeError):
    """A worker call failed; `code` is the grpc.StatusCode."""

    def __init__(self, what: str, error: grpc.RpcError):
        self.code = error.code() if hasattr(error, "code") else None
        details = error.details() if hasattr(error, "details") else str(error)
        name = self.code.name if self.code is not None else "ERROR"
        super().__init__(f"{what}: {name}: {details}")


@dataclasses.dataclass(frozen=True)
class Geometry:
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config: Any) -> "Geometry":
        """From a transformers config, a config.json dict, or a path to
        config.json or a model directory."""
        if isinstance(config, (str, os.PathLike)):
            path = os.fspath(config)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path) as f:
                config = json.load(f)
        if not isinstance(config, Mapping):
            if hasattr(config, "get_text_config"):
                config = config.get_text_config()
            config = config.to_dict() if hasattr(config, "to_dict") else vars(config)
        if "text_config" in config and "num_hidden_layers" not in config:
            config = config["text_config"]
        try:
            layers = int(config["num_hidden_layers"])
            heads = int(config["num_attention_heads"])
        except KeyError as e:
            raise ValueError(f"kvcal: config has no {e.args[0]}; pass geometry= instead") from None
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = config.get("head_dim")
        if not head_dim:
            head_dim = int(config["hidden_size"]) // heads
        return cls(layers, heads, kv_heads, int(head_dim))


def _resolve(name: str, table: Mapping[str, int], aliases: Mapping[str, str], what: str) -> str:
    key = str(name).lower().replace("-", "_")  # the CLI spells them with hyphens
    key = aliases.get(key, key)
    if key not in table:
        raise ValueError(f"kvcal: unknown {what} {name!r} (one of {', '.join(table)})")
    return key


def _role_name(role: int) -> str:
    return {pb.ROLE_Q: "q", pb.ROLE_K: "k", pb.ROLE_V: "v"}[role]


class Client:
    """A connection to one kvcal worker and (optionally) one session on it.

    target: "host:port". token: sent as `authorization: Bearer <token>`.
    tls: False/None (plaintext), True (system roots), a path to a PEM CA
    bundle, or grpc.ChannelCredentials.
    """

    def __init__(self, target: str, token: Optional[str] = None,
                 tls: Union[bool, str, None, grpc.ChannelCredentials] = None,
                 session_id: Optional[str] = None,
                 max_message_bytes: int = 64 << 20,
                 timeout: Optional[float] = 60.0):
        self.target = target
        self.token = token
        self.timeout = timeout
        self.session_id = session_id
        self.geometry: Optional[Geometry] = None
        options = [("grpc.max_send_message_length", max_message_bytes),
                   ("grpc.max_receive_message_length", max_message_bytes),
                   # While a call is open: ping every 30 s, drop the connection
                   # after 20 s without an answer (a vanished worker host
                   # would otherwise leave a stream waiting forever). The
                   # worker accepts pings this often.
                   ("grpc.keepalive_time_ms", 30000),
                   ("grpc.keepalive_timeout_ms", 20000),
                   ("grpc.http2.max_pings_without_data", 0)]
        if tls:
            if isinstance(tls, grpc.ChannelCredentials):
                creds = tls
            elif isinstance(tls, (str, os.PathLike)):
                with open(tls, "rb") as f:
                    creds = grpc.ssl_channel_credentials(root_certificates=f.read())
            else:
                creds = grpc.ssl_channel_credentials()
            self._channel = grpc.secure_channel(target, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)
        self._stub = pb_grpc.CalibrationStub(self._channel)

    # -- plumbing ------------------------------------------------------------
    @property
    def metadata(self) -> Sequence[tuple]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    @property
    def stub(self) -> pb_grpc.CalibrationStub:
        return self._stub

    def _call(self, what: str, method, request, timeout: Optional[float] = None):
        try:
            return method(request, metadata=self.metadata,
                          timeout=timeout if timeout is not None else self.timeout)
        except grpc.RpcError as e:
            raise KvcalError(what, e) from None

    def _session(self, session_id: Optional[str]) -> str:
        sid = session_id or self.session_id
        if not sid:
            raise ValueError("kvcal: no session: call create_session() or pass session_id")
        return sid

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- sessions ------------------------------------------------------------
    def create_session(self, config: Any = None, *, geometry: Union[Geometry, Mapping, None] = None,
                       histograms: int = DEFAULT_HISTOGRAMS, session_id: str = "",
                       roles: Iterable[str] = ()) -> pb.Session:
        """Creates a session (or returns the identical existing one) and makes
        it this client's session. Geometry from `config` (transformers config,
        config.json dict or path) or `geometry` (Geometry or a dict with
        num_layers, num_attention_heads, num_key_value_heads, head_dim)."""
        if geometry is None:
            if config is None:
                raise ValueError("kvcal: create_session needs a config or a geometry")
            geometry = Geometry.from_config(config)
        elif isinstance(geometry, Mapping):
            geometry = Geometry(**geometry)
        role_values = [{"q": pb.ROLE_Q, "k": pb.ROLE_K, "v": pb.ROLE_V}[r.lower()] for r in roles]
        request = pb.CreateSessionRequest(
            session_id=session_id, num_layers=geometry.num_layers,
            num_attention_heads=geometry.num_attention_heads,
            num_key_value_heads=geometry.num_key_value_heads, head_dim=geometry.head_dim,
            histogram_bins_per_octave=histograms, roles=role_values)
        session = self._call("CreateSession", self._stub.CreateSession, request)
        self.session_id = session.session_id
        self.geometry = geometry
        return session

    def attach(self, session_id: str) -> pb.Session:
        """Makes an existing session this client's session."""
        session = self.status(session_id)
        self.session_id = session.session_id
        self.geometry = Geometry(session.num_layers, session.num_attention_heads,
                                 session.num_key_value_heads, session.head_dim)
        return session

    def status(self, session_id: Optional[str] = None) -> pb.Session:
        """The session's counters and producer watermarks (GetSession)."""
        return self._call("GetSession", self._stub.GetSession,
                          pb.GetSessionRequest(session_id=self._session(session_id)))

    def list_sessions(self) -> Sequence[pb.Session]:
        return list(self._call("ListSessions", self._stub.ListSessions,
                               pb.ListSessionsRequest()).sessions)

    def delete(self, session_id: Optional[str] = None) -> None:
        sid = self._session(session_id)
        self._call("DeleteSession", self._stub.DeleteSession, pb.DeleteSessionRequest(session_id=sid))
        if sid == self.session_id:
            self.session_id = None

    def export_state(self, session_id: Optional[str] = None) -> pb.SessionState:
        return self._call("ExportState", self._stub.ExportState,
                          pb.ExportStateRequest(session_id=self._session(session_id)))

    # -- scales --------------------------------------------------------------
    def finalize_response(self, session_id: Optional[str] = None, **kwargs) -> pb.FinalizeResponse:
        """The raw FinalizeResponse (scales, absmax, counts); see finalize()."""
        request, _, _, _ = self._finalize_request(self._session(session_id), **kwargs)
        return self._call("Finalize", self._stub.Finalize, request)

    def finalize(self, observer: str = "static_minmax", granularity: str = "tensor",
                 fmt: str = "float8_e4m3fn", *, session_id: Optional[str] = None,
                 as_torch: bool = False, **params) -> Scales:
        """Computes scales. Returns a Scales dict from checkpoint tensor name
        (`model.layers.{L}.self_attn.{q,k,v}_scale`) to a float32 numpy array
        of shape [1] (per tensor) or [heads, 1, 1] (per head), or to torch
        tensors with as_torch=True.

        observer: static_minmax | minmax (EMA) | memoryless_minmax | mse | percentile.
        granularity: tensor | head.  fmt: float8_e4m3fn | float8_e4m3fnuz | float8_e5m2 | int8.
        params: averaging_constant, percentile, margin, mse_grid, mse_max_shrink,
        mse_norm, mse_patience, q_per_kv_group, allow_missing, layers.
        """
        sid = self._session(session_id)
        request, observer, granularity, fmt = self._finalize_request(
            sid, observer=observer, granularity=granularity, fmt=fmt, **params)
        response = self._call("Finalize", self._stub.Finalize, request)
        tensors: Dict[str, np.ndarray] = {}
        counts: Dict[str, Dict[str, int]] = {}
        for layer in response.layers:
            counts[str(layer.layer)] = {}
            for role_name, role in (("q", layer.q), ("k", layer.k), ("v", layer.v)):
                counts[str(layer.layer)][role_name] = int(role.count)
                if not role.scale:
                    continue
                values = np.asarray(role.scale, dtype=np.float32)
                shape = (len(values), 1, 1) if granularity == "head" else (1,)
                tensors[f"model.layers.{layer.layer}.self_attn.{role_name}_scale"] = values.reshape(shape)
        options = {
            "averaging_constant": request.averaging_constant or 0.01,
            "percentile": request.percentile or 99.99,
            "margin": request.margin or 1.0,
            "mse_grid": request.mse_grid or 100,
            "mse_max_shrink": request.mse_max_shrink or 0.2,
            "mse_norm": request.mse_norm or 2.4,
            "mse_patience": request.mse_patience or 5,
            "q_per_kv_group": request.q_per_kv_group,
            "allow_missing": request.allow_missing,
        }
        scales = Scales(tensors, granularity=granularity, observer=observer, fmt=fmt,
                        metadata={"session": sid, "observer_options": json.dumps(options),
                                  "counts": json.dumps(counts), "workers": "1"})
        return scales.to_torch() if as_torch else scales

    def _finalize_request(self, session_id: str, observer: str = "static_minmax",
                          granularity: str = "tensor", fmt: str = "float8_e4m3fn",
                          averaging_constant: float = 0.0, percentile: float = 0.0,
                          margin: float = 0.0, mse_grid: int = 0, mse_max_shrink: float = 0.0,
                          mse_norm: float = 0.0, mse_patience: int = 0,
                          q_per_kv_group: bool = False, allow_missing: bool = False,
                          layers: Iterable[int] = ()):
        observer = _resolve(observer, OBSERVERS, _OBSERVER_ALIASES, "observer")
        granularity = _resolve(granularity, GRANULARITIES, _GRANULARITY_ALIASES, "granularity")
        fmt = _resolve(fmt, FORMATS, _FORMAT_ALIASES, "format")
        request = pb.FinalizeRequest(
            session_id=session_id, granularity=GRANULARITIES[granularity],
            observer=OBSERVERS[observer], format=FORMATS[fmt],
            averaging_constant=averaging_constant, percentile=percentile, margin=margin,
            mse_grid=mse_grid, mse_max_shrink=mse_max_shrink, mse_norm=mse_norm,
            mse_patience=mse_patience, q_per_kv_group=q_per_kv_group,
            allow_missing=allow_missing, layers=list(layers))
        return request, observer, granularity, fmt
