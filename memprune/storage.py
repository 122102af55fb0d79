"""Where a user's files live: a local path or an object-storage URI, resolved once to a pyarrow filesystem.

`location(value)` turns what a user gave (`./runs/a`, `file:///data/x`, `s3://bucket/prefix`,
`gs://...`, `abfs://...`) into a `Location`: the pyarrow filesystem, the path on it and the URI
to show. pyarrow's own filesystems serve s3, gs and abfs (credentials and endpoints from the
standard environment: `AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, ... for S3); fsspec serves any
other scheme it has an implementation installed for. Everything else is one `StorageError`
line naming the value and what is known.

Local paths behave exactly as before (`Location.local`), so callers keep their `Path` code for
them and reach for the filesystem only where a URI may appear. `fetch_dir` brings a small
remote directory (a scorer artifact) to this node once, cached by its listing.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memprune.errors import MemPruneError

SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+)://")
BROKEN = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/(?!/)")  # s3:/b/x: what a Path makes of s3://b/x
PYARROW = frozenset({"s3", "gs", "gcs", "abfs", "abfss", "hdfs", "file"})  # schemes pyarrow serves itself
CACHE_ENV = "MEMPRUNE_CACHE_DIR"


class StorageError(MemPruneError):
    """A location that cannot be used: unknown scheme, missing bucket or credentials, unreadable object."""


def is_uri(value: str | os.PathLike[str]) -> bool:
    """True for `scheme://...` (a storage URI; `file://` included), False for a plain local path."""
    return bool(SCHEME.match(str(value)))


@dataclass(frozen=True)
class Location:
    """A file or directory on a filesystem: `fs` (pyarrow), `path` on it, `uri` as the user should see it."""

    fs: Any
    path: str
    uri: str
    local: bool

    def __str__(self) -> str:
        return self.uri

    def __truediv__(self, name: str) -> "Location":
        return self.join(name)

    def join(self, *names: str) -> "Location":
        tail = "/".join(n.strip("/") for n in names if n)
        path = f"{self.path.rstrip('/')}/{tail}" if tail else self.path
        uri = f"{self.uri.rstrip('/')}/{tail}" if tail else self.uri
        return Location(self.fs, path, uri, self.local)

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    @property
    def parent(self) -> "Location":
        path, uri = self.path.rstrip("/").rsplit("/", 1)[0], self.uri.rstrip("/").rsplit("/", 1)[0]
        return Location(self.fs, path, uri, self.local)

    def as_path(self) -> Path:
        """The local path (only for `local` locations)."""
        if not self.local:
            raise StorageError(f"{self.uri}: not a local path")
        return Path(self.path)

    def _info(self) -> Any:
        try:
            return self.fs.get_file_info(self.path)
        except OSError as exc:
            raise StorageError(f"{self.uri}: {_reason(exc)}") from None

    def exists(self) -> bool:
        from pyarrow import fs

        return self._info().type != fs.FileType.NotFound

    def is_file(self) -> bool:
        from pyarrow import fs

        return self._info().type == fs.FileType.File

    def is_dir(self) -> bool:
        from pyarrow import fs

        return self._info().type == fs.FileType.Directory

    def stamp(self) -> tuple[int, int | None]:
        """(size in bytes, modification time in ns) of a file, from one lookup."""
        info = self._info()
        return int(info.size or 0), info.mtime_ns

    def read_bytes(self) -> bytes:
        try:
            with self.fs.open_input_stream(self.path) as fh:
                return fh.read()
        except FileNotFoundError:
            raise StorageError(f"{self.uri}: no such file") from None
        except OSError as exc:
            raise StorageError(f"{self.uri}: {_reason(exc)}") from None

    def read_text(self) -> str:
        return self.read_bytes().decode("utf-8")

    def write_bytes(self, data: bytes) -> None:
        """Write the whole file: atomically (temp + rename) on a local disk, one PUT on object storage."""
        if self.local:  # temp + rename, as memprune.io's atomic writes (which sit above this module)
            target = Path(self.path)
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            try:
                tmp.write_bytes(data)
                os.replace(tmp, target)
            finally:
                tmp.unlink(missing_ok=True)
            return
        try:
            with self.fs.open_output_stream(self.path) as fh:
                fh.write(data)
        except OSError as exc:
            raise StorageError(f"{self.uri}: cannot write: {_reason(exc)}") from None

    def write_text(self, text: str) -> None:
        self.write_bytes(text.encode("utf-8"))

    def files(self) -> dict[str, int]:
        """Every file below this directory: relative path -> size (empty when there is none)."""
        from pyarrow import fs

        try:
            infos = self.fs.get_file_info(fs.FileSelector(self.path, recursive=True, allow_not_found=True))
        except OSError as exc:
            raise StorageError(f"{self.uri}: cannot list: {_reason(exc)}") from None
        root = self.path.rstrip("/") + "/"
        return {i.path[len(root):]: int(i.size or 0) for i in infos
                if i.type == fs.FileType.File and i.path.startswith(root)}

    def fetch_missing(self, target: Path, skip: tuple[str, ...] = ()) -> None:
        """Copy every file below this directory that the local directory `target` lacks into it, each written whole;
        files whose relative path starts with one of `skip` are left out."""
        for name in self.files():
            if not name.startswith(skip) and not (target / name).is_file():
                location(str(target / name)).write_bytes((self / name).read_bytes())

    def delete(self) -> None:
        """Remove this file or directory (and everything below it); nothing when absent."""
        from pyarrow import fs

        info = self._info()
        try:
            if info.type == fs.FileType.Directory:
                self.fs.delete_dir(self.path)
            elif info.type == fs.FileType.File:
                self.fs.delete_file(self.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise StorageError(f"{self.uri}: cannot delete: {_reason(exc)}") from None

    def copy_to(self, target: "Location") -> None:
        """Copy this file or directory to `target`: within one filesystem file by file with its own copy (server-side
        on object storage, so no byte passes through this process); across filesystems through this process."""
        from pyarrow import fs

        try:
            if not same_fs(self, target):
                fs.copy_files(self.path, target.path, source_filesystem=self.fs, destination_filesystem=target.fs)
            elif self.is_dir():
                for name in self.files():
                    if target.local:
                        target.fs.create_dir((target / name).parent.path, recursive=True)
                    self.fs.copy_file((self / name).path, (target / name).path)
            else:
                self.fs.copy_file(self.path, target.path)
        except OSError as exc:
            raise StorageError(f"{self.uri} -> {target.uri}: cannot copy: {_reason(exc)}") from None

    def check_reachable(self) -> None:
        """Fail with one line when the bucket (or container) does not exist or cannot be listed with these
        credentials; nothing to check on a local disk."""
        if self.local:
            return
        from pyarrow import fs

        bucket = self.path.split("/", 1)[0]
        try:
            info = self.fs.get_file_info(bucket)
        except OSError as exc:
            raise StorageError(f"{self.uri}: {_reason(exc)}") from None
        if info.type == fs.FileType.NotFound:
            raise StorageError(f"{self.uri}: bucket {bucket!r} does not exist (or these credentials cannot see it)")


def directory(value: str | os.PathLike[str], what: str = "--data") -> "Path | Location":
    """An input directory as its readers take it: a local one as a `Path` (their `Path` code is unchanged), a URI as
    its `Location` (read through its filesystem; `/`, `is_file`, `exists` as a Path has them), its bucket checked
    (one line when it does not exist or these credentials cannot see it)."""
    loc = location(value, what)  # a URI a Path would break (s3:/b/x) is one line here
    if loc.local:
        return Path(loc.path) if is_uri(value) else Path(value)
    loc.check_reachable()
    return loc


def canonical(value: str | os.PathLike[str]) -> str:
    """One spelling of a location for every node: an absolute local path, or the URI."""
    loc = location(value)
    return loc.path if loc.local else loc.uri


def object_store_options(value: str) -> dict[str, str]:
    """Storage options for libraries with their own object-store client (Lance): the S3 endpoint, region and keys
    from the same standard environment pyarrow reads (`AWS_ENDPOINT_URL`, `AWS_DEFAULT_REGION`, ...); empty for
    a local path and for other schemes (their clients read their own environment)."""
    if not str(value).lower().startswith("s3://"):
        return {}
    env = os.environ
    options = {"endpoint": env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL"),
               "region": env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION"),
               "access_key_id": env.get("AWS_ACCESS_KEY_ID"), "secret_access_key": env.get("AWS_SECRET_ACCESS_KEY"),
               "session_token": env.get("AWS_SESSION_TOKEN")}
    if (options["endpoint"] or "").startswith("http://"):
        options["allow_http"] = "true"
    return {k: v for k, v in options.items() if v}


def same_fs(a: Location, b: Location) -> bool:
    """Two locations on one filesystem (same kind and options): a server-side copy or a prefix check applies."""
    return a.fs is b.fs or (type(a.fs) is type(b.fs) and a.fs == b.fs)


def _reason(exc: BaseException) -> str:
    """pyarrow's error in one line, with the fix for the common ones."""
    text = " ".join(str(exc).split())
    low = text.lower()
    if any(w in low for w in ("credentials", "access denied", "access_denied", "accessdenied", "invalidaccesskeyid",
                              "signaturedoesnotmatch")):
        return (f"{text} (credentials come from the standard environment: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or "
                "AWS_PROFILE for S3, GOOGLE_APPLICATION_CREDENTIALS for GCS; AWS_ENDPOINT_URL for an S3-compatible "
                "server)")
    return text


