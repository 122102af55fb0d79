"""Record-exact CSV and JSONL files: each record keeps its own bytes, so a write changes only what it names.

A file is parsed into its `head` (the CSV header record; nothing for JSONL) and its `chunks`: one per
record, holding the record's id and its exact text (line ending and, for CSV, quoting and embedded
newlines included), plus id-less chunks for blank lines. Deleting records is leaving their chunks
out; putting records back is putting their archived text back at its recorded position; setting a
field edits that record's text only. Nothing is ever re-serialised through inferred types, so ids
like `0003`, zips like `02139`, ISO times and absent keys stay as they were.

Text is decoded as UTF-8 with `surrogateescape`, so any byte sequence survives a rewrite unchanged.

`scan` is the live path's read of one group (`memprune.stores.table`): it walks the file once and parses only the
records that can match (a JSONL line without a backslash that lacks the group's text cannot hold it, so it is never
decoded; a CSV record is read by the csv module, and only one with a cell equal to the group goes further),
keeping those records' positions and where their text starts; `cut` removes records from the text by those offsets.
"""

from __future__ import annotations

import csv
import io
import json
import sys
from itertools import accumulate
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

ENCODING, ERRORS = "utf-8", "surrogateescape"
# A CSV field may be as long as a file can hold (the csv module's default cap, 128 KiB, would make a valid store with
# one long memory unreadable). The cap is the csv module's, process-wide.
csv.field_size_limit(sys.maxsize)
_DECODER = json.JSONDecoder()
_WS = " \t\r\n"


class RecordError(ValueError):
    """A record that cannot be parsed; the message names the record (1-based line or row)."""


@dataclass
class Chunk:
    """One record's exact text (`id` None: a blank line, kept where it is)."""

    id: str | None
    text: str
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass
class RecordFile:
    """A CSV or JSONL file as its head and its chunks, in file order."""

    fmt: str
    head: str
    chunks: list[Chunk]
    columns: list[str]  # CSV: the header; JSONL: every key seen, in first-seen order

    def records(self) -> Iterator[tuple[int, Chunk]]:
        """(position, chunk) for every record; a position counts blank lines too, which are never removed."""
        return ((p, c) for p, c in enumerate(self.chunks) if c.id is not None)

    def render(self) -> str:
        """The file's text: head then chunks; a chunk without a line ending gets one unless it is the last."""
        eol = _eol(self.head or (self.chunks[0].text if self.chunks else ""))
        parts = [self.head]
        for i, c in enumerate(self.chunks):
            last = i == len(self.chunks) - 1
            parts.append(c.text if last or c.text.endswith(("\n", "\r")) else c.text + eol)
        return "".join(parts)


def _eol(text: str) -> str:
    return "\r\n" if text.endswith("\r\n") else "\r" if text.endswith("\r") else "\n"


def encode(text: str) -> bytes:
    return text.encode(ENCODING, ERRORS)


def id_text(value: Any) -> str | None:
    """A record's id as the text memprune uses: strings as they are, numbers as written; null/empty -> None."""
    if value is None or isinstance(value, (dict, list)):
        return None
    text = value if isinstance(value, str) else json.dumps(value)
    return text or None


def parse(data: bytes, fmt: str, id_column: str) -> RecordFile:
    """Parse a CSV or JSONL file's bytes (of the table store) into record chunks keyed by `id_column`."""
    text = data.decode(ENCODING, ERRORS)
    return parse_csv(text, id_column) if fmt == "csv" else parse_jsonl(text, id_column)


def parse_csv(text: str, id_column: str) -> RecordFile:
    """CSV (the csv module's dialect, as pyarrow reads it): the header is the head, each record one chunk."""
    source = io.StringIO(text, newline="")
    consumed: list[str] = []

    def lines() -> Iterator[str]:
        for line in iter(source.readline, ""):
            consumed.append(line)
            yield line

    reader = csv.reader(lines())
    header: list[str] | None = None
    head, chunks = "", []
    for n, cells in enumerate(reader, start=1):
        raw = "".join(consumed)
        consumed.clear()
        if header is None:
            if not cells:  # blank lines before the header belong to the head
                head += raw
                continue
            header = [c.lstrip("\ufeff") if i == 0 else c for i, c in enumerate(cells)]
            head += raw
            continue
        if not cells:
            chunks.append(Chunk(None, raw))
            continue
        row = dict(zip(header, cells))
        chunks.append(Chunk(id_text(row.get(id_column)) or f"\0row{n}", raw, row))
    return RecordFile("csv", head, chunks, header or [])


def parse_jsonl(text: str, id_column: str) -> RecordFile:
    """JSON lines: one object a line, each one chunk; blank lines are kept as id-less chunks."""
    chunks, columns = [], {}
    for n, line in enumerate(_lines(text), start=1):
        if not line.strip(_WS):
            chunks.append(Chunk(None, line))
            continue
        obj = _jsonl_object(line, n)
        columns.update(dict.fromkeys(obj))
        chunks.append(Chunk(id_text(obj.get(id_column)) or f"\0line{n}", line, obj))
    return RecordFile("jsonl", "", chunks, list(columns))


