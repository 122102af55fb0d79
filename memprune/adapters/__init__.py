"""Dataset adapters: each turns one source format into the canonical corpus tables.

An adapter is registered by name and yields one `Conversation` at a time (so ingest
streams), calling `ledger.saw(kind)` for every input item it meets and
`ledger.reject(...)` for every one it cannot use, with kinds among
`conversation`, `session`, `turn`, `bullet`, `qa` and `evidence` (one per evidence
reference attached to a bullet or QA item). The ingest step counts what is written, so
conservation (seen == written + rejected) is checked for every kind.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from memprune.errors import MemPruneError
from memprune.rejects import Ledger
from memprune.texts import unencodable

KINDS = ("conversation", "session", "turn", "bullet", "qa", "evidence")


class IngestError(MemPruneError):
    """The input cannot be read at all (wrong path, unreadable file, wrong layout)."""


@dataclass
class Conversation:
    """One conversation in canonical rows: `sessions`, `bullets` and `qa` follow `memprune.schema`."""

    conversation_id: str
    sessions: list[dict[str, Any]] = field(default_factory=list)
    bullets: list[dict[str, Any]] = field(default_factory=list)
    qa: list[dict[str, Any]] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        return {
            "conversation": 1,
            "session": len(self.sessions),
            "turn": sum(len(s["turns"]) for s in self.sessions),
            "bullet": len(self.bullets),
            "qa": len(self.qa),
            "evidence": sum(len(b["evidence"]) for b in self.bullets) + sum(len(q["evidence"]) for q in self.qa),
        }


def json_type(value: Any) -> str:
    """JSON type of a decoded value with its article ("an array", "a string", "null"), for messages."""
    if value is None:
        return "null"
    kind = {bool: "boolean", int: "number", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(value), type(value).__name__)
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"


def text_problem(name: str, value: Any, allow_empty: bool = False) -> str | None:
    """Why `value` is not a usable text field called `name`, or None when it is."""
    if value is None:
        return f"missing {name}"
    if not isinstance(value, str):
        return f"{name} is {json_type(value)}, expected a string"
    if not allow_empty and not value.strip():
        return f"empty {name}"
    if unencodable(value) is not None:
        return f"{name} is not valid Unicode (lone surrogate escape)"
    return None


def first_text_problem(*fields: tuple[str, str, Any]) -> tuple[str, str, Any] | None:
    """The first of (field, name, value) whose value is not usable text, as (field, reason, value); None if all are."""
    for key, name, value in fields:
        if reason := text_problem(name, value):
            return key, reason, value
    return None


class Adapter(ABC):
    """Reads one source format. Subclasses set `name` (and `has_qa` if they emit QA)."""

    name: ClassVar[str]
    has_qa: ClassVar[bool] = False
    default_split: ClassVar[str | None] = None  # the split read when none is given (a format with splits: msc)

    @abstractmethod
    def read(self, path: Path, ledger: Ledger, split: str | None = None) -> Iterator[Conversation]:
        """Yield conversations from `path`; raise `IngestError` if the input is unreadable as a whole."""


_REGISTRY: dict[str, type[Adapter]] = {}


def register(cls: type[Adapter]) -> type[Adapter]:
    """Class decorator: make an adapter available by its `name`."""
    _REGISTRY[cls.name] = cls
    return cls


def get_adapter(name: str) -> Adapter:
    """The adapter registered as `name`; an unknown name lists the known ones."""
    _load_builtin()
    if name not in _REGISTRY:
        raise IngestError(f"unknown format {name!r}; known formats: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]()


def formats() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def _load_builtin() -> None:
    """Import every module of this package, which registers the built-in adapters."""
    import importlib
    import pkgutil

    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
