"""`memprune prune`: the Ray Data job (streaming and shuffle paths), `MemoryPruner`, bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from memprune.calibration import Calibration, write_calibration
from memprune.prune import (
    GROUP_KEYS,
    MemoryPruner,
    PruneConfig,
    PruneError,
    group_keys_of,
    list_store_files,
    open_store,
    plan_store,
    read_pruned,
    run_prune,
    score_texts,
)
from memprune.prune.stage import DRIVER_BLOCKS, DRIVER_STREAMS, where_to_score
from memprune.prune.store import STORE_DIR
from memprune.schema import BULLETS
from memprune.scorer import Scorer
from memprune.tokens import token_counter

SESSION = list(GROUP_KEYS["session"])


# ------------------------------------------------------------------ fixtures



@pytest.fixture(scope="module")
def calibrated_dir(scorer_dir, tmp_path_factory) -> Path:
    """The vanilla artifact plus a calibration.json: a steep Platt map with P = 0.5 at raw 0.45, so raw and
    calibrated scores cut at 0.5 decide differently."""
    path = tmp_path_factory.mktemp("calibrated") / "scorer"
    shutil.copytree(scorer_dir, path)
    write_calibration(path, Calibration("platt", 0.5, {"a": 4.0, "b": 0.8}))
    return path


@pytest.fixture(scope="module")
def pruner(scorer_dir) -> MemoryPruner:
    return MemoryPruner(scorer_dir, threshold=0.5, top_k=3)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> pa.Table:
    """A small synthetic bullets table (extra columns `recurs`, `kind`), plus a session of 7 equal bullets."""
    from memprune.synth import generate

    out = tmp_path_factory.mktemp("synth")
    generate(conversations=6, sessions=3, out=out, seed=1)
    table = pq.read_table(out / "bullets.parquet")
    ties = pa.table(
        {
            "bullet_id": [f"tie:s0:b{i}" for i in range(7)],
            "conversation_id": ["tie"] * 7,
            "session_index": pa.array([0] * 7, pa.int32()),
            "speaker": ["Ann"] * 7,
            "text": ["Ann has a cat named Tom."] * 7,
            "evidence": [["tie:s0:t0"]] * 7,
            "recurs": [False] * 7,
            "kind": ["pet"] * 7,
        },
        schema=table.schema,
    )
    return pa.concat_tables([table, ties])


@pytest.fixture(scope="module")
def store(tmp_path_factory, corpus) -> Path:
    """The corpus as two Parquet files; the file boundary falls inside a session."""
    d = tmp_path_factory.mktemp("store")
    keys = group_keys_of(corpus, SESSION)
    cut = next(i for i in range(corpus.num_rows // 2, corpus.num_rows) if keys[i - 1] == keys[i])
    pq.write_table(corpus.slice(0, cut), d / "part-0.parquet", row_group_size=40)
    pq.write_table(corpus.slice(cut), d / "part-1.parquet", row_group_size=40)
    return d


def _job(scorer_dir, store, out, group_by="session", **kw) -> dict:
    kw = {"block_rows": 64, "progress": False, "rule": {"top_k": 3, "group_by": group_by}, **kw}
    cfg = PruneConfig(scorer=str(scorer_dir), input=str(store), out=str(out), **kw)
    return run_prune(cfg)


# ------------------------------------------------------------------ the batch job (Ray)


@pytest.fixture(scope="module")
def streamed(ray_local, scorer_dir, store, tmp_path_factory):
    """The batch job through the CLI, group by session: the streaming (contiguous) path."""
    from typer.testing import CliRunner

    from memprune.cli import app

    out = tmp_path_factory.mktemp("streamed")
    result = CliRunner().invoke(
        app,
        ["prune", "--scorer", str(scorer_dir), "--input", str(store), "--out", str(out), "--threshold", "0.5",
         "--top-k", "3", "--set", "block_rows=16", "--set", "progress=false", "--set", "actors=2",
         "--set", "execution=ray"],
    )
    assert result.exit_code == 0, result.output
    return out, json.loads((out / "prune.json").read_text())


def test_streaming_path_rows_order_and_columns(streamed, corpus):
    out, summary = streamed
    assert summary["grouping"]["mode"] == "contiguous"
    assert summary["grouping"]["blocks"] > 5  # several blocks, several actors, still input order
    got = read_pruned(out)
    assert got.num_rows == corpus.num_rows == summary["input"]["rows"] == summary["output"]["rows"]
    assert got["bullet_id"].to_pylist() == corpus["bullet_id"].to_pylist()
    assert got.column_names == [*corpus.column_names, "score", "keep", "reason", "duplicate_of"]
    assert got.select(corpus.column_names).equals(corpus)  # extra columns pass through untouched
    assert got.schema.field("score").type == pa.float64() and got.schema.field("keep").type == pa.bool_()


def test_batch_job_and_memory_pruner_decide_identically(streamed, corpus, pruner):
    got = read_pruned(streamed[0])
    keep, scores = got["keep"].to_numpy(zero_copy_only=False), got["score"].to_numpy()
    sessions = group_keys_of(corpus, SESSION)
    texts = corpus["text"].to_pylist()
    n_sessions = 0
    for key in dict.fromkeys(sessions):
        idx = [i for i, s in enumerate(sessions) if s == key]
        kept = pruner.prune([texts[i] for i in idx])
        assert [idx[k.index] for k in kept] == [i for i in idx if keep[i]], key
        np.testing.assert_allclose([k.score for k in kept], scores[[idx[k.index] for k in kept]], atol=1e-5)
        n_sessions += 1
    assert n_sessions > 10
    # the rule itself, on the job's own scores (duplicates, merged first, aside)
    dup = np.array([r == "duplicate" for r in got["reason"].to_pylist()])
    for key in dict.fromkeys(sessions):
        idx = np.array([i for i, s in enumerate(sessions) if s == key and not dup[i]])
        s = scores[idx]
        passing = np.flatnonzero(s >= 0.5)
        ranked = passing[np.lexsort((passing, -s[passing]))][:3]
        assert sorted(idx[ranked].tolist()) == idx[keep[idx]].tolist()


def test_ties_keep_the_earlier_bullets(streamed, corpus):
    got = read_pruned(streamed[0])
    tie = got.filter(pa.compute.equal(got["conversation_id"], "tie"))
    assert len(set(tie["score"].to_pylist())) == 1  # equal texts, exactly equal scores
    assert tie["score"][0].as_py() >= 0.5  # the seeded vanilla head passes them (else this test would be vacuous)
    # equal texts are duplicates: the earliest represents them, the others go with reason and representative
    assert tie["keep"].to_pylist() == [True] + [False] * 6
    assert tie["reason"].to_pylist() == [None] + ["duplicate"] * 6
    assert tie["duplicate_of"].to_pylist() == [None] + ["tie:s0:b0"] * 6


def test_prune_json_matches_the_written_store(streamed, scorer_dir, pruner):
    out, summary = streamed
    got = read_pruned(out)
    sessions = group_keys_of(got, SESSION)
    n = len(set(sessions))
    keep = got["keep"].to_numpy(zero_copy_only=False)
    count, unit = token_counter("encoder", tokenizer=pruner.scorer.tokenizer)
    tokens = count(got["text"].to_pylist())
    r = summary["result"]
    assert summary["groups"] == n and r["top_k"] == 3 and r["threshold"] == 0.5
    assert r["bullets_total_before"] == got.num_rows and r["bullets_total_after"] == int(keep.sum())
    assert r["tokens_total_before"] == int(tokens.sum()) and r["tokens_total_after"] == int(tokens[keep].sum())
    assert r["bullets_before"] == pytest.approx(got.num_rows / n)
    assert r["bullet_reduction_pct"] == pytest.approx(100 * (1 - keep.mean()))
    assert r["token_reduction_pct"] == pytest.approx(100 * (1 - tokens[keep].sum() / tokens.sum()))
    assert set(summary["settings"]) == {"t0.5_k3", "t0.5_k1", "t0.5_k5", "t0.5_kall"}
    k1, kall = summary["settings"]["t0.5_k1"], summary["settings"]["t0.5_kall"]
    assert k1["bullets_after"] <= r["bullets_after"] <= summary["settings"]["t0.5_k5"]["bullets_after"] <= kall["bullets_after"]
    dup = np.array([r == "duplicate" for r in got["reason"].to_pylist()])
    assert kall["bullets_total_after"] == int(((got["score"].to_numpy() >= 0.5) & ~dup).sum())
    assert r["dropped_by_reason"]["duplicate"] == int(dup.sum()) == summary["duplicates"] >= 6
    assert summary["tokenizer"].startswith("tokens of the scorer's encoder tokenizer")
    assert "| t0.5_k3 (written) |" in (out / "prune.md").read_text()


def test_prune_json_records_the_precision_that_ran(streamed):
    """`precision: auto` (the default) is the request; on the CPU the actors ran fp32, and prune.json says so."""
    _, summary = streamed
    assert summary["config"]["precision"] == "auto"
    assert summary["resources"]["precision_requested"] == "auto" and summary["resources"]["precision"] == "fp32"


def test_prune_json_says_where_the_time_went(streamed):
    """`timing.parts` cuts the wall time into the job's steps (they add up to it); per actor: load, blocks, busy."""
    out, summary = streamed
    t = summary["timing"]
    parts = t["parts"]
    assert set(parts) == {"checks_s", "ray_init_s", "plan_s", "actor_start_s", "compute_s", "stall_s", "drain_s",
                          "finish_s", "other_s"}
    assert sum(parts.values()) == pytest.approx(t["wall_s"], abs=0.01)
    assert min(parts.values()) >= -0.01 and parts["compute_s"] == t["compute_s"] > 0
    assert parts["actor_start_s"] > 0 and parts["actor_start_s"] + parts["compute_s"] <= t["pipeline_s"] + 0.01
    assert 0 <= t["underused_s"] <= t["compute_s"]
    actors = t["actors"]
    assert len(actors) == summary["resources"]["actors"] == t["work"]["actors_started"]
    assert sum(a["blocks"] for a in actors) == summary["grouping"]["blocks"]
    assert all(0 <= a["created_s"] < a["ready_s"] and a["load_s"] == pytest.approx(a["ready_s"] - a["created_s"], abs=0.01)
               and a["busy_s"] <= t["compute_s"] + 0.01 for a in actors)
    assert 0 < t["work"]["tokenize_s"] < t["work"]["score_s"]
    assert "Time: checks " in (out / "prune.md").read_text()


