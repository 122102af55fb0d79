"""External stores (issue 14): a real Mem0 store (local Qdrant, MiniLM embedder, `infer=False`), Lance and a
mapped Parquet export: the same decisions from each; `--apply` archives then deletes (a SIGKILL mid-apply is
finished by a rerun, a second apply does nothing); restore brings records back; bad input is one line, nothing
changed."""

from __future__ import annotations

import datetime as dt
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from helpers import USERS, mem0_close, mem0_config, mem0_get_all, mem0_memory, mem0_points

from memprune.archive import read_archive, restore
from memprune.cli import app
from memprune.stores import StoreError, normalize, parse_map, split_input

RULE = ["--threshold", "0.5", "--top-k", "2", "--set", "progress=false", "--set", "actors=1"]
# issue 26: a pinned memory (Mem0 metadata key `pinned`) and two old ones (their own created_at)
OLD = "2024-01-01T00:00:00+00:00"
METADATA = {"lol": {"pinned": True, "created_at": OLD}, "Bob is allergic to peanuts.": {"created_at": OLD},
            "k": {"pinned": False}}


def _cli(*args: str):
    return CliRunner().invoke(app, list(args))



@pytest.fixture(scope="module")
def mem0_store(tmp_path_factory, minilm_path) -> tuple[Path, pa.Table]:
    """A real Mem0 store (3 users, duplicates and junk) and its records as a mapped export table."""
    d = tmp_path_factory.mktemp("mem0")
    config = mem0_config(d, minilm_path)
    m = mem0_memory(config)
    for user, texts in USERS.items():
        for text in texts:
            m.add([{"role": "user", "content": text}], user_id=user, infer=False, metadata=METADATA.get(text))
    rows = [r for u in USERS for r in m.get_all(filters={"user_id": u}, top_k=100)["results"]]
    mem0_close(m)
    export = pa.table({"memory_id": [r["id"] for r in rows], "memory": pa.array([r["memory"] for r in rows], pa.large_string()),
                       "user": [r["user_id"] for r in rows], "created_at": [r["created_at"] for r in rows]})
    return config, export


@pytest.fixture(scope="module")
def decisions(ray_local, scorer_dir, mem0_store, tmp_path_factory) -> dict[str, tuple[Path, pa.Table]]:
    """Dry runs on the same memories read from Mem0, from a Lance dataset and from a mapped Parquet export."""
    import lance

    config, export = mem0_store
    d = tmp_path_factory.mktemp("decisions")
    pq.write_table(export, d / "export.parquet")
    lance.write_dataset(export.rename_columns(["id", "text", "user_id", "created_at"]), str(d / "mem.lance"))
    inputs = {"mem0": ["--input", f"mem0:{config}"],
              "lance": ["--input", f"lance:{d / 'mem.lance'}", "--map", "group=user_id,time=created_at"],
              "table": ["--input", f"table:{d / 'export.parquet'}", "--map", "id=memory_id,text=memory,group=user,time=created_at"]}
    out = {}
    for kind, args in inputs.items():
        res = _cli("prune", "--scorer", str(scorer_dir), "--out", str(d / f"out-{kind}"), *args, *RULE)
        assert res.exit_code == 0, res.output
        out[kind] = (d / f"out-{kind}", pq.read_table(d / f"out-{kind}" / "decision.parquet"))
    return out


@pytest.mark.slow
def test_same_decisions_from_mem0_lance_and_parquet(decisions, mem0_store) -> None:
    _, export = mem0_store
    tables = {k: t.sort_by("id") for k, (_, t) in decisions.items()}
    base = tables["mem0"]
    assert base.num_rows == export.num_rows == sum(map(len, USERS.values()))
    assert 0 < sum(base.column("keep").to_pylist()) < base.num_rows
    for kind in ("lance", "table"):
        for col in ("id", "group", "keep", "reason", "hash"):
            assert tables[kind].column(col).to_pylist() == base.column(col).to_pylist(), (kind, col)
        assert tables[kind].column("score").to_pylist() == pytest.approx(base.column("score").to_pylist(), abs=1e-6)
    # the duplicates score alike; top-k 2 per user keeps at most 2
    for user in USERS:
        assert sum(1 for g, k in zip(base.column("group").to_pylist(), base.column("keep").to_pylist()) if g == user and k) <= 2


@pytest.mark.slow
def test_mem0_apply_survives_a_kill_is_idempotent_and_restores(decisions, mem0_store, scorer_dir, ray_address) -> None:
    config, _ = mem0_store
    out, decision = decisions["mem0"]
    rows = decision.to_pylist()
    kept = {u: {r["id"] for r in rows if r["group"] == u and r["keep"]} for u in USERS}
    dropped = {r["id"] for r in rows if not r["keep"]}
    assert len(dropped) >= 3
    before = mem0_get_all(config)
    points = mem0_points(config)
    assert all({"data", "hash", "created_at", "user_id"} <= set(p) for p, _ in points.values())
    # 1. an apply killed (SIGKILL) after its first delete: archive written, store partly changed
    script = (
        "import os, signal, sys\n"
        "from memprune.stores.mem0_store import Mem0Store\n"
        "orig = Mem0Store.delete\n"
        "def delete(self, ids):\n"
        "    n = orig(self, ids)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "Mem0Store.delete = delete\n"
        "from memprune.cli import app\n"
        "app(sys.argv[1:])\n")
    args = ["prune", "--scorer", str(scorer_dir), "--input", f"mem0:{config}", "--out", str(out), *RULE,
            "--set", "store.batch=1", "--apply"]
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "RAY_ADDRESS": ray_address})
    assert proc.returncode == -9, proc.stderr[-2000:]
    partial = mem0_get_all(config)
    assert sum(map(len, partial.values())) == sum(map(len, before.values())) - 1
    assert set(read_archive(out / "archive").records.column("id").to_pylist()) == dropped
    # 2. the rerun finishes the apply; Mem0's own get_all returns exactly the kept memories
    res = _cli(*args)
    assert res.exit_code == 0, res.output
    assert mem0_get_all(config) == kept
    applied = json.loads((out / "apply.json").read_text())
    assert (applied["deleted"], applied["already_deleted"]) == (len(dropped) - 1, 1)
    # 3. a second apply does nothing
    res = _cli(*args)
    assert res.exit_code == 0 and json.loads((out / "apply.json").read_text())["deleted"] == 0
    assert mem0_get_all(config) == kept
    # 4. restore puts the dropped memories back (payload, vector and id); Mem0 sees them again
    first = next(iter(dropped))
    assert restore(out / "archive", [first])["restored"] == 1
    assert restore(out / "archive")["restored"] == len(dropped) - 1
    assert mem0_get_all(config) == before
    assert mem0_points(config) == points  # whole records back: payload (hash, created_at, metadata) and vector
    m = mem0_memory(config)
    hits = m.search("Who has a cat named Tom?", filters={"user_id": "alice"}, top_k=3)["results"]
    mem0_close(m)
    assert hits and "cat" in hits[0]["memory"]


