"""A step's output directory or prefix: checked before any work (`check_out`, `check_out_location`,
`check_out_outside`), written as one `OutputSet` committed together with a marker (`MARKER`), and read only once
committed (`check_committed`). Local directories and object storage alike (see `OutputSet`)."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

from memprune.errors import MemPruneError
from memprune.io import MARKER, TEMP, file_size, clean_stale, temp_name, write_json

URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:/")  # s3://b/x, and s3:/b/x as a Path makes of it


def check_out(out: str | os.PathLike[str], step: str) -> Path:
    """`out` as a Path, refused up front (before any work) when it is a URI, or exists and is not a directory.

    The steps that write object storage check their `out` with `check_out_location` instead."""
    if URI.match(str(out)):
        raise MemPruneError(f"--out {out}: object-storage outputs (URIs) are not supported by the {step} step yet; "
                            "give a local directory or a shared filesystem path")
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise MemPruneError(f"{p}: is a file; the {step} output directory (--out) must be a directory")
    return p


SCRATCH = (".staging-", ".work/", "ray/")  # what a run puts under a URI `out` before its first commit


def check_out_location(out: str | os.PathLike[str], step: str) -> Any:
    """`out` (a local directory or a storage URI) as a `memprune.storage.Location`, checked before any work: a local
    one as `check_out` does; a URI's bucket must exist; a directory or prefix that holds files must be a memprune
    output (its marker), or hold only what a run leaves before its first commit (`SCRATCH`, temporary names)."""
    from memprune.storage import location

    loc = location(out, "--out")
    if loc.local:
        path = check_out(loc.path, step)
        names = sorted(e.name + ("/" if e.is_dir() else "") for e in path.iterdir()) if path.is_dir() else []
        foreign = [n for n in names if not n.startswith(SCRATCH) and not TEMP.match(n.rstrip("/"))]
        if foreign and MARKER not in names:
            raise MemPruneError(f"--out {path}: holds {len(foreign)} entr{'y' if len(foreign) == 1 else 'ies'} (e.g. "
                                f"{foreign[0]}) but no {MARKER}: not a memprune output, whose files it would overwrite; "
                                "give an empty or new directory")
        return loc
    loc.check_reachable()
    if loc.is_file():
        raise MemPruneError(f"--out {loc}: is an object, not a prefix; the {step} output must be a prefix")
    files = loc.files()
    if files and MARKER not in files and not all(n.startswith(SCRATCH) for n in files):
        first = min(files)
        raise MemPruneError(f"--out {loc}: holds {len(files)} object(s) (e.g. {first}) but no {MARKER}: not a memprune "
                            "output; give an empty or new prefix")
    return loc


def check_out_outside(out: str | os.PathLike[str] | Any, location: str, what: str) -> None:
    """Refuse an output directory (or URI prefix) inside (or equal to) the store it reads: the store would read
    memprune's own files."""
    from memprune.storage import location as resolve, same_fs

    o, here = resolve(out), resolve(location)
    if o.local != here.local:
        return
    if not o.local:
        inside = same_fs(o, here) and (o.path + "/").startswith(here.path.rstrip("/") + "/")
    elif not Path(here.path).exists():
        return
    else:
        a, b = Path(o.path).resolve(), Path(here.path).resolve()
        inside = a == b or b in a.parents
    if inside:
        raise MemPruneError(f"--out {out}: inside the {what} {location}; memprune would read its own outputs as "
                            "store records (and an apply would delete them). Put --out outside the store")


