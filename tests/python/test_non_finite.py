"""Non-finite activations and attention kvcal does not calibrate, as a user
meets them: `kvcal push` and `kvcal finalize` name the (layer, role, head)
triples holding NaN or Inf; a session created with --reject-non-finite (or
Client.create_session(reject_non_finite=True)) refuses such chunks with
INVALID_ARGUMENT naming them and stays exactly as it was, in-band, by shared
memory, held out and after a worker restart; DeepSeek-style MLA and other
attention kvcal does not understand is refused by `kvcal create`,
`calibrate`, `inspect`, the Python client and kvcal.torch.capture."""
import json
import os
import subprocess

import numpy as np
import pytest

import kvcal
from kvcal.v1 import pb

CONFIG = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 8, "hidden_size": 32}
GEOMETRY = dict(num_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
MLA_LINE = ("DeepSeek-style multi-head latent attention (kv_lora_rank): vLLM 0.34 caches one "
            "compressed latent per token, and its weight loader drops every calibrated MLA scale")


def write_dump(directory, batches=2, nan_in=None, seed=3):
    """float32 [40, heads, 8] q/k/v per layer and batch; nan_in=(batch, layer,
    role) makes that tensor all NaN."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    os.makedirs(directory, exist_ok=True)
    for b in range(batches):
        tensors = {}
        for layer in range(2):
            for role, heads in (("q", 4), ("k", 2), ("v", 2)):
                x = rng.standard_normal((40, heads, 8)).astype(np.float32)
                if nan_in == (b, layer, role):
                    x[:] = np.nan
                tensors[f"model.layers.{layer}.self_attn.{role}"] = x
        save_file(tensors, os.path.join(directory, f"batch{b:03d}.safetensors"))
    return directory


def run(cli, *args):
    return subprocess.run([cli, *args], capture_output=True, text=True, timeout=120)


def status_json(cli, target, session):
    r = run(cli, "status", "--server", target, "--session", session, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_push_and_finalize_name_nonfinite_heads(make_worker, kvcal_cli, tmp_path):
    w = make_worker()
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG))
    dumps = write_dump(str(tmp_path / "dumps"), nan_in=(1, 1, "k"))
    r = run(kvcal_cli, "create", "--server", w.target, "--config", str(config), "--session", "nan")
    assert r.returncode == 0, r.stderr
    r = run(kvcal_cli, "push", "--server", w.target, "--session", "nan", dumps)
    assert r.returncode == 0, r.stderr
    # 40 tokens x 8 dims of each of layer 1's two K heads in batch 1.
    assert "warning: session nan holds 640 non-finite values" in r.stdout, r.stdout
    assert "in 2 (layer, role, head) triples:" in r.stdout
    assert "  layer 1 K head 0: 320 NaN, 0 Inf\n" in r.stdout
    assert "  layer 1 K head 1: 320 NaN, 0 Inf\n" in r.stdout
    s = status_json(kvcal_cli, w.target, "nan")
    assert s["nonfinite_values"] == 640 and s["reject_non_finite"] is False
    assert s["nonfinite_heads"] == [
        {"layer": 1, "role": "k", "head": 0, "nan": 320, "inf": 0},
        {"layer": 1, "role": "k", "head": 1, "nan": 320, "inf": 0}]

    scales = str(tmp_path / "scales.safetensors")
    r = run(kvcal_cli, "finalize", "--server", w.target, "--session", "nan", "-o", scales)
    assert r.returncode == 0, r.stderr
    assert ("warning: 640 non-finite values (NaN or Inf) were left out of these scales, in 2 "
            "(layer, role, head) triples:") in r.stdout, r.stdout
    assert "  layer 1 K head 1: 320 NaN, 0 Inf\n" in r.stdout
    # A clean push says nothing about non-finite values.
    r = run(kvcal_cli, "create", "--server", w.target, "--config", str(config), "--session", "ok")
    r = run(kvcal_cli, "push", "--server", w.target, "--session", "ok",
            write_dump(str(tmp_path / "clean")))
    assert r.returncode == 0 and "non-finite" not in r.stdout, r.stdout


def test_held_out_batches_must_be_finite(make_worker, kvcal_cli, tmp_path):
    """Finalize --evaluate runs attention on held-out batches: a NaN there
    made every error NaN and --observer auto choose on NaN. Such a chunk is
    refused in every session, counting ones included."""
    w = make_worker()
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG))
    r = run(kvcal_cli, "create", "--server", w.target, "--config", str(config), "--session", "h")
    assert r.returncode == 0, r.stderr
    dumps = write_dump(str(tmp_path / "dumps"), batches=3, nan_in=(2, 1, "v"))
    r = run(kvcal_cli, "push", "--server", w.target, "--session", "h", "--holdout-batches", "1",
            dumps)
    assert r.returncode != 0, r.stdout
    assert ("640 non-finite values (640 NaN, 0 Inf) in layer 1 V: head 0 (320 NaN, 0 Inf), "
            "head 1 (320 NaN, 0 Inf); held-out chunks must be finite") in r.stderr, r.stderr
    s = status_json(kvcal_cli, w.target, "h")
    assert s["holdout_chunks"] == 5 and s["nonfinite_values"] == 0
    r = run(kvcal_cli, "finalize", "--server", w.target, "--session", "h", "--evaluate",
            "-o", str(tmp_path / "s.safetensors"))
    assert r.returncode != 0  # layer 1's held-out V is missing: no NaN error figures
    assert "nan%" not in r.stdout


def write_one_inf_bf16(directory):
    """One [40, 4, 8] bf16 q tensor of layer 0 with a single +Inf (token 7,
    head 2, dim 5) among finite values."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    x = torch.linspace(-3, 3, 40 * 4 * 8).reshape(40, 4, 8).to(torch.bfloat16)
    x[7, 2, 5] = float("inf")
    save_file({"model.layers.0.self_attn.q": x}, os.path.join(directory, "b.safetensors"))
    return directory


def test_reject_non_finite_refuses_the_chunk_and_changes_nothing(make_worker, kvcal_cli,
                                                                tmp_path):
    w = make_worker()
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG))
    r = run(kvcal_cli, "create", "--server", w.target, "--config", str(config), "--session",
            "strict", "--reject-non-finite")
    assert r.returncode == 0, r.stderr
    assert "chunks with NaN or Inf are refused" in r.stdout
    r = run(kvcal_cli, "push", "--server", w.target, "--session", "strict",
            write_dump(str(tmp_path / "clean")))
    assert r.returncode == 0, r.stderr
    before = status_json(kvcal_cli, w.target, "strict")
    assert before["reject_non_finite"] is True and before["chunks_applied"] == 12

    bad = write_one_inf_bf16(str(tmp_path / "bad"))
    for extra in ((), ("--shm",)):  # in-band, then by shared memory
        r = run(kvcal_cli, "push", "--server", w.target, "--session", "strict", "--producer",
                "second", "--json", *extra, bad)
        assert r.returncode != 0, r.stdout
        out = json.loads(r.stdout)
        assert out["code"] == "INVALID_ARGUMENT", out
        assert ("chunk 1 from producer 'second': 1 non-finite values (0 NaN, 1 Inf) in layer 0 "
                "Q: head 2 (0 NaN, 1 Inf); session 'strict' rejects non-finite values") \
            in out["error"], out
        assert "rejects non-finite values" in r.stderr
        assert status_json(kvcal_cli, w.target, "strict") == before

    # A dump with an all-NaN tensor: the push stops at its chunk. Chunks
    # before it (by sequence: the dump's order, layer 0's k first) stay
    # applied, nothing of it or after it is.
    r = run(kvcal_cli, "push", "--server", w.target, "--session", "strict", "--producer",
            "third", write_dump(str(tmp_path / "nan"), nan_in=(0, 0, "q")))
    assert r.returncode != 0
    assert ("chunk 2 from producer 'third': 1280 non-finite values (1280 NaN, 0 Inf) in layer 0 "
            "Q: head 0 (320 NaN, 0 Inf), head 1 (320 NaN, 0 Inf)") in r.stderr, r.stderr
    after = status_json(kvcal_cli, w.target, "strict")
    assert after["chunks_applied"] == before["chunks_applied"] + 1
    assert after["nonfinite_values"] == 0
    assert {p["producer"]: p["sequence"] for p in after["producers"]} == {"default": 12,
                                                                          "third": 1}


