"""kvcal.Client: sessions and scales on one kvcal worker or several.

    client = kvcal.Client("127.0.0.1:50051")     # or "w0:50051,w1:50051",
                                                 # ["w0:50051", "w1:50051"],
                                                 # "dns:///kvcal-worker.kvcal.svc:50051"
    client.create_session(model.config)          # geometry from the config
    ...                                          # stream with kvcal.Producer
    scales = client.finalize(observer="mse", granularity="head")
    scales["model.layers.0.self_attn.k_scale"]   # numpy float32, shape [kv_heads, 1, 1]
    scales.save("scales.safetensors")            # what `kvcal patch` reads

Why this file is over 600 lines: it is one class, Client, whose methods
are the service's RPCs, for one worker and for a sharded set alike (each
method fans out to the workers that own the layers and merges the
replies); splitting it would split every method in two.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Dict, Iterable, Mapping, Optional, Sequence, Union

import grpc
import numpy as np

from kvcal import _ranges, names
from kvcal.scales import Scales
from kvcal.sharding import expand_endpoints, layer_owner, layer_owners
from kvcal.v1 import pb, pb_grpc


# The enum names (kvcal.names; kvcal.client.OBSERVERS etc. as before).
OBSERVERS = names.OBSERVERS
GRANULARITIES = names.GRANULARITIES
FORMATS = names.FORMATS

# The CLI and the Python client default to 64 bins per octave (docs/wire-contract.md).
DEFAULT_HISTOGRAMS = 64


class KvcalError(RuntimeError):
    """A worker call failed; `code` is the grpc.StatusCode."""

    def __init__(self, what: str, error: grpc.RpcError):
        self.code = error.code() if hasattr(error, "code") else None
        details = error.details() if hasattr(error, "details") else str(error)
        name = self.code.name if self.code is not None else "ERROR"
        super().__init__(f"{what}: {name}: {details}")


# Attention kvcal does not calibrate (client/checkpoint/model_config.cc has the same
# rules): refused with the config key that says so, never read as ordinary
# attention. vLLM 0.34 caches one compressed latent per token for MLA, not
# per-head K and V, and its loader takes no calibrated MLA scale from a
# checkpoint (tests/python/test_mla_vllm_loader.py).
MLA_NOT_SUPPORTED = ("DeepSeek-style multi-head latent attention (kv_lora_rank): vLLM 0.34 caches "
                     "one compressed latent per token, and its weight loader drops every "
                     "calibrated MLA scale whatever the checkpoint calls it ('not loaded', then "
                     "1.0), so there is nothing to patch; kvcal.torch.capture_mla measures the "
                     "latent's scales")
_MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_mtp", "kimi_k2",
                    "kimi_linear", "glm4_moe_lite", "glm_moe_dsa", "axk1", "longcat_flash",
                    "mistral_large_4", "pangu_ultra_moe")
# Ordinary softmax attention over per-head K and V; vLLM quantizes the KV
# cache of sliding-window and chunked layers with their scales too.
_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "attention")
_HYBRID_LAYOUT_KEYS = ("hybrid_override_pattern", "attn_layer_indices", "attn_layer_period",
                       "attn_layer_offset", "hybrid_layer_ids", "linear_attn_config",
                       "full_attn_idxs", "full_attention_idx")


def _set(config: Mapping, key: str) -> bool:
    return config.get(key) is not None


def attention_problem(config: Mapping) -> Optional[str]:
    """Why kvcal cannot calibrate the attention `config` (a config.json dict)
    describes, naming the key; None for ordinary attention."""
    if _set(config, "kv_lora_rank"):
        return f"kv_lora_rank {config['kv_lora_rank']}: {MLA_NOT_SUPPORTED}"
    # (An explicit null kv_lora_rank is no latent: the checks below decide.)
    if "kv_lora_rank" not in config and config.get("model_type") in _MLA_MODEL_TYPES:
        return f"model_type {config['model_type']!r}: {MLA_NOT_SUPPORTED}"
    for key in ("qk_rope_head_dim", "qk_nope_head_dim"):
        if _set(config, key):
            return (f"{key}: attention with separate RoPE and non-RoPE query/key parts "
                    f"(DeepSeek style) is not supported yet")
    if _set(config, "v_head_dim") and config.get("head_dim") != config["v_head_dim"]:
        return (f"v_head_dim {config['v_head_dim']}: values with a head size other than the keys' "
                f"(head_dim) are not supported")
    if config.get("is_encoder_decoder") is True:
        return ("is_encoder_decoder: encoder-decoder models (cross-attention, an encoder without "
                "a KV cache) are not supported")
    if config.get("add_cross_attention") is True:
        return "add_cross_attention: decoders with cross-attention are not supported"
    if config.get("cross_attention_layers"):
        return "cross_attention_layers: models with cross-attention layers are not supported"
    for key in ("layer_types", "layers_block_type", "block_types"):
        types = config.get(key)
        if types is None:
            continue
        if not isinstance(types, (list, tuple)):
            return f"{key}: is {types!r}, not a list"
        for i, t in enumerate(types):
            if t not in _ATTENTION_LAYER_TYPES:
                return (f"{key}[{i}] {t!r}: models with layers other than softmax attention "
                        f"(linear attention, Mamba or other state-space, convolution or hybrid "
                        f"layers) are not supported yet; accepted: full_attention, "
                        f"sliding_attention, chunked_attention")
        layers = config.get("num_hidden_layers")  # (block_types is a repeating pattern)
        if key != "block_types" and isinstance(layers, int) and layers != len(types):
            return f"{key}: has {len(types)} entries for num_hidden_layers {layers} layers"
    shared = config.get("num_kv_shared_layers")
    if isinstance(shared, int) and shared != 0:
        return (f"num_kv_shared_layers {shared}: layers that read another layer's KV cache "
                f"(Gemma 3n style) are not supported yet")
    for key in _HYBRID_LAYOUT_KEYS:
        if _set(config, key):
            return f"{key}: hybrid models whose layers are not all softmax attention are not supported yet"
    for key, value in config.items():
        if str(key).startswith("mamba") and value is not None:
            return f"{key}: models with Mamba (state-space) layers are not supported yet"
    return None


def _config_dicts(config: Any):
    """(the whole config, its text model's config) as dicts; a path names a
    config.json or a model directory."""
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            config = json.load(f)
    if not isinstance(config, Mapping):
        if isinstance(config, (list, str, int, float)) or config is None:
            raise ValueError("kvcal: config.json is not a JSON object")
        text = config.get_text_config() if hasattr(config, "get_text_config") else config

        def as_dict(c):
            return c.to_dict() if hasattr(c, "to_dict") else dict(vars(c))

        root = as_dict(config)
        return root, (root if text is config else as_dict(text))
    text = config
    if "text_config" in config and "num_hidden_layers" not in config \
            and isinstance(config["text_config"], Mapping):
        text = config["text_config"]
    return config, text


def check_attention(config: Any) -> None:
    """ValueError naming the key when `config` (transformers config,
    config.json dict or path) has attention kvcal does not calibrate."""
    _check_attention_dicts(*_config_dicts(config))


def _check_attention_dicts(root: Mapping, text: Mapping) -> None:
    for c in (root, text) if text is not root else (root,):
        problem = attention_problem(c)
        if problem is not None:
            raise ValueError(f"kvcal: config.json: {problem}")


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
        root, config = _config_dicts(config)
        _check_attention_dicts(root, config)

        def positive(key: str, required: bool) -> Optional[int]:
            value = config.get(key)
            if value is None:
                if required:
                    raise ValueError(f"kvcal: config has no {key}; pass geometry= instead")
                return None
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"kvcal: config.json: {key} is {value!r}, not a positive integer")
            return value

        layers = positive("num_hidden_layers", True)
        heads = positive("num_attention_heads", True)
        kv_heads = positive("num_key_value_heads", False) or heads
        if heads % kv_heads:
            raise ValueError(f"kvcal: config.json: num_attention_heads ({heads}) must be a multiple "
                             f"of num_key_value_heads ({kv_heads})")
        head_dim = positive("head_dim", False)
        if head_dim is None:
            hidden = positive("hidden_size", False)
            if hidden is None:
                raise ValueError("kvcal: config.json has neither head_dim nor hidden_size")
            if hidden % heads:
                raise ValueError(f"kvcal: config.json: hidden_size {hidden} is not a multiple of "
                                 f"num_attention_heads {heads} and there is no head_dim")
            head_dim = hidden // heads
        return cls(layers, heads, kv_heads, head_dim)


def _role_name(role: int) -> str:
    return {pb.ROLE_Q: "q", pb.ROLE_K: "k", pb.ROLE_V: "v"}[role]


class Client:
    """A connection to kvcal workers and (optionally) one session on them.

    target: "host:port", several ("a:1,b:2" or a list), "dns:///host:port"
    (every address the name resolves to: a Kubernetes headless Service) or
    "file:PATH" (a list of endpoints, read again when a worker moved): the
    same forms as the CLI's --server. With several workers, layers are
    sharded by worker id exactly as the C++ client does (kvcal.sharding);
    `workers` holds one single-worker Client per worker, in id order.
    token: sent as `authorization: Bearer <token>`. tls: False/None
    (plaintext), True (system roots), a path to a PEM CA bundle, or
    grpc.ChannelCredentials. A "host" without a port gets port 50051 (logged);
    a port outside 1..65535, max_message_bytes outside 64 KiB..2 GiB-1 and a
    timeout that is not > 0 (or None) are a ValueError before anything
    connects.
    """

    def __init__(self, target: Union[str, Sequence[str]], token: Optional[str] = None,
                 tls: Union[bool, str, None, grpc.ChannelCredentials] = None,
                 session_id: Optional[str] = None,
                 max_message_bytes: int = 64 << 20,
                 timeout: Optional[float] = 60.0):
        max_message_bytes = _ranges.check_int("Client", "max_message_bytes", max_message_bytes,
                                            _ranges.IntRange(1 << 16, (1 << 31) - 1))
        timeout = _ranges.check_timeout("Client", "timeout", timeout)
        self.token = token
        self.timeout = timeout
        self.session_id = session_id
        self.geometry: Optional[Geometry] = None
        self.workers: Optional[list] = None  # several workers: one Client each, by id
        self.worker_ids: Sequence[str] = ()
        self.worker_id: Optional[str] = None  # this single worker's id, when known
        self.shard_worker_ids: Sequence[str] = ()  # sent with chunks (set by a sharding parent)
        self.relocate = None  # set by a sharding parent: finds this worker under a new address
        self._spec = target
        self._tls = tls
        self._max_message_bytes = max_message_bytes
        endpoints = expand_endpoints(target)
        if not endpoints:
            raise ValueError("kvcal: no worker address given")
        if len(endpoints) > 1:
            self.target = ",".join(endpoints)
            self._channel = None
            self._stub = None
            self._connect_workers(endpoints)
            return
        self._open(endpoints[0])

    def _open(self, target: str) -> None:
        self.target = target
        tls, max_message_bytes = self._tls, self._max_message_bytes
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

    # -- several workers -------------------------------------------------------
    def _single(self, endpoint: str) -> "Client":
        return Client(endpoint, token=self.token, tls=self._tls,
                      max_message_bytes=self._max_message_bytes, timeout=self.timeout)

    def _ask_id(self, timeout: Optional[float] = None, wait_for_ready: bool = True) -> str:
        try:
            info = self._stub.GetWorkerInfo(pb.GetWorkerInfoRequest(), metadata=self.metadata,
                                            timeout=timeout or self.timeout,
                                            wait_for_ready=wait_for_ready)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:  # a worker older than GetWorkerInfo
                return self.target
            raise KvcalError(f"GetWorkerInfo on {self.target}", e) from None
        return info.worker_id or self.target

    def _connect_workers(self, endpoints: Sequence[str]) -> None:
        workers = [self._single(e) for e in endpoints]
        for w in workers:
            w.worker_id = w._ask_id()
        workers.sort(key=lambda w: w.worker_id.encode())
        for a, b in zip(workers, workers[1:]):
            if a.worker_id == b.worker_id:
                for w in workers:
                    w.close()
                raise ValueError(
                    f"kvcal: workers {a.target} and {b.target} both report worker id "
                    f"'{a.worker_id}' (the same worker listed twice, or two workers without their "
                    f"own --worker-id); layers are assigned by id, so each worker needs its own")
        self.workers = workers
        self.worker_ids = [w.worker_id for w in workers]
        for w in workers:
            w.shard_worker_ids = list(self.worker_ids)
            w.relocate = (lambda w=w: self._relocate(w))

    def _relocate(self, worker: "Client") -> bool:
        """Looks for `worker`'s id under another address (a worker restarted
        elsewhere, say a rescheduled pod); True when it moved there."""
        try:
            endpoints = expand_endpoints(self._spec)
        except (OSError, ValueError):
            return False
        for endpoint in endpoints:
            if endpoint == worker.target:
                continue
            probe = self._single(endpoint)
            try:
                found = probe._ask_id(timeout=1.0, wait_for_ready=False)
            except KvcalError:
                found = None
            finally:
                probe.close()
            if found == worker.worker_id:
                # The old channel is left to the garbage collector: another
                # thread may be in a call on it right now.
                worker._open(endpoint)
                logging.getLogger("kvcal").info("kvcal: worker %s moved to %s",
                                                worker.worker_id, endpoint)
                return True
        return False

    def _describe_change(self, session_ids: Sequence[str]) -> str:
        added = sorted(set(self.worker_ids) - set(session_ids))
        missing = sorted(set(session_ids) - set(self.worker_ids))
        parts = []
        if added:
            parts.append("added [" + ", ".join(added) + "]")
        if missing:
            parts.append("missing [" + ", ".join(missing) + "]")
        return ", ".join(parts) or "same ids, different layer owners"

    def check_session_workers(self, session_id: Optional[str] = None) -> pb.Session:
        """With several workers: every worker holds the session with this
        client's worker set, else ValueError naming what changed (as the C++
        client's CheckSessionWorkers). Returns the first worker's Session."""
        sid = self._session(session_id)
        if self.workers is None:
            return self.status(sid)
        have, lack, first = [], [], None
        for w in self.workers:
            try:
                session = w.status(sid)
            except KvcalError as e:
                if e.code == grpc.StatusCode.NOT_FOUND:
                    lack.append(w.worker_id)
                    continue
                raise
            have.append(w.worker_id)
            first = first or session
        if first is None:
            return self.workers[0].status(sid)  # raises NOT_FOUND
        session_ids = list(first.shard_map.worker_ids)
        if session_ids and session_ids != list(self.worker_ids):
            raise ValueError(
                f"kvcal: session '{sid}' is sharded over workers [{', '.join(session_ids)}]; this "
                f"client has [{', '.join(self.worker_ids)}] ({self._describe_change(session_ids)}); "
                f"give the session's workers, or create a new session for this set")
        if lack:
            raise ValueError(f"kvcal: session '{sid}' exists on workers [{', '.join(have)}] but not "
                             f"on [{', '.join(lack)}]")
        if not session_ids:
            raise ValueError(f"kvcal: session '{sid}' has no shard map (created by a single-worker "
                             f"or an older client); use it with the worker that created it")
        if list(first.shard_map.layer_owners) != layer_owners(sid, first.num_layers, self.worker_ids):
            raise ValueError(f"kvcal: session '{sid}' assigns layers differently from this "
                             f"client's rendezvous hashing")
        return first

    def worker_for(self, layer: int, session_id: Optional[str] = None) -> "Client":
        """The (single-worker) Client that holds `layer` of the session."""
        if self.workers is None:
            return self
        return self.workers[layer_owner(self._session(session_id), layer, self.worker_ids)]

    # -- plumbing ------------------------------------------------------------
    @property
    def metadata(self) -> Sequence[tuple]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    @property
    def stub(self) -> pb_grpc.CalibrationStub:
        if self._stub is None:
            raise ValueError("kvcal: a client of several workers has no single stub; "
                             "use client.workers[i].stub or client.worker_for(layer)")
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
        if self.workers is not None:
            for w in self.workers:
                w.close()
        else:
            self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- sessions ------------------------------------------------------------
    def create_session(self, config: Any = None, *, geometry: Union[Geometry, Mapping, None] = None,
                       histograms: int = DEFAULT_HISTOGRAMS, session_id: str = "",
                       roles: Iterable[str] = (), holdout_budget_bytes: int = 0,
                       reject_non_finite: bool = False) -> pb.Session:
        """Creates a session (or returns the identical existing one) and makes
        it this client's session. Geometry from `config` (transformers config,
        config.json dict or path; attention kvcal does not calibrate, such as
        DeepSeek-style MLA, is a ValueError naming the config key) or
        `geometry` (Geometry or a dict with num_layers, num_attention_heads,
        num_key_value_heads, head_dim).
        holdout_budget_bytes: bytes of held-out data the worker keeps (0 = its
        default, 64 MiB).
        reject_non_finite: the workers refuse any chunk holding NaN or Inf
        (INVALID_ARGUMENT naming layer, role, head and counts; nothing of it is
        applied, so a Producer stops with a ProducerError) instead of counting
        such values and leaving them out of the statistics (the default)."""
        histograms = _ranges.check_histograms(histograms)
        holdout_budget_bytes = _ranges.check_int("create_session", "holdout_budget_bytes",
                                               holdout_budget_bytes, _ranges.UINT64)
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
            histogram_bins_per_octave=histograms, roles=role_values,
            holdout_budget_bytes=int(holdout_budget_bytes),
            reject_non_finite=bool(reject_non_finite))
        if self.workers is not None:
            if not request.session_id:  # the map depends on the id: the first worker picks it
                request.session_id = self.workers[0]._call(
                    "CreateSession", self.workers[0]._stub.CreateSession, request).session_id
            request.shard_map.worker_ids.extend(self.worker_ids)
            request.shard_map.layer_owners.extend(
                layer_owners(request.session_id, geometry.num_layers, self.worker_ids))
            session = None
            for w in self.workers:
                created = w._call(f"CreateSession on {w.worker_id} ({w.target})",
                                  w._stub.CreateSession, request)
                session = session or created
            for w in self.workers:
                w.session_id, w.geometry = session.session_id, geometry
        else:
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
        for w in self.workers or ():
            w.session_id, w.geometry = self.session_id, self.geometry
        return session

    def status(self, session_id: Optional[str] = None) -> pb.Session:
        """The session's counters and producer watermarks (GetSession). With
        several workers: counters summed, producers prefixed "<worker id>/"."""
        sid = self._session(session_id)
        if self.workers is None:
            return self._call("GetSession", self._stub.GetSession, pb.GetSessionRequest(session_id=sid))
        total = pb.Session()
        total.CopyFrom(self.check_session_workers(sid))
        del total.producers[:]
        for field in ("chunks_applied", "values_ingested", "bytes_ingested", "nonfinite_values",
                      "state_bytes", "holdout_bytes", "holdout_chunks", "holdout_batches",
                      "nonfinite_heads_total"):
            setattr(total, field, 0)
        del total.nonfinite_heads[:]
        for w in self.workers:
            part = w.status(sid)
            for field in ("chunks_applied", "values_ingested", "bytes_ingested",
                          "nonfinite_values", "state_bytes", "holdout_bytes", "holdout_chunks",
                          "nonfinite_heads_total"):
                setattr(total, field, getattr(total, field) + getattr(part, field))
            total.nonfinite_heads.extend(part.nonfinite_heads)  # each its own layers
            # Every worker holds the same held-out batches, for its own layers.
            total.holdout_batches = max(total.holdout_batches, part.holdout_batches)
            for p in part.producers:
                total.producers.add(producer_id=f"{w.worker_id}/{p.producer_id}", sequence=p.sequence,
                                    durable_sequence=p.durable_sequence)
        heads = sorted(total.nonfinite_heads, key=lambda h: (h.layer, h.role, h.head))
        del total.nonfinite_heads[:]
        total.nonfinite_heads.extend(heads)
        total.worker_id = ""
        return total

    def list_sessions(self) -> Sequence[pb.Session]:
        if self.workers is not None:
            by_id: Dict[str, pb.Session] = {}
            for w in self.workers:
                for s in w.list_sessions():
                    by_id.setdefault(s.session_id, s)
            return [by_id[k] for k in sorted(by_id)]
        return list(self._call("ListSessions", self._stub.ListSessions,
                               pb.ListSessionsRequest()).sessions)

    def delete(self, session_id: Optional[str] = None) -> None:
        sid = self._session(session_id)
        if self.workers is not None:
            for w in self.workers:
                w.delete(sid)
        else:
            self._call("DeleteSession", self._stub.DeleteSession,
                       pb.DeleteSessionRequest(session_id=sid))
        if sid == self.session_id:
            self.session_id = None

    def export_state(self, session_id: Optional[str] = None) -> pb.SessionState:
        if self.workers is not None:
            raise ValueError("kvcal: export from each worker: client.workers[i].export_state()")
        return self._call("ExportState", self._stub.ExportState,
                          pb.ExportStateRequest(session_id=self._session(session_id)))

    def import_state(self, state: pb.SessionState, session_id: Optional[str] = None,
                     import_id: str = "") -> pb.Session:
        """Merges an exported state (ExportState, kvcal.LocalStatistics.export_state)
        into the session (ImportState; creates it when it does not exist).
        A non-empty import_id that the session already applied changes
        nothing, so a retried import is applied once."""
        if self.workers is not None:
            raise ValueError("kvcal: import into each worker: client.workers[i].import_state()")
        return self._call("ImportState", self._stub.ImportState,
                          pb.ImportStateRequest(session_id=self._session(session_id),
                                                state=state, import_id=import_id))

    # -- scales --------------------------------------------------------------
    def finalize_response(self, session_id: Optional[str] = None, **kwargs) -> pb.FinalizeResponse:
        """The raw FinalizeResponse (scales, absmax, counts); see finalize()."""
        request, _, _, _ = self._finalize_request(self._session(session_id), **kwargs)
        return self._finalize_call(request)

    def _finalize_call(self, request: pb.FinalizeRequest) -> pb.FinalizeResponse:
        if self.workers is None:
            return self._call("Finalize", self._stub.Finalize, request)
        session = self.check_session_workers(request.session_id)
        layers = list(request.layers) or list(range(session.num_layers))
        total = pb.FinalizeResponse()
        for i, w in enumerate(self.workers):
            mine = [l for l in layers if layer_owner(request.session_id, l, self.worker_ids) == i]
            if not mine:
                continue  # empty would mean "every layer"
            part = pb.FinalizeRequest()
            part.CopyFrom(request)
            del part.layers[:]
            part.layers.extend(mine)
            part.shard_worker_ids.extend(self.worker_ids)
            response = w._call(f"Finalize on {w.worker_id} ({w.target})",
                               w._stub.Finalize, part)
            total.layers.extend(response.layers)
            if not total.HasField("resolved") and response.HasField("resolved"):
                # Every worker resolves the same options; the layers are the caller's.
                total.resolved.CopyFrom(response.resolved)
                del total.resolved.layers[:]
                total.resolved.layers.extend(request.layers)
            # evaluate / observer auto: each worker judged its own layers. Layer
            # rows are concatenated; session totals are the first worker's (as
            # the C++ client does).
            if response.HasField("evaluation"):
                if not total.HasField("evaluation"):
                    total.evaluation.CopyFrom(response.evaluation)
                else:
                    total.evaluation.layers.extend(response.evaluation.layers)
            if not total.candidates:
                total.candidates.extend(response.candidates)
            else:
                for mine, theirs in zip(total.candidates, response.candidates):
                    mine.layers.extend(theirs.layers)
        total.layers.sort(key=lambda l: l.layer)
        if total.HasField("evaluation"):
            rows = sorted(total.evaluation.layers, key=lambda l: l.layer)
            del total.evaluation.layers[:]
            total.evaluation.layers.extend(rows)
        return total

    def finalize(self, observer: str = "static_minmax", granularity: str = "tensor",
                 fmt: str = "float8_e4m3fn", *, session_id: Optional[str] = None,
                 as_torch: bool = False, **params) -> Scales:
        """Computes scales. Returns a Scales dict from checkpoint tensor name
        (`model.layers.{L}.self_attn.{q,k,v}_scale`) to a float32 numpy array
        of shape [1] (per tensor) or [heads, 1, 1] (per head), or to torch
        tensors with as_torch=True.

        observer: static_minmax | minmax (EMA) | memoryless_minmax | mse | percentile |
        auto (every observer judged on the held-out batches; finalize_response()
        returns the evaluation that justifies the choice).
        granularity: tensor | head.  fmt: float8_e4m3fn | float8_e4m3fnuz | float8_e5m2 | int8.
        params: averaging_constant, percentile, margin, mse_grid, mse_max_shrink,
        mse_norm, mse_patience, q_per_kv_group, allow_missing, layers, evaluate,
        evaluate_kv_only, auto_per_session, auto_granularities.
        """
        sid = self._session(session_id)
        request, observer, granularity, fmt = self._finalize_request(
            sid, observer=observer, granularity=granularity, fmt=fmt, **params)
        response = self._finalize_call(request)
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
        # The worker echoes the request with its defaults resolved.
        if not response.HasField("resolved"):
            raise RuntimeError("kvcal: Finalize: the worker did not report the options it "
                               "used (FinalizeResponse.resolved); upgrade the worker")
        used = response.resolved
        options = {
            "averaging_constant": used.averaging_constant,
            "percentile": used.percentile,
            "margin": used.margin,
            "mse_grid": used.mse_grid,
            "mse_max_shrink": used.mse_max_shrink,
            "mse_norm": used.mse_norm,
            "mse_patience": used.mse_patience,
            "q_per_kv_group": used.q_per_kv_group,
            "allow_missing": used.allow_missing,
        }
        scales = Scales(tensors, granularity=granularity, observer=observer, fmt=fmt,
                        metadata={"session": sid, "observer_options": json.dumps(options),
                                  "counts": json.dumps(counts),
                                  "workers": str(len(self.workers or [self]))})
        return scales.to_torch() if as_torch else scales

    def _finalize_request(self, session_id: str, observer: str = "static_minmax",
                          granularity: str = "tensor", fmt: str = "float8_e4m3fn",
                          averaging_constant: float = 0.0, percentile: float = 0.0,
                          margin: float = 0.0, mse_grid: int = 0, mse_max_shrink: float = 0.0,
                          mse_norm: float = 0.0, mse_patience: int = 0,
                          q_per_kv_group: bool = False, allow_missing: bool = False,
                          layers: Iterable[int] = (), evaluate: bool = False,
                          evaluate_kv_only: bool = False, auto_per_session: bool = False,
                          auto_granularities: Iterable[str] = ()):
        # The CLI's ranges (kernels/scale_math.cc ScaleOptions::Validate);
        # 0 asks the worker for its default.
        averaging_constant = _ranges.check_real("finalize", "averaging_constant",
                                              averaging_constant, _ranges.AVERAGING_CONSTANT)
        percentile = _ranges.check_real("finalize", "percentile", percentile, _ranges.PERCENTILE)
        margin = _ranges.check_real("finalize", "margin", margin, _ranges.MARGIN)
        mse_grid = _ranges.check_int("finalize", "mse_grid", mse_grid, _ranges.MSE_GRID)
        mse_max_shrink = _ranges.check_real("finalize", "mse_max_shrink", mse_max_shrink,
                                          _ranges.MSE_MAX_SHRINK)
        mse_norm = _ranges.check_real("finalize", "mse_norm", mse_norm, _ranges.MSE_NORM)
        mse_patience = _ranges.check_int("finalize", "mse_patience", mse_patience,
                                       _ranges.MSE_PATIENCE)
        layers = [_ranges.check_int("finalize", "layers[]", l, _ranges.IntRange(0, (1 << 32) - 1))
                  for l in layers]
        observer = names.resolve_observer(observer)
        granularity = names.resolve_granularity(granularity)
        fmt = names.resolve_format(fmt)
        request = pb.FinalizeRequest(
            session_id=session_id, granularity=GRANULARITIES[granularity],
            observer=OBSERVERS[observer], format=FORMATS[fmt],
            averaging_constant=averaging_constant, percentile=percentile, margin=margin,
            mse_grid=mse_grid, mse_max_shrink=mse_max_shrink, mse_norm=mse_norm,
            mse_patience=mse_patience, q_per_kv_group=q_per_kv_group,
            allow_missing=allow_missing, layers=list(layers), evaluate=evaluate,
            evaluate_kv_only=evaluate_kv_only, auto_per_session=auto_per_session,
            auto_granularities=[GRANULARITIES[names.resolve_granularity(g)]
                                for g in auto_granularities])
        return request, observer, granularity, fmt