@pytest.mark.slow
def test_apply_refuses_a_changed_store_and_changes_nothing(decisions) -> None:
    import lance

    out, _ = decisions["lance"]
    path = json.loads((out / "prune.json").read_text())["store"]["location"]
    scorer = json.loads((out / "prune.json").read_text())["scorer"]["path"]
    schema = lance.dataset(path).schema
    lance.write_dataset(pa.table({"id": ["new-1"], "text": ["Dora keeps bees."], "user_id": ["dora"],
                                  "created_at": ["2026-01-01"]}).cast(schema), path, mode="append")
    rows = lance.dataset(path).count_rows()
    res = _cli("prune", "--scorer", scorer, "--out", str(out), "--input", f"lance:{path}",
               "--map", "group=user_id,time=created_at", *RULE, "--apply")
    assert res.exit_code == 2
    lines = [ln for ln in res.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "changed since the decision" in res.output and "1 added" in res.output
    assert lance.dataset(path).count_rows() == rows and not (out / "archive").exists()


def test_bad_inputs_are_one_line_and_change_nothing(tmp_path, scorer_dir) -> None:
    store = tmp_path / "mem.parquet"
    pq.write_table(pa.table({"memory_id": ["a"], "memory": ["x"], "user": ["u"]}), store)
    size = store.stat().st_size
    bad_cfg = tmp_path / "mem0.yaml"
    bad_cfg.write_text("vector_store:\n  provider: no-such-backend\n")
    cases = {
        "unknown store kind 'foo'": ["--input", "foo:bar"],
        "column 'nope' (mapped to text) missing": ["--input", f"table:{store}", "--map", "id=memory_id,text=nope,group=user"],
        "cannot open the Mem0 store": ["--input", f"mem0:{bad_cfg}"],
        "unknown field 'colour'": ["--input", f"table:{store}", "--map", "colour=red"],
        "column 'starred' (mapped to pin) missing": ["--input", f"table:{store}", "--map",
                                                     "id=memory_id,text=memory,group=user,pin=starred"],
        "--pin-field starred: an external store's pins are a column (Mem0: a metadata key) in its map: use --map "
        "pin=starred": ["--input", f"table:{store}", "--map", "id=memory_id,text=memory,group=user", "--pin-field",
                        "starred"],
    }
    for expected, args in cases.items():
        res = _cli("prune", "--scorer", str(scorer_dir), "--out", str(tmp_path / "out"), *args, "--apply")
        assert res.exit_code == 2, (expected, res.output)
        assert len(res.output.strip().splitlines()) == 1 and expected in " ".join(res.output.split()), res.output
    assert store.stat().st_size == size and not (tmp_path / "out").exists()


def test_bad_store_times_and_pins_are_one_line_naming_store_record_and_column(ray_local, scorer_dir, tmp_path) -> None:
    """Issue 26 on stores: a time that does not parse (with forgetting/expiry) or a pin that is not true/false is
    one line naming the store, the record and the column; nothing is written. Mem0's pin key: `Mem0Store` test."""
    from memprune.stores.base import open_store
    from memprune.stores.export import check_lives

    store = tmp_path / "mem.csv"
    store.write_text("id,text,user,created,pinned\n0001,a,u,2024-01-02,true\n0002,b,u,yesterday,false\n")
    before = store.read_bytes()
    args = ["prune", "--scorer", str(scorer_dir), "--input", f"table:{store}", "--top-k", "1", "--max-age", "30d",
            "--set", "progress=false", "--set", "actors=1"]
    res = _cli(*args, "--out", str(tmp_path / "o"), "--map", "group=user,time=created,pin=pinned")
    assert res.exit_code == 2, res.output
    # (the CLI's error is its last line; Ray Data's logger may print to the runner's stream before it)
    errors = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0] == res.output.strip().splitlines()[-1], res.output
    assert f"table:{store}: column 'created': 'yesterday' (record '0002') is not a time" in errors[0], res.output
    assert store.read_bytes() == before and not (tmp_path / "o" / "decision.parquet").exists()
    assert not (tmp_path / "o" / "prune.json").exists()
    # the same store decides without forgetting/expiry (the time is then only the sort key)
    store.write_text("id,text,user,created,pinned\n0001,a,u,2024-01-02,true\n0002,b,u,2024-01-03,maybe\n")
    s = open_store("table", str(store), {"group": "user", "time": "created", "pin": "pinned"})
    batch = next(iter(s.read()))
    with pytest.raises(StoreError, match=f"table:{store}: record '0002': column 'pinned' \\(mapped to pin\\) is "
                                         "'maybe', not true/false"):
        check_lives(s, batch, check_times=False)