def test_python_client_reject_option_survives_a_restart(make_worker):
    import torch

    w = make_worker(state_dir=True)
    client = kvcal.Client(w.target)
    session = client.create_session(geometry=GEOMETRY, session_id="py", reject_non_finite=True)
    assert session.reject_non_finite
    clean = torch.randn(3, 2, 5, 8)
    with kvcal.Producer(client, producer_id="a") as producer:
        producer.put(0, "k", clean)
        producer.flush(durable=True)
    before = client.status()
    assert before.chunks_applied == 1

    def put_failing(tensor, holdout=False, producer_id="b"):
        producer = kvcal.Producer(client, producer_id=producer_id)
        producer.holdout = holdout
        with pytest.raises(kvcal.ProducerError) as e:
            producer.put(1, "v", tensor)
            producer.flush()
        with pytest.raises(kvcal.ProducerError):
            producer.close()  # joins its thread; reports the failure again
        return str(e.value)

    bad = clean.clone()
    bad[2, 1, 4, 7] = float("nan")
    message = put_failing(bad)
    assert "INVALID_ARGUMENT" in message and "in layer 1 V: head 1 (1 NaN, 0 Inf)" in message
    message = put_failing(bad, holdout=True, producer_id="c")
    assert "INVALID_ARGUMENT" in message and "head 1 (1 NaN, 0 Inf)" in message
    after = client.status()
    assert after.chunks_applied == before.chunks_applied and after.holdout_chunks == 0
    assert [p.producer_id for p in after.producers] == ["a"]

    # From the state dir: the option is the session's, not the worker's.
    w.restart()
    client = kvcal.Client(w.target, session_id="py")
    assert client.status().reject_non_finite
    assert "INVALID_ARGUMENT" in put_failing(bad, producer_id="d")
    assert client.status().chunks_applied == 1
    # Created again with the other value: refused, not silently ignored.
    with pytest.raises(kvcal.KvcalError) as e:
        kvcal.Client(w.target).create_session(geometry=GEOMETRY, session_id="py")
    assert e.value.code.name == "ALREADY_EXISTS" and "reject_non_finite" in str(e.value)

    # Default: counted and listed per head.
    counting = kvcal.Client(w.target)
    counting.create_session(geometry=GEOMETRY, session_id="counting")
    with kvcal.Producer(counting) as producer:
        producer.put(1, "v", bad)
    s = counting.status()
    assert s.nonfinite_values == 1 and s.nonfinite_heads_total == 1
    h = s.nonfinite_heads[0]
    assert (h.layer, h.role, h.head, h.nan, h.inf) == (1, pb.ROLE_V, 1, 1, 0)


