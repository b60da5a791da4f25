"""Every kvcal name the user-facing docs mention imports: the names in
backticks and in ```python blocks of README.md, python/README.md and
docs/calibrate.md (kvcal.Client, kvcal.torch.capture,
kvcal.calibrate.data.HOLDOUT_TOKENS, ...), resolved as a user would, by
importing the longest module path and taking the rest as attributes. The
package's rooms (kvcal/calibrate/, kvcal/producer/, kvcal/torch/) may move
code; the names users were told about stay where the docs say."""
import importlib
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = ("README.md", "python/README.md", "docs/calibrate.md")
# Not Python names: the wheel's directory of bundled libraries
# (auditwheel's kvcal.libs), and the extension module, which only a build
# or a wheel has (test_local_statistics.py loads it through load_engine()).
NOT_NAMES = {"kvcal.libs", "kvcal._engine"}
NAME = re.compile(r"(?<![\w./-])kvcal(?:\.[A-Za-z_]\w*)+")


def documented_names():
    found = {}
    for doc in DOCS:
        with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
            text = f.read()
        spans = re.findall(r"```python\n(.*?)```", text, re.S)
        spans += re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
        for span in spans:
            for m in NAME.finditer(span):
                found.setdefault(m.group(0), doc)
    return sorted((name, doc) for name, doc in found.items() if name not in NOT_NAMES)


def resolve(name):
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as e:
            if not ".".join(parts[:cut]).startswith(e.name or "\0"):
                raise  # a module the package itself failed to import
            continue
        for attr in parts[cut:]:
            value = getattr(value, attr)
        return value
    raise ModuleNotFoundError(name)


def test_the_docs_name_enough_to_check():
    names = {name for name, _ in documented_names()}
    # The entry points of each room are among them.
    for name in ("kvcal.Client", "kvcal.Producer", "kvcal.LocalStatistics", "kvcal.calibrate_model",
                 "kvcal.torch.capture", "kvcal.torch.evaluate", "kvcal.vllm.update_attention_scales"):
        assert name in names


@pytest.mark.parametrize("name,doc", documented_names())
def test_documented_name_imports(name, doc):
    try:
        resolve(name)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"{doc} names {name}, which does not import: {type(e).__name__}: {e}")