def test_normal_form_accepts_every_string_type_and_counts_rejects() -> None:
    batch = pa.table({"k": pa.array(["a", None, "c", ""], pa.string_view()),
                      "t": pa.array(["x", "y", None, "z"], pa.large_string()), "g": ["u", "u", None, "v"]})
    norm = normalize(batch, {"id": "k", "text": "t", "group": "g"}, "test")
    assert norm.column("id").type == pa.string() and norm.column("group").to_pylist() == ["u", "u", "", "v"]
    assert [r is None for r in norm.column("reject").to_pylist()] == [True, False, False, False]
    with pytest.raises(StoreError, match="column 't' \\(mapped to text\\) has type int64"):
        normalize(pa.table({"k": ["a"], "t": [1]}), {"id": "k", "text": "t"}, "test")
    assert split_input("lance:/x") == ("lance", "/x") and split_input(str(Path(__file__))) is None
    assert parse_map("id=a, text=b") == {"id": "a", "text": "b"}
    assert parse_map("pin=starred") == {"pin": "starred"}
    pins = normalize(pa.table({"k": ["a", "b", "c"], "t": ["x", "y", "z"], "p": [True, None, False]}),
                     {"id": "k", "text": "t", "pin": "p"}, "test")
    assert pins.column("pin").to_pylist() == ["true", None, "false"]
    with pytest.raises(StoreError, match="column 'p' \\(mapped to pin\\) has type double; expected a boolean"):
        normalize(pa.table({"k": ["a"], "t": ["x"], "p": [0.5]}), {"id": "k", "text": "t", "pin": "p"}, "test")