def location(value: str | os.PathLike[str] | Location, what: str = "path") -> Location:
    """Resolve a local path or a storage URI once (see the module docstring); `what` names it in errors."""
    if isinstance(value, Location):
        return value
    raw = str(value)
    broken = BROKEN.match(raw)
    if broken and not SCHEME.match(raw) and len(broken.group(1)) > 1:
        raise StorageError(f"{what} {raw}: looks like a URI with one slash; write {broken.group(1)}://...")
    m = SCHEME.match(raw)
    if m is None:
        from pyarrow import fs

        path = os.path.abspath(os.path.expanduser(raw))
        return Location(fs.LocalFileSystem(), path, raw, True)
    scheme = m.group(1).lower()
    if scheme == "file":
        from pyarrow import fs

        path = raw[len("file://"):]
        return Location(fs.LocalFileSystem(), os.path.abspath(path or "/"), raw, True)
    if scheme in PYARROW:
        try:
            filesystem, path = _from_uri(raw)
        except (OSError, ValueError) as exc:
            raise StorageError(f"{what} {raw}: {_reason(exc)}") from None
        return Location(filesystem, path.rstrip("/"), raw.rstrip("/"), False)
    return _fsspec_location(raw, scheme, what)


@functools.lru_cache(maxsize=256)
def _from_uri(raw: str) -> tuple[Any, str]:
    """pyarrow's filesystem for a URI, made once per process: Ray Data's read tasks resolve the same files' URIs
    block after block, and each new S3 filesystem is a new client."""
    from pyarrow import fs

    return fs.FileSystem.from_uri(raw)


