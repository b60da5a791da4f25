"""kvcal-calibrate's data: a prompt file -> token windows for calibration and
held-out evaluation, deterministic for a given seed.

Formats (read_documents):
- `.txt`: documents separated by blank lines;
- `.jsonl`: one JSON object per line with a `text` string, or `messages`
  (a chat: [{"role": ..., "content": ...}, ...]) rendered with the
  tokenizer's chat template;
- `.parquet` / `.arrow`: the same columns, read with the `datasets` package
  when it is installed.

Sampling (make_samples): the documents are shuffled with `seed`, then
tokenized in that order until the request is met (a large file is not
tokenized whole). `pack` (default) concatenates documents (an EOS token
between them where the tokenizer has one) and cuts windows of exactly
`seq_len` tokens; `truncate` makes one sample per document, cut to
`seq_len` (shorter ones stay shorter and are padded in a batch). The
held-out samples come from the first documents and the calibration samples
from the documents after them: no document feeds both. When the file is
too short for the request, what it gives is used and the caller warns with
the counts.

Batches (batches): samples grouped `batch_size` at a time, right-padded,
with an attention mask whose zeros kvcal.torch.capture leaves out of the
statistics (and kvcal.torch.evaluate out of every figure).
"""
from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass, field
from typing import Iterable, Iterator, List, Optional, Sequence

FORMATS = (".txt", ".jsonl", ".parquet", ".arrow")


class DataError(ValueError):
    """The dataset cannot be used; the message says what to change."""


@dataclass
class Samples:
    holdout: List[List[int]]
    calibration: List[List[int]]
    documents: int              # documents in the file
    documents_used: int         # documents tokenized
    tokens: int                 # tokens in the samples
    requested: int
    requested_holdout: int
    short: bool = False         # the file gave fewer samples than requested
    notes: List[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.holdout) + len(self.calibration)


