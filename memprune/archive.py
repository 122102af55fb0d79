"""The audit archive of pruned records, and putting them back: one mechanism for every store kind.

A prune that drops records (`memprune prune --emit split` on a bullets store, `--apply` on an
external store) first writes every dropped record whole into an archive directory:

- `archive.parquet`: the records as the store gave them (every column, vectors included where the
  store has them) plus `memprune_score`, `memprune_reason`, `memprune_duplicate_of` and (prune archives) `memprune_superseded_by`;
- `archive.jsonl`: the same rows as JSON lines, for people and grep;
- `archive.json`: the manifest: format, the prune run's fingerprint, row count, the id column, and
  `store`, a JSON description of the store the records came from (its `kind` picks the restorer).

`restore(archive_dir, ids)` re-inserts archived records through the restorer registered for the
manifest's store kind (`register_restorer`), so each store package adds its own kind; the manifest's
`store.provider` names the memprune module that registers it, imported when no restorer is known yet.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from memprune.errors import MemPruneError
from memprune.io import check_committed, jsonable, write_json
from memprune.outputs import OutputSet

ARCHIVE_FORMAT = 1
SCORE, REASON, DUPLICATE_OF = "memprune_score", "memprune_reason", "memprune_duplicate_of"
SUPERSEDED_BY = "memprune_superseded_by"  # the bullet that superseded a record (reason superseded), else null
DECISION_COLUMNS = (SCORE, REASON, DUPLICATE_OF, SUPERSEDED_BY)  # what restore drops
REQUIRED_COLUMNS = (SCORE, REASON, DUPLICATE_OF)  # what every archive has (superseded_by: since supersession)


class ArchiveError(MemPruneError):
    """An archive that cannot be written, read or restored; the message names the directory."""


@dataclass(frozen=True)
class Archive:
    """An archive read back: its records (with the decision columns) and its manifest."""

    path: Path
    records: pa.Table
    manifest: dict[str, Any]

    @property
    def id_column(self) -> str:
        return str(self.manifest["id_column"])

    @property
    def store(self) -> dict[str, Any]:
        return dict(self.manifest["store"])


def write_archive(directory: str | Path, records: pa.Table, *, id_column: str, store: dict[str, Any],
                  fingerprint: str) -> str | Path:
    """Write `records` (with the decision columns) as an archive into `directory` (a path or a URI), committed as
    one set; returns `directory`."""
    missing = [c for c in (id_column, *REQUIRED_COLUMNS) if c not in records.column_names]
    if missing:
        raise ArchiveError(f"{directory}: archive records lack column {missing[0]!r}")
    if "kind" not in store:
        raise ArchiveError(f"{directory}: the archive's store description needs a 'kind'")
    manifest = {"format": ARCHIVE_FORMAT, "fingerprint": fingerprint, "rows": records.num_rows,
                "id_column": id_column, "store": jsonable(store)}
    with OutputSet(directory, "archive") as outputs:
        pq.write_table(records, outputs.path("archive.parquet"))
        with open(outputs.path("archive.jsonl"), "w", encoding="utf-8") as fh:
            for row in records.to_pylist():
                fh.write(json.dumps(jsonable(row), ensure_ascii=False) + "\n")
        write_json(outputs.path("archive.json"), manifest)
    return directory


def read_archive(directory: str | Path, ids: Iterable[str] | None = None) -> Archive:
    """An archive's records (all, or those with `ids`: every id must be in it) and its manifest. An archive on
    object storage is read from this node's copy (`storage.fetch_dir`)."""
    from memprune.storage import fetch_dir, is_uri

    path = fetch_dir(directory, "archive") if is_uri(directory) else Path(directory)
    manifest_path = path / "archive.json"
    if not manifest_path.is_file():
        raise ArchiveError(f"{directory}: not an archive (no archive.json)")
    check_committed(path / "archive.parquet")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArchiveError(f"{manifest_path}: not a readable archive manifest ({exc}); truncated or edited? nothing "
                           "was restored") from None
    if not isinstance(manifest, dict) or manifest.get("format") != ARCHIVE_FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise ArchiveError(f"{manifest_path}: archive format {got!r}, expected {ARCHIVE_FORMAT}")
    records_path = path / "archive.parquet"
    if not records_path.is_file():
        raise ArchiveError(f"{records_path}: missing; the archive's records are gone, nothing was restored")
    try:
        records = pq.read_table(records_path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise ArchiveError(f"{records_path}: cannot read as parquet ({str(exc).splitlines()[0]}); nothing was "
                           "restored") from None
    if records.num_rows != manifest.get("rows"):
        raise ArchiveError(f"{path}: archive.parquet has {records.num_rows} rows, the manifest says {manifest['rows']}")
    if ids is not None:
        wanted = [str(i) for i in ids]
        have = set(records.column(manifest["id_column"]).cast(pa.string()).to_pylist())
        absent = [i for i in wanted if i not in have]
        if absent:
            raise ArchiveError(f"{path}: {len(absent)} id(s) not in the archive, first {absent[0]!r}")
        records = records.filter(pc.is_in(records.column(manifest["id_column"]).cast(pa.string()),
                                          pa.array(sorted(set(wanted)), pa.string())))
    return Archive(path, records, manifest)


def read_ids(path: str | Path) -> list[str]:
    """Ids to restore from a file: one per line (blank lines and `#` comments skipped)."""
    p = Path(path)
    if not p.is_file():
        raise ArchiveError(f"{p}: no such ids file")
    return [ln.strip() for ln in p.read_text(encoding="utf-8").splitlines() if ln.strip() and not ln.startswith("#")]


Restorer = Callable[[Archive, dict[str, Any]], dict[str, Any]]
_RESTORERS: dict[str, Restorer] = {}


def register_restorer(kind: str, restorer: Restorer) -> None:
    """Make `restore` able to put records back into stores of `kind` (called by each store package)."""
    _RESTORERS[kind] = restorer


def restore(directory: str | Path, ids: Iterable[str] | None = None, **options: Any) -> dict[str, Any]:
    """Put archived records (all, or `ids`) back into the store they came from; returns the restorer's summary."""
    archive = read_archive(directory, ids)
    kind, provider = archive.store["kind"], str(archive.store.get("provider") or "")
    if kind not in _RESTORERS and provider.startswith("memprune."):  # the module that registers this kind
        importlib.import_module(provider)
    if kind not in _RESTORERS:
        raise ArchiveError(f"{archive.path}: no restorer for store kind {kind!r} (known: {', '.join(sorted(_RESTORERS))})")
    return _RESTORERS[kind](archive, options)