def test_scoring_on_the_driver_writes_what_the_ray_job_writes(streamed, scorer_dir, store, tmp_path):
    """execution driver (auto's choice for a small store with no cluster named): the same store, files, decisions
    and counters as the Ray job, without Ray; prune.json says where it ran."""
    import torch
    from typer.testing import CliRunner

    from memprune.cli import app

    ray_out, ray_summary = streamed
    args = ["prune", "--scorer", str(scorer_dir), "--input", str(store), "--threshold", "0.5", "--top-k", "3",
            "--set", "block_rows=16", "--set", "progress=false"]
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path), "--set", "execution=driver",
                                      "--set", "rows_per_file=100"])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "prune.json").read_text())
    assert summary["resources"]["execution"] == "driver" and ray_summary["resources"]["execution"] == "ray"
    assert summary["resources"]["nodes"] == 1  # scored by DRIVER_STREAMS threads, each with its own scorer
    assert (summary["resources"]["actors"] == len(summary["timing"]["actors"])
            == min(DRIVER_STREAMS, torch.get_num_threads()))
    assert "ray_init_s" not in summary["timing"]["parts"]
    got, want = read_pruned(tmp_path), read_pruned(ray_out)
    sizes = [pq.ParquetFile(tmp_path / STORE_DIR / f).metadata.num_rows for f in summary["output"]["files"]]
    assert len(sizes) > 1 and min(sizes[:-1]) >= 100 and sum(sizes) == got.num_rows  # as write_parquet cuts them
    assert summary["grouping"]["blocks"] == DRIVER_BLOCKS  # block_rows=16 raised: four length-sorted windows
    assert got.drop_columns(["score"]).equals(want.drop_columns(["score"]))
    np.testing.assert_allclose(got["score"].to_numpy(), want["score"].to_numpy(), rtol=1e-5, atol=1e-6)
    for key in ("groups", "result", "settings", "duplicates"):
        assert summary[key] == ray_summary[key], key
    # auto: this small store with no cluster named is scored here; naming a cluster or a bigger store: on Ray
    cfg = PruneConfig(scorer=str(scorer_dir), input=str(store), out=str(tmp_path / "x"))
    assert where_to_score(cfg, 100) == "driver"
    assert where_to_score(cfg.model_copy(update={"driver_rows": 99}), 100) == "ray"
    assert where_to_score(cfg.model_copy(update={"ray_address": "auto"}), 100) == "ray"
    assert where_to_score(cfg.model_copy(update={"execution": "ray"}), 1) == "ray"


