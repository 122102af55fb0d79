"""Resumable work: digests, fingerprinted work directories, resumable chunks, finished outputs.

A long stage cuts its work into deterministic pieces (shards, chunks, (stage, seed) runs) and
writes each one atomically when it is done, under a directory named by a fingerprint of
everything the result depends on. A rerun of the same command finds the finished pieces and
redoes only the rest; a changed input or setting gives another fingerprint, so stale pieces
are never trusted.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from memprune.errors import MemPruneError
from memprune.io import MARKER, atomic_path, write_json
from memprune.outputs import OutputSet, check_out_location


def digest(payload: Any) -> str:
    """SHA-256 hex digest of a JSON-able payload (key order independent; other values via `str`)."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode("utf-8")).hexdigest()


def file_digest(path: str | Path) -> str:
    """SHA-256 hex digest of a file's bytes (a local path or a URI), read in 1 MiB blocks."""
    from memprune.storage import is_uri, location

    h = hashlib.sha256()
    loc = location(path) if is_uri(path) else None
    with open(path, "rb") if loc is None else loc.fs.open_input_stream(loc.path) as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def table_digest(table: pa.Table, columns: Iterable[str]) -> str:
    """SHA-256 of the Arrow buffers of `columns` (content and layout of the given columns)."""
    h = hashlib.sha256()
    for col in columns:
        for chunk in table.column(col).chunks:
            for buf in chunk.buffers():
                if buf is not None:
                    h.update(buf)
    return h.hexdigest()


class WorkDir:
    """`OUT/.work/<fingerprint[:16]>/`: a manifest plus one atomically written file per finished piece.

    With a storage URI `out` the pieces are written on this node (its cache, `path`) and each finished one is
    uploaded to `OUT/.work/<fingerprint[:16]>/` (`keep`); a rerun on any node first fetches the pieces there, so
    it resumes as a local one does."""

    def __init__(self, out: str | Path, payload: dict[str, Any]) -> None:
        from memprune.storage import cache_root, location

        self.fingerprint = digest(payload)
        loc = location(out)
        self.remote = None if loc.local else loc.join(".work", self.fingerprint[:16])
        if self.remote is None:
            self.path = Path(str(out).removeprefix("file://")) / ".work" / self.fingerprint[:16]
        else:
            self.path = cache_root() / "work" / digest(self.remote.uri)[:16]
            self.remote.fetch_missing(self.path)
        self.path.mkdir(parents=True, exist_ok=True)
        manifest = self.path / "manifest.json"
        if manifest.exists():
            old = json.loads(manifest.read_text(encoding="utf-8"))
            if old.get("fingerprint") != self.fingerprint:
                raise MemPruneError(f"{manifest}: belongs to another run (fingerprint prefix clash); delete {self.path}")
        else:
            write_json(manifest, {"fingerprint": self.fingerprint, "payload": payload})
            self.keep(manifest)

    def __str__(self) -> str:
        return str(self.remote or self.path)

    def piece(self, kind: str, i: int, ext: str) -> Path:
        """The path of finished piece `i` of `kind` (e.g. `emb-00003.npy`)."""
        return self.path / f"{kind}-{i:05d}.{ext}"

    def keep(self, piece: Path) -> None:
        """A finished piece (written on this node) also goes to the URI `out`, where any rerun finds it."""
        if self.remote is not None:
            (self.remote / piece.name).write_bytes(piece.read_bytes())


def resumable_chunks(
    table: pa.Table,
    chunk_rows: int,
    work: WorkDir,
    fn: Callable[[pa.Table], pa.Table],
    schema: pa.Schema,
    desc: str,
    progress: bool = True,
    setup: Callable[[], None] | None = None,
) -> tuple[pa.Table, dict[str, Any]]:
    """`fn` over consecutive row chunks of `table`, each result saved atomically in `work`.

    A rerun reuses every chunk already saved and computes only the missing ones, so a killed
    long job resumes where it stopped. `setup` (e.g. starting Ray) runs once, only if work is left.
    """
    from tqdm import tqdm

    bounds = [(s, min(s + chunk_rows, table.num_rows)) for s in range(0, table.num_rows, chunk_rows)]
    paths = [work.piece("chunk", i, "parquet") for i in range(len(bounds))]
    pending = [i for i, p in enumerate(paths) if not p.exists()]
    if pending and setup is not None:
        setup()
    for i in tqdm(pending, desc=desc, unit="chunk", disable=not progress):
        a, b = bounds[i]
        result = fn(table.slice(a, b - a))
        with atomic_path(paths[i]) as tmp:
            pq.write_table(result, tmp)
        work.keep(paths[i])
    results = pa.concat_tables([pq.read_table(p, schema=schema) for p in paths]) if paths else schema.empty_table()
    return results, {"chunks": len(bounds), "reused": len(bounds) - len(pending), "work": str(work)}


def finished(summary: Path, fingerprint: str, needs: Iterable[str] = ()) -> dict[str, Any] | None:
    """The JSON summary of a finished piece of work with this fingerprint, or None.

    Finished means: `summary` exists, parses, records `fingerprint`, and every file named in
    `needs` (relative to its directory) exists. The summary is written last, so its presence
    with the right fingerprint says the whole piece was completed.
    """
    if not summary.is_file() or not all((summary.parent / n).exists() for n in needs):
        return None
    try:
        done = json.loads(summary.read_text(encoding="utf-8"))
    except ValueError:
        return None
    return done if isinstance(done, dict) and done.get("fingerprint") == fingerprint else None


def in_working_copy(uri: str, step: str, run: Callable[[Path], dict[str, Any]], leave: tuple[str, ...] = ()
                    ) -> dict[str, Any]:
    """Run a step that works in a local directory (`run(directory)`) against the storage URI `uri`, and commit its
    outputs there as one output set of `step`.

    The working copy is this node's (`cache_root()/<step>/<digest of the URI>`), started from what is committed at
    `uri`, so a rerun on any node reuses the finished pieces a run committed there. Every top-level entry of the
    working copy is committed except hidden ones (the local output set's marker and staging) and those named in
    `leave` (caches, Ray's own storage). The reports (every .json, .md and .yaml) and the returned summary name the
    URI, not the working copy."""
    from memprune.storage import cache_root

    out = check_out_location(uri, step)
    work = cache_root() / step / digest(out.uri)[:16]
    committed = out / MARKER
    if committed.is_file() and json.loads(committed.read_text()).get("state") == "done":
        out.fetch_missing(work, skip=(".", *(f"{name}/" for name in leave)))
    summary = run(work)
    shown = str(work)
    with OutputSet(out, step) as outputs:
        for entry in work.iterdir():
            if entry.name.startswith(".") or entry.name in leave:
                continue
            (shutil.copytree if entry.is_dir() else shutil.copy)(entry, outputs.path(entry.name))
        for report in [p for ext in ("json", "md", "yaml") for p in outputs.staging.rglob(f"*.{ext}")]:
            report.write_text(report.read_text(encoding="utf-8").replace(shown, out.uri), encoding="utf-8")
    result: dict[str, Any] = json.loads(json.dumps(summary).replace(shown, out.uri))
    return result
