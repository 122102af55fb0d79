"""Table stores (issue 28): an apply changes only the records the decision names, and a restore gives back
every record byte for byte, in its place. The property test drives the real apply (`apply_decision`: the
changed-store check, the archive, the deletes) and the real restore (`memprune.archive.restore`) over CSV,
JSONL and Parquet files with leading-zero ids, mixed key sets, odd times, unicode and embedded newlines."""

from __future__ import annotations

import csv
import io
import json
import os
import stat
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memprune.archive import read_archive, restore
from memprune.stores.apply import apply_decision
from memprune.stores.config import StoreError, StoreOptions
from memprune.stores.export import scan_current
from memprune.stores.table import TableStore

MAP = {"id": "id", "text": "text", "group": "user"}  # time: the optional default column "time"
TEXT = st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=30)
TIMES = st.sampled_from(["2024-05-01T10:00:00", "2024-05-01 10:00", "01/05/2024", "2024-05-01T10:00:00+02:00", "", "0"])


@st.composite
def record(draw, n: int) -> dict:
    """One memory: a leading-zero (or unicode) id, free text, a user, and keys that not every record has."""
    rec = {"id": draw(st.sampled_from([f"{n:04d}", f"u-{n}-é", f"{n:03d}\u00a0x"])), "text": draw(TEXT),
           "user": draw(st.sampled_from(["u1", "u2", "0007", "ü"]))}
    if draw(st.booleans()):
        rec["time"] = draw(TIMES)
    if draw(st.booleans()):
        rec["zip"] = draw(st.sampled_from(["02139", "00501", "1e5", "007"]))
    if draw(st.booleans()):
        rec["note"] = draw(TEXT)
    return rec


def _records(draw, size: int) -> list[dict]:
    return [draw(record(i)) for i in range(size)]


def write_store(path: Path, fmt: str, rows: list[dict], crlf: bool, spaced: bool) -> None:
    """Write the rows as a user's tool would: CSV by the csv module, JSONL by json.dumps (keys as each row has
    them), Parquet by pyarrow (absent keys null)."""
    keys = list(dict.fromkeys(k for r in rows for k in r)) or ["id", "text", "user"]
    if fmt == "csv":
        buf = io.StringIO(newline="")
        # The csv module leaves a lone CR unquoted under a "\n" terminator (a file no reader can split right),
        # so such a file is written fully quoted, as a careful tool would.
        lone_cr = not crlf and any("\r" in str(v) for r in rows for v in r.values())
        w = csv.DictWriter(buf, fieldnames=keys, lineterminator="\r\n" if crlf else "\n",
                           quoting=csv.QUOTE_ALL if lone_cr else csv.QUOTE_MINIMAL)
        w.writeheader()
        w.writerows(rows)
        path.write_bytes(buf.getvalue().encode())
    elif fmt == "jsonl":
        sep = (", ", ": ") if spaced else (",", ":")
        eol = "\r\n" if crlf else "\n"
        path.write_bytes("".join(json.dumps(r, ensure_ascii=not spaced, separators=sep) + eol for r in rows).encode())
    else:
        schema = pa.schema([(k, pa.string()) for k in keys])
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, compression="zstd")


def decide(store: TableStore, out: Path, keep: list[bool]) -> None:
    """A decision over the store as `memprune prune` writes it (id, hash, score, keep, reason), rejects kept."""
    normal = pa.concat_tables([pa.Table.from_batches([b]) for b in store.read()])
    rows = normal.to_pylist()
    decided = [r["reject"] is None for r in rows]
    flags = [k or not d for k, d in zip(keep, decided)]
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({
        "id": [r["id"] for r in rows], "group": [r["group"] for r in rows], "time": [r["time"] for r in rows],
        "text": [r["text"] for r in rows], "hash": [r["hash"] for r in rows],
        "score": pa.array([0.5 if d else None for d in decided], pa.float64()), "keep": flags,
        "reason": [None if f else "below_threshold" for f in flags], "duplicate_of": pa.nulls(len(rows), pa.string())}),
        out / "decision.parquet")