def _jsonl_object(line: str, n: int) -> dict[str, Any]:
    """Line `n` of a JSONL file as its object; a line that is not a JSON object is a RecordError naming it."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise RecordError(f"line {n}: not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise RecordError(f"line {n}: a JSONL record must be an object, got {type(obj).__name__}")
    return obj


def _lines(text: str) -> list[str]:
    """JSON lines end at "\n" only (str.splitlines would also cut at U+2028, U+0085 and others inside a string)."""
    parts = text.split("\n")
    lines = [p + "\n" for p in parts[:-1]]
    return lines + [parts[-1]] if parts[-1] else lines


@dataclass
class Found:
    """A record `scan` kept: its position (as `RecordFile.records` numbers it), where its text starts, its chunk."""

    position: int
    start: int
    chunk: Chunk


def scan(data: bytes, fmt: str, id_column: str, keep: Callable[[dict[str, Any]], bool],
         needle: str | None = None) -> tuple[str, list[str], list[Found]]:
    """The file's text, its columns (CSV: the header; JSONL: the keys of the kept records) and the records `keep`
    accepts (their fields), in file order, parsing no more than it must: a JSONL line without a backslash that does
    not contain `needle` is never decoded, a CSV record without a cell equal to `needle` never becomes a dict
    (None: every record is looked at), as `keep` could not accept them."""
    text = data.decode(ENCODING, ERRORS)
    return (text, *(_scan_csv(text, id_column, keep, needle) if fmt == "csv" else
                    _scan_jsonl(text, id_column, keep, needle)))


def csv_header(data: bytes) -> list[str]:
    """A CSV file's header (its first non-blank record), decoding no more of the file than it needs."""
    for size in (1 << 16, len(data)):
        head = data if size >= len(data) else data[:data.find(b"\n", size) + 1 or len(data)]
        source = io.StringIO(head.decode(ENCODING, ERRORS), newline="")
        for cells in csv.reader(iter(source.readline, "")):
            if cells:
                if source.tell() < len(source.getvalue()) or head is data:  # the header ended inside `head`
                    return [c.lstrip("\ufeff") if i == 0 else c for i, c in enumerate(cells)]
                break
        if head is data:
            return []
    return []


def _scan_jsonl(text: str, id_column: str, keep: Callable[[dict[str, Any]], bool],
                needle: str | None) -> tuple[list[str], list[Found]]:
    found, columns = [], {}
    for n, at, line in _jsonl_lines(text, needle):
        if not line.strip(_WS):
            continue
        obj = _jsonl_object(line, n)
        if keep(obj):
            columns.update(dict.fromkeys(obj))
            found.append(Found(n - 1, at, Chunk(id_text(obj.get(id_column)) or f"\0line{n}", line, obj)))
    return list(columns), found


def _jsonl_lines(text: str, needle: str | None) -> Iterator[tuple[int, int, str]]:
    """(1-based line number, start, line) of every line, or (`needle`) of the lines holding `needle` or a backslash
    only, found by searching the text (no per-line work for the others)."""
    if needle is None:
        at = 0
        for n, line in enumerate(_lines(text), start=1):
            yield n, at, line
            at += len(line)
        return
    spans = set()
    for pattern in (needle, "\\"):
        i = text.find(pattern)
        while i >= 0:
            start, end = text.rfind("\n", 0, i) + 1, text.find("\n", i)
            end = len(text) if end < 0 else end + 1
            spans.add((start, end))
            i = text.find(pattern, end)
    n, last = 1, 0
    for start, end in sorted(spans):
        n += text.count("\n", last, start)
        last = start
        yield n, start, text[start:end]


def _scan_csv(text: str, id_column: str, keep: Callable[[dict[str, Any]], bool],
              needle: str | None) -> tuple[list[str], list[Found]]:
    """The csv module reads every record (its line count says which lines each one spans); only a record with a
    cell equal to `needle` (every record when None) becomes a dict for `keep`."""
    lines = io.StringIO(text, newline="").readlines()
    ends = list(accumulate(map(len, lines)))
    reader = csv.reader(lines)
    header: list[str] | None = None
    found, first, position = [], 0, 0
    for n, cells in enumerate(reader, start=1):
        first, last = reader.line_num, first  # this record is lines[last:first]
        if header is None:
            if cells:
                header = [c.lstrip("\ufeff") if i == 0 else c for i, c in enumerate(cells)]
            continue
        position += 1
        if not cells or (needle is not None and needle not in cells):
            continue
        row = dict(zip(header, cells))
        if keep(row):
            raw = lines[last] if first == last + 1 else "".join(lines[last:first])
            found.append(Found(position - 1, ends[last - 1] if last else 0,
                               Chunk(id_text(row.get(id_column)) or f"\0row{n}", raw, row)))
    return header or [], found


def cut(text: str, gone: Sequence[Found]) -> str:
    """`text` without the records `gone` (found in this very text by `scan`), every other byte as it was."""
    parts, at = [], 0
    for f in sorted(gone, key=lambda f: f.start):
        parts.append(text[at:f.start])
        at = f.start + len(f.chunk.text)
    parts.append(text[at:])
    return "".join(parts)