@pytest.mark.slow  # a Ray Data job of 20 s or more
def test_score_writes_scores_into_a_jsonl_table(ray_local, scorer_dir, tmp_path) -> None:
    store = tmp_path / "mem.jsonl"
    texts = ["Eve keeps bees.", "ok", "Eve speaks Welsh.", None]
    store.write_text("".join(json.dumps({"mid": f"m{i}", "memory": t, "user": "u"}) + "\n" for i, t in enumerate(texts)))
    args = ["--scorer", str(scorer_dir), "--map", "id=mid,text=memory,group=user", "--set", "progress=false",
            "--set", "actors=1"]
    res = _cli("score", "--input", f"table:{store}", "--out", str(tmp_path / "out"), *args)
    assert res.exit_code == 0, res.output
    rows = [json.loads(ln) for ln in store.read_text().splitlines()]
    scores = pq.read_table(tmp_path / "out" / "scores.parquet").to_pylist()
    assert len(scores) == 3 and {s["id"] for s in scores} == {"m0", "m1", "m2"}
    assert {r["mid"]: r["memprune_score"] for r in rows[:3]} == pytest.approx({s["id"]: s["memprune_score"] for s in scores})
    assert all(0 <= r["memprune_score"] <= 1 and "keep" not in r for r in rows[:3])
    # the row without text is a counted reject, not scored, and its line is left exactly as it was
    assert store.read_text().splitlines()[3] == json.dumps({"mid": "m3", "memory": None, "user": "u"})
    rejects = [json.loads(ln) for ln in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert rejects == [{"id": "m3", "group": "u", "reason": "text (memory) is null"}]
    assert json.loads((tmp_path / "out" / "score.json").read_text())["store"]["rejected"] == 1
    # two records with one id: one error line, the store unchanged
    dup = tmp_path / "dup.csv"
    dup.write_text("mid,memory,user\na,x,u\na,y,u\n")
    res = _cli("score", "--input", f"table:{dup}", "--out", str(tmp_path / "out-dup"), *args)
    # (the CLI's error is its last line; Ray Data's logger may print to the runner's closed stream before it)
    last = res.output.strip().splitlines()[-1]
    assert res.exit_code == 2 and last.startswith("error:") and "duplicate id 'a'" in " ".join(res.output.split())
    assert dup.read_text() == "mid,memory,user\na,x,u\na,y,u\n"


@pytest.mark.slow
def test_lance_delete_and_restore_and_table_flag(decisions) -> None:
    import lance

    out, decision = decisions["table"]
    summary = json.loads((out / "prune.json").read_text())
    path, scorer = summary["store"]["location"], summary["scorer"]["path"]
    res = _cli("prune", "--scorer", scorer, "--out", str(out), "--input", f"table:{path}",
               "--map", "id=memory_id,text=memory,group=user,time=created_at", *RULE, "--apply-flag")
    assert res.exit_code == 0, res.output
    flagged = pq.read_table(path).to_pylist()
    want = {r["id"]: r["keep"] for r in decision.to_pylist()}
    assert {r["memory_id"]: r["memprune_keep"] for r in flagged} == want and len(flagged) == len(want)
    # lance: a fresh copy of the decided dataset, apply delete, restore the archive
    lout, ldec = decisions["lance"]
    lpath = json.loads((lout / "prune.json").read_text())["store"]["location"]
    ds = lance.dataset(lpath)
    if ds.count_rows() != ldec.num_rows:  # the changed-store test appended a row: take it out again
        ds.delete("id = 'new-1'")
    rows_before = lance.dataset(lpath).to_table().sort_by("id").to_pylist()
    res = _cli("prune", "--scorer", scorer, "--out", str(lout), "--input", f"lance:{lpath}",
               "--map", "group=user_id,time=created_at", *RULE, "--apply")
    assert res.exit_code == 0, res.output
    left = set(lance.dataset(lpath).to_table(columns=["id"]).column(0).to_pylist())
    assert left == {r["id"] for r in ldec.to_pylist() if r["keep"]}
    archived = read_archive(lout / "archive").records
    assert "created_at" in archived.column_names and archived.num_rows == ldec.num_rows - len(left)
    assert restore(lout / "archive")["restored"] == archived.num_rows
    assert lance.dataset(lpath).to_table().sort_by("id").to_pylist() == rows_before  # every column of every row


@pytest.mark.slow
def test_flags_on_mem0_and_lance_set_keep_and_score_and_nothing_else(decisions, mem0_store, scorer_dir, tmp_path) -> None:
    """`--apply-flag`: each decided record gets memprune_keep/memprune_score; its other fields stay as they were."""
    import lance

    from memprune.prune import MemoryPruner, PruneRule

    config, export = mem0_store
    lout, _ = decisions["lance"]
    lpath = json.loads((lout / "prune.json").read_text())["store"]["location"]
    # Mem0 with a pin key and forgetting + expiry (issue 26): the decision is MemoryPruner's on the same memories
    now = (max(dt.datetime.fromisoformat(t) for t in export.column("created_at").to_pylist()) + dt.timedelta(days=1))
    life = {"half_life": "30d", "max_age": "90d", "now": now.isoformat()}
    inputs = {"mem0": ["--input", f"mem0:{config}", "--map", "pin=pinned", "--half-life", life["half_life"],
                       "--max-age", life["max_age"], "--now", life["now"], "--supersede", "slot"],
              "lance": ["--input", f"lance:{lpath}", "--map", "group=user_id,time=created_at"]}
    for kind, args in inputs.items():
        before = mem0_points(config) if kind == "mem0" else {r["id"]: r for r in lance.dataset(lpath).to_table().to_pylist()}
        out = tmp_path / f"flag-{kind}"
        for extra in ([], ["--apply-flag"]):
            res = _cli("prune", "--scorer", str(scorer_dir), "--out", str(out), *args, *RULE, *extra)
            assert res.exit_code == 0, res.output
        decision = {r["id"]: r for r in pq.read_table(out / "decision.parquet").to_pylist()}
        if kind == "mem0":
            records = sorted(({"bullet_id": i, "text": p["data"], "conversation_id": p["user_id"], "time": p["created_at"],
                               "pinned": p.get("pinned"), "speaker": ""} for i, (p, _) in before.items()),
                             key=lambda r: (r["conversation_id"], r["time"], r["bullet_id"]))
            # supersession (issue 26): the user is the scope and (no speaker in a store) the subject
            rule = PruneRule.of(threshold=0.5, top_k=2, pin_field="pinned", group_by="conversation", retention=life,
                                supersede={"judge": "slot"})
            expected = MemoryPruner(scorer_dir, rule=rule).prune_table(pa.Table.from_pylist(records))
            assert {r["bullet_id"]: (r["keep"], r["reason"], r["superseded_by"]) for r in expected.to_pylist()} == \
                {i: (r["keep"], r["reason"], r["superseded_by"]) for i, r in decision.items()}
            by_text = {r["text"]: r for r in decision.values()}
            assert by_text["lol"]["keep"] and by_text["Bob is allergic to peanuts."]["reason"] == "expired"
            assert "Pins: column `pinned (store)`; 1 pinned" in (out / "prune.md").read_text()
            after = {i: p for i, (p, _) in mem0_points(config).items()}
            assert set(after) == set(before)
            for i, payload in after.items():
                assert payload["memprune_keep"] == decision[i]["keep"]
                assert payload["memprune_score"] == pytest.approx(decision[i]["score"])
                assert {k: v for k, v in payload.items() if not k.startswith("memprune_")} == before[i][0]
        else:
            after = {r["id"]: r for r in lance.dataset(lpath).to_table().to_pylist()}
            assert set(after) == set(before)
            for i, row in after.items():
                assert row["memprune_keep"] == decision[i]["keep"]
                assert row["memprune_score"] == pytest.approx(decision[i]["score"])
                assert {k: v for k, v in row.items() if not k.startswith("memprune_")} == \
                    {k: v for k, v in before[i].items() if not k.startswith("memprune_")}
    # a pin key no memory has: one line naming the store and the key, after the read, before the job
    from memprune.stores.export import export as export_store
    from memprune.stores.mem0_store import Mem0Store

    store = Mem0Store(str(config), {"pin": "starred"})
    try:
        with pytest.raises(StoreError, match=f"mem0:{config}: --map pin=starred: no record has the key 'starred'"):
            export_store(store, tmp_path / "no-pin")
    finally:
        store.close()


@pytest.mark.slow  # a Ray Data job of 20 s or more
def test_csv_store_apply_and_restore_keep_every_byte(ray_local, scorer_dir, tmp_path) -> None:
    """The issue's reproduction: ids `0003` and zips `02139` survive apply and restore; mode 0600 is kept.
    With pins and times mapped (`--map time=created,pin=pinned`) and forgetting + expiry (issue 26) the decision
    is MemoryPruner's on the same records; apply deletes exactly the dropped ones (never a pinned one)."""
    from memprune.prune import MemoryPruner, PruneRule

    store = tmp_path / "mem.csv"

    def created(i: int) -> str:
        return "" if i == 5 else f"2024-01-{i % 28 + 1:02d}T00:00:00Z"

    pins = {i: "true" if i % 7 == 0 else "" if i % 11 == 0 else "false" for i in range(1, 41)}
    lines = [f"{i:04d},Memory number {i} of {'Alice' if i % 2 else 'Bob'}.,u{i % 20},{2139 + i:05d},{created(i)},{pins[i]}\n"
             for i in range(1, 41)]
    header = "id,text,user,zip,created,pinned\n"
    store.write_text(header + "".join(lines))
    os.chmod(store, 0o600)
    original = store.read_bytes()
    life = ["--half-life", "10d", "--max-age", "20d", "--now", "2024-01-29T00:00:00Z"]
    args = ["prune", "--input", f"table:{store}", "--map", "group=user,time=created,pin=pinned", "--scorer", str(scorer_dir),
            "--out", str(tmp_path / "o"), "--threshold", "0", "--top-k", "1", "--no-dedup", *life, "--set", "progress=false",
            "--set", "actors=1"]
    res = _cli(*args, "--dry-run")  # a store prune's dry run writes the decision that --apply then applies
    assert res.exit_code == 0, res.output
    assert store.read_bytes() == original
    decision = pq.read_table(tmp_path / "o" / "decision.parquet").sort_by("id")
    records = sorted(({"bullet_id": f"{i:04d}", "text": f"Memory number {i} of {'Alice' if i % 2 else 'Bob'}.",
                       "conversation_id": f"u{i % 20}", "time": created(i) or None, "pinned": pins[i] == "true"}
                      for i in range(1, 41)), key=lambda r: (r["conversation_id"], r["time"] or "", r["bullet_id"]))
    rule = PruneRule.of(threshold=0, top_k=1, dedup=False, pin_field="pinned", group_by="conversation",
                        retention={"half_life": "10d", "max_age": "20d", "now": "2024-01-29T00:00:00Z"})
    expected = MemoryPruner(scorer_dir, rule=rule).prune_table(pa.Table.from_pylist(records)).sort_by("bullet_id")
    assert decision.column("id").to_pylist() == expected.column("bullet_id").to_pylist()
    for col in ("keep", "reason"):
        assert decision.column(col).cast(pa.string()).to_pylist() == expected.column(col).cast(pa.string()).to_pylist()
    reasons = dict(zip(decision.column("id").to_pylist(), decision.column("reason").to_pylist()))
    keep = dict(zip(decision.column("id").to_pylist(), decision.column("keep").to_pylist()))
    assert "expired" in reasons.values() and all(keep[f"{i:04d}"] for i in pins if pins[i] == "true")
    assert any(keep[f"{i:04d}"] and created(i) and created(i) < "2024-01-09" for i in pins if pins[i] == "true")  # pinned, expired age
    res = _cli(*args, "--apply")
    assert res.exit_code == 0, res.output
    kept = {i for i, k in keep.items() if k}
    assert all(len(i) == 4 for i in kept) and 20 < len(kept) < 40
    assert store.read_text() == header + "".join(ln for ln in lines if ln[:4] in kept)
    assert stat.S_IMODE(store.stat().st_mode) == 0o600
    res = _cli("restore", "--archive", str(tmp_path / "o" / "archive"), "--all")
    assert res.exit_code == 0, res.output
    assert store.read_bytes() == original and stat.S_IMODE(store.stat().st_mode) == 0o600


def test_store_requests_that_would_harm_the_store_are_refused_up_front(scorer_dir, tmp_path, monkeypatch) -> None:
    d = tmp_path / "store"
    d.mkdir()
    (d / "mem.jsonl").write_text("".join(json.dumps({"id": f"{i:03d}", "text": f"t{i}", "group": "u"}) + "\n"
                                         for i in range(5)))
    before = (d / "mem.jsonl").read_bytes()
    monkeypatch.chdir(tmp_path)
    base = ["prune", "--scorer", str(scorer_dir), "--input", f"table:{d}"]
    cases = {
        "inside the table store": [*base, "--out", str(d / "out")],
        "dry_run and store.apply exclude each other": [*base, "--out", str(tmp_path / "o"), "--top-k", "2",
                                                       "--dry-run", "--apply"],
        "an external store's groups are its `--map group=` column": [*base, "--out", str(tmp_path / "o"),
                                                                     "--group-by", "session"],
        "does not run on the default policy": [*base, "--out", str(tmp_path / "o"), "--apply"],
        "no decision to apply yet": [*base, "--out", str(tmp_path / "o"), "--top-k", "2", "--apply"],
    }
    for expected, args in cases.items():
        res = _cli(*args)
        assert res.exit_code == 2, (expected, res.output)
        assert len(res.output.strip().splitlines()) == 1 and expected in " ".join(res.output.split()), res.output
    assert (d / "mem.jsonl").read_bytes() == before and sorted(p.name for p in d.iterdir()) == ["mem.jsonl"]
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_a_bullets_archive_restores_from_a_fresh_interpreter(ray_local, scorer_dir, msc_small, tmp_path) -> None:
    """`memprune.archive.restore` finds the bullets restorer without `memprune.prune` imported first."""
    out = tmp_path / "p"
    res = _cli("prune", "--scorer", str(scorer_dir), "--input", str(msc_small), "--out", str(out), "--emit", "split",
               "--set", "progress=false", "--set", "actors=1")
    assert res.exit_code == 0, res.output
    kept_rows = pq.read_table(out / "kept").num_rows
    script = ("import sys, json\nfrom memprune.archive import restore\n"
              "print(json.dumps(restore(sys.argv[1])))\n")
    proc = subprocess.run([sys.executable, "-c", script, str(out / "dropped")], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["restored"] > 0 and summary["rows"] == kept_rows + summary["restored"]
    assert pq.read_table(out / "kept").num_rows == pq.read_table(msc_small / "bullets.parquet").num_rows


@pytest.mark.slow
def test_a_ray_that_cannot_start_is_one_line(scorer_dir, msc_small, tmp_path) -> None:
    """A local Ray that fails to start (its temp dir cannot be made): one error line, no traceback."""
    (tmp_path / "a-file").write_text("")
    proc = subprocess.run([sys.executable, "-m", "memprune.cli", "prune", "--scorer", str(scorer_dir), "--input",
                           str(msc_small), "--out", str(tmp_path / "o"), "--set", "execution=ray"], capture_output=True,
                          text=True, timeout=120, env={**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
                               "RAY_TMPDIR": str(tmp_path / "a-file" / "ray"), "PYTHONPATH": os.pathsep.join(sys.path)})
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip() and not ln.startswith("note:")]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and "cannot start a local Ray instance" in lines[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()


def test_a_store_of_several_files_equals_the_same_records_in_one_file(ray_local, tmp_path) -> None:
    """The same records as one file or spread over three give the same bullets, rejects and fingerprint (the
    Ray-task read past `sort_in_memory`: the test below)."""
    from memprune.stores.base import open_store
    from memprune.stores.export import export

    rows = [{"id": f"{i:04d}", "text": None if i == 7 else f"Memory {i}.", "user": f"u{i % 3}"} for i in range(1, 13)]
    one, many = tmp_path / "one", tmp_path / "many"
    one.mkdir()
    many.mkdir()
    (one / "mem.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for k in range(3):
        (many / f"mem-{k}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[k::3]))
    got = {}
    for name, d in (("one", one), ("many", many)):
        store = open_store("table", str(d), {"group": "user"})
        assert len(store.partitions()) == (1 if name == "one" else 3)
        e = export(store, tmp_path / f"work-{name}")
        got[name] = (pq.read_table(e.bullets.path).to_pylist(), e.rejects, e.fingerprint, e.usable)
    assert got["one"] == got["many"] and got["one"][3] == 11 and [r["id"] for r in got["one"][1]] == ["0007"]


@pytest.mark.slow  # Ray Data read tasks and the Ray sort of the spilled path
def test_a_store_of_several_files_decides_the_same_held_in_memory_or_spilled(ray_local, tmp_path) -> None:
    """Issue 25: up to `sort_in_memory` usable rows the export holds the store in memory (no normal-form copy, no Ray
    task); past it the rows held spill to Parquet and the files left are read by Ray Data tasks and sorted by Ray.
    A store of three files (Parquet and CSV, rejects, times, pins) gives the same bullets, rejects, fingerprint and
    error lines either way."""
    from memprune.stores.base import open_store
    from memprune.stores.export import export

    def store_of(rows: list[dict]) -> object:
        d = tmp_path / f"store-{len(list(tmp_path.glob('store-*')))}"
        d.mkdir()
        for k in range(2):
            pq.write_table(pa.Table.from_pylist(rows[k::3]), d / f"mem-{k}.parquet")
        (d / "mem-2.csv").write_text("mid,memory,user,at,star\n" + "".join(
            f"{r['mid'] or ''},{r['memory'] or ''},{r['user']},{r['at']},{r['star']}\n" for r in rows[2::3]))
        return open_store("table", str(d), {"id": "mid", "text": "memory", "group": "user", "time": "at", "pin": "star"})

    rows = [{"mid": "" if i == 4 else f"{i:04d}", "memory": None if i in (7, 11) else f"Memory {i}.",
             "user": f"u{i % 4}", "at": f"2024-03-{1 + i % 5:02d}T10:00:00Z", "star": i % 5 == 0} for i in range(1, 31)]
    ways = {"held": {}, "spilled": {"sort_in_memory": 4}}

    def run(store, name: str, **kw) -> tuple:
        e = export(store, tmp_path / f"work-{name}", check_times=True, **kw)
        return e.spilled, (pq.read_table(e.bullets.path).to_pylist(), e.rejects, e.fingerprint, e.usable, e.records,
                           e.rejected_without_id)

    store = store_of(rows)
    assert len(store.partitions()) == 3
    (held, got), (spilled, again) = (run(store, name, **kw) for name, kw in ways.items())
    assert (held, spilled) == (False, True) and got == again
    bullets, rejects, _, usable, records, without_id = got
    assert (usable, records, without_id) == (27, 30, 1) and sorted(r["reason"][:4] for r in rejects) == ["id (", "text", "text"]
    keys = [(b["conversation_id"], b["memprune_time"], b["bullet_id"]) for b in bullets]
    assert keys == sorted(keys)
    assert sum(b["memprune_pin"] for b in bullets) == 6 and all(b["time"] for b in bullets)
    for bad, why in ((dict(rows[29], memory="again"), "duplicate id '0030'"), ({**rows[0], "mid": "0031", "at": "soon"},
                                                                                 "record '0031'")):
        store = store_of([*rows[:29], bad, rows[29]])  # the bad record in the CSV file: Ray reads it when spilled
        errors = []
        for name, kw in ways.items():
            with pytest.raises(StoreError) as err:
                export(store, tmp_path / f"bad-{name}", check_times=True, **kw)
            errors.append(str(err.value))
        assert errors[0] == errors[1] and why in errors[0] and "\n" not in errors[0], errors


def _raw_rows(store, group: str) -> pa.Table:
    return pa.Table.from_batches([b for part in store.raw_group(group) for b in part()])


def test_a_group_is_asked_of_the_store_alone(tmp_path) -> None:
    """Issue 27: one group's prune reads that group only: a Parquet file and a Lance dataset return just its rows
    (text or integer group column), and `read_group` equals a whole read filtered to the group."""
    import lance

    from memprune.stores.base import open_store

    rows = pa.table({"mid": [f"m{i}" for i in range(9)], "memory": [f"Memory {i}." for i in range(9)],
                     "user": [f"u{i % 3}" for i in range(9)], "n": [i % 3 for i in range(9)]})
    pq.write_table(rows, tmp_path / "mem.parquet")
    lance.write_dataset(rows.rename_columns(["id", "text", "user", "n"]), str(tmp_path / "mem.lance"))
    stores = {("user", "u1"): open_store("table", str(tmp_path / "mem.parquet"),
                                         {"id": "mid", "text": "memory", "group": "user"}),
              ("n", "1"): open_store("table", str(tmp_path / "mem.parquet"), {"id": "mid", "text": "memory", "group": "n"}),
              ("user", "u2"): open_store("lance", str(tmp_path / "mem.lance"), {"group": "user"}),
              ("n", "2"): open_store("lance", str(tmp_path / "mem.lance"), {"group": "n"})}
    for (column, group), store in stores.items():
        raw = _raw_rows(store, group)
        assert raw.num_rows == 3 and set(raw.column(column).cast(pa.string()).to_pylist()) == {group}, store.where
        whole = pa.Table.from_batches(list(store.read()))
        assert pa.Table.from_batches(list(store.read_group(group))) == \
            whole.filter(pa.compute.equal(whole.column("group"), group))
        assert sum(b.num_rows for part in store.raw_group("x") for b in part()) == 0  # a group nobody has


@pytest.mark.slow
def test_a_mem0_group_is_a_filter_qdrant_runs(mem0_store) -> None:
    from memprune.stores.mem0_store import Mem0Store

    config, _ = mem0_store
    store = Mem0Store(str(config))
    try:
        raw = _raw_rows(store, "bob")
        assert raw.num_rows == len(USERS["bob"]) and set(raw.column("user_id").to_pylist()) == {"bob"}
        assert sorted(raw.column("data").to_pylist()) == sorted(USERS["bob"])
    finally:
        store.close()


def test_a_group_apply_leaves_records_changed_since_the_decision(scorer_dir, tmp_path) -> None:
    """Issue 27: between `decide_group` and `apply_group` someone edits one dropped record and deletes another:
    apply deletes only the unchanged dropped ones and reports the two; restore gives back exactly those deleted."""
    from memprune.prune import MemoryPruner
    from memprune.stores.base import open_store
    from memprune.stores.group import apply_group, decide_group

    store_path = tmp_path / "mem.csv"
    lines = [f"m{i},Memory number {i} of Ann.,{'ann' if i < 8 else 'ben'}\n" for i in range(10)]
    store_path.write_text("mid,memory,user\n" + "".join(lines))
    store = open_store("table", str(store_path), {"id": "mid", "text": "memory", "group": "user"})
    decided = decide_group(store, "ann", MemoryPruner(str(scorer_dir), threshold=None, top_k=3, dedup=False))
    dropped = [i for i, k in zip(decided.column("bullet_id").to_pylist(), decided.column("keep").to_pylist()) if not k]
    assert decided.num_rows == 8 and len(dropped) == 5
    edited, gone = dropped[0], dropped[1]
    text = store_path.read_text().replace(f"{edited},Memory number", f"{edited},Edited memory number")
    store_path.write_text("".join(ln for ln in text.splitlines(keepends=True) if not ln.startswith(f"{gone},")))
    before = store_path.read_bytes()
    done = apply_group(store, decided, tmp_path / "archive")
    assert done["deleted"] == 3 and sorted(done["skipped"], key=lambda s: s["id"]) == sorted(
        [{"id": edited, "why": "changed since the decision"}, {"id": gone, "why": "removed since the decision"}],
        key=lambda s: s["id"])
    left = [ln.split(",")[0] for ln in store_path.read_text().splitlines()[1:]]
    assert edited in left and set(left) == {f"m{i}" for i in range(10)} - set(dropped[1:])
    assert set(read_archive(tmp_path / "archive").records.column("mid").to_pylist()) == set(dropped[2:])
    assert restore(tmp_path / "archive")["restored"] == 3
    assert store_path.read_bytes() == before


def _decided(store, group: str, drop: set[str]) -> pa.Table:
    """`decide_group`'s table for `group` (the real layout, read from the store) with the records of `drop` dropped."""
    from memprune.stores.group import group_table

    table = group_table(store, group)
    keep = [i not in drop for i in table.column("bullet_id").to_pylist()]
    return (table.append_column("score", pa.array([0.5] * table.num_rows, pa.float64()))
            .append_column("keep", pa.array(keep))
            .append_column("reason", pa.array([None if k else "below_threshold" for k in keep], pa.string()))
            .append_column("duplicate_of", pa.nulls(table.num_rows, pa.string())))


def _why(done: dict) -> dict[str, str]:
    return {s["id"]: s["why"] for s in done["skipped"]}


WRITER = """
import json, sys
path, fmt, edited, gone = sys.argv[1:]
lines = open(path, encoding="utf-8", newline="").read().splitlines(keepends=True)
out = []
for line in lines:
    if line.startswith(gone + ",") or line.startswith('{"mid": "%s"' % gone):
        continue
    if line.startswith(edited + ",") or line.startswith('{"mid": "%s"' % edited):
        line = line.replace("Memory number", "Edited memory number")
    out.append(line)
out.append("m99,Added by the other writer.,ann\\n" if fmt == "csv" else
           json.dumps({"mid": "m99", "memory": "Added by the other writer.", "user": "ann"}) + "\\n")
open(path + ".tmp", "w", encoding="utf-8", newline="").write("".join(out))
import os; os.replace(path + ".tmp", path)
"""


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_a_live_apply_leaves_what_another_process_changes_between_its_check_and_its_delete(tmp_path, fmt) -> None:
    """Issue 27: after `apply_group` checked the group and committed its archive, a second process (a plain
    program that knows nothing of memprune's lock) edits one dropped record, deletes another and appends a record.
    The delete works from the file as it is then: the edited record stays (`changed`), the removed one is reported
    (`removed`), the appended one stays, only the other dropped records leave; restore gives back exactly those."""
    from memprune.stores.base import CHANGED, REMOVED, open_store
    from memprune.stores.group import apply_group

    path = tmp_path / f"mem.{fmt}"
    rows = [("m%d" % i, f"Memory number {i} of Ann.", "ann" if i < 8 else "ben") for i in range(10)]
    path.write_text("mid,memory,user\n" + "".join(f"{i},{t},{u}\n" for i, t, u in rows) if fmt == "csv" else
                    "".join(json.dumps({"mid": i, "memory": t, "user": u}) + "\n" for i, t, u in rows))
    store = open_store("table", str(path), {"id": "mid", "text": "memory", "group": "user"})
    drop = {"m1", "m2", "m3", "m4"}
    decided = _decided(store, "ann", drop)

    def other_writer() -> None:
        subprocess.run([sys.executable, "-c", WRITER, str(path), fmt, "m1", "m2"], check=True, timeout=60)

    done = apply_group(store, decided, tmp_path / "archive", before_delete=other_writer)
    assert done["deleted"] == 2 and _why(done) == {"m1": CHANGED, "m2": REMOVED}
    after = path.read_text()
    left = [ln.split(",")[0] if fmt == "csv" else json.loads(ln)["mid"] for ln in after.splitlines()[fmt == "csv":]]
    assert left == ["m0", "m1", "m5", "m6", "m7", "m8", "m9", "m99"] and "Edited memory number 1" in after
    assert restore(tmp_path / "archive")["restored"] == 2  # m3, m4: the archive holds what the apply deleted
    again = open_store("table", str(path), {"id": "mid", "text": "memory", "group": "user"})
    assert {r["id"] for b in again.read_group("ann") for r in b.to_pylist()} == \
        {"m0", "m1", "m3", "m4", "m5", "m6", "m7", "m99"}


LOCKED_WRITER = """
import sys
import pyarrow as pa
from memprune.stores.base import open_store
store = open_store("table", sys.argv[1], {"id": "mid", "text": "memory", "group": "user"})
print("locking", flush=True)
store.set_fields(pa.table({"id": ["m0", "m3"], "memprune_note": ["set by the other writer"] * 2}))
print("done", flush=True)
"""


def test_a_live_apply_holds_memprunes_other_writers_until_its_last_delete(tmp_path) -> None:
    """Issue 27: a second process writing the same JSONL store through memprune (`set_fields`, as `--apply flag`
    or a restore would) while `apply_group` runs waits on the store's lock file until the deletes are done, and
    then works from the file as they left it: neither write is lost."""
    from memprune.stores.base import open_store
    from memprune.stores.group import apply_group

    path = tmp_path / "mem.jsonl"
    path.write_text("".join(json.dumps({"mid": f"m{i}", "memory": f"Memory {i}.", "user": "ann"}) + "\n"
                            for i in range(6)))
    store = open_store("table", str(path), {"id": "mid", "text": "memory", "group": "user"})
    decided = _decided(store, "ann", {"m1", "m2"})
    procs = []

    def other_writer() -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), *sys.path])}
        proc = subprocess.Popen([sys.executable, "-c", LOCKED_WRITER, str(path)], stdout=subprocess.PIPE, text=True,
                                env=env)
        procs.append(proc)
        assert proc.stdout.readline() == "locking\n"
        with pytest.raises(subprocess.TimeoutExpired):  # blocked on the lock this apply holds
            proc.wait(timeout=2)

    done = apply_group(store, decided, tmp_path / "archive", before_delete=other_writer)
    assert done["deleted"] == 2 and done["skipped"] == []
    out, _ = procs[0].communicate(timeout=60)
    assert procs[0].returncode == 0 and out == "done\n"
    got = [json.loads(ln) for ln in path.read_text().splitlines()]
    assert [r["mid"] for r in got] == ["m0", "m3", "m4", "m5"]
    assert [r.get("memprune_note") for r in got] == ["set by the other writer"] * 2 + [None, None]
    assert (tmp_path / ".mem.jsonl.memprune-lock").exists()