def parquet_state(path: Path) -> tuple[pa.Schema, list[dict]]:
    t = pq.read_table(path)
    return t.schema, t.to_pylist()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data(), fmt=st.sampled_from(["csv", "jsonl", "parquet"]), crlf=st.booleans(), spaced=st.booleans())
def test_apply_then_restore_gives_back_every_record_byte_for_byte(tmp_path_factory, data, fmt, crlf, spaced) -> None:
    d = tmp_path_factory.mktemp("store")
    rows = _records(data.draw, data.draw(st.integers(1, 12)))
    rows = list({r["id"]: r for r in rows}.values())
    path = d / f"mem.{fmt}"
    write_store(path, fmt, rows, crlf, spaced)
    os.chmod(path, 0o600)
    original = path.read_bytes()
    before = parquet_state(path) if fmt == "parquet" else None
    store = TableStore(str(path), MAP)
    keep = data.draw(st.lists(st.booleans(), min_size=len(rows), max_size=len(rows)))
    out = d / "out"
    decide(store, out, keep)
    result = apply_decision(store, out, {"store": {"fingerprint": "f"}}, StoreOptions(apply="delete"))
    dropped = {r["id"] for r, k in zip(rows, keep) if not k}
    assert result["deleted"] == len(dropped)
    # apply changed nothing but the dropped records: what is left is the original minus them, byte for byte
    _only_dropped_gone(path, fmt, before, original, dropped)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert {r["id"] for r in scan_current(store).to_pylist()} == {r["id"] for r in rows} - dropped
    # restore gives back the original file (Parquet: the same schema and rows, in order)
    if dropped:
        assert restore(out / "archive")["restored"] == len(dropped)
    if fmt == "parquet":
        assert parquet_state(path) == before
    else:
        assert path.read_bytes() == original
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    # restoring again does nothing
    if dropped:
        assert restore(out / "archive")["restored"] == 0


def _split_records(raw: bytes, fmt: str) -> tuple[bytes, list[tuple[str, bytes]]]:
    """(header, [(id, record bytes)]) of a file this test wrote, parsed independently of memprune."""
    if fmt == "jsonl":
        lines = [ln + b"\n" for ln in raw.split(b"\n")[:-1]]
        return b"", [(json.loads(ln)["id"], ln) for ln in lines]
    text = raw.decode()
    reader_lines: list[str] = []
    src = io.StringIO(text, newline="")

    def feed():
        for line in iter(src.readline, ""):
            reader_lines.append(line)
            yield line

    out: list[tuple[str, bytes]] = []
    header = b""
    for i, row in enumerate(csv.reader(feed())):
        chunk = "".join(reader_lines).encode()
        reader_lines.clear()
        if i == 0:
            header = chunk
        else:
            out.append((row[0], chunk))
    return header, out


def _only_dropped_gone(path: Path, fmt: str, before: Any, original: bytes, dropped: set[str]) -> None:
    """What is left of the store file is the original minus the dropped records, byte for byte (Parquet: schema and
    rows)."""
    if fmt == "parquet":
        schema, left = parquet_state(path)
        assert schema == before[0] and left == [r for r in before[1] if r["id"] not in dropped]
    else:
        header, lines = _split_records(original, fmt)
        assert path.read_bytes() == header + b"".join(line for rid, line in lines if rid not in dropped)


def test_partial_restores_put_each_record_back_in_its_place(tmp_path) -> None:
    path = tmp_path / "mem.csv"
    path.write_bytes(b"id,text,user,zip\n0001,Alice has a cat.,u1,02139\n0002,\"two\nlines, quoted\",u1,00501\n"
                     b"\n0003,Bob,u2,0\r\n0004,last without newline,u2,7")
    original = path.read_bytes()
    store = TableStore(str(path), {"group": "user"})
    decide(store, tmp_path / "out", [True, False, False, False])
    apply_decision(store, tmp_path / "out", {"store": {"fingerprint": "f"}}, StoreOptions(apply="delete"))
    assert path.read_bytes() == b"id,text,user,zip\n0001,Alice has a cat.,u1,02139\n\n"
    for ids in (["0004"], ["0002"], ["0003"]):
        restore(tmp_path / "out" / "archive", ids)
    assert path.read_bytes() == original