def test_window_split_and_underused_seconds():
    from memprune.timing import underused_seconds, window_split

    got = window_split(0.0, 10.0, [(2.0, 4.0), (3.0, 5.0), (6.0, 8.0), (11.0, 12.0)])
    assert got == {"startup_s": 2.0, "compute_s": 5.0, "stall_s": 1.0, "drain_s": 2.0}
    assert window_split(0.0, 3.0, []) == {"startup_s": 3.0, "compute_s": 0.0, "stall_s": 0.0, "drain_s": 0.0}
    # two workers: one busy 0-4, the other 2-4: a union of 4 s, 1 s lost on average to the idle one
    assert underused_seconds([[(0.0, 4.0)], [(2.0, 4.0)]]) == pytest.approx(1.0)
    assert underused_seconds([[(0.0, 4.0)], [(0.0, 4.0)]]) == 0.0 and underused_seconds([]) == 0.0


@pytest.mark.slow  # a Ray Data job of 20 s or more
def test_batch_job_prunes_on_calibrated_scores_where_available(ray_local, calibrated_dir, scorer_dir, store,
                                                              corpus, tmp_path):
    out = tmp_path / "calibrated"
    summary = _job(calibrated_dir, store, out)
    assert summary["score"] == {"requested": "auto", "used": "calibrated", "note": None,
                                "calibration": {"method": "platt", "relevance_threshold": 0.5}}
    assert summary["scorer"]["calibration"] == {"method": "platt", "relevance_threshold": 0.5}
    got = read_pruned(out)
    expected = MemoryPruner(calibrated_dir, threshold=0.5, top_k=3).prune_table(corpus)  # auto: calibrated too
    np.testing.assert_allclose(got["score"].to_numpy(), expected["score"].to_numpy(), atol=1e-5)
    assert got["keep"].to_pylist() == expected["keep"].to_pylist()
    assert "Scores: calibrated P(label >= 0.5) (platt)" in (out / "prune.md").read_text()
    with pytest.raises(PruneError, match=r"score 'calibrated' asked for, but the scorer artifact has no calibration"):
        _job(scorer_dir, store, tmp_path / "never", score="calibrated")  # refused on the driver, before Ray
    assert not (tmp_path / "never" / "pruned").exists()