def _fsspec_location(raw: str, scheme: str, what: str) -> Location:
    known = ", ".join(sorted(PYARROW)) + ", or a local path"
    try:
        import fsspec
        from pyarrow.fs import FSSpecHandler, PyFileSystem
    except ImportError:
        raise StorageError(f"{what} {raw}: unknown storage scheme {scheme!r} (known: {known})") from None
    if scheme not in fsspec.available_protocols():
        raise StorageError(f"{what} {raw}: unknown storage scheme {scheme!r} (known: {known}; fsspec serves others "
                           "once their package is installed)")
    try:
        filesystem, path = fsspec.core.url_to_fs(raw)
    except (ImportError, ValueError) as exc:
        raise StorageError(f"{what} {raw}: scheme {scheme!r} needs a package fsspec cannot import: "
                           f"{' '.join(str(exc).split())}") from None
    return Location(PyFileSystem(FSSpecHandler(filesystem)), path.rstrip("/"), raw.rstrip("/"), False)


def cache_root() -> Path:
    """This node's cache of fetched artifacts: $MEMPRUNE_CACHE_DIR, else ~/.cache/memprune (else a temp dir)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    home = Path.home() / ".cache" / "memprune"
    try:
        home.mkdir(parents=True, exist_ok=True)
        return home
    except OSError:
        return Path(tempfile.gettempdir()) / "memprune-cache"


def fetch_dir(value: str | os.PathLike[str] | Location, what: str = "artifact", skip: tuple[str, ...] = ()) -> Path:
    """A local directory with the files of `value`: the path itself when local; else a copy in this node's cache,
    fetched once and reused while the remote listing (names and sizes) is unchanged. Files whose relative path
    starts with one of `skip` (e.g. `ray/`, a run's Ray Train checkpoints) are left out."""
    loc = location(value, what)
    if loc.local:
        return Path(loc.path)
    loc.check_reachable()
    listing = {n: size for n, size in loc.files().items() if not n.startswith(skip)} if skip else loc.files()
    if not listing:
        raise StorageError(f"{what} {loc.uri}: no such directory (no files under it)")
    key = hashlib.sha256(repr((loc.uri, sorted(listing.items()))).encode()).hexdigest()[:20]
    target = cache_root() / "artifacts" / key
    if target.is_dir() and all((target / n).is_file() and (target / n).stat().st_size == s for n, s in listing.items()):
        return target
    tmp = target.parent / f".{key}.{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        for name, _ in sorted(listing.items()):
            dest = tmp / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(loc.join(name).read_bytes())
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if target.is_dir():  # another process on this node fetched it meanwhile
            return target
        raise
    return target
