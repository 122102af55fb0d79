"""Bookkeeping that makes "nothing is silently dropped" checkable.

A `Ledger` counts every input item an adapter sees, by kind (record, turn, bullet, ...),
and every item it rejects, with the source file, the record, the field and the reason.
Conservation is then a plain equation per kind: seen == written + rejected.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from memprune.io import JsonlSink

MAX_VALUE_CHARS = 200


@dataclass(frozen=True)
class Reject:
    """One unusable input item: where it came from, what it was and why it was rejected."""

    source: str
    record: str
    field: str
    kind: str
    reason: str
    value: str | None = None


def _printable(text: str) -> str:
    """`text` with anything not encodable as UTF-8 (lone surrogates) backslash-escaped."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _short(value: Any) -> str | None:
    if value is None:
        return None
    text = _printable(value if isinstance(value, str) else repr(value))
    return text if len(text) <= MAX_VALUE_CHARS else text[:MAX_VALUE_CHARS] + "..."


class Ledger:
    """Counts seen, written and rejected items per kind, and streams rejects to JSONL."""

    def __init__(self, sink: JsonlSink | None = None) -> None:
        self.sink = sink
        self.seen: Counter[str] = Counter()
        self.written: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.reasons: Counter[str] = Counter()
        self.normalised: Counter[str] = Counter()

    def saw(self, kind: str, n: int = 1) -> None:
        self.seen[kind] += n

    def wrote(self, kind: str, n: int = 1) -> None:
        self.written[kind] += n

    def note(self, what: str, n: int = 1) -> None:
        """Count an unambiguous normalisation (kept, but changed), e.g. a zero-padded id."""
        self.normalised[what] += n

    def reject(
        self,
        *,
        source: str,
        record: str,
        field: str,
        kind: str,
        reason: str,
        value: Any = None,
        lost: dict[str, int] | None = None,
    ) -> None:
        """Record one unusable item of `kind` (turn, bullet, ...).

        `lost` counts the items contained in it that are rejected with it (a dropped
        session takes its turns and bullets along), so conservation still balances.
        """
        self.rejected[kind] += 1
        for k, n in (lost or {}).items():
            self.rejected[k] += n
        self.reasons[reason] += 1
        if self.sink is not None:
            reject = Reject(_printable(source), _printable(record), _printable(field), kind, _printable(reason),
                            _short(value))
            self.sink.write(asdict(reject))

    def account(self, rows: Iterable[Mapping[str, Any]], kind: str, source: str, id_key: str = "row_id") -> None:
        """Count LLM output rows of `kind`: written when `error` is empty, else rejected with the raw model text."""
        for row in rows:
            self.saw(kind)
            if row.get("error"):
                self.reject(source=source, record=str(row[id_key]), field=kind, kind=kind, reason=row["error"],
                            value=row.get("raw"))
            else:
                self.wrote(kind)

    def imbalance(self) -> dict[str, dict[str, int]]:
        """Kinds whose seen count differs from written + rejected (empty when conservation holds)."""
        out = {}
        for kind in sorted(set(self.seen) | set(self.written) | set(self.rejected)):
            s, w, r = self.seen[kind], self.written[kind], self.rejected[kind]
            if s != w + r:
                out[kind] = {"seen": s, "written": w, "rejected": r}
        return out

    def summary(self) -> dict[str, Any]:
        return {
            "seen": dict(sorted(self.seen.items())),
            "written": dict(sorted(self.written.items())),
            "rejected": dict(sorted(self.rejected.items())),
            "rejects_by_reason": dict(sorted(self.reasons.items())),
            "normalised": dict(sorted(self.normalised.items())),
            "conservation": "ok" if not self.imbalance() else self.imbalance(),
        }
