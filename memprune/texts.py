"""What a text must be to enter memprune: Unicode that encodes as UTF-8 (the tokenizers, Arrow and every store need
it). JSON and Python strings can carry lone surrogates ("\\udc00") that no encoder takes; they are refused where
texts enter (the HTTP models, `MemoryPruner`) as one error for that request or bullet, never a failed batch."""

from __future__ import annotations


def unencodable(text: str) -> str | None:
    """Why `text` is not valid Unicode text (its first lone surrogate and where), else None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"not valid Unicode text: a lone surrogate U+{ord(text[exc.start]):04X} at character {exc.start}"
    return None


def check_text(text: str) -> str:
    """`text` itself, or ValueError saying why it is not valid Unicode text (a pydantic validator)."""
    why = unencodable(text)
    if why is not None:
        raise ValueError(why)
    return text
