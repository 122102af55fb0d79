"""One file of a `table` store, by format: the interface each format implements (`TableFile`), the formats by
suffix (`FILE_FORMATS`; `@register_format`), and the I/O they share (a whole read, an atomic whole replace).

`memprune.stores.table_parquet` (Parquet, filtered with its own schema and codec) and `memprune.stores.table_text`
(CSV and JSONL, edited record by record in their own text) implement it; `memprune.stores.table.TableStore` holds
one `TableFile` per file and never asks which format a file is. Adding a format is one module with one subclass.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa

from memprune.io import atomic_path
from memprune.storage import Location
from memprune.stores.config import StoreError

FILE, POSITION, RAW = "memprune_file", "memprune_position", "memprune_raw"
LOCATOR = (FILE, POSITION, RAW)  # where an archived record stood: its file, its position there, its exact text
BATCH = 65_536


class TableFile(ABC):
    """One file of a table store and what the store does with it. `fields`: the mapped field -> column names (id,
    text, group, time, pin), `mapping`: the store's mapping as `normalize` takes it."""

    suffixes: ClassVar[tuple[str, ...]] = ()
    may_lack_keys: ClassVar[bool] = False  # a file without records names no columns (JSONL)

    def __init__(self, path: Location, fields: dict[str, str], mapping: dict[str, str]) -> None:
        self.path, self.fields, self.mapping = path, fields, mapping

    @abstractmethod
    def columns(self, wanted: list[str]) -> list[str]:
        """The file's column names (enough of them to check that `wanted` are there)."""

    @abstractmethod
    def batches(self) -> Iterator[pa.RecordBatch]:
        """The mapped columns of every record, in batches (what `normalize` reads)."""

    @abstractmethod
    def group_batches(self, group: str) -> Iterator[pa.RecordBatch]:
        """The mapped columns of the records of `group` alone, found without reading the rest where the format
        allows."""

    @abstractmethod
    def fetch(self, wanted: set[str], group: str | None) -> pa.Table:
        """The whole records with ids in `wanted` (of `group` only, when given), each with its `POSITION` (and,
        where the format keeps them, its exact text, `RAW`)."""

    @abstractmethod
    def current(self, group: str, expected: dict[str, str]) -> tuple[dict[str, str | None], Any]:
        """The text hash of each record of `group` with an id in `expected` as the file now holds it, and what
        `cut` needs to delete from these very bytes."""

    @abstractmethod
    def cut(self, state: Any, gone: dict[str, str], now: dict[str, str | None]) -> None:
        """Delete, from what `current` read, the records of `gone` whose text is still the decided one."""

    @abstractmethod
    def delete(self, wanted: set[str]) -> int:
        """Delete the records with ids in `wanted`; how many went."""

    @abstractmethod
    def set_fields(self, by_id: dict[str, dict[str, Any]], values: pa.Table) -> int:
        """Set the named fields of the records in `by_id` (`values`: the same as a table with an `id` column)."""

    @abstractmethod
    def insert(self, rows: pa.Table, archived: pa.Table) -> None:
        """Put archived records (`rows`) back at their positions, among the file's archived records (`archived`) that
        it does not hold now (see `records.put_back`)."""

    def absent(self, present: set[str], archived: pa.Table) -> set[int]:
        """Positions of the file's archived records that the file does not hold now."""
        ids = archived.column(self.fields["id"]).cast(pa.string()).to_pylist()
        return {p for i, p in zip(ids, archived.column(POSITION).to_pylist()) if i not in present}


FILE_FORMATS: dict[str, type[TableFile]] = {}


def register_format(cls: type[TableFile]) -> type[TableFile]:
    """Class decorator: a file whose suffix is one of `cls.suffixes` is read and written by `cls`."""
    for suffix in cls.suffixes:
        FILE_FORMATS[suffix] = cls
    return cls


def table_file(path: Location, fields: dict[str, str], mapping: dict[str, str]) -> TableFile:
    """The `TableFile` of `path` by its suffix; an unknown suffix is one error."""
    suffix = Path(path.name).suffix
    cls = FILE_FORMATS.get(suffix.lower())
    if cls is None:
        raise StoreError(f"{path}: not a {', '.join(sorted({c.__name__.removesuffix('File') for c in FILE_FORMATS.values()}))} "
                         f"file (suffix {suffix or 'none'})")
    return cls(path, fields, mapping)


def read_bytes(path: Location) -> bytes:
    try:
        return Path(path.path).read_bytes() if path.local else path.read_bytes()
    except OSError as exc:
        raise StoreError(f"{path}: cannot read: {exc.strerror or exc}") from None


def replace(path: Location, data: bytes) -> None:
    """Replace a file of the store with `data` whole: temp file + rename keeping its mode and owner on a local disk,
    one PUT of the new object on object storage."""
    if not path.local:
        path.write_bytes(data)
        return
    try:
        with atomic_path(path.path, keep_mode=True) as tmp:
            tmp.write_bytes(data)
    except PermissionError as exc:  # an immutable or read-only file or directory: this file is left as it was
        raise StoreError(f"{path}: cannot replace it ({exc.strerror}: an immutable or read-only file or directory?); "
                         "it is unchanged; make it writable and rerun, which resumes") from None


def complement(n: int, absent: set[int]) -> np.ndarray:
    """The first `n` positions not in `absent`: where the records in a file now stood before the archived left."""
    return np.setdiff1d(np.arange(n + len(absent)), np.fromiter(absent, np.int64, len(absent)))[:n]