def test_jsonl_flags_edit_only_the_named_records_in_their_own_text(tmp_path) -> None:
    path = tmp_path / "mem.jsonl"
    lines = ['{"id": "0001", "text": "a", "user": "u", "ts": "2024-05-01T10:00:00"}\n',
             '{"id":"0002","text":"b","user":"u","n":1e5,"nested":{"x":[1,2]}}\n',
             '{"id": "0003", "text": null, "user": "u"}\n']
    path.write_text("".join(lines))
    store = TableStore(str(path), {"group": "user", "time": "ts"})
    store.set_fields(pa.table({"id": ["0001", "0002"], "memprune_keep": [True, False], "memprune_score": [0.5, 0.25]}))
    got = path.read_text().splitlines(keepends=True)
    assert got[0] == lines[0][:-2] + ', "memprune_keep": true, "memprune_score": 0.5}\n'
    assert got[1] == lines[1][:-2] + ', "memprune_keep": false, "memprune_score": 0.25}\n'
    assert got[2] == lines[2]  # not named: not touched (no keys added, no nulls)
    store.set_fields(pa.table({"id": ["0001"], "memprune_keep": [False], "memprune_score": [0.75]}))
    assert path.read_text().splitlines(keepends=True)[0] == \
        lines[0][:-2] + ', "memprune_keep": false, "memprune_score": 0.75}\n'


def test_an_edited_or_vanished_record_blocks_the_apply(tmp_path) -> None:
    """The changed-store check compares each record's text hash, not only the id set."""
    for change in ("edit", "vanish"):
        path = tmp_path / f"{change}.jsonl"
        path.write_text("".join(json.dumps({"id": f"{i:04d}", "text": f"t{i}", "user": "u"}) + "\n" for i in range(4)))
        store = TableStore(str(path), {"group": "user"})
        out = tmp_path / f"out-{change}"
        decide(store, out, [True, True, False, False])
        lines = path.read_text().splitlines(keepends=True)
        if change == "edit":  # a kept record edited by the user after the decision
            lines[0] = lines[0].replace('"t0"', '"t0 edited"')
        else:  # a kept record deleted by someone else
            del lines[1]
        path.write_text("".join(lines))
        before = path.read_bytes()
        with pytest.raises(StoreError, match="changed since the decision"):
            apply_decision(store, out, {"store": {"fingerprint": "f"}}, StoreOptions(apply="delete"))
        assert path.read_bytes() == before and not (out / "archive").exists()


def test_a_restore_into_a_csv_store_without_a_time_column_uses_the_archive_mapping(tmp_path) -> None:
    path = tmp_path / "mem.csv"
    path.write_text("id,text,user,zip\n0001,a,u1,02139\n0002,b,u1,02140\n")
    original = path.read_bytes()
    store = TableStore(str(path), {"group": "user"})
    decide(store, tmp_path / "out", [True, False])
    apply_decision(store, tmp_path / "out", {"store": {"fingerprint": "f"}}, StoreOptions(apply="delete"))
    archived = read_archive(tmp_path / "out" / "archive").records.to_pylist()
    assert [(r["id"], r["zip"]) for r in archived] == [("0002", "02140")]  # text in the archive too, not 2140
    restore(tmp_path / "out" / "archive")
    assert path.read_bytes() == original


def _group_decision(store: TableStore, group: str, keep: list[bool]) -> pa.Table:
    """`decide_group`'s table for `group` with the given keep flags (as a pruner returns it)."""
    from memprune.stores.group import group_table

    table = group_table(store, group)
    flags = keep[:table.num_rows] + [True] * max(0, table.num_rows - len(keep))
    return (table.append_column("score", pa.array([0.5] * table.num_rows, pa.float64()))
            .append_column("keep", pa.array(flags, pa.bool_()))
            .append_column("reason", pa.array([None if k else "below_threshold" for k in flags], pa.string()))
            .append_column("duplicate_of", pa.nulls(table.num_rows, pa.string())))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data(), fmt=st.sampled_from(["csv", "jsonl", "parquet"]), crlf=st.booleans(), spaced=st.booleans(),
       group=st.sampled_from(["u1", "u2", "0007", "ü"]))