MLA_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "hidden_size": 7168, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128, "v_head_dim": 128,
}


def test_cli_refuses_mla_configs(make_worker, kvcal_cli, tmp_path):
    w = make_worker()
    model = tmp_path / "deepseek"
    os.makedirs(model)
    (model / "config.json").write_text(json.dumps(MLA_CONFIG))
    dumps = write_dump(str(tmp_path / "dumps"))
    for args in (("create", "--server", w.target, "--config", str(model / "config.json")),
                 ("calibrate", "--server", w.target, "--checkpoint", str(model), dumps),
                 ("inspect", str(model))):
        r = run(kvcal_cli, *args)
        assert r.returncode != 0, (args, r.stdout)
        assert MLA_LINE in r.stdout + r.stderr, (args, r.stdout, r.stderr)
        assert "kv_lora_rank 512" in r.stdout + r.stderr
    # Nothing was created on the worker.
    assert kvcal.Client(w.target).list_sessions() == []


def test_python_refuses_attention_it_does_not_calibrate():
    with pytest.raises(ValueError, match=r"kv_lora_rank 512: DeepSeek-style multi-head latent"):
        kvcal.Geometry.from_config(MLA_CONFIG)
    # A DeepSeek-V3 config that leaves kv_lora_rank to its default.
    no_rank = {k: v for k, v in MLA_CONFIG.items() if k != "kv_lora_rank"}
    with pytest.raises(ValueError, match=r"model_type 'deepseek_v3': DeepSeek-style"):
        kvcal.Geometry.from_config(no_rank)
    linear = dict(CONFIG, layer_types=["linear_attention", "full_attention"])
    with pytest.raises(ValueError, match=r"layer_types\[0\] 'linear_attention'"):
        kvcal.Geometry.from_config(linear)
    with pytest.raises(ValueError, match="is_encoder_decoder"):
        kvcal.Geometry.from_config(dict(CONFIG, is_encoder_decoder=True))
    # Sliding-window layers are ordinary attention (vLLM quantizes them).
    sliding = dict(CONFIG, layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    assert kvcal.Geometry.from_config(sliding) == kvcal.Geometry(2, 4, 2, 8)
    with pytest.raises(ValueError, match="hidden_size 30 is not a multiple of num_attention_heads 4"):
        kvcal.Geometry.from_config({"num_hidden_layers": 2, "num_attention_heads": 4,
                                    "hidden_size": 30})
    with pytest.raises(ValueError, match="num_hidden_layers is 0, not a positive integer"):
        kvcal.Geometry.from_config(dict(CONFIG, num_hidden_layers=0))


def test_capture_refuses_a_deepseek_v3_model(worker):
    torch = pytest.importorskip("torch")
    import kvcal.torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
        topk_group=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config).eval()
    client = kvcal.Client(worker.target)
    with pytest.raises(ValueError, match="kv_lora_rank 16: " + MLA_LINE.replace("(", r"\(")
                       .replace(")", r"\)")):
        client.create_session(model.config)
    client.create_session(geometry=dict(num_layers=2, num_attention_heads=4,
                                        num_key_value_heads=4, head_dim=8), session_id="mla")
    with kvcal.Producer(client) as producer:
        with pytest.raises(kvcal.torch.UnsupportedModelError, match=r"kv_lora_rank 16"):
            with kvcal.torch.capture(model, producer):
                model(torch.randint(0, 64, (1, 5)))
    assert client.status().chunks_applied == 0