def test_memory_pruner_raw_vs_calibrated(calibrated_dir, scorer_dir, corpus):
    texts = corpus["text"].to_pylist()[:60]
    loaded = Scorer.load(calibrated_dir)
    assert loaded.calibration is not None and loaded.source == calibrated_dir
    raw = MemoryPruner(loaded, threshold=0.5, top_k=None, score="raw", dedup=False)
    cal = MemoryPruner(loaded, threshold=0.5, top_k=None, dedup=False)  # auto: the artifact has a calibration
    assert cal.calibrated and cal.score_note is None and not raw.calibrated
    r, c = raw.score(texts), cal.score(texts)
    np.testing.assert_allclose(c, loaded.calibration.apply(r))
    np.testing.assert_allclose(c, loaded.score(texts, calibrated=True), atol=1e-6)  # other batches: float noise
    assert (np.diff(c[np.argsort(r, kind="stable")]) >= 0).all()  # the map keeps the raw order
    keep_r, keep_c = raw.decide(texts)[1], cal.decide(texts)[1]
    assert keep_r.tolist() == (r >= 0.5).tolist() and keep_c.tolist() == (c >= 0.5).tolist()
    assert keep_c.sum() > keep_r.sum()  # raw scores in [0.45, 0.5) pass only once calibrated
    plain = MemoryPruner(Scorer.load(scorer_dir), threshold=0.5)
    assert not plain.calibrated and plain.score_note.endswith("has no calibration.json: pruned on raw scores")
    with pytest.raises(PruneError, match="no calibration.json"):
        MemoryPruner(plain.scorer, score="calibrated")