def without(rf: RecordFile, ids: set[str]) -> RecordFile:
    """The file with the records of `ids` left out (every other byte as it was)."""
    return RecordFile(rf.fmt, rf.head, [c for c in rf.chunks if c.id not in ids], rf.columns)


def put_back(rf: RecordFile, restored: Sequence[tuple[int, str, str]], absent: set[int]) -> RecordFile:
    """The file with archived records (position, id, text) back at their positions.

    `absent` holds the original positions of every archived record of this file that is not in it
    now (restored ones included): the chunks in the file now take the other positions, in order,
    so each restored record lands where it was, also when only some are restored. Records added
    since the archive was made stay after the others.
    """
    taken = sorted(absent)
    where: list[int] = []
    p = t = 0
    for _ in rf.chunks:
        while t < len(taken) and taken[t] == p:
            p, t = p + 1, t + 1
        where.append(p)
        p += 1
    placed = [*zip(where, rf.chunks), *((pos, Chunk(i, text)) for pos, i, text in restored)]
    return RecordFile(rf.fmt, rf.head, [c for _, c in sorted(placed, key=lambda x: x[0])], rf.columns)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def _csv_line(cells: Sequence[str], eol: str) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator=eol).writerow(cells)
    return buf.getvalue()


def _split_eol(text: str) -> tuple[str, str]:
    body = text.rstrip("\r\n")
    return body, text[len(body):]


def set_fields(rf: RecordFile, values: dict[str, dict[str, Any]]) -> RecordFile:
    """The file with fields set on the records named in `values` (id -> {column: value}).

    JSONL: each named record gets its keys set in its own text (an existing key's value replaced in
    place, a new key appended before the closing brace); other records are untouched. CSV: a new
    column is appended to the header and to every record (empty where not named); a named record
    whose existing cell changes is written again with the csv module (its other cells' values kept).
    """
    names = list(dict.fromkeys(k for v in values.values() for k in v))
    if rf.fmt == "jsonl":
        chunks = [Chunk(c.id, _json_set(c.text, values[c.id]), c.fields) if c.id in values else c for c in rf.chunks]
        return RecordFile(rf.fmt, rf.head, chunks, [*rf.columns, *(n for n in names if n not in rf.columns)])
    new = [n for n in names if n not in rf.columns]
    header = [*rf.columns, *new]
    head = rf.head
    if new:
        body, eol = _split_eol(head)
        head = body + "," + _csv_line(new, eol)
    chunks = []
    for c in rf.chunks:
        if c.id is None:
            chunks.append(c)
            continue
        body, eol = _split_eol(c.text)
        mine = values.get(c.id, {})
        if any(k in rf.columns for k in mine):
            row = {**c.fields, **{k: _cell(v) for k, v in mine.items()}}
            text = _csv_line([row.get(h, "") for h in header], eol or "\n")
        elif new:
            text = body + "," + _csv_line([_cell(mine.get(n)) for n in new], eol)
        else:
            text = c.text
        chunks.append(Chunk(c.id, text, c.fields))
    return RecordFile(rf.fmt, head, chunks, header)


def _json_spans(line: str) -> tuple[dict[str, tuple[int, int]], int]:
    """The spans of a JSON object line's top-level values (key -> (start, end)) and its closing brace's index."""
    i = len(line) - len(line.lstrip(_WS))
    if line[i:i + 1] != "{":
        raise RecordError("not a JSON object")
    spans: dict[str, tuple[int, int]] = {}
    i += 1
    while True:
        while line[i] in _WS:
            i += 1
        if line[i] == "}":
            return spans, i
        if line[i] == ",":
            i += 1
            continue
        key, i = json.decoder.scanstring(line, i + 1)  # type: ignore[attr-defined]
        while line[i] in _WS + ":":
            i += 1
        _, end = _DECODER.raw_decode(line, i)
        spans[key] = (i, end)
        i = end


def _json_set(line: str, fields: dict[str, Any]) -> str:
    """`line` with `fields` set: values replaced in place (last key first, so spans stay valid), new keys appended."""
    spans, close = _json_spans(line)
    new = [(k, v) for k, v in fields.items() if k not in spans]
    if new:
        empty = not spans
        add = ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}" for k, v in new)
        line = line[:close] + ("" if empty else ", ") + add + line[close:]
    for k in sorted((k for k in fields if k in spans), key=lambda k: spans[k][0], reverse=True):
        start, end = spans[k]
        line = line[:start] + json.dumps(fields[k], ensure_ascii=False) + line[end:]
    return line


def serialise(fmt: str, columns: Sequence[str], row: dict[str, Any]) -> str:
    """A record written anew (only for archives made before records kept their text)."""
    if fmt == "jsonl":
        return json.dumps({k: v for k, v in row.items() if v is not None}, ensure_ascii=False) + "\n"
    return _csv_line([_cell(row.get(c)) for c in columns], "\n")
