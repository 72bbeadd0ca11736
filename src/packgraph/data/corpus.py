"""The embedded default corpus: the running Python's own standard-library sources, as byte tokens.

Every Python install carries its standard library, so this corpus needs no download and is always present. It is
a real, heavy-tailed mix of document lengths (from a few bytes to several hundred kilobytes), which is what
packing and bucketing need to be exercised honestly.

* **Documents.** Each ``.py`` file under ``sysconfig.get_paths()["stdlib"]`` is one document; third-party code
  (``site-packages``/``dist-packages`` directories) is excluded. Files are ordered by their path relative to the
  stdlib root (POSIX form), so the order is deterministic for a given Python install. Different Python versions
  give different corpora.
* **Tokens.** A document's tokens are its raw file bytes (0..255, the files are UTF-8), optionally followed by
  :data:`EOS_ID`. :data:`PAD_ID` fills rows that belong to no document. The vocabulary is :data:`VOCAB_SIZE`.
"""

from __future__ import annotations

import functools
import math
import os
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

__all__ = [
    "EOS_ID",
    "PAD_ID",
    "VOCAB_SIZE",
    "CorpusStats",
    "corpus_stats",
    "decode",
    "encode",
    "load_corpus",
    "source_files",
    "stdlib_root",
]

EOS_ID: int = 256
"""End-of-document token, appended to each document by default."""

PAD_ID: int = 257
"""Filler token for rows that belong to no document (padding and tail rows)."""

VOCAB_SIZE: int = 258
"""256 byte values plus :data:`EOS_ID` and :data:`PAD_ID`."""

_THIRD_PARTY_DIRS = frozenset({"site-packages", "dist-packages"})


def stdlib_root() -> Path:
    """The directory the corpus is read from: the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


@functools.lru_cache(maxsize=1)
def source_files() -> tuple[str, ...]:
    """Relative POSIX paths of every stdlib ``.py`` file, sorted. Cached: the walk happens once per process."""
    root = stdlib_root()
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning here keeps the walk from ever entering third-party trees (which can be huge).
        dirnames[:] = [d for d in dirnames if d not in _THIRD_PARTY_DIRS and d != "__pycache__"]
        rel_dir = Path(dirpath).relative_to(root)
        found.extend((rel_dir / name).as_posix() for name in filenames if name.endswith(".py"))
    return tuple(sorted(found))


def encode(text: str) -> Tensor:
    """UTF-8 bytes of ``text`` as an int64 ``[len]`` tensor (no EOS)."""
    return _bytes_to_tokens(text.encode("utf-8"))


def decode(tokens: Tensor | Sequence[int]) -> str:
    """Text of a token sequence: specials (>= 256) are dropped, invalid UTF-8 becomes U+FFFD."""
    if isinstance(tokens, Tensor):
        tokens = tokens.detach().reshape(-1).cpu().tolist()
    return bytes(t for t in tokens if 0 <= t < 256).decode("utf-8", errors="replace")


def load_corpus(
    *,
    max_docs: int | None = None,
    max_doc_len: int | None = None,
    min_doc_len: int = 1,
    append_eos: bool = True,
) -> list[Tensor]:
    """Load the stdlib corpus as a list of int64 ``[len_i]`` token tensors, in :func:`source_files` order.

    Empty files are skipped (they carry no text). Filters and caps apply in this order, per file:

    1. the document is the file's bytes, plus :data:`EOS_ID` if ``append_eos``;
    2. it is skipped if shorter than ``min_doc_len`` tokens;
    3. it is truncated to ``max_doc_len`` tokens; the EOS is kept as the last token when ``append_eos``, so a
       truncated document still ends a document;
    4. loading stops after ``max_docs`` documents (files past that are never read).

    The result is deterministic for a given Python install.
    """
    if max_docs is not None and max_docs < 0:
        raise ValueError(f"max_docs must be >= 0, got {max_docs}")
    if max_doc_len is not None and max_doc_len < 1:
        raise ValueError(f"max_doc_len must be >= 1, got {max_doc_len}")
    root = stdlib_root()
    docs: list[Tensor] = []
    for rel in source_files():
        if max_docs is not None and len(docs) >= max_docs:
            break
        data = (root / rel).read_bytes()
        if not data:
            continue
        n_tokens = len(data) + int(append_eos)
        if n_tokens < min_doc_len:
            continue
        if max_doc_len is not None and n_tokens > max_doc_len:
            data = data[: max_doc_len - int(append_eos)]
        tokens = _bytes_to_tokens(data)
        if append_eos:
            tokens = torch.cat([tokens, torch.tensor([EOS_ID], dtype=torch.int64)])
        docs.append(tokens)
    return docs


@dataclass(frozen=True)
class CorpusStats:
    """Length statistics of a list of documents (lengths in tokens; percentiles by nearest rank)."""

    count: int
    total_tokens: int
    min_len: int
    median_len: int
    p90_len: int
    max_len: int

    def __str__(self) -> str:
        return (
            f"{self.count} docs, {self.total_tokens} tokens; length min {self.min_len}, median {self.median_len}, "
            f"p90 {self.p90_len}, max {self.max_len}"
        )


def corpus_stats(docs: Sequence[Tensor | Sequence[int]]) -> CorpusStats:
    """Count, total tokens and min/median/p90/max length of ``docs`` (all zero for no documents).

    Percentiles use the nearest-rank definition, so each is an actual document length (the median is the lower
    median).
    """
    lengths = sorted(len(d) for d in docs)
    if not lengths:
        return CorpusStats(0, 0, 0, 0, 0, 0)

    def rank(p: float) -> int:
        return lengths[max(math.ceil(p * len(lengths)), 1) - 1]

    return CorpusStats(len(lengths), sum(lengths), lengths[0], rank(0.5), rank(0.9), lengths[-1])


def _bytes_to_tokens(data: bytes) -> Tensor:
    if not data:
        return torch.zeros(0, dtype=torch.int64)
    # frombuffer needs a writable buffer to avoid a warning; bytearray copies once, then the int64 cast copies.
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)
