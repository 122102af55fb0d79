"""CSV and JSONL files of a `table` store, edited record by record in their own text (`memprune.stores.records`: no
type inference, no re-serialisation): a record's exact text is kept in the archive (`RAW`) and put back byte for
byte. One group's records are found without parsing the rest: a CSV file's other rows never become records, a JSONL
line that cannot hold the group is never decoded (`records.scan`).

Text is decoded as UTF-8 with `surrogateescape`: a record whose mapped values hold bytes that are not UTF-8 is a
reject naming the column and the byte (never decided, never touched)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa

from memprune.archive import DECISION_COLUMNS
from memprune.stores import records as rec
from memprune.stores.base import INTEGER, REJECT, text_hash
from memprune.stores.config import StoreError
from memprune.stores.tablefile import BATCH, LOCATOR, POSITION, RAW, TableFile, read_bytes, register_format, replace


def _text_value(value: Any, where: str, column: str, field: str) -> str | None:
    """A JSONL value of a mapped field as text: strings as they are; ids, groups and times may be numbers."""
    if value is None or isinstance(value, str):
        return value
    if field != "text" and isinstance(value, (int, float)):
        return json.dumps(value)
    raise StoreError(f"{where}: field {column!r} (mapped to {field}) is a JSON {type(value).__name__}; "
                     "expected a string")


def _group_value(value: Any, where: str, column: str) -> str:
    """A record's group as the normal form has it (`_text_value`; null: the empty group)."""
    text = value if value is None or isinstance(value, str) else _text_value(value, where, column, "group")
    return "" if text is None else text


def _needle(group: str) -> str | None:
    """Text every JSONL line without a backslash holding `group` contains, and a cell every CSV record of `group`
    has (None: no such text). A string is written as it is; a JSON number as its digits only where `group` is an
    integer (3.0 may be written 3e0)."""
    if group == "":
        return None  # a record without the key is in the empty group
    if not INTEGER.fullmatch(group):
        try:
            float(group)
            return None
        except ValueError:
            pass
    return group


def _has_key(data: bytes, key: str) -> bool:
    """Whether a JSONL record (one of the first few lines holding `key`'s JSON text) has the top-level key `key`."""
    needle = json.dumps(key, ensure_ascii=False).encode(rec.ENCODING, rec.ERRORS)
    at = data.find(needle)
    for _ in range(8):
        if at < 0:
            return False
        start, end = data.rfind(b"\n", 0, at) + 1, data.find(b"\n", at)
        try:
            obj = json.loads(data[start:None if end < 0 else end].decode(rec.ENCODING, rec.ERRORS))
        except json.JSONDecodeError:
            obj = None
        if isinstance(obj, dict) and key in obj:
            return True
        at = data.find(needle, len(data) if end < 0 else end)
    return False


def _cell_text(value: Any) -> str | None:
    """A JSONL value as a readable archive cell (the exact record is in memprune_raw)."""
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def _not_utf8(col: str, field: str, value: str) -> str | None:
    """Why `value` (decoded with surrogateescape) is not UTF-8 text, else None."""
    at = next((i for i, ch in enumerate(value) if "\udc80" <= ch <= "\udcff"), None)
    if at is None:
        return None
    return (f"{col} ({field}) is not UTF-8 text: byte 0x{ord(value[at]) - 0xDC00:02X} at character {at}; convert the "
            "file to UTF-8 (iconv -t utf-8)")


