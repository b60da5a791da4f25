"""docs/contributing.md matches the tree: every file or folder it names (in
backticks, `a/b.{h,cc}` expanded, and every relative link) exists in the
checkout, so its recipes ("Adding an observer", ...) list files that are
there. What a build or ./run makes (build/, .venv/, ...) is not a file of
the tree and is left out."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(ROOT, "docs", "contributing.md")
# Made by a build or by ./run, never committed.
GENERATED = ("build/", "build-asan/", "build-tsan/", "build-fuzz/", ".venv/", ".venv",
             "<build>/", "dist/")
SOURCE_EXT = (".h", ".cc", ".cu", ".cuh", ".py", ".md", ".proto", ".cmake", ".txt", ".sh",
              ".json", ".yaml", ".toml")


def expand(token):
    m = re.search(r"\{([^{}]*)\}", token)
    if not m:
        return [token]
    return [p for alt in m.group(1).split(",")
            for p in expand(token[:m.start()] + alt + token[m.end():])]


def named_paths():
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    out = set()
    for span in re.findall(r"`([^`\n]+)`", text):
        for token in span.split():
            token = token.strip("(),;:")
            if token.startswith(GENERATED) or "*" in token or "=" in token or "://" in token:
                continue
            looks_like_path = "/" in token or token.endswith(SOURCE_EXT)
            if not looks_like_path or not re.fullmatch(r"[\w./{},<>-]+", token):
                continue
            if not re.search(r"[A-Za-z0-9]", token.split(".")[0]) and "/" not in token.strip("/"):
                continue  # an extension (`.cc`) or a comment marker, not a path
            out.update(expand(token))
    for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in link:
            out.add(os.path.normpath(os.path.join("docs", link)))
    return sorted(out)


def exists(path):
    if os.path.exists(os.path.join(ROOT, path)):
        return True
    # A bare name: somewhere in the tree, as the prose names it beside its
    # folder (`kvcal_cli.h` under client/cli/, `rpc/` under client/).
    name = path.rstrip("/")
    if "/" not in name:
        for top, dirs, files in os.walk(ROOT):
            dirs[:] = [d for d in dirs if not d.startswith((".", "build"))]
            if name in (dirs if path.endswith("/") else files):
                return True
    return False


def test_the_doc_names_files():
    paths = named_paths()
    assert len(paths) > 40, paths  # the recipes name files; the parser found them
    for must in ("kernels/observers/observer.h", "proto/kvcal/v1/calibration.proto"):
        assert must in paths


def test_every_path_in_contributing_md_exists():
    missing = [p for p in named_paths() if not exists(p)]
    assert not missing, f"docs/contributing.md names paths the tree does not have: {missing}"