@pytest.mark.slow  # a Ray Data job of 20 s or more
def test_shuffle_path_for_interleaved_groups(ray_local, scorer_dir, store, corpus, pruner, tmp_path):
    """group_by speaker: a speaker's bullets interleave across sessions, so the job must shuffle (here through the
    distributed `Dataset.sort`, as on a store above `sort_in_memory` rows; test_prune_job_policies.py runs the
    driver-side sort of a small store)."""
    summary = _job(scorer_dir, store, tmp_path, group_by="speaker", actors=1, sort_in_memory=0, execution="ray")
    assert summary["grouping"]["mode"] == "shuffle" and not summary["grouping"]["contiguous"]
    assert summary["grouping"]["sort"] == "distributed"
    got = read_pruned(tmp_path)
    assert got.num_rows == corpus.num_rows
    assert sorted(got["bullet_id"].to_pylist()) == sorted(corpus["bullet_id"].to_pylist())
    expected = pruner.prune_table(corpus, group_by="speaker")
    cols = ("keep", "reason", "duplicate_of")  # same decisions and reasons (duplicates merged across the sort)
    want = dict(zip(expected["bullet_id"].to_pylist(), zip(*(expected[c].to_pylist() for c in cols))))
    assert dict(zip(got["bullet_id"].to_pylist(), zip(*(got[c].to_pylist() for c in cols)))) == want
    assert "duplicate" in expected["reason"].to_pylist()
    # rows come out grouped (by key), each group in input order
    pos = {b: i for i, b in enumerate(corpus["bullet_id"].to_pylist())}
    keys = group_keys_of(got, GROUP_KEYS["speaker"])
    runs = [k for i, k in enumerate(keys) if i == 0 or keys[i - 1] != k]
    assert len(runs) == len(set(runs)) == summary["groups"]
    for key in set(keys):
        rows = [pos[b] for b, k in zip(got["bullet_id"].to_pylist(), keys) if k == key]
        assert rows == sorted(rows)


def test_nan_scores_fail_the_job_loudly(ray_local, scorer_dir, store, streamed, tmp_path, minilm_path):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "nan-scorer"
    broken.mkdir()
    (broken / "scorer.json").write_text((scorer_dir / "scorer.json").read_text())
    head = load_file(str(scorer_dir / "head.safetensors"))
    head = {k: v.clone().fill_(float("nan")) if k.endswith("bias") else v for k, v in head.items()}
    save_file(head, str(broken / "head.safetensors"))
    # The failed run goes over an earlier prune's outputs: it must leave them whole (and write nothing of its own).
    shutil.copytree(streamed[0], tmp_path / "out")
    files = sorted((tmp_path / "out").rglob("*"))
    before = [(str(f.relative_to(tmp_path / "out")), f.read_bytes() if f.is_file() else None) for f in files]
    for execution in ("ray", "driver"):  # inside an actor or in this process: the same one line
        with pytest.raises(PruneError, match=r"non-finite score.*first for bullet"):
            _job(broken, store, tmp_path / "out", actors=1, execution=execution)
    files = sorted((tmp_path / "out").rglob("*"))
    assert [(str(f.relative_to(tmp_path / "out")), f.read_bytes() if f.is_file() else None) for f in files] == before
    with pytest.raises(PruneError, match="non-finite"):
        MemoryPruner(broken).prune(["a bullet"])


# ------------------------------------------------------------------ the plan (no Ray)


def _files(tmp_path, tables) -> list:
    paths = []
    for i, t in enumerate(tables):
        p = tmp_path / f"f{i}.parquet"
        pq.write_table(t, p, row_group_size=3)
        paths.append(p)
    return open_store(paths, None)[0]