class TextFile(TableFile):
    """A CSV or JSONL file (`fmt`), as record chunks."""

    fmt = ""

    def _records(self, parse: Callable[[], Any]) -> Any:
        """`parse()` of the file's records; a record that cannot be parsed is one error naming the file."""
        try:
            return parse()
        except rec.RecordError as exc:
            raise StoreError(f"{self.path}: {exc}") from None

    def _parse(self) -> rec.RecordFile:
        data = read_bytes(self.path)
        return self._records(lambda: rec.parse(data, self.fmt, self.fields["id"]))

    def _write(self, rf: rec.RecordFile) -> None:
        replace(self.path, rec.encode(rf.render()))

    def _scan_group(self, group: str, ids: set[str] | None = None) -> tuple[str, list[str], list[rec.Found]]:
        """The file's text, columns and the records of `group` (of `ids` only, when given) found in it."""
        data, column, where, idcol = read_bytes(self.path), self.fields["group"], str(self.path), self.fields["id"]

        def keep(row: dict[str, Any]) -> bool:
            if ids is not None and rec.id_text(row.get(idcol)) not in ids:
                return False
            return _group_value(row.get(column), where, column) == group
        return self._records(lambda: rec.scan(data, self.fmt, idcol, keep, _needle(group)))

    def _chunk_batches(self, columns: list[str], chunks: list[rec.Chunk]) -> Iterator[pa.RecordBatch]:
        """The mapped columns of records as string batches; a record with bytes that are not UTF-8 is a reject."""
        # JSONL records without a mapped key name none: each then has every mapped column (null where absent).
        present = [(f, c) for f, c in self.fields.items() if c in columns or self.may_lack_keys]
        for start in range(0, max(len(chunks), 1), BATCH):
            part = chunks[start:start + BATCH]
            cols = {col: self._values(part, start, col, field) for field, col in present}
            reject: list[str | None] = [None] * len(part)
            for field, col in present:
                values = cols[col]
                for k, value in enumerate(values):
                    why = None if value is None else _not_utf8(col, field, value)
                    if why is not None:
                        reject[k] = reject[k] or why
                        values[k] = value.encode(rec.ENCODING, rec.ERRORS).decode(rec.ENCODING, "replace")
            out = {k: pa.array(v, pa.string()) for k, v in cols.items()}
            if any(reject):
                out[REJECT] = pa.array(reject, pa.string())
            yield pa.RecordBatch.from_pydict(out)

    def _values(self, part: list[rec.Chunk], start: int, col: str, field: str) -> list[str | None]:
        """One mapped column of `part` (records `start`...) as text."""
        return [c.fields.get(col) for c in part]

    def batches(self) -> Iterator[pa.RecordBatch]:
        rf = self._parse()
        yield from self._chunk_batches(rf.columns, [c for _, c in rf.records()])

    def group_batches(self, group: str) -> Iterator[pa.RecordBatch]:
        _, columns, found = self._scan_group(group)
        yield from self._chunk_batches(columns, [f.chunk for f in found])

    def fetch(self, wanted: set[str], group: str | None) -> pa.Table:
        if group is None:
            rf = self._parse()
            columns, hits = rf.columns, [(p, c) for p, c in rf.records() if c.id in wanted]
        else:
            _, columns, found = self._scan_group(group, wanted)
            hits = [(f.position, f.chunk) for f in found]
        cols = self._archived_columns(columns)
        idcol = self.fields["id"]
        return pa.table({**{col: pa.array([rec.id_text(c.fields.get(col)) if col == idcol else
                                           _cell_text(c.fields.get(col)) for _, c in hits], pa.string())
                            for col in cols},
                         POSITION: pa.array([p for p, _ in hits], pa.int64()),
                         RAW: pa.array([c.text for _, c in hits], pa.string())})

    def _archived_columns(self, columns: list[str]) -> list[str]:
        """The readable columns an archived record keeps beside its exact text."""
        return columns

    def current(self, group: str, expected: dict[str, str]) -> tuple[dict[str, str | None], Any]:
        text, _, found = self._scan_group(group, set(expected))
        now: dict[str, str | None] = {}
        for f in found:
            body = f.chunk.fields.get(self.fields["text"])
            now[f.chunk.id] = None if body is None else text_hash(
                _text_value(body, f"{self.path}: record {f.position + 1}", self.fields["text"], "text"))
        return now, (text, found)

    def cut(self, state: Any, gone: dict[str, str], now: dict[str, str | None]) -> None:
        text, found = state
        cut = [f for f in found if f.chunk.id in gone and now.get(f.chunk.id) == gone[f.chunk.id]]
        if cut:
            replace(self.path, rec.encode(rec.cut(text, cut)))

    def delete(self, wanted: set[str]) -> int:
        rf = self._parse()
        kept = rec.without(rf, wanted)
        hits = len(rf.chunks) - len(kept.chunks)
        if hits:
            self._write(kept)
        return hits

    def set_fields(self, by_id: dict[str, dict[str, Any]], values: pa.Table) -> int:
        rf = self._parse()
        mine = {c.id: by_id[c.id] for _, c in rf.records() if c.id in by_id}
        if mine:
            self._write(rec.set_fields(rf, mine))
        return len(mine)

    def insert(self, rows: pa.Table, archived: pa.Table) -> None:
        idcol, fmt = self.fields["id"], self.fmt
        columns = [c for c in rows.column_names if c not in (*DECISION_COLUMNS, *LOCATOR)]
        if self.path.exists():
            rf = self._parse()
        else:  # the whole file went away: start it again (CSV: the header from the archive's columns)
            rf = rec.RecordFile(fmt, self._head(columns), [], columns)
        ids = rows.column(idcol).cast(pa.string()).to_pylist()
        if RAW not in rows.column_names or POSITION not in rows.column_names:  # an archive from before positions
            chunks = [rec.Chunk(i, rec.serialise(fmt, rf.columns, r)) for i, r in zip(ids, rows.select(columns).to_pylist())]
            self._write(rec.RecordFile(fmt, rf.head, [*rf.chunks, *chunks], rf.columns))
            return
        present = {c.id for _, c in rf.records()}
        restored = list(zip(rows.column(POSITION).to_pylist(), ids, rows.column(RAW).to_pylist()))
        self._write(rec.put_back(rf, restored, self.absent(present, archived)))

    def _head(self, columns: list[str]) -> str:
        """What a new file of these columns starts with."""
        return ""


@register_format
class CsvFile(TextFile):
    suffixes = (".csv",)
    fmt = "csv"

    def columns(self, wanted: list[str]) -> list[str]:
        data = read_bytes(self.path)
        return self._records(lambda: rec.csv_header(data))

    def _head(self, columns: list[str]) -> str:
        return rec.serialise(self.fmt, columns, dict(zip(columns, columns)))


@register_format
class JsonlFile(TextFile):
    suffixes = (".jsonl", ".json", ".ndjson")
    fmt = "jsonl"
    may_lack_keys = True

    def columns(self, wanted: list[str]) -> list[str]:
        """Every key of its records, or, when each of `wanted` is the key of a record found by its text, `wanted` alone
        (no whole parse to check a mapping)."""
        data = read_bytes(self.path)
        if wanted and all(_has_key(data, key) for key in wanted):
            return list(wanted)
        return self._records(lambda: rec.parse(data, self.fmt, self.fields["id"])).columns

    def _values(self, part: list[rec.Chunk], start: int, col: str, field: str) -> list[str | None]:
        return [_text_value(c.fields.get(col), f"{self.path}: record {start + k + 1}", col, field)
                for k, c in enumerate(part)]

    def _archived_columns(self, columns: list[str]) -> list[str]:
        return [c for c in dict.fromkeys(self.fields.values()) if c in columns]
