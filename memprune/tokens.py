"""Token counting for the cost side of pruning (prune, evaluate): one counter, one default unit.

The default unit is `encoder`: the tokenizer of the scorer's own encoder (all-MiniLM-L6-v2 for the
default scorer), without special tokens and without truncation. `whitespace` counts words; a
path names a local `tokenizer.json` (or a directory holding one), e.g. the generator LLM's, to
count what a prompt would cost. Nothing is ever downloaded.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from memprune.encoders import canonical_encoder, model_label, resolve_encoder
from memprune.errors import MemPruneError

Counter = Callable[[Sequence[str]], np.ndarray]
Encoder = Callable[[Sequence[str]], list[list[int]]]
DEFAULT_UNIT = "encoder"


class TokenizerError(MemPruneError):
    """The token unit cannot be used (no such tokenizer file, no encoder to take it from)."""


def count_words(texts: Sequence[str]) -> np.ndarray:
    """Whitespace-separated words per text."""
    return np.fromiter((len(t.split()) for t in texts), dtype=np.int64, count=len(texts))


def tokenizer_file(spec: str | Path) -> Path:
    """A `tokenizer.json` path from a file or a directory holding one (existence is the caller's check)."""
    file = Path(spec)
    return file / "tokenizer.json" if file.is_dir() else file


def backend_encoder(backend: object) -> Encoder:
    """Token ids per text under a `tokenizers.Tokenizer`, without special tokens, truncation or padding.

    Special tokens written in the text (a chat template's `<|user|>`) are still recognised as such.
    """
    backend = copy.deepcopy(backend)
    backend.no_truncation()  # type: ignore[attr-defined]
    backend.no_padding()  # type: ignore[attr-defined]

    def encode(texts: Sequence[str]) -> list[list[int]]:
        if not len(texts):
            return []
        return [e.ids for e in backend.encode_batch(list(texts), add_special_tokens=False)]  # type: ignore[attr-defined]

    return encode


def _backend_counter(backend: object) -> Counter:
    """Tokens per text under a `tokenizers.Tokenizer`, without special tokens, truncation or padding."""
    encode = backend_encoder(backend)

    def count(texts: Sequence[str]) -> np.ndarray:
        ids = encode(texts)
        return np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))

    return count


def check_unit(spec: str) -> None:
    """Fail early (before any work starts) for a tokenizer path that does not exist."""
    if spec in ("encoder", "whitespace"):
        return
    file = tokenizer_file(spec)
    if not file.is_file():
        raise TokenizerError(f"{file}: tokenizer file not found (give 'encoder', 'whitespace', a tokenizer.json "
                             "or its directory)")


def unit_name(spec: str, encoder: str | None = None) -> str:
    """The name of a token unit as reports print it."""
    if spec == "whitespace":
        return "whitespace words"
    if spec == "encoder":
        name = model_label(canonical_encoder(encoder)) if encoder else "encoder"
        return f"tokens of the scorer's encoder tokenizer ({name}, no special tokens)"
    return f"tokens of {tokenizer_file(spec)} (no special tokens)"


def token_counter(spec: str = DEFAULT_UNIT, encoder: str | None = None, tokenizer: object | None = None
                  ) -> tuple[Counter, str]:
    """A function texts -> token counts, and the unit's name.

    `encoder`: the tokenizer of `tokenizer` (an already loaded one, e.g. the scorer's) or of the
    encoder named by `encoder`; `whitespace`: words; otherwise a local `tokenizer.json` or its dir.
    """
    if spec == "whitespace":
        return count_words, unit_name(spec)
    if spec == "encoder":
        if tokenizer is None:
            if encoder is None:
                raise TokenizerError("token unit 'encoder' needs an encoder (the scorer's) to take the tokenizer from")
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(resolve_encoder(encoder))
        unit = unit_name(spec, encoder or getattr(tokenizer, "name_or_path", None))
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:  # the Rust tokenizer directly: same ids, about 2x faster than tokenizer(...)
            return _backend_counter(backend), unit

        def count_slow(texts: Sequence[str]) -> np.ndarray:
            ids = tokenizer(list(texts), add_special_tokens=False, truncation=False, verbose=False)["input_ids"]  # type: ignore[operator]
            return np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))

        return count_slow, unit
    check_unit(spec)
    from tokenizers import Tokenizer

    file = tokenizer_file(spec)
    return _backend_counter(Tokenizer.from_file(str(file))), unit_name(spec)