def test_a_live_group_apply_then_restore_gives_back_every_byte(tmp_path_factory, data, fmt, crlf, spaced,
                                                               group) -> None:
    """Issue 27: the live path (`apply_group`: one group scanned for, archived, cut out of the file under its lock)
    keeps issue 28's guarantees: the group's read equals a whole read filtered, only the dropped records leave,
    and restore gives back the original bytes."""
    from memprune.stores.group import apply_group

    d = tmp_path_factory.mktemp("store")
    rows = list({r["id"]: r for r in _records(data.draw, data.draw(st.integers(1, 12)))}.values())
    path = d / f"mem.{fmt}"
    write_store(path, fmt, rows, crlf, spaced)
    original = path.read_bytes()
    before = parquet_state(path) if fmt == "parquet" else None
    store = TableStore(str(path), MAP)
    whole = pa.Table.from_batches(list(store.read()))
    assert pa.Table.from_batches(list(store.read_group(group)), schema=whole.schema) == \
        whole.filter(pa.compute.equal(whole.column("group"), group))
    decided = _group_decision(store, group, data.draw(st.lists(st.booleans(), min_size=12, max_size=12)))
    dropped = {i for i, k in zip(decided.column("bullet_id").to_pylist(), decided.column("keep").to_pylist()) if not k}
    done = apply_group(store, decided, d / "archive")
    assert done["deleted"] == len(dropped) and done["skipped"] == []
    _only_dropped_gone(path, fmt, before, original, dropped)
    if dropped:
        assert restore(d / "archive")["restored"] == len(dropped)
    assert (parquet_state(path) == before) if fmt == "parquet" else (path.read_bytes() == original)


def test_a_jsonl_group_scan_finds_every_spelling_of_its_group(tmp_path) -> None:
    """The JSONL scan skips a line undecoded only when it cannot hold the group: escaped, numeric, boolean and
    absent group values are found exactly as a whole read finds them."""
    lines = ['{"id": "a", "text": "t", "user": "ann"}', '{"id": "b", "text": "t", "user": "\\u0061nn"}',
             '{"id": "c", "text": "ann", "user": "bo"}', '{"id": "d", "text": "t", "user": 3}',
             '{"id": "e", "text": "t", "user": 3.0}', '{"id": "f", "text": "t", "user": 3e0}',
             '{"id": "g", "text": "t", "user": -0}', '{"id": "h", "text": "t", "user": true}',
             '{"id": "i", "text": "t"}', '{"id": "j", "text": "t", "user": null}',
             '{"id": "k", "text": "t", "user": ""}',
             '{"id": "l", "text": "t", "user": "a\\"b"}', '{"id": "m", "text": "t", "user": 30}']
    path = tmp_path / "mem.jsonl"
    path.write_text("\n".join(lines) + "\n")
    store = TableStore(str(path), {"group": "user"})
    whole = pa.Table.from_batches(list(store.read()))
    for group in ["ann", "bo", "3", "3.0", "0", "true", "", 'a"b', "30", "nobody"]:
        want = whole.filter(pa.compute.equal(whole.column("group"), group))
        got = pa.Table.from_batches(list(store.read_group(group)), schema=whole.schema)
        assert got == want, group
    assert set(pa.Table.from_batches(list(store.read_group("3.0"))).column("id").to_pylist()) == {"e", "f"}


def test_a_csv_group_scan_finds_the_group_in_quoted_multiline_and_short_rows(tmp_path) -> None:
    """The CSV scan splits a quote-free line itself and hands a quoted one (with the lines its record spans) to the
    csv module: quoted, multi-line, short and blank rows are found exactly as a whole read finds them."""
    path = tmp_path / "mem.csv"
    path.write_bytes(b'\n\xef\xbb\xbfid,text,user\r\n1,plain,ann\r\n2,"quoted, with comma",ann\n'
                     b'3,"two\nlines ann",bo\n\n4,"ann",""\n5,short\n6,"say ""ann""",\"ann\"\n7,x"y,ann\n'
                     b'8,ann,a"b\n9,t,"a""b"\n10,last,ann')
    store = TableStore(str(path), {"group": "user"})
    whole = pa.Table.from_batches(list(store.read()))
    for group in ["ann", "bo", "", 'a"b', "nobody"]:
        want = whole.filter(pa.compute.equal(whole.column("group"), group))
        assert pa.Table.from_batches(list(store.read_group(group)), schema=whole.schema) == want, group
    assert pa.Table.from_batches(list(store.read_group("ann"))).column("id").to_pylist() == ["1", "2", "6", "7", "10"]