LANCE_WRITER = """
import sys, lance
ds = lance.dataset(sys.argv[1])
ds.update({"text": "'Edited by the other writer.'"}, where="id = 'm1'")
lance.dataset(sys.argv[1]).delete("id = 'm2'")
"""


def test_a_live_lance_delete_is_conditional_on_id_and_text(tmp_path) -> None:
    """Issue 27: a second process updates one dropped record of a Lance dataset and deletes another after
    `apply_group`'s check: the delete (`id = X AND text = T`) leaves the updated one (`changed`), reports the
    removed one, deletes the rest; restore gives back exactly those."""
    import lance

    from memprune.stores.base import CHANGED, REMOVED, open_store
    from memprune.stores.group import apply_group

    texts = [f"Memory {i} of Ann, who's 'quoted'." for i in range(6)]
    lance.write_dataset(pa.table({"id": [f"m{i}" for i in range(6)], "text": texts, "user": ["ann"] * 5 + ["bo"]}),
                        str(tmp_path / "mem.lance"))
    store = open_store("lance", str(tmp_path / "mem.lance"), {"group": "user"})
    decided = _decided(store, "ann", {"m1", "m2", "m3", "m4"})

    def other_writer() -> None:
        subprocess.run([sys.executable, "-c", LANCE_WRITER, str(tmp_path / "mem.lance")], check=True, timeout=120)

    done = apply_group(store, decided, tmp_path / "archive", before_delete=other_writer)
    assert done["deleted"] == 2 and _why(done) == {"m1": CHANGED, "m2": REMOVED}
    now = lance.dataset(str(tmp_path / "mem.lance")).to_table().sort_by("id")
    assert now.column("id").to_pylist() == ["m0", "m1", "m5"]
    assert now.column("text").to_pylist()[1] == "Edited by the other writer."
    assert restore(tmp_path / "archive")["restored"] == 2
    assert lance.dataset(str(tmp_path / "mem.lance")).to_table().sort_by("id").column("id").to_pylist() == \
        ["m0", "m1", "m3", "m4", "m5"]