def _bullets(keys: list[tuple[str, int]], first: int = 0) -> pa.Table:
    n = len(keys)
    return pa.table(
        {
            "bullet_id": [f"b{i}" for i in range(first, first + n)],
            "conversation_id": [k[0] for k in keys],
            "session_index": pa.array([k[1] for k in keys], pa.int32()),
            "speaker": ["A"] * n,
            "text": [f"fact {i}" for i in range(n)],
            "evidence": [[]] * n,
        },
        schema=BULLETS,
    )


def test_plan_cuts_blocks_at_group_boundaries_across_files(tmp_path):
    keys = [("c1", 0)] * 4 + [("c1", 1)] * 3 + [("c2", 0)] * 5 + [("c2", 1)] * 2
    files = _files(tmp_path, [_bullets(keys[:6]), _bullets(keys[6:], first=6)])  # ("c1", 1) spans both files
    plan = plan_store(files, SESSION, block_rows=3)
    assert plan.contiguous and plan.mode == "contiguous" and plan.runs == 4 and plan.rows == 14
    assert plan.blocks == [(0, 4), (4, 7), (7, 12), (12, 14)]
    assert plan_store(files, SESSION, block_rows=100).blocks == [(0, 14)]
    assert plan_store(files, SESSION, block_rows=3, limit_rows=5).blocks == [(0, 4), (4, 7)]  # whole groups
    assert plan_store(files, SESSION, block_rows=5, grouping="shuffle").blocks == [(0, 5), (5, 10), (10, 14)]


def test_plan_detects_interleaved_groups(tmp_path):
    keys = [("c1", 0)] * 2 + [("c2", 0)] * 2 + [("c1", 0)] * 2
    files = _files(tmp_path, [_bullets(keys)])
    plan = plan_store(files, SESSION, block_rows=2)
    assert not plan.contiguous and plan.mode == "shuffle"
    assert "f0.parquet row 0 appears again at" in plan.reason and "row 4" in plan.reason
    with pytest.raises(PruneError, match="grouping 'contiguous' requested"):
        plan_store(files, SESSION, block_rows=2, grouping="contiguous")
    # non-decreasing keys are not required, only adjacency
    assert plan_store(_files(tmp_path, [_bullets([("z", 1), ("a", 0), ("a", 0)])]), SESSION, 1).contiguous


def test_empty_store_writes_an_empty_store(tmp_path, scorer_dir):
    pq.write_table(_bullets([]), tmp_path / "empty.parquet")
    summary = run_prune(PruneConfig(scorer=str(scorer_dir), input=str(tmp_path / "empty.parquet"), out=str(tmp_path / "o")))
    got = read_pruned(tmp_path / "o")
    assert got.num_rows == 0 and got.column_names[-4:] == ["score", "keep", "reason", "duplicate_of"]
    assert summary["groups"] == 0 and summary["result"]["bullets_total_after"] == 0


# ------------------------------------------------------------------ bad input (no Ray)


def _cfg(scorer_dir, path, tmp_path) -> PruneConfig:
    return PruneConfig(scorer=str(scorer_dir), input=str(path), out=str(tmp_path / "out"))


def test_schema_mismatch_names_file_and_column(tmp_path, scorer_dir):
    good = _bullets([("c", 0)] * 3)
    cases = {
        "missing.parquet": (good.drop_columns(["text"]), r"missing\.parquet: column 'text' missing"),
        "type.parquet": (good.set_column(2, "session_index", pa.array(["0", "0", "0"])),
                         r"type\.parquet: column 'session_index' has type string, expected int32"),
        "nulls.parquet": (good.set_column(4, "text", pa.array(["a", None, "c"])),
                          r"nulls\.parquet: column 'text' has 1 null value\(s\) in rows 0-2"),
    }
    for name, (table, pattern) in cases.items():
        pq.write_table(table, tmp_path / name)
        with pytest.raises(PruneError, match=pattern):
            run_prune(_cfg(scorer_dir, tmp_path / name, tmp_path))
    # an int64 session_index (pandas writes one) whose values fit is read as int32
    pq.write_table(good.set_column(2, "session_index", pa.array([0, 0, 0], pa.int64())), tmp_path / "wide.parquet")
    assert run_prune(_cfg(scorer_dir, tmp_path / "wide.parquet", tmp_path))["output"]["rows"] == 3
    d = tmp_path / "mixed"
    d.mkdir()
    pq.write_table(good, d / "a.parquet")
    pq.write_table(good.append_column("note", pa.array(["x"] * 3)), d / "b.parquet")
    with pytest.raises(PruneError, match=r"b\.parquet: column 'note' is not in .*a\.parquet"):
        run_prune(_cfg(scorer_dir, d, tmp_path))
    with pytest.raises(PruneError, match=r"column 'nope' \(named in `columns`\) missing"):
        run_prune(PruneConfig(scorer=str(scorer_dir), input=str(d / "a.parquet"), out=str(tmp_path / "o"), columns=["nope"]))


