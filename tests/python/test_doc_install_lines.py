"""The `pip install` lines of docs/calibrate.md, README.md and
python/README.md run as pasted (issue 31, "Install and help that work as
written"): docs/calibrate.md used to say `pip install
"dist/kvcal-VERSION-*.whl[torch]"`, which no shell expands (the quotes stop
the glob, VERSION is a placeholder).

Every `pip install` line of those files (fenced code blocks and inline code
spans; the same command once) is run by bash exactly as written, from a
directory whose dist/ holds a wheel of ./python (a pure-Python one, `pip
wheel --no-deps --no-build-isolation` with the test environment's
setuptools and grpcio-tools: the real `./run wheel` needs the C++ build)
and an older kvcal wheel beside it (`./run wheel` only replaces wheels of
its own version), or from the checkout's root for `./python`; `pip` there is
a shell function that records the arguments bash gave it and runs the fresh
venv's `pip install --dry-run --ignore-installed --report`.

Checked, per line: bash expands it to one requirement, an existing wheel
(the newest in dist/) or the ./python directory, with the extras written in
the line attached; pip accepts it (exit 0, no "does not provide the extra"
warning) and reports kvcal from that file with those extras requested; each
requested extra exists in the package's metadata with requirements of its
own, and `[gguf]` brings gguf and accelerate.

Lines with [torch] or [gguf] get `--no-deps --no-index` as well: resolving
them fetches torch and its CUDA wheels (gigabytes; pip here downloads whole
wheels to read their metadata even with --dry-run), so for them pip
resolves nothing beyond the wheel: the extras' own requirements are not
resolved against PyPI. Lines without extras are resolved in full against
the index (grpcio, protobuf, numpy; for ./python, pip's isolated build of
the metadata): that part needs PyPI and skips when it cannot be reached,
unless CI=true. Not checked: that the installed programs run (test_wheel.py
does that with the real wheel).
"""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import urllib.request

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DOCS = ("docs/calibrate.md", "README.md", "python/README.md")
TIMEOUT = 300
VENV_PY = os.path.join(ROOT, ".venv", "bin", "python")
CHECKOUT_PY = VENV_PY if os.path.exists(VENV_PY) else sys.executable
HEAVY_EXTRAS = ("torch", "gguf")  # both pull torch (accelerate needs it)


def _install_lines():
    """[(doc, line)] of every `pip install` command, each command once."""
    found, seen = [], set()
    for doc in DOCS:
        with open(os.path.join(ROOT, doc)) as f:
            text = f.read()
        lines = []
        for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M):
            lines += [line.strip() for line in block.splitlines()
                      if line.strip().startswith("pip install")]
        lines += re.findall(r"(?<!`)`(pip install [^`\n]+)`(?!`)", text)
        for line in lines:
            key = tuple(shlex.split(line, comments=True))
            if key not in seen:
                seen.add(key)
                found.append((doc, line))
    return found


LINES = _install_lines()


def _extras(line):
    """The extras written in the line, as a sorted list."""
    found = re.search(r"\)\[([A-Za-z0-9_,-]+)\]\"", line) or re.search(
        r"\[([A-Za-z0-9_,-]+)\]", line.split("#")[0])
    return sorted(found.group(1).split(",")) if found else []


def _heavy(line):
    return any(extra in HEAVY_EXTRAS for extra in _extras(line))