def test_vllm_update_refuses_mla_layers():
    torch = pytest.importorskip("torch")
    import kvcal.vllm

    class MLAAttention(torch.nn.Module):  # vLLM's class name; its k_scale buffer
        def __init__(self):
            super().__init__()
            self.register_buffer("_k_scale", torch.tensor(1.0))
            self.kv_lora_rank = 512

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].self_attn = torch.nn.Module()
    model.layers[0].self_attn.mla_attn = MLAAttention()
    scales = {"model.layers.0.self_attn.k_scale": np.float32(0.5)}
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.mla_attn \(MLAAttention\): "
                                         r"DeepSeek-style multi-head latent attention"):
        kvcal.vllm.update_attention_scales(model, scales)
    with pytest.raises(ValueError, match="DeepSeek-style multi-head latent attention"):
        kvcal.vllm.update_attention_scales({0: model.layers[0].self_attn.mla_attn}, scales)
    assert float(model.layers[0].self_attn.mla_attn._k_scale) == 1.0


def test_sharded_sessions_list_every_workers_heads(make_worker, kvcal_cli, tmp_path):
    """Each worker lists the heads of its own layers; both clients put the
    lists together in (layer, role, head) order."""
    from kvcal.sharding import layer_owners

    w0 = make_worker(extra_args=("--worker-id", "w0"))
    w1 = make_worker(extra_args=("--worker-id", "w1"))
    servers = f"{w0.target},{w1.target}"
    # A session id whose two layers land on different workers.
    sid = next(f"two-{i}" for i in range(100)
               if len(set(layer_owners(f"two-{i}", 2, ["w0", "w1"]))) == 2)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG))
    r = run(kvcal_cli, "create", "--server", servers, "--config", str(config), "--session", sid)
    assert r.returncode == 0, r.stderr
    from safetensors.numpy import save_file

    dumps = tmp_path / "dumps"
    os.makedirs(dumps)
    tensors = {}
    for layer in range(2):
        for role, heads in (("q", 4), ("k", 2), ("v", 2)):
            x = np.ones((3, heads, 8), np.float32)
            if role == "k":
                x[0, layer, layer] = np.inf if layer else np.nan  # layer 0 head 0, layer 1 head 1
            tensors[f"model.layers.{layer}.self_attn.{role}"] = x
    save_file(tensors, str(dumps / "b.safetensors"))
    r = run(kvcal_cli, "push", "--server", servers, "--session", sid, str(dumps))
    assert r.returncode == 0, r.stderr
    assert ("holds 2 non-finite values (NaN or Inf; counted, left out of every statistic), in 2 "
            "(layer, role, head) triples:\n  layer 0 K head 0: 1 NaN, 0 Inf\n"
            "  layer 1 K head 1: 0 NaN, 1 Inf\n") in r.stdout, r.stdout
    client = kvcal.Client(servers, session_id=sid)
    assert [w.status(sid).nonfinite_heads_total for w in client.workers] == [1, 1]
    s = client.status()
    assert s.nonfinite_heads_total == 2
    assert [(h.layer, h.role, h.head, h.nan, h.inf) for h in s.nonfinite_heads] == [
        (0, pb.ROLE_K, 0, 1, 0), (1, pb.ROLE_K, 1, 0, 1)]
    r = run(kvcal_cli, "finalize", "--server", servers, "--session", sid, "--json",
            "-o", str(tmp_path / "s.safetensors"))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["nonfinite_heads_total"] == 2
    assert [(h["layer"], h["role"], h["head"]) for h in out["nonfinite_heads"]] == [
        (0, "k", 0), (1, "k", 1)]