def test_a_store_file_that_is_a_symlink_is_pruned_and_restored_through_its_target(tmp_path) -> None:
    """Issue 56, item 3: the apply rewrites the real file (readers through the link see the records go), takes the lock
    beside it, and the link stays a link; restore gives the real file back byte for byte."""
    real = tmp_path / "data" / "mem.csv"
    real.parent.mkdir()
    real.write_text("id,text,user\n0001,a,u1\n0002,b,u1\n0003,c,u2\n")
    original = real.read_bytes()
    for link in (tmp_path / "link.csv", tmp_path / "linked" / "mem.csv"):  # the store, or a file of a store directory
        link.parent.mkdir(exist_ok=True)
        link.symlink_to(real)
        out = tmp_path / f"out-{link.parent.name}"
        store = TableStore(str(link if link.parent == tmp_path else link.parent), {"group": "user"})
        decide(store, out, [True, False, True])
        apply_decision(store, out, {"store": {"fingerprint": "f"}}, StoreOptions(apply="delete"))
        assert link.is_symlink() and link.resolve() == real
        assert real.read_bytes() == b"id,text,user\n0001,a,u1\n0003,c,u2\n"
        assert (real.parent / ".mem.csv.memprune-lock").exists() and not (link.parent / ".link.csv.memprune-lock").exists()
        restore(out / "archive")
        assert link.is_symlink() and real.read_bytes() == original


def test_records_that_are_not_utf8_are_rejected_with_their_reason_and_long_fields_are_read(tmp_path) -> None:
    """Issue 56, messages: a latin-1 CSV is no traceback: each record whose bytes are not UTF-8 is a reject naming
    the column and the byte (kept untouched); a CSV field of 1 MB is read whole (the csv module's cap is 128 KiB)."""
    path = tmp_path / "latin.csv"
    path.write_bytes("id,text,user\n1,caf\xe9 au lait,u1\n2,plain,u1\n".encode("latin-1"))
    rows = pa.Table.from_batches(list(TableStore(str(path), {"group": "user"}).read())).to_pylist()
    assert [r["reject"] for r in rows] == [
        "text (text) is not UTF-8 text: byte 0xE9 at character 3; convert the file to UTF-8 (iconv -t utf-8)", None]
    assert rows[0]["text"] == "caf\ufffd au lait" and rows[1]["text"] == "plain"
    big = tmp_path / "big.csv"
    big.write_text(f'id,text,user\n1,"{"x" * 1_100_000}",u1\n2,short,u1\n')
    rows = pa.Table.from_batches(list(TableStore(str(big), {"group": "user"}).read())).to_pylist()
    assert [len(r["text"]) for r in rows] == [1_100_000, 5] and all(r["reject"] is None for r in rows)


def test_an_immutable_store_file_is_one_line_and_the_rerun_resumes(tmp_path) -> None:
    """Issue 56, messages: `--apply` on a file the system will not let anyone replace (chattr +i) is one StoreError
    line with the file unchanged; once it is writable again the same apply finishes."""
    import subprocess

    path = tmp_path / "mem.csv"
    path.write_text("id,text,user\n0001,a,u1\n0002,b,u1\n")
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here")
    try:
        store = TableStore(str(path), {"group": "user"})
        decide(store, tmp_path / "out", [True, False])
        with pytest.raises(StoreError, match=r"mem.csv: cannot replace it \(Operation not permitted: an immutable"):
            apply_decision(store, tmp_path / "out", {"store": {"fingerprint": "f"}}, StoreOptions(apply="delete"))
        assert path.read_text() == "id,text,user\n0001,a,u1\n0002,b,u1\n"
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)
    apply_decision(store, tmp_path / "out", {"store": {"fingerprint": "f"}}, StoreOptions(apply="delete"))
    assert path.read_text() == "id,text,user\n0001,a,u1\n"