def test_corrupted_input_names_the_file(tmp_path, scorer_dir):
    bad = tmp_path / "garbage.parquet"
    bad.write_bytes(b"PAR1 this is not parquet at all")
    with pytest.raises(PruneError, match=r"garbage\.parquet: cannot read as Parquet"):
        run_prune(_cfg(scorer_dir, bad, tmp_path))
    full = tmp_path / "full.parquet"
    pq.write_table(_bullets([("c", 0)] * 50), full)
    cut = tmp_path / "truncated.parquet"
    cut.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    with pytest.raises(PruneError, match=r"truncated\.parquet: cannot read as Parquet"):
        run_prune(_cfg(scorer_dir, cut, tmp_path))
    with pytest.raises(PruneError, match="no such file or directory"):
        run_prune(_cfg(scorer_dir, tmp_path / "absent", tmp_path))
    with pytest.raises(PruneError, match="not a scorer artifact"):
        run_prune(PruneConfig(scorer=str(tmp_path), input=str(full), out=str(tmp_path / "o")))


def test_cli_reports_bad_input_in_one_line(tmp_path, scorer_dir):
    from typer.testing import CliRunner

    from memprune.cli import app

    pq.write_table(_bullets([("c", 0)]).drop_columns(["evidence"]), tmp_path / "b.parquet")
    result = CliRunner().invoke(app, ["prune", "--scorer", str(scorer_dir), "--input", str(tmp_path / "b.parquet"),
                                      "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert "column 'evidence' missing" in " ".join(result.output.split())


def test_corpus_dir_resolves_to_its_bullets_file(tmp_path):
    pq.write_table(_bullets([("c", 0)]), tmp_path / "bullets.parquet")
    pq.write_table(pa.table({"x": [1]}), tmp_path / "sessions.parquet")
    assert list_store_files(tmp_path) == [tmp_path / "bullets.parquet"]


# ------------------------------------------------------------------ MemoryPruner and the rule edge cases


class FixedScorer:
    """Returns preset scores by text: exercises the rule wiring without a model."""

    def __init__(self, scores: dict[str, float]) -> None:
        self.scores = scores

    def score(self, texts, batch_size=64):
        return np.array([self.scores[t] for t in texts], dtype=np.float64)


def test_memory_pruner_rule_edge_cases():
    sc = FixedScorer({"a": 0.9, "b": 0.7, "c": 0.7, "d": 0.7, "e": 0.2, "f": float("nan")})
    p = MemoryPruner(sc, threshold=0.5, top_k=2)
    kept = p.prune(["e", "c", "a", "b", "d"])
    assert [(k.index, k.text, k.score) for k in kept] == [(1, "c", 0.7), (2, "a", 0.9)]  # tie 0.7: earliest wins
    assert [k.text for k in p.prune(["b", "e"])] == ["b"]  # group smaller than k
    assert p.prune([]) == []  # empty group
    # everything below the threshold: by default (min_keep 1) the group keeps its best; min_keep 0 empties it
    assert [(k.index, k.text) for k in p.prune(["e", "e"])] == [(0, "e")]
    assert MemoryPruner(sc, threshold=0.5, top_k=2, min_keep=0).prune(["e", "e"]) == []
    assert [k.text for k in MemoryPruner(sc, threshold=None, top_k=None).prune(["e", "a"])] == ["e", "a"]
    assert [k.text for k in MemoryPruner(sc, threshold=0.7, top_k=None).prune(["b", "e", "c"])] == ["b", "c"]
    with pytest.raises(PruneError, match=r"non-finite score.*bullets\[1\]"):
        p.prune(["a", "f"])
    kept = p.prune([{"text": "a", "id": 1}, {"text": "b", "id": 2}, {"text": "c", "id": 3}])
    assert [k.bullet["id"] for k in kept] == [1, 2]
    with pytest.raises(PruneError, match=r"bullets\[1\]: is int"):
        p.prune(["a", 3])
    _, keep = p.decide(["a", "b", "c", "e"], groups=["x", "y", "x", "y"])
    assert keep.tolist() == [True, True, True, False]
    for bad in ({"top_k": 0}, {"top_k": 2.5}, {"threshold": float("nan")}):
        with pytest.raises(PruneError):
            MemoryPruner(sc, **bad)
    # issue 56, item 7: what is not a list of bullets, too many, or text that is not Unicode: one line each
    for bad, kind in (("abc", "str"), (None, "NoneType"), ({"text": "a"}, "dict"), (7, "int")):
        for call in (p.prune, p.decide, p.decisions, p.score):
            with pytest.raises(PruneError, match=rf"^bullets: a list of strings or of mappings with 'text', not {kind}$"):
                call(bad)
    with pytest.raises(PruneError, match=r"^bullets: 4 in one call, at most 3 \(MemoryPruner max_bullets\)"):
        MemoryPruner(sc, threshold=0.5, max_bullets=3).prune(["a", "b", "c", "e"])
    with pytest.raises(PruneError, match=r"^bullets\[1\]: not valid Unicode text: a lone surrogate U\+DC00 at character 1$"):
        p.prune(["a", {"text": "b\udc00"}])


def test_score_texts_dedupes_and_restores_order():
    calls = []

    class Recorder(FixedScorer):
        def score(self, texts, batch_size=64):
            calls.append(list(texts))
            return super().score(texts, batch_size)

    sc = Recorder({"long text": 0.1, "s": 0.2, "mid": 0.3})
    out = score_texts(sc, ["mid", "long text", "s", "mid"], batch_size=2)
    assert out.tolist() == [0.3, 0.1, 0.2, 0.3]
    assert calls == [["s", "mid", "long text"]]  # each distinct text once, shortest first


def test_config_validation_and_shipped_configs():
    from memprune.config import ConfigError, load_config

    root = Path(__file__).resolve().parents[1]
    for name in ("prune-local.yaml", "prune-gpu.yaml", "paper-prune.yaml"):
        cfg = load_config(root / "configs" / name, [], PruneConfig)
        assert cfg.rule.policy.threshold == 0.5 and cfg.rule.policy.top_k == 5
        # the shipped configs never empty a session; the paper's exact rule is one config away
        assert cfg.rule.min_keep == (0 if name.startswith("paper") else 1)
    assert PruneConfig(scorer="s", input="i", out="o").rule.min_keep == 1  # the safe default
    from memprune.pipeline import PipelineConfig

    for name, min_keep in (("pipeline-local.yaml", 1), ("paper-pipeline.yaml", 0)):
        cfg = load_config(root / "configs" / name, [], PipelineConfig)
        assert cfg.prune.rule.min_keep == min_keep and cfg.evaluate.rule.min_keep == 0
    with pytest.raises(ConfigError, match="top_k"):
        load_config(root / "configs" / "prune-local.yaml", ["rule.top_k=0"], PruneConfig)
    with pytest.raises(ConfigError, match="group_by"):
        load_config(root / "configs" / "prune-local.yaml", ["rule.group_by=turn"], PruneConfig)


def test_the_ray_that_prunes_listens_on_loopback_only(streamed) -> None:
    """Issue 56, item 2: the session's Ray, started as memprune starts its own (`init_local_ray`), after a prune on Ray
    Data: no process of it (GCS, raylet, dashboard, agents, workers, this driver) listens beyond 127.0.0.1."""
    from helpers import listeners_beyond_loopback

    assert listeners_beyond_loopback() == []
