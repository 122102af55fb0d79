"""The shared audit archive: write, read back (all or by id), restore through a registered store kind."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from memprune.archive import ArchiveError, read_archive, read_ids, register_restorer, restore, write_archive


def _records() -> pa.Table:
    return pa.table({"id": ["a", "b", "c"], "text": ["x", "y", "z"], "vector": [[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]],
                     "memprune_score": [0.1, 0.2, 0.3], "memprune_reason": ["below_threshold", "duplicate", "over_top_k"],
                     "memprune_duplicate_of": [None, "c", None]})


def test_write_read_and_restore_by_id(tmp_path: Path) -> None:
    d = write_archive(tmp_path / "arch", _records(), id_column="id", store={"kind": "test-kind", "path": "s"},
                      fingerprint="f" * 16)
    whole = read_archive(d)
    assert whole.records.equals(_records()) and whole.manifest["fingerprint"] == "f" * 16
    assert [json.loads(ln)["id"] for ln in (d / "archive.jsonl").read_text().splitlines()] == ["a", "b", "c"]
    (tmp_path / "ids.txt").write_text("# two of them\nc\n\na\n")
    assert read_archive(d, read_ids(tmp_path / "ids.txt")).records.column("id").to_pylist() == ["a", "c"]
    with pytest.raises(ArchiveError, match="1 id\\(s\\) not in the archive, first 'nope'"):
        read_archive(d, ["a", "nope"])

    got: list[list[str]] = []
    register_restorer("test-kind", lambda a, opts: got.append(a.records.column(a.id_column).to_pylist()) or {"n": 1})
    assert restore(d, ["b"]) == {"n": 1} and got == [["b"]]


def test_bad_archives_fail_with_the_directory_named(tmp_path: Path) -> None:
    with pytest.raises(ArchiveError, match="not an archive"):
        read_archive(tmp_path)
    with pytest.raises(ArchiveError, match="lack column 'memprune_reason'"):
        write_archive(tmp_path / "a", _records().drop_columns(["memprune_reason"]), id_column="id",
                      store={"kind": "k"}, fingerprint="f")
    d = write_archive(tmp_path / "b", _records(), id_column="id", store={"kind": "unknown-kind"}, fingerprint="f")
    with pytest.raises(ArchiveError, match="no restorer for store kind 'unknown-kind'"):
        restore(d)