class OutputSet:
    """The outputs of one step run, committed together.

    Files are written into a staging directory inside `out` (`path(name)`); when the block succeeds
    they are moved into `out` and the marker `out/.memprune.json` records the step and each file's
    size. A failure before that leaves the previous outputs untouched; a crash during the moves
    leaves the marker in the state `committing`, which readers refuse (`check_committed`).

    `out` may be a storage URI, where there is no rename: the driver's small files are staged in a
    local temporary directory (`path(name)`), the workers write big tables to a unique staging
    prefix inside `out` (`target(name)`); the commit then marks the set `committing`, copies every
    output to its final name (server-side), removes the staging prefix and marks it `done` with the
    sizes, so a reader accepts a set only once every file of it is in place. A crashed run's staging
    prefix is removed by the next run into `out`.
    """

    def __init__(self, out: str | os.PathLike[str], step: str) -> None:
        from memprune.storage import location

        self.loc = location(out, "--out")
        self.remote = not self.loc.local
        self.step = step
        self.remote_staging = self.loc / f".staging-{uuid.uuid4().hex[:12]}" if self.remote else None
        if not self.remote:
            self.out = Path(str(out).removeprefix("file://"))
            self.staging = self.out / temp_name("staging")

    def __enter__(self) -> "OutputSet":
        if self.remote:
            check_out_location(self.loc.uri, self.step)
            for name in {n.split("/", 1)[0] for n in self.loc.files()}:  # what crashed runs left
                if name.startswith(".staging-"):
                    (self.loc / name).delete()
            self.out = Path(tempfile.mkdtemp(prefix="memprune-out-"))  # the driver's files, uploaded at the commit
            self.staging = self.out / temp_name("staging")
            self.staging.mkdir()
            return self
        check_out(self.out, self.step)
        self._created = next((p for p in reversed([self.out, *self.out.parents]) if not p.exists()), None)
        self.out.mkdir(parents=True, exist_ok=True)
        clean_stale(self.out)
        self.staging.mkdir()
        return self

    def path(self, name: str) -> Path:
        """Where to write output `name` (a file or a directory) on this machine during the run."""
        return self.staging / name

    def target(self, name: str) -> Any:
        """Where workers write output `name` (a `Location`): the staging dir, or the staging prefix for a URI."""
        from memprune.storage import location

        return self.remote_staging / name if self.remote_staging is not None else location(self.staging / name)

    def final(self, name: str) -> str:
        """Where output `name` is once committed, as the user should see it (a path or a URI)."""
        return str(self.loc / name) if self.remote else str(self.out / name)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self.remote:
            try:
                if exc_type is None:
                    self._commit_remote()
            finally:
                shutil.rmtree(self.out, ignore_errors=True)
                if exc_type is not None and self.remote_staging is not None:
                    with contextlib.suppress(MemPruneError):
                        self.remote_staging.delete()
            return
        if exc_type is not None:  # nothing is committed; a directory this run created is removed again if empty
            shutil.rmtree(self.staging, ignore_errors=True)
            if self._created is not None and not any(f.is_file() for f in self._created.rglob("*")):
                shutil.rmtree(self._created, ignore_errors=True)
            return
        names = sorted(p.name for p in self.staging.iterdir())
        write_json(self.out / MARKER, {"step": self.step, "state": "committing", "files": names})
        for name in names:
            target = self.out / name
            if target.is_dir():
                old = self.out / temp_name(name)
                os.replace(target, old)
                os.replace(self.staging / name, target)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(self.staging / name, target)
        self.staging.rmdir()
        sizes = {n: file_size(self.out / n) for n in names}
        write_json(self.out / MARKER, {"step": self.step, "state": "done", "files": sizes,
                                       "finished": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")})

    def _commit_remote(self) -> None:
        from memprune.storage import location

        assert self.remote_staging is not None
        staged = {n.split("/", 1)[0] for n in self.remote_staging.files()}
        here = {p.name for p in self.staging.iterdir()}
        names = sorted(staged | here)
        marker = self.loc / MARKER
        marker.write_text(json.dumps({"step": self.step, "state": "committing", "files": names}, indent=2))
        for name in names:
            (self.loc / name).delete()
            source = self.remote_staging / name if name in staged else location(self.staging / name)
            source.copy_to(self.loc / name)
        self.remote_staging.delete()
        listing = self.loc.files()
        sizes = {n: sum(s for f, s in listing.items() if f == n or f.startswith(n + "/")) for n in names}
        marker.write_text(json.dumps({"step": self.step, "state": "done", "files": sizes,
                                      "finished": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")},
                                     indent=2))
