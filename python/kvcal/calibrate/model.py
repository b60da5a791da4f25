"""The model step: where the model is (a directory, a GGUF file, a hub
name), its config checked, the tokenizer and weights loaded with
transformers, and a GGUF model's export to safetensors."""
from __future__ import annotations

import contextlib
import json
import os
import re
from typing import Optional

from kvcal.calibrate.errors import CalibrateError, UsageError, first_line
from kvcal.calibrate.ui import Ui


_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def resolve_model(model: str, gguf_file: Optional[str]):
    """(directory, is_hub, gguf path or None)."""
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        if gguf_file:
            g = gguf_file if os.path.isabs(gguf_file) else os.path.join(path, gguf_file)
            if not os.path.isfile(g):
                raise CalibrateError(f"--gguf-file {gguf_file}: no such file in {path}")
            return os.path.abspath(path), False, os.path.abspath(g)
        if not os.path.isfile(os.path.join(path, "config.json")):
            ggufs = [f for f in os.listdir(path) if f.endswith(".gguf")]
            hint = (f"; for a GGUF model pass --gguf-file {ggufs[0]}" if ggufs else "")
            raise CalibrateError(f"{path} has no config.json: not a Hugging Face model "
                                 f"directory{hint}")
        return os.path.abspath(path), False, None
    if os.path.exists(path):
        if path.endswith(".gguf"):
            raise CalibrateError(f"{model} is a GGUF file: pass its directory and --gguf-file "
                                 f"{os.path.basename(path)}")
        raise CalibrateError(f"{model} is a file, not a model directory")
    first = path.split("/", 1)[0]
    if (_HUB_NAME.fullmatch(model) and not model.startswith((".", "/", "~"))
            and not os.path.isdir(first)):
        return model, True, None
    raise CalibrateError(f"model directory {model} does not exist")


def fetch_hub(name: str) -> str:
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name, allow_patterns=[
            "*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja", "*.tiktoken"])
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, no access
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CalibrateError(
            f"{name} is not a local directory, and the Hugging Face hub did not give it "
            f"({type(e).__name__}: {why[:160]}); download it where the hub is reachable "
            f"(huggingface-cli download {name} --local-dir DIR) and pass DIR") from None


