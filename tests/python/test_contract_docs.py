"""The repository owns its contract, and the contract keeps up with the proto.

- docs/wire-contract.md names, in backticks, every RPC, message, enum and
  enum value of proto/kvcal/v1/calibration.proto: a new one fails here until
  its rule is written down.
- No tracked file refers to notes outside the repository (the `shared`
  directory beside a checkout, the old CONTRACT / FORMATS / HOUSE_STYLE
  notes): docs/ holds the contract. This file spells those references in
  pieces so that it does not make one itself.

Fast and self-contained: plain text, no torch, no worker, no build.
"""
import os
import re
import subprocess

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PROTO = os.path.join(ROOT, "proto", "kvcal", "v1", "calibration.proto")
CONTRACT = os.path.join(ROOT, "docs", "wire-contract.md")


# -- a small proto reader -----------------------------------------------------

def _strip_comments(text):
    """The proto without // and /* */ comments, each string literal emptied
    to "" (its text could look like a declaration)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""')
            i = j + 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            i = n if j < 0 else j + 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _block(text, open_brace):
    """The text between the brace at `open_brace` and its matching one."""
    depth = 0
    for i in range(open_brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[open_brace + 1:i]
    raise ValueError("unbalanced braces in the proto")


def read_proto(text):
    """{'rpc': [...], 'message': [...], 'enum': [...], 'enum value': [...]}."""
    text = _strip_comments(text)
    names = {"rpc": [], "message": [], "enum": [], "enum value": []}
    for m in re.finditer(r"\bservice\s+\w+\s*\{", text):
        body = _block(text, m.end() - 1)
        names["rpc"] += re.findall(r"\brpc\s+(\w+)\s*\(", body)
    names["message"] = re.findall(r"\bmessage\s+(\w+)\s*\{", text)
    for m in re.finditer(r"\benum\s+(\w+)\s*\{", text):
        names["enum"].append(m.group(1))
        body = _block(text, m.end() - 1)
        names["enum value"] += re.findall(r"(?:^|;|\{)\s*([A-Za-z_]\w*)\s*=\s*-?\d+", body)
    return names


def backticked_words(markdown):
    """Every identifier inside a `code span` of `markdown` (qualified names
    give each of their parts)."""
    words = set()
    for span in re.findall(r"`([^`\n]+)`", markdown):
        words.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", span))
    return words


def unmentioned(proto_text, markdown):
    """[(kind, name)] of the proto's names the markdown does not backtick."""
    words = backticked_words(markdown)
    return [(kind, name) for kind, names in read_proto(proto_text).items()
            for name in names if name not in words]


# -- the reader itself --------------------------------------------------------

SAMPLE = """
// rpc Commented(A) returns (B);  message Hidden {}
/* enum Gone { GONE_X = 0; } */
extend google.protobuf.EnumValueOptions { string label = 50001; }
service S {
  rpc Go(GoRequest) returns (GoResponse);
  // Many lines:
  rpc Stream(stream GoRequest)
      returns (stream GoResponse);
}
enum Color { COLOR_UNSPECIFIED = 0; COLOR_RED = 1 [(label) = "red; x = 2"];
  COLOR_BLUE = 2; }
message GoRequest { string s = 1; message Inner { int32 x = 1; } }
message GoResponse {}
"""


def test_the_reader_finds_every_kind_and_skips_comments():
    names = read_proto(SAMPLE)
    assert names == {"rpc": ["Go", "Stream"],
                     "message": ["GoRequest", "Inner", "GoResponse"],
                     "enum": ["Color"],
                     "enum value": ["COLOR_UNSPECIFIED", "COLOR_RED", "COLOR_BLUE"]}


def test_a_name_counts_only_in_backticks():
    doc = "`Go` and `GoRequest`/`GoResponse`, `Inner`, `Color`: `COLOR_RED` (1), COLOR_BLUE."
    missing = unmentioned(SAMPLE, doc)
    assert missing == [("rpc", "Stream"), ("enum value", "COLOR_UNSPECIFIED"),
                       ("enum value", "COLOR_BLUE")]
    assert unmentioned(SAMPLE, doc + " `Stream` `COLOR_UNSPECIFIED`, `x.COLOR_BLUE`") == []


def test_the_real_proto_reads_as_expected():
    with open(PROTO, encoding="utf-8") as f:
        names = read_proto(f.read())
    # What the reader must at least see (a reader that finds nothing would
    # let any contract pass).
    assert {"CreateSession", "Ingest", "Finalize", "ImportState",
            "RegisterSharedMemory"} <= set(names["rpc"])
    assert len(names["rpc"]) >= 12
    assert {"IngestRequest", "Session", "SessionState", "ShardMap"} <= set(names["message"])
    assert {"Role", "Observer", "Format", "SharedMemoryKind"} <= set(names["enum"])
    assert {"ROLE_UNSPECIFIED", "OBSERVER_AUTO", "FORMAT_INT8"} <= set(names["enum value"])
    assert "canonical_name" not in names["enum value"]  # an extension field


# -- the contract -------------------------------------------------------------

def test_wire_contract_names_everything_in_the_proto():
    with open(PROTO, encoding="utf-8") as f:
        proto = f.read()
    with open(CONTRACT, encoding="utf-8") as f:
        doc = f.read()
    missing = unmentioned(proto, doc)
    assert not missing, (
        "docs/wire-contract.md does not name (in backticks) these parts of "
        "proto/kvcal/v1/calibration.proto; write down their rules there: "
        + ", ".join(f"{kind} {name}" for kind, name in missing))


# -- nothing outside the repository -------------------------------------------

# The notes the project was once written against, outside the repository.
OUTSIDE = re.compile(rb"\.\./" rb"shared\b|\bshared/(?:CONTRACT|FORMATS|HOUSE_STYLE)"
                     rb"|\bCONTRACT\.md\b|\bFORMATS\.md\b|\bHOUSE_STYLE\b")


def tracked_files():
    try:
        out = subprocess.run(["git", "-C", ROOT, "ls-files", "-z"], check=True,
                             capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.fail(f"cannot list the tracked files with git ls-files in {ROOT}: {e}")
    return [p for p in out.decode("utf-8", "surrogateescape").split("\0") if p]


def test_the_pattern_matches_what_it_must():
    for hit in (b"see ../" b"shared/CONTRACT.md", b"(../../" b"shared/FORMATS.md)",
                b"CONTRACT.md \"Ingest\"", b"that HOUSE_STYLE describes",
                b"FORMATS.md's table"):
        assert OUTSIDE.search(hit), hit
    for miss in (b"shared memory", b"docs/shared_memory.md", b"docs/formats.md",
                 b"docs/wire-contract.md", b"MY_CONTRACT.md2"):
        assert not OUTSIDE.search(miss), miss


def test_no_tracked_file_refers_outside_the_repository():
    this = os.path.relpath(os.path.abspath(__file__), ROOT)
    files = tracked_files()
    assert "proto/kvcal/v1/calibration.proto" in files, files[:5]
    offenders = []
    for path in files:
        if path == this:
            continue
        full = os.path.join(ROOT, path)
        if not os.path.isfile(full):  # deleted in the work tree, or a link to a directory
            continue
        with open(full, "rb") as f:
            for number, line in enumerate(f, 1):
                if OUTSIDE.search(line):
                    offenders.append(f"{path}:{number}: {line.strip()[:120].decode('utf-8', 'replace')}")
    assert not offenders, (
        "these lines refer to notes outside the repository; point them at "
        "docs/wire-contract.md, docs/formats.md or docs/contributing.md:\n"
        + "\n".join(offenders))
