"""The batch job (Ray) against `MemoryPruner` for every policy; dry run; `--emit split` and `memprune restore`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from memprune.prune import MemoryPruner, PruneConfig, PruneRule, read_pruned, run_prune


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    """A synthetic corpus with injected verbatim and paraphrased duplicates and fact updates."""
    from memprune.synth import generate

    out = tmp_path_factory.mktemp("synth-dup")
    generate(conversations=5, sessions=3, out=out, seed=2, duplicates=0.3, updates=0.5)
    return out


@pytest.fixture(scope="module")
def corpus(corpus_dir) -> pa.Table:
    return pq.read_table(corpus_dir / "bullets.parquet")


def _decisions(table: pa.Table) -> dict[str, tuple]:
    cols = ("bullet_id", "keep", "reason", "duplicate_of", "superseded_by")
    return {b: tuple(rest) for b, *rest in zip(*(table.column(c).to_pylist() for c in cols if c in table.column_names))}


def _same_as_memory_pruner(scorer_dir: Path, rule: PruneRule, corpus: pa.Table, got: dict[str, tuple]) -> None:
    expected = MemoryPruner(scorer_dir, rule=rule).prune_table(corpus)
    assert got == _decisions(expected)  # every bullet: kept, reason, duplicate_of


def test_budget_dry_run_matches_memory_pruner_and_writes_no_store(ray_local, scorer_dir, corpus_dir, corpus, tmp_path):
    rule = PruneRule.of(policy="budget", budget_tokens=24, min_keep=1)
    summary = run_prune(PruneConfig(scorer=str(scorer_dir), input=str(corpus_dir), out=str(tmp_path), rule=rule,
                                    dry_run=True, preview_groups=1000, block_rows=24, progress=False))
    assert summary["dry_run"] and summary["output"] is None
    assert not (tmp_path / "pruned").exists()  # no store written: the decision alone, every bullet, no store columns
    decision = pq.read_table(tmp_path / "decision")
    assert decision.num_rows == corpus.num_rows and "evidence" not in decision.column_names
    assert {"bullet_id", "conversation_id", "session_index", "score", "keep", "reason"} <= set(decision.column_names)
    assert {p.name for p in tmp_path.iterdir()} >= {"prune.json", "prune.md", "preview.jsonl", "review.html"}
    preview = [json.loads(ln) for ln in (tmp_path / "preview.jsonl").read_text().splitlines()]
    assert len(preview) == corpus.num_rows  # every group sampled at this size
    got = {p["bullet_id"]: (p["kept"], p["reason"], p["duplicate_of"]) for p in preview}
    _same_as_memory_pruner(scorer_dir, rule, corpus, got)
    r = summary["result"]
    assert r["groups_emptied"] == 0  # min-keep 1: no session is emptied
    assert r["dropped_by_reason"]["over_budget"] > 0 and r["dropped_by_reason"]["duplicate"] > 0
    assert summary["duplicates"] == r["dropped_by_reason"]["duplicate"]
    assert "over_budget" in (tmp_path / "prune.md").read_text()


@pytest.mark.slow  # a Ray Data job of 20 s or more
def test_fraction_shuffle_split_then_restore_gives_back_the_input(ray_local, scorer_dir, corpus_dir, corpus, tmp_path):
    from memprune.cli import app

    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["prune", "--scorer", str(scorer_dir), "--input", str(corpus_dir), "--out", str(out),
                                   "--fraction", "0.5", "--floor", "0.3", "--emit", "split", "--group-by", "speaker",
                                   "--supersede", "slot", "--set", "grouping=shuffle",
                                   "--set", "block_rows=24", "--set", "progress=false", "--set", "actors=1"])
    assert res.exit_code == 0, res.output
    summary = json.loads((out / "prune.json").read_text())
    rule = PruneRule.of(policy="fraction", fraction=0.5, floor=0.3, group_by="speaker", supersede={"judge": "slot"})
    assert summary["rule"]["policy"] == "fraction" and summary["rule"]["name"] == rule.name
    # the embeddings travel through the sort to the decision; the sort keeps each conversation (the supersession
    # scope: without the forced shuffle it streams, since conversations are contiguous) in one block
    assert summary["grouping"]["mode"] == "shuffle" and summary["grouping"]["sort"] == "driver"  # a small store
    assert "warning:" not in res.output  # fraction keeps at least one bullet of every speaker above the floor
    pruned = read_pruned(out)
    _same_as_memory_pruner(scorer_dir, rule, corpus, _decisions(pruned))
    kept = pq.read_table(out / "kept" / "part-00000.parquet")
    pos = {b: i for i, b in enumerate(corpus.column("bullet_id").to_pylist())}
    in_order = pruned.take(pa.array(np.argsort([pos[b] for b in pruned.column("bullet_id").to_pylist()])))
    keep = in_order.column("keep").to_numpy(zero_copy_only=False)
    assert kept.column_names == corpus.column_names and kept.equals(corpus.filter(pa.array(keep)))
    archive = json.loads((out / "dropped" / "archive.json").read_text())
    assert archive["rows"] == int((~keep).sum()) and archive["fingerprint"] == summary["fingerprint"]
    dropped = pq.read_table(out / "dropped" / "archive.parquet")
    reasons = dropped.column("memprune_reason").to_pylist()
    assert set(reasons) <= {"duplicate", "superseded", "below_floor", "over_top_k"} and "superseded" in reasons
    by = dropped.column("memprune_superseded_by").to_pylist()
    assert all((b is not None) == (r == "superseded") for b, r in zip(by, reasons))  # restore gives them back too
    # restore some, then the rest: the kept store becomes the input again, in input order
    ids = dropped.column("bullet_id").to_pylist()
    (tmp_path / "ids.txt").write_text("\n".join(ids[:3]) + "\n")
    res = CliRunner().invoke(app, ["restore", "--archive", str(out / "dropped"), "--ids", str(tmp_path / "ids.txt")])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["restored"] == 3
    res = CliRunner().invoke(app, ["restore", "--archive", str(out / "dropped"), "--all"])
    assert res.exit_code == 0, res.output
    done = json.loads(res.stdout)
    assert done["restored"] == len(ids) - 3 and done["already_present"] == 3 and done["placement"] == "input positions"
    from memprune.prune import list_store_files

    restored = pa.concat_tables([pq.read_table(f) for f in list_store_files(out / "kept")])
    assert restored.equals(corpus)
    res = CliRunner().invoke(app, ["restore", "--archive", str(out / "dropped")])
    assert res.exit_code == 2 and "exactly one of --ids FILE or --all" in res.output


def test_cli_warns_in_one_line_when_many_groups_end_up_empty(monkeypatch, tmp_path):
    """The warning's wiring (no Ray): a run whose prune.json says 3 of 10 sessions were emptied."""
    import memprune.prune as prune_pkg
    from memprune.cli import app

    def fake_run(cfg):
        result = {"bullets_after": 1.0, "bullets_before": 3.0, "bullet_reduction_pct": 66.7, "token_reduction_pct": 60.0,
                  "groups_emptied": 3, "groups_emptied_pct": 30.0}
        return {"result": result, "duplicates": 0, "groups": 10, "rule": {"group_by": "session", "name": "t0.5_k5"}}

    monkeypatch.setattr(prune_pkg, "run", fake_run)
    res = CliRunner().invoke(app, ["prune", "--scorer", "s", "--input", "i", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    lines = [ln for ln in res.output.splitlines() if "warning:" in ln]
    assert len(lines) == 1 and "30% of the sessions (3 of 10) end up empty under t0.5_k5" in lines[0]
    monkeypatch.setattr(prune_pkg, "run", lambda cfg: {**fake_run(cfg), "result": {**fake_run(cfg)["result"],
                                                                                     "groups_emptied_pct": 20.0}})
    assert "warning:" not in CliRunner().invoke(app, ["prune", "--scorer", "s", "--input", "i", "--out", str(tmp_path)]).output