def config_dict(directory: str, gguf: Optional[str]) -> dict:
    if gguf:
        import transformers

        try:
            config = transformers.AutoConfig.from_pretrained(
                directory, gguf_file=os.path.basename(gguf))
        except Exception as e:  # noqa: BLE001
            raise CalibrateError(f"cannot read {gguf}: {e}") from None
        return config.to_dict()
    path = os.path.join(directory, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as e:
        raise CalibrateError(f"{path} is not valid JSON ({e})") from None


def check_config(config: dict, where: str) -> dict:
    """MLA and models without attention are refused; returns the text config."""
    text = config
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        text = config["text_config"]
    if text.get("kv_lora_rank"):
        raise CalibrateError(
            f"{where} uses multi-head latent attention (kv_lora_rank {text['kv_lora_rank']}, "
            f"model_type {text.get('model_type', '?')}): vLLM 0.34 caches one compressed latent "
            f"per token, and its weight loader drops every calibrated MLA scale whatever the "
            f"checkpoint calls it ('not loaded', then 1.0), so there is nothing to patch")
    heads = text.get("num_attention_heads")
    layers = text.get("num_hidden_layers", text.get("n_layer"))
    if not heads or not layers:
        kind = text.get("model_type", "this model")
        raise CalibrateError(
            f"{where} has no attention layers to calibrate ({kind}: config has no "
            f"{'num_attention_heads' if not heads else 'num_hidden_layers'}); kvcal calibrates "
            f"the KV cache of attention layers")
    from kvcal.client import attention_problem

    problem = attention_problem(text)
    if problem:
        raise CalibrateError(f"{where} cannot be calibrated: {problem}")
    return text


def check_quant_method(config: dict, target: str, where: str) -> None:
    method = (config.get("quantization_config") or {}).get("quant_method")
    if target in ("modelopt", "quark") and method != target:
        raise CalibrateError(f"--target {target} patches {target} checkpoints only; {where} has "
                             f"quant_method {method or 'none'} (use --target compressed-tensors)")


def check_context(seq_len: int, text_config: dict, model: str) -> None:
    """--seq-len within the model's context (max_position_embeddings): past
    it the positions are ones the model never saw, and the scales would
    calibrate RoPE angles it is never served with."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        limit = text_config.get(key)
        if isinstance(limit, int) and limit > 0:
            if seq_len > limit:
                raise UsageError(f"--seq-len {seq_len} is longer than {model}'s context "
                                 f"({key} {limit}); use --seq-len {limit} or less")
            return


def load_model(directory: str, gguf: Optional[str], device: str, dtype, ui: Ui):
    import transformers

    if ui.quiet:
        transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    kwargs = {"gguf_file": os.path.basename(gguf)} if gguf else {}
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory, **kwargs)
    except Exception as e:  # noqa: BLE001
        raise CalibrateError(f"cannot load the tokenizer of {directory}: {first_line(e)}") from None
    return tokenizer, (lambda: _load_weights(transformers, directory, kwargs, device, dtype))


def _load_weights(transformers, directory, kwargs, device, dtype):
    try:
        config = transformers.AutoConfig.from_pretrained(directory, **kwargs)
        _without_kv_scheme(config)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, config=config, dtype=dtype, attn_implementation="sdpa", **kwargs)
    except Exception as e:  # noqa: BLE001
        raise CalibrateError(f"cannot load the model in {directory}: {first_line(e)}") from None
    return model.to(device).eval()


def _without_kv_scheme(config) -> None:
    """A checkpoint calibrated before (kv_cache_scheme in its compressed-
    tensors config) must load unquantized: transformers would otherwise hook
    the FP8 KV quantization into the forwards that are being measured. A
    config that only kvcal wrote (no config_groups) is dropped; otherwise
    only its kv_cache_scheme."""
    q = getattr(config, "quantization_config", None)
    if q is None:
        return
    d = q if isinstance(q, dict) else (q.to_dict() if hasattr(q, "to_dict") else None)
    if not isinstance(d, dict) or d.get("kv_cache_scheme") is None:
        return
    if d.get("quant_method") == "compressed-tensors" and not d.get("config_groups"):
        del config.quantization_config
        return
    d = dict(d)
    d["kv_cache_scheme"] = None
    config.quantization_config = d


def device_and_dtype(torch, device: str, dtype: str):
    """`auto` resolved: CUDA in bfloat16 where torch sees a GPU, else CPU in
    float32."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise CalibrateError("--device cuda: torch sees no CUDA device; use --device cpu")
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    return device, dtype


# The dtype a GGUF model's conversion is written in (its quantized weights
# have no torch dtype of their own), and the --dtype the serve line passes.
GGUF_EXPORT_DTYPE = "bfloat16"


def served_dtype(text_config: dict, gguf: Optional[str]) -> str:
    """The dtype vLLM serves the checkpoint in (--dtype auto reads the
    config's torch_dtype / dtype)."""
    if gguf:
        return GGUF_EXPORT_DTYPE
    value = text_config.get("torch_dtype") or text_config.get("dtype") or "bfloat16"
    return str(value).replace("torch.", "")


def gguf_exporter(model, run):
    """export(dir): the GGUF model's de-quantized weights as an ordinary
    safetensors checkpoint in GGUF_EXPORT_DTYPE (a model built from the
    config without GGUF's quantization_config, holding the loaded weights;
    its config's dtype says so, and the serve line passes --dtype), with its
    tokenizer."""
    def export(directory: str) -> int:
        import copy

        import torch
        import transformers

        dtype = getattr(torch, GGUF_EXPORT_DTYPE)
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.torch_dtype = dtype
        plain = type(model)(config).to(dtype=dtype)
        plain.load_state_dict({k: v.to("cpu") for k, v in model.state_dict().items()})
        with _transformers_quiet(transformers):
            plain.save_pretrained(directory)
        del plain
        transformers.AutoTokenizer.from_pretrained(
            run.directory, gguf_file=os.path.basename(run.gguf)).save_pretrained(directory)
        return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(directory)
                   for f in fs)
    return export


@contextlib.contextmanager
def _transformers_quiet(transformers):
    """transformers' own progress bars off for a step whose phase line is
    kvcal-calibrate's (save_pretrained's "Writing model shards")."""
    logging = transformers.utils.logging
    was = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            logging.enable_progress_bar()