def _check_format(path: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext not in FORMATS:
        raise DataError(f"{path}: unknown dataset format '{ext or '(no extension)'}'; use a .txt "
                        f"(documents separated by blank lines), .jsonl (a 'text' or 'messages' "
                        f"field per line), .parquet or .arrow file")
    return ext


def check_dataset(path: str) -> str:
    """Cheap checks before anything is loaded: exists, readable, a known
    format (and `datasets` present for parquet/arrow). Returns the extension."""
    ext = _check_format(path)
    if not os.path.exists(path):
        raise DataError(f"dataset {path} does not exist")
    if not os.path.isfile(path):
        raise DataError(f"dataset {path} is not a file")
    if not os.access(path, os.R_OK):
        raise DataError(f"dataset {path} is not readable")
    if ext in (".parquet", ".arrow"):
        try:
            import datasets  # noqa: F401
        except ImportError:
            raise DataError(f"{path}: reading {ext} files needs the `datasets` package "
                            f"(pip install datasets), or convert it to .jsonl") from None
    return ext


def _record_document(record, where: str):
    """A document from one record: a text string or a list of messages."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: a JSON object with 'text' or 'messages' is needed, "
                        f"found {type(record).__name__}")
    text = record.get("text")
    if isinstance(text, str):
        return text
    messages = record.get("messages")
    if isinstance(messages, list) and all(isinstance(m, dict) and "role" in m and "content" in m
                                          for m in messages):
        return messages
    if text is not None or messages is not None:
        raise DataError(f"{where}: 'text' must be a string and 'messages' a list of "
                        f"{{'role', 'content'}} objects")
    fields = ", ".join(sorted(record)[:8]) or "none"
    raise DataError(f"{where}: no 'text' or 'messages' field (fields: {fields}); each record "
                    f"needs a 'text' string or a 'messages' chat")


def read_documents(path: str) -> list:
    """Every document of the file, in file order: strings, or message lists."""
    ext = check_dataset(path)
    if ext == ".txt":
        try:
            with open(path, encoding="utf-8") as f:
                content = f.read()
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        return [d.strip() for d in re.split(r"\n[ \t\r\f\v]*\n", content) if d.strip()]
    if ext == ".jsonl":
        docs = []
        with open(path, encoding="utf-8", errors="strict") as f:
            try:
                for number, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except ValueError as e:
                        raise DataError(f"{path} line {number}: not JSON ({e})") from None
                    docs.append(_record_document(record, f"{path} line {number}"))
            except UnicodeDecodeError as e:
                raise DataError(f"{path}: not UTF-8 ({e.reason})") from None
        return docs
    import datasets

    try:
        table = (datasets.Dataset.from_parquet(path) if ext == ".parquet"
                 else datasets.Dataset.from_file(path))
    except Exception as e:  # noqa: BLE001 - any reader error is the file's
        raise DataError(f"{path}: cannot read it with `datasets`: {e}") from None
    columns = set(table.column_names)
    if not columns & {"text", "messages"}:
        raise DataError(f"{path}: no 'text' or 'messages' column (columns: "
                        f"{', '.join(sorted(columns)[:8])})")
    keep = [c for c in ("text", "messages") if c in columns]
    return [_record_document({k: row[k] for k in keep if row[k] is not None}, f"{path} row {i}")
            for i, row in enumerate(table.select_columns(keep))]


def _is_chat(doc) -> bool:
    return isinstance(doc, list)


class _Tokenize:
    def __init__(self, tokenizer, path: str):
        self.tokenizer = tokenizer
        self.path = path
        self.eos = getattr(tokenizer, "eos_token_id", None)

    def __call__(self, doc) -> List[int]:
        tok = self.tokenizer
        if _is_chat(doc):
            if not getattr(tok, "chat_template", None):
                raise DataError(f"{self.path} has chat 'messages' but the model's tokenizer has no "
                                f"chat template; use 'text' records instead")
            text = tok.apply_chat_template(doc, tokenize=False)
            return list(tok(text, add_special_tokens=False)["input_ids"])
        if not doc.strip():
            return []
        return list(tok(doc)["input_ids"])


class _Packer:
    """Concatenates documents and cuts windows of `length` tokens, up to
    `want` windows; what is left when full is dropped."""

    def __init__(self, length: int, want: int, eos: Optional[int]):
        self.length, self.want, self.eos = length, want, eos
        self.windows: List[List[int]] = []
        self.buffer: List[int] = []

    @property
    def full(self) -> bool:
        return len(self.windows) >= self.want

    def add(self, ids: List[int]) -> None:
        if self.full or not ids:
            return
        if self.buffer and self.eos is not None and self.buffer[-1] != self.eos:
            self.buffer.append(self.eos)
        self.buffer.extend(ids)
        while len(self.buffer) >= self.length and not self.full:
            self.windows.append(self.buffer[:self.length])
            del self.buffer[:self.length]
        if self.full:
            self.buffer = []

    def finish(self) -> None:
        """The data ran out: a last, shorter window from what is left."""
        if not self.full and len(self.buffer) >= 2:
            self.windows.append(self.buffer)
        self.buffer = []


# The default held-out set: a tenth of the windows, and at least
# HOLDOUT_TOKENS tokens, at most half of the windows (at least 2).
# HOLDOUT_TOKENS is measured (docs/calibrate.md, "How many samples"): on
# SmolLM2 it lets the held-out set resolve the default --tolerance (2
# standard errors of the paired difference of scale 1.0 against the best
# calibrated setting at most 0.02 nats/token).
HOLDOUT_SHARE = 0.1
HOLDOUT_TOKENS = 8192


def default_holdout(windows: int, seq_len: int) -> int:
    """Held-out windows when --holdout-samples is not given, of `windows`
    windows of up to `seq_len` tokens."""
    want = max(2, int(round(windows * HOLDOUT_SHARE)), -(-HOLDOUT_TOKENS // max(1, seq_len)))
    return max(2, min(want, windows // 2))


def make_samples(documents: Sequence, tokenizer, *, path: str, samples: int, seq_len: int,
                 holdout: int, seed: int, packing: str = "pack",
                 holdout_given: bool = False, progress=None) -> Samples:
    """`samples` windows (of which `holdout` held out) from `documents`; see
    the module docs. `progress(n)` is called with the tokens tokenized."""
    if packing not in ("pack", "truncate"):
        raise DataError(f"packing {packing!r} is not pack or truncate")
    order = list(range(len(documents)))
    random.Random(seed).shuffle(order)
    tokenize = _Tokenize(tokenizer, path)
    eos = tokenize.eos if packing == "pack" else None
    hold = _Packer(seq_len, holdout, eos)
    cal = _Packer(seq_len, samples - holdout, eos)
    used = 0
    for index in order:
        if hold.full and cal.full:
            break
        ids = tokenize(documents[index])
        used += 1
        if progress is not None:
            progress(len(ids))
        if len(ids) < 2:
            continue
        target = hold if not hold.full else cal
        if packing == "truncate":
            target.windows.append(ids[:seq_len])
        else:
            target.add(ids)
    hold.finish()
    cal.finish()
    held, calibration = hold.windows, cal.windows
    short = len(held) + len(calibration) < samples
    result = Samples(holdout=held, calibration=calibration, documents=len(documents),
                     documents_used=used, tokens=0, requested=samples,
                     requested_holdout=holdout, short=short)
    if short:
        # Too little text: split what there is again, held out first.
        every = held + calibration
        if not holdout_given:
            window = max((len(w) for w in every), default=seq_len)
            holdout = default_holdout(len(every), window)
        if len(every) < holdout + 1:
            got = len(every)
            raise DataError(
                f"{path} gives {'no usable samples' if got == 0 else f'only {got} sample(s)'} "
                f"({sum(len(w) for w in every)} tokens in {len(documents)} documents); "
                f"kvcal-calibrate needs at least {holdout + 1} ({holdout} held out, 1 or more "
                f"to calibrate): add text, or lower --seq-len"
                + (" or --holdout-samples" if holdout_given else ""))
        result.holdout, result.calibration = every[:holdout], every[holdout:]
    result.tokens = sum(len(w) for w in result.holdout) + sum(len(w) for w in result.calibration)
    return result


@dataclass
class Batch:
    input_ids: "object"        # torch.LongTensor [batch, tokens]
    attention_mask: "object"   # torch.LongTensor [batch, tokens], 0 = padding
    tokens: int                # unpadded tokens


def batches(windows: Sequence[Sequence[int]], batch_size: int, pad_id: int,
            device=None) -> Iterator[Batch]:
    """Right-padded batches of `batch_size` windows, in order."""
    import torch

    for start in range(0, len(windows), batch_size):
        group = windows[start:start + batch_size]
        width = max(len(w) for w in group)
        ids = torch.full((len(group), width), int(pad_id), dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for row, w in enumerate(group):
            ids[row, :len(w)] = torch.as_tensor(list(w), dtype=torch.long)
            mask[row, :len(w)] = 1
        if device is not None:
            ids, mask = ids.to(device), mask.to(device)
        yield Batch(ids, mask, sum(len(w) for w in group))


def pad_id_of(tokenizer) -> int:
    for name in ("pad_token_id", "eos_token_id", "unk_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0


def fingerprint_file(path: str, h) -> None:
    """Feeds the file's bytes into hash `h`."""
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)


def describe(samples: Samples, seq_len: int) -> str:
    return (f"{len(samples.calibration)} calibration + {len(samples.holdout)} held-out samples of "
            f"up to {seq_len} tokens ({samples.tokens} tokens from {samples.documents_used} of "
            f"{samples.documents} documents)")


def iter_chunks(seq: Sequence, n: int) -> Iterable[Sequence]:
    for i in range(0, len(seq), n):
        yield seq[i:i + n]
