"""Token counting for the cost side of pruning (evaluate, prune): words or a local tokenizer.json."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

Counter = Callable[[Sequence[str]], np.ndarray]


def count_words(texts: Sequence[str]) -> np.ndarray:
    """Whitespace-separated words per text."""
    return np.fromiter((len(t.split()) for t in texts), dtype=np.int64, count=len(texts))


def tokenizer_file(spec: str | Path) -> Path:
    """A `tokenizer.json` path from a file or a directory holding one (existence is the caller's check)."""
    file = Path(spec)
    return file / "tokenizer.json" if file.is_dir() else file


def file_counter(file: Path) -> Counter:
    """Tokens per text under a local `tokenizer.json`, without special tokens and without truncation."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(file))
    tok.no_truncation()
    tok.no_padding()

    def count(texts: Sequence[str]) -> np.ndarray:
        enc = tok.encode_batch(list(texts), add_special_tokens=False)
        return np.fromiter((len(e.ids) for e in enc), dtype=np.int64, count=len(enc))

    return count
