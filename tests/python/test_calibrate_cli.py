"""kvcal-calibrate as a user meets it: --version agrees with `kvcal
--version`, --help names a guide that exists where the package is
installed and --help-guide prints it, every progress bar ends at its total
(replaced by one finished line), no phase line is printed twice, and
--json keeps stderr for warnings only.
"""
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import BUILD, KVCAL_CLI

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
LICENSES = "/usr/share/common-licenses"


def env():
    return dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", KVCAL_BUILD_DIR=BUILD)


def calibrate(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "kvcal.calibrate", *args], capture_output=True,
                          text=True, timeout=timeout, env=env(), stdin=subprocess.DEVNULL)


def test_version_matches_kvcal_version():
    if not os.path.exists(KVCAL_CLI):
        pytest.skip(f"{KVCAL_CLI} is not built")
    got = calibrate("--version")
    assert got.returncode == 0, got.stderr
    kvcal_line = subprocess.run([KVCAL_CLI, "--version"], capture_output=True,
                                text=True).stdout.strip()
    version = re.match(r"kvcal (\S+)", kvcal_line).group(1)
    with open(os.path.join(ROOT, "VERSION")) as f:
        assert version == f.read().strip()
    line = got.stdout.strip()
    assert line.startswith(f"kvcal-calibrate {version} ("), line
    assert kvcal_line in line  # the binary it runs, named


def test_help_points_to_a_guide_that_is_there():
    got = calibrate("--help")
    assert got.returncode == 0
    assert "--help-guide" in got.stdout and "docs/calibrate.md" not in got.stdout.split(
        "--help-guide")[0]
    guide = calibrate("--help-guide")
    assert guide.returncode == 0, guide.stderr
    with open(os.path.join(ROOT, "docs", "calibrate.md"), encoding="utf-8") as f:
        assert guide.stdout == f.read()
    # The installed package carries its own copy (what a wheel user reads).
    import kvcal.calibrate as module

    path = module.cli.guide_path()
    assert path is not None and os.path.isfile(path)


from test_calibrate import dataset, smollm2_dir  # noqa: E402,F401 (fixtures)


SMALL = ("--samples", "8", "--seq-len", "32", "--observer", "static_minmax",
         "--kv-cache-formats", "fp8,nvfp4")


def bar_states(stderr):
    """{bar description: its last drawn state} from tqdm's output (carriage
    returns between states on a non-terminal stream)."""
    last = {}
    for piece in re.split(r"[\r\n]", stderr):
        m = re.match(r"\s*([a-z][a-z -]+?):\s+(\d+)%\|", piece)
        if m:
            last[m.group(1)] = piece.strip()
    return last


def test_progress_ends_at_its_total_and_phases_print_once(smollm2_dir, dataset, tmp_path):
    got = calibrate(smollm2_dir, "--dataset", dataset, *SMALL, "--out", str(tmp_path / "out"))
    assert got.returncode == 0, got.stderr[-3000:]
    err = got.stderr
    states = bar_states(err)
    assert {"tokenizing", "forwards", "upload", "scoring on held-out"} <= set(states), states
    for desc, state in states.items():
        m = re.search(r"(\d[\d,.]*[kM]?)/(\d[\d,.]*[kM]?)", state)
        assert "100%" in state and m and m.group(1) == m.group(2), (desc, state)
    for desc in ("tokenizing", "forwards", "upload", "scoring on held-out",
                 "scoring cache formats"):
        done = re.findall(rf"^kvcal-calibrate: {desc}: done, ", err, re.M)
        assert len(done) == 1, (desc, err[-3000:])
    # Phase lines once each; nothing of transformers' own bars.
    lines = [l for l in re.split(r"[\r\n]", err) if l.startswith("kvcal-calibrate: ")]
    assert len(lines) == len(set(lines)), lines
    assert "Writing model shards" not in err and "Traceback" not in err


def test_json_keeps_stderr_for_warnings(smollm2_dir, tmp_path):
    # 64 samples of 32 tokens ask for more text than these few paragraphs
    # give: a warning, on stderr even with --json.
    short = tmp_path / "short.jsonl"
    with open(os.path.join(LICENSES, "GPL-3"), encoding="utf-8") as f:
        docs = [" ".join(d.split()) for d in re.split(r"\n\s*\n", f.read()) if d.strip()]
    with open(short, "w") as f:
        for d in docs[:12]:
            f.write(json.dumps({"text": d}) + "\n")
    got = calibrate(smollm2_dir, "--dataset", str(short), "--samples", "64", "--seq-len", "32",
                    "--observer", "static_minmax", "--kv-cache-formats", "fp8",
                    "--out", str(tmp_path / "out"), "--json")
    assert got.returncode == 0, got.stderr[-3000:]
    result = json.loads(got.stdout)
    assert result["ok"] and result["warnings"]
    lines = [l for l in got.stderr.splitlines() if l.strip()]
    assert lines and all(l.startswith("kvcal-calibrate: warning: ") for l in lines), lines
