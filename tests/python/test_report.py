"""`kvcal report`: the HTML page from a live session (its statistics) plus
kvcal.torch.evaluate results, and from a scales file alone, rendered in
headless Chromium (Debian package `chromium`, installed by ./run): no
console error, every figure the report lists is in the rendered DOM exactly
once, nothing is fetched; the screenshot is kept in the test output
directory (KVCAL_TEST_OUTPUT, default BUILD/test-output/report/). A page
with a deliberate console error shows the check catches one. A tiny random
Llama keeps it to seconds."""
import json
import os
import re
import shutil
import subprocess

import pytest
import torch

import kvcal
import kvcal.torch
from conftest import BUILD
from tiny_llama import tiny_llama

OUTPUT = os.environ.get("KVCAL_TEST_OUTPUT", os.path.join(BUILD, "test-output", "report"))
LAYERS, HEADS, KV_HEADS = 2, 4, 2


def chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    if os.environ.get("CI") == "true":
        pytest.fail("chromium is not installed (./run installs the Debian package)")
    pytest.skip("chromium is not installed (./run installs the Debian package `chromium`)")


def render(html_path, screenshot=None):
    """(DOM after load, console messages) of a page in headless Chromium."""
    args = [chromium(), "--headless", "--no-sandbox", "--disable-gpu",
            "--disable-dev-shm-usage", "--no-first-run", "--enable-logging=stderr", "--v=0",
            "--window-size=1400,2400", f"--user-data-dir={html_path}.profile"]
    url = "file://" + os.path.abspath(html_path)
    dom = subprocess.run(args + ["--dump-dom", url], capture_output=True, text=True,
                         timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    console = [line for line in dom.stderr.splitlines() if "CONSOLE" in line]
    if screenshot:
        shot = subprocess.run(args + [f"--screenshot={screenshot}", url], capture_output=True,
                              text=True, timeout=120)
        assert shot.returncode == 0, shot.stderr[-2000:]
        console += [line for line in shot.stderr.splitlines() if "CONSOLE" in line]
    return dom.stdout, console


def svg_ids(dom):
    return re.findall(r'<svg[^>]*\bid="([^"]+)"', dom)


@pytest.fixture(scope="module")
def calibrated(worker):
    model = tiny_llama(num_kv_heads=KV_HEADS, layers=LAYERS, heads=HEADS)
    g = torch.Generator().manual_seed(3)
    cal = [torch.randint(0, 128, (2, 16), generator=g) for _ in range(3)]
    ev = [torch.randint(0, 128, (2, 16), generator=g) for _ in range(2)]
    client = kvcal.Client(worker.target)
    client.create_session(model.config)
    with kvcal.Producer(client) as producer, kvcal.torch.capture(model, producer):
        with torch.no_grad():
            for ids in cal:
                model(ids, use_cache=False)
    yield client, model, ev
    client.delete()


def run_report(kvcal_cli, *args):
    return subprocess.run([kvcal_cli, "report", "--json", *args], capture_output=True, text=True,
                          timeout=120)


def test_report_from_session_and_evaluations(calibrated, kvcal_cli, worker, tmp_path):
    client, model, ev = calibrated
    evals = []
    reference = None
    for granularity, kv_only in (("tensor", False), ("head", False), ("tensor", True)):
        scales = client.finalize(observer="static_minmax", granularity=granularity)
        r = kvcal.torch.evaluate(model, scales, ev, kv_only=kv_only, reference=reference)
        reference = r.runs["reference"]
        path = str(tmp_path / f"{granularity}{'-kv' if kv_only else ''}.json")
        r.to_json(path)
        evals += ["--eval", path]
    os.makedirs(OUTPUT, exist_ok=True)
    html = os.path.join(OUTPUT, "report.html")
    out = run_report(kvcal_cli, "--server", worker.target, "--session", client.session_id,
                     *evals, "-o", html)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    rec = summary["recommendation"]
    assert rec["basis"] == "evaluation"
    assert rec["observer"] == "static_minmax"
    assert rec["quantize"] in ("k_v", "q_k_v") and rec["margin"] >= 1.0 and rec["reason"]
    # Every observer x (tensor, head, head with q per KV group) estimated.
    assert len(summary["estimates"]) == 6 * 3
    for e in summary["estimates"]:
        for role in "qkv":
            assert 0 < e[role]["mean_error"] < 0.2, e
    pct999 = [e for e in summary["estimates"] if e["label"] == "percentile 99.9"]
    assert all(e["k"]["saturated"] > 0 for e in pct999)  # it clips by design
    static = [e for e in summary["estimates"] if e["label"] == "static_minmax"]
    assert all(e[r]["saturated"] == 0 for e in static for r in "qkv")

    figures = summary["figures"]
    want = ({f"heatmap-scale-{r}" for r in "qkv"} | {f"heatmap-absmax-{r}" for r in "qkv"}
            | {f"hist-{l}-{r}" for l in range(LAYERS) for r in "qkv"}
            | {"chart-estimated-error"} | {f"heatmap-headroom-{r}" for r in "qkv"})
    assert want <= set(figures), want - set(figures)

    page = open(html).read()
    # Self-contained: no script, nothing loaded from anywhere.
    assert "<script" not in page and " src=" not in page and "href=" not in page
    assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", page)
    dom, console = render(html, screenshot=os.path.join(OUTPUT, "report.png"))
    assert console == [], console
    ids = svg_ids(dom)
    for figure in figures:
        assert ids.count(figure) == 1, figure
    for l in range(LAYERS):
        for r in "qkv":
            figure = re.search(rf'<svg[^>]*id="hist-{l}-{r}".*?</svg>', dom, re.S).group(0)
            # One clip line per observer (six) and the calibration maximum.
            assert figure.count("<line") == 7, (l, r)
    assert "Recommendation" in dom and "static_minmax" in dom
    assert os.path.getsize(os.path.join(OUTPUT, "report.png")) > 10000


def test_report_from_scales_file_alone(calibrated, kvcal_cli, tmp_path):
    client, _, _ = calibrated
    scales_path = str(tmp_path / "scales.safetensors")
    client.finalize(observer="mse", granularity="head").save(scales_path)
    html = str(tmp_path / "scales.html")
    out = run_report(kvcal_cli, "--scales", scales_path, "-o", html)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["recommendation"]["basis"] == "none"
    assert set(summary["figures"]) == {f"heatmap-scale-{r}" for r in "qkv"}
    dom, console = render(html)
    assert console == [], console
    assert sorted(svg_ids(dom)) == sorted(summary["figures"])
    # One cell per (layer, head): q has HEADS columns, k and v KV_HEADS.
    assert dom.count("<rect") == LAYERS * (HEADS + 2 * KV_HEADS)


def test_console_errors_are_caught(tmp_path):
    """The console check is live: a page that logs an error is reported."""
    page = tmp_path / "bad.html"
    page.write_text("<!DOCTYPE html><html><body><script>console.error('kvcal-probe')"
                    "</script></body></html>")
    _, console = render(str(page))
    assert any("kvcal-probe" in line for line in console), console


def test_bad_evaluation_is_a_clear_error(calibrated, kvcal_cli, worker, tmp_path):
    client, _, _ = calibrated
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"kvcal_evaluation_version": 1, "granularity": "tensor"}))
    html = str(tmp_path / "never.html")
    out = run_report(kvcal_cli, "--server", worker.target, "--session", client.session_id,
                     "--eval", str(bad), "-o", html)
    assert out.returncode == 1
    assert "no field 'observer'" in out.stderr and str(bad) in out.stderr
    assert not os.path.exists(html)
    missing = run_report(kvcal_cli, "-o", html)
    assert missing.returncode == 1 and "--scales" in missing.stderr