@pytest.mark.slow
def test_a_live_mem0_delete_rechecks_each_memory(tmp_path, minilm_path) -> None:
    """Issue 27: while `apply_group` runs on a real Mem0 store, another thread (sharing the Mem0 client, as a local
    Qdrant allows one) updates one dropped memory and deletes another: each memory is read again right before its
    delete, so the updated one stays (`changed`), the deleted one is reported (`removed`), the rest are deleted;
    restore gives back exactly those."""
    import threading

    from memprune.stores.base import CHANGED, REMOVED
    from memprune.stores.group import apply_group
    from memprune.stores.mem0_store import Mem0Store

    config = mem0_config(tmp_path, minilm_path)
    memory = mem0_memory(config)
    try:
        for text in USERS["alice"][2:] + USERS["bob"][:2]:
            memory.add([{"role": "user", "content": text}], user_id="alice" if text in USERS["alice"] else "bob",
                       infer=False)
        ids = {r["memory"]: r["id"] for r in memory.get_all(filters={"user_id": "alice"}, top_k=100)["results"]}
        store = Mem0Store(str(config), memory=memory)
        edited, gone = ids["ok"], ids["lol"]
        drop = {edited, gone, ids["Alice works night shifts as a nurse."]}
        decided = _decided(store, "alice", drop)

        def other_writer() -> None:
            def write() -> None:
                memory.update(edited, "Alice now works day shifts.")
                memory.delete(gone)
            thread = threading.Thread(target=write)
            thread.start()
            thread.join(timeout=120)

        done = apply_group(store, decided, tmp_path / "archive", before_delete=other_writer)
        assert done["deleted"] == 1 and _why(done) == {edited: CHANGED, gone: REMOVED}
        left = {r["id"]: r["memory"] for r in memory.get_all(filters={"user_id": "alice"}, top_k=100)["results"]}
        assert left == {edited: "Alice now works day shifts.",
                        ids["Alice is training for the Berlin marathon in May."]:
                            "Alice is training for the Berlin marathon in May."}
        assert restore_to_store(store, tmp_path / "archive") == 1
        assert set(r["id"] for r in memory.get_all(filters={"user_id": "alice"}, top_k=100)["results"]) == \
            set(left) | {ids["Alice works night shifts as a nurse."]}
    finally:
        mem0_close(memory)


def restore_to_store(store, archive: Path) -> int:
    from memprune.stores.base import restore_to

    return restore_to(store, read_archive(archive))["restored"]