def test_the_docs_have_install_lines():
    docs = {doc for doc, _ in LINES}
    assert docs == set(DOCS), LINES
    text = "\n".join(line for _, line in LINES)
    assert "VERSION" not in text, text
    assert any(_extras(line) == ["torch"] for _, line in LINES), LINES
    assert any(_extras(line) == ["gguf", "torch"] for _, line in LINES), LINES


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A directory with dist/kvcal-*.whl (and an older wheel), a fresh venv."""
    base = tmp_path_factory.mktemp("doc-install")
    work = base / "work"
    dist = work / "dist"
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    proc = subprocess.run([CHECKOUT_PY, "-m", "pip", "wheel", "-q", "--no-deps",
                           "--no-build-isolation", "--no-index", "-w", str(dist),
                           os.path.join(ROOT, "python")],
                          capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (wheel,) = [str(dist / n) for n in os.listdir(dist)]
    older = dist / "kvcal-0.0.1-py3-none-any.whl"
    shutil.copyfile(wheel, older)
    os.utime(older, (1_000_000_000, 1_000_000_000))  # 2001: older than the one built
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=TIMEOUT,
                   env=env)
    env["PATH"] = os.pathsep.join([str(venv / "bin"), "/usr/bin", "/bin"])
    return {"work": str(work), "wheel": wheel, "python": str(venv / "bin" / "python"),
            "env": env, "base": base}


# `pip` for the doc's line: records what bash made of the line, then a dry run.
SHIM = r'''
pip() {
  if [ "$1" != install ]; then echo "the doc's line runs pip $1, not pip install" >&2; return 2; fi
  shift
  printf '%s\0' "$@" > "$KVCAL_ARGS"
  "$KVCAL_PY" -m pip install --dry-run --ignore-installed --report "$KVCAL_REPORT" \
    $KVCAL_FLAGS "$@"
}
'''


def _pypi_reachable():
    url = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/") + "/grpcio/"
    try:
        with urllib.request.urlopen(url, timeout=15) as response:
            response.read(1)
        return None
    except Exception as e:  # noqa: BLE001
        return f"{url}: {e}"


@pytest.mark.parametrize("doc,line", LINES, ids=[f"{d}: {l}" for d, l in LINES])
def test_install_line_runs_as_pasted(setup, doc, line, tmp_path):
    heavy = _heavy(line)
    if not heavy:
        why = _pypi_reachable()
        if why:
            message = f"PyPI is not reachable ({why}): this line is resolved against it"
            if os.environ.get("CI") == "true":
                pytest.fail(message)
            pytest.skip(message)
    local = "./python" not in line
    cwd = setup["work"] if local else ROOT
    args_file, report = tmp_path / "args", tmp_path / "report.json"
    env = dict(setup["env"], KVCAL_ARGS=str(args_file), KVCAL_REPORT=str(report),
               KVCAL_PY=setup["python"], KVCAL_FLAGS="--no-deps --no-index" if heavy else "")
    proc = subprocess.run(["bash", "--noprofile", "--norc", "-c", SHIM + line],
                          capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd=cwd)
    assert proc.returncode == 0, f"{doc}: {line}\n{proc.stderr[-4000:]}"
    assert "does not provide the extra" not in proc.stderr, proc.stderr

    # What bash handed to pip: one requirement, the file or directory, the
    # extras of the line attached.
    args = args_file.read_text().split("\0")[:-1]
    assert len(args) == 1, args
    extras = _extras(line)
    target, _, tail = args[0].partition("[")
    given = sorted(tail[:-1].split(",")) if tail.endswith("]") else []
    assert given == extras and (tail == "" or tail.endswith("]")), args
    path = os.path.normpath(os.path.join(cwd, target))
    if local:
        assert path == setup["wheel"], f"bash gave pip {args[0]!r}, not the newest wheel"
    else:
        assert target == "./python" and os.path.isdir(path), args

    # What pip made of it.
    with open(report) as f:
        items = json.load(f)["install"]
    (kvcal,) = [i for i in items if i["metadata"]["name"] == "kvcal"]
    assert kvcal["download_info"]["url"] == "file://" + path, kvcal["download_info"]
    assert sorted(kvcal.get("requested_extras") or []) == extras
    metadata = kvcal["metadata"]
    for extra in extras:
        assert extra in metadata.get("provides_extra", []), (extra, metadata)
        assert any(f'extra == "{extra}"' in r for r in metadata["requires_dist"]), extra
    if "gguf" in extras:
        gguf = {re.split(r"[<>=!~;\s\[]", r)[0].lower() for r in metadata["requires_dist"]
                if 'extra == "gguf"' in r}
        assert {"gguf", "accelerate"} <= gguf, gguf
    if not heavy:  # resolved in full: the runtime dependencies came with it
        names = {i["metadata"]["name"].lower() for i in items}
        assert {"grpcio", "protobuf", "numpy"} <= names, names
