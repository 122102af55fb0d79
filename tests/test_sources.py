"""Label sources beyond the judge: QA-evidence labels (LoCoMo-format fixture), usage-log labels
with rejects (JSONL and Parquet), the `source` column of every labels table, and the CLI."""

from __future__ import annotations

import datetime as dt
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from memprune import schema
from memprune.cli import app
from memprune.io import read_table, write_table
from memprune.label import LabelConfig, aggregate, run_label
from memprune.label.sources import (
    NO_LATER_SESSION,
    NO_QA_FOR_CONVERSATION,
    NO_USAGE_EVENTS,
    NO_USAGE_FOR_CONVERSATION,
    QAOptions,
    SourceError,
    UsageOptions,
    parse_time,
    qa_labels,
    read_usage_log,
    usage_labels,
)
from memprune.rejects import Ledger

M1, M2 = "locomo:mini-1", "locomo:mini-2"


@pytest.fixture(scope="module")
def locomo(fixtures_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The LoCoMo-format fixture ingested: 2 conversations x 2 sessions, 11 bullets, 8 QA items."""
    from memprune.ingest import ingest

    out = tmp_path_factory.mktemp("locomo")
    ingest("locomo", fixtures_dir / "locomo_mini.json", out)
    return out


def _tables(root: Path) -> tuple[pa.Table, pa.Table, pa.Table]:
    return (read_table(root / "bullets.parquet", "bullets"), read_table(root / "qa.parquet", "qa"),
            read_table(root / "sessions.parquet", "sessions"))


def _by_id(labels: pa.Table) -> dict[str, tuple[float, int]]:
    return {r["bullet_id"]: (r["label"], r["n_pairs"]) for r in labels.to_pylist()}


# ---------------------------------------------------------------- qa


def test_qa_binary_and_graded_labels_by_hand(locomo: Path):
    bullets, qa, sessions = _tables(locomo)
    res = qa_labels(bullets, qa, sessions)
    got = _by_id(res.labels)
    # Citing QA items (evidence overlap), from the fixture:
    #   mini-1 q0 s1:t0 | q1 s1:t1,s1:t3 | q2 (cat 5) s2:t0 | q3 s1:t2 | q5 s2:t0
    #   mini-2 q0 s1:t2 | q1 s2:t0,s1:t1 | q2 no evidence (not usable)
    expected_n = {f"{M1}:s1:b0": 1, f"{M1}:s1:b1": 1, f"{M1}:s1:b2": 2, f"{M1}:s1:b3": 1, f"{M1}:s1:b4": 1,
                  f"{M1}:s2:b1": 2, f"{M1}:s2:b3": 0, f"{M2}:s1:b0": 0, f"{M2}:s1:b1": 2, f"{M2}:s1:b2": 1,
                  f"{M2}:s2:b0": 1}
    assert got == {b: (1.0 if n else 0.0, n) for b, n in expected_n.items()}
    assert set(res.labels.column("source").to_pylist()) == {"qa"}
    assert set(res.labels.column("aggregation").to_pylist()) == {"qa:binary"}
    schema.validate_table(res.labels, "labels")
    c = res.counts
    assert c["qa"] == 8 and c["qa_used"] == 7 and c["qa_without_evidence"] == 1 and c["bullets_cited"] == 9
    assert c["bullets"] == c["bullets_labelled"] + c["bullets_unlabelled"] == 11

    graded = _by_id(qa_labels(bullets, qa, sessions, QAOptions(grading="graded", grade_cap=2)).labels)
    assert graded == {b: (min(1.0, n / 2), n) for b, n in expected_n.items()}

    no_adversarial = _by_id(qa_labels(bullets, qa, sessions, QAOptions(categories=(1, 2, 3, 4))).labels)
    assert no_adversarial[f"{M1}:s2:b1"] == (1.0, 1)  # q2 (category 5) no longer counts, q5 still does


def test_qa_later_only_counts_questions_reaching_a_later_session(locomo: Path):
    bullets, qa, sessions = _tables(locomo)
    res = qa_labels(bullets, qa, sessions, QAOptions(later_only=True))
    got = _by_id(res.labels)
    # Only mini-2 q1 (evidence in sessions 1 and 2) reaches beyond session 1; last-session bullets are unlabelled.
    assert {b for b, (y, _) in got.items() if y > 0} == {f"{M2}:s1:b1", f"{M2}:s1:b2"}
    assert len(got) == 8
    assert {u["bullet_id"]: u["reason"] for u in res.unlabelled} == {
        f"{M1}:s2:b1": NO_LATER_SESSION, f"{M1}:s2:b3": NO_LATER_SESSION, f"{M2}:s2:b0": NO_LATER_SESSION}
    # without a sessions table the turn-id suffix gives the sessions: same result
    assert _by_id(qa_labels(bullets, qa, None, QAOptions(later_only=True)).labels) == got


def test_qa_conversation_without_questions_gets_no_labels(locomo: Path):
    bullets, qa, sessions = _tables(locomo)
    only_m1 = qa.filter(pc.equal(qa.column("conversation_id"), M1))
    res = qa_labels(bullets, only_m1, sessions)
    assert {u["bullet_id"] for u in res.unlabelled} == {b for b in bullets.column("bullet_id").to_pylist()
                                                         if b.startswith(M2)}
    assert {u["reason"] for u in res.unlabelled} == {NO_QA_FOR_CONVERSATION}
    assert res.counts["unlabelled_no_qa_for_conversation"] == 4


def test_run_label_qa_writes_tables_and_reconciling_summary(locomo: Path, tmp_path: Path):
    summary = run_label(LabelConfig(data=locomo, out=tmp_path, source="qa", qa={"grading": "graded"}))
    labels = read_table(tmp_path / "labels.parquet", "labels")
    assert labels.num_rows == 11 and set(labels.column("source").to_pylist()) == {"qa"}
    assert summary["source"] == "qa" and summary["reconciles"] and summary["rule"] == "qa:graded/3"
    assert json.loads((tmp_path / "label.json").read_text())["counts"]["bullets_cited"] == 9
    assert "source: qa" in (tmp_path / "label.md").read_text()
    assert not (tmp_path / "pairs.parquet").exists()
    # a corpus without a qa table is a clear error
    no_qa = tmp_path / "noqa"
    no_qa.mkdir()
    (no_qa / "bullets.parquet").write_bytes((locomo / "bullets.parquet").read_bytes())
    with pytest.raises(ValueError, match="qa.parquet"):
        run_label(LabelConfig(data=no_qa, out=tmp_path / "o", source="qa"))


# ---------------------------------------------------------------- judge rows carry their source; old tables stay valid


def test_judge_labels_have_source_and_tables_without_it_stay_valid():
    pairs = pa.table({"bullet_id": ["a", "b"], "score": [0.3, 0.7], "horizon": pa.array([1, 1], type=pa.int32())})
    labels, _ = aggregate(pairs, decay=0.5)
    assert labels.column("source").to_pylist() == ["judge", "judge"]
    schema.validate_table(labels, "labels")
    old = labels.drop_columns(["source"])
    schema.validate_table(old, "labels")  # written before the column existed
    bad = labels.set_column(4, "source", pa.array(["judge", None], pa.string()))
    with pytest.raises(schema.SchemaError, match="source"):
        schema.validate_table(bad, "labels")


# ---------------------------------------------------------------- usage


def _bullet_conv(bullets: pa.Table) -> dict[str, str]:
    return dict(zip(bullets.column("bullet_id").to_pylist(), bullets.column("conversation_id").to_pylist()))


def test_usage_jsonl_labels_and_rejects(locomo: Path, tmp_path: Path):
    bullets, _, _ = _tables(locomo)
    b0, b1, b2, b3 = (f"{M1}:s1:b{i}" for i in range(4))
    lines = [
        json.dumps({"bullet_id": b0, "used": True, "time": "2024-01-01T10:00:00Z"}),
        json.dumps({"bullet_id": b0, "used": False, "time": "2024-01-03T10:00:00Z"}),
        json.dumps({"bullet_id": b1, "weight": 0.4}),
        json.dumps({"bullet_id": b1, "weight": 0.8, "used": False}),  # weight wins over used
        json.dumps({"bullet_id": "locomo:mini-1:s9:b9", "used": True}),  # unknown bullet
        "not json",
        json.dumps({"bullet_id": b2, "used": "yes"}),
        json.dumps({"bullet_id": b3, "weight": 1.5}),
        json.dumps({"bullet_id": b3, "used": True, "time": "yesterday"}),
        json.dumps({"bullet_id": b3}),
        json.dumps({"used": True}),
        "",
        "[1, 2]",
    ]
    log = tmp_path / "usage.jsonl"
    log.write_text("\n".join(lines) + "\n", encoding="utf-8")
    ledger = Ledger()
    totals, counts = read_usage_log(log, _bullet_conv(bullets), ledger)
    assert counts == {"events": 12, "events_counted": 4, "events_outside_window": 0, "events_rejected": 8,
                      "conversations_in_log": 1}
    assert ledger.summary()["conservation"] == "ok"
    assert ledger.reasons["unknown bullet_id (not in bullets.parquet)"] == 1
    assert ledger.reasons["neither 'used' nor 'weight' is given"] == 1
    assert ledger.reasons["bullet_id is missing or not a string"] == 1
    assert ledger.reasons["weight outside [0, 1] or not finite"] == 1

    res = usage_labels(bullets, totals)
    assert _by_id(res.labels) == {b0: (1.0, 2), b1: (0.8, 2)}
    assert set(res.labels.column("source").to_pylist()) == {"usage"}
    assert {u["reason"] for u in res.unlabelled} == {NO_USAGE_EVENTS} and len(res.unlabelled) == 9
    mean = _by_id(usage_labels(bullets, totals, UsageOptions(aggregation="mean")).labels)
    assert mean == {b0: (0.5, 2), b1: (pytest.approx(0.6), 2)}
    zero = usage_labels(bullets, totals, UsageOptions(missing="zero"))
    # mini-1 appears in the log: its other bullets are negatives; mini-2 does not: unlabelled
    assert zero.labels.num_rows == 7 and zero.counts["bullets_zero_filled"] == 5
    assert {u["reason"] for u in zero.unlabelled} == {NO_USAGE_FOR_CONVERSATION} and len(zero.unlabelled) == 4

    # the time window: the second b0 event is after `until`; an event without a time is then rejected
    ledger = Ledger()
    totals, counts = read_usage_log(log, _bullet_conv(bullets), ledger,
                                    UsageOptions(until=dt.datetime(2024, 1, 2, tzinfo=dt.timezone.utc)))
    assert counts["events_outside_window"] == 1 and counts["events_counted"] == 1
    assert ledger.reasons["no time, but a usage time window is set"] == 2
    assert ledger.summary()["conservation"] == "ok"


def test_usage_parquet_directory_and_file_errors(locomo: Path, tmp_path: Path):
    bullets, _, _ = _tables(locomo)
    logs = tmp_path / "logs"
    logs.mkdir()
    ids = [f"{M2}:s1:b0", f"{M2}:s1:b1", f"{M2}:s1:b1", "ghost"]
    pq.write_table(pa.table({"bullet_id": ids, "used": [True, False, None, True],
                             "weight": pa.array([None, None, None, 0.5]),
                             "time": pa.array([dt.datetime(2024, 5, 1)] * 4, pa.timestamp("s"))}), logs / "a.parquet")
    (logs / "b.jsonl").write_text(json.dumps({"bullet_id": f"{M2}:s2:b0", "used": 1, "time": 1714521600}) + "\n")
    (logs / "notes.txt").write_text("ignored: not a log file")
    ledger = Ledger()
    totals, counts = read_usage_log(logs, _bullet_conv(bullets), ledger)
    assert counts["events"] == 5 and counts["events_counted"] == 3 and counts["events_rejected"] == 2
    assert {k: (v.n, v.best) for k, v in totals.items()} == {
        f"{M2}:s1:b0": (1, 1.0), f"{M2}:s1:b1": (1, 0.0), f"{M2}:s2:b0": (1, 1.0)}

    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"bullet_id": ["x"], "weight": ["high"]}), bad)
    with pytest.raises(SourceError, match=r"bad\.parquet.*'weight'.*string"):
        read_usage_log(bad, {}, Ledger())
    pq.write_table(pa.table({"bullet_id": ["x"], "score": [1.0]}), bad)
    with pytest.raises(SourceError, match=r"bad\.parquet.*'used'.*'weight'"):
        read_usage_log(bad, {}, Ledger())
    with pytest.raises(SourceError, match="not found"):
        read_usage_log(tmp_path / "missing.jsonl", {}, Ledger())
    with pytest.raises(SourceError, match="unknown usage log format"):
        read_usage_log(logs / "notes.txt", {}, Ledger())
    assert parse_time("2024-05-01T00:00:00Z") == parse_time(1714521600) == parse_time(dt.datetime(2024, 5, 1))
    with pytest.raises(ValueError):
        UsageOptions(since=dt.datetime(2024, 2, 1), until=dt.datetime(2024, 1, 1))


def test_usage_labels_recover_synthetic_ground_truth(tmp_path: Path):
    """A simulated chatbot draws on a bullet in a later reply iff its fact recurs (5% noise both ways)."""
    from memprune.synth import generate

    generate(conversations=6, sessions=3, out=tmp_path / "data", seed=1)
    bullets = pq.read_table(tmp_path / "data" / "bullets.parquet")
    rng = np.random.default_rng(0)
    recurs = bullets.column("recurs").to_pylist()
    rows = []
    for bid, r in zip(bullets.column("bullet_id").to_pylist(), recurs):
        for _ in range(3):  # three replies had it in context
            rows.append({"bullet_id": bid, "used": bool(r) != (rng.random() < 0.05)})
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "usage.parquet")
    summary = run_label(LabelConfig(data=tmp_path / "data", out=tmp_path / "lab", source="usage",
                                    usage={"log": tmp_path / "usage.parquet", "aggregation": "mean"}))
    assert summary["reconciles"] and summary["counts"]["events_rejected"] == 0
    labels = dict(zip(*read_table(tmp_path / "lab" / "labels.parquet", "labels").select(["bullet_id", "label"])
                      .to_pydict().values()))
    y = np.array([labels[b] for b in bullets.column("bullet_id").to_pylist()])
    truth = np.array(recurs, dtype=bool)
    assert truth.any() and (~truth).any()
    assert ((y >= 0.5) == truth).mean() > 0.95


def test_cli_sources(locomo: Path, tmp_path: Path):
    runner = CliRunner()
    res = runner.invoke(app, ["label", "--source", "qa", "--qa-later-only", "--data", str(locomo),
                              "--out", str(tmp_path / "qa")])
    assert res.exit_code == 0, res.output
    assert read_table(tmp_path / "qa" / "labels.parquet", "labels").num_rows == 8
    log = tmp_path / "u.jsonl"
    log.write_text(json.dumps({"bullet_id": f"{M1}:s1:b0", "used": True}) + "\n"
                   + json.dumps({"bullet_id": "nope", "used": True}) + "\n")
    res = runner.invoke(app, ["label", "--source", "usage", "--usage-log", str(log), "--data", str(locomo),
                              "--out", str(tmp_path / "u")])
    assert res.exit_code == 0, res.output
    rejects = [json.loads(x) for x in (tmp_path / "u" / "rejects.jsonl").read_text().splitlines()]
    assert [(r["record"], r["field"], r["reason"]) for r in rejects] == [
        ("line 2 bullet_id=nope", "bullet_id", "unknown bullet_id (not in bullets.parquet)")]
    res = runner.invoke(app, ["label", "--source", "usage", "--data", str(locomo), "--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and "usage.log" in res.output.replace("\n", "")
    res = runner.invoke(app, ["label", "--source", "logs", "--data", str(locomo), "--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and "source" in res.output


# ---------------------------------------------------------------- evaluation: AUC, QA lift, pooled out-of-fold predictions


def test_roc_auc_is_the_pairwise_win_rate():
    from memprune.evaluate import metrics as M

    rng = np.random.default_rng(0)
    t = rng.random(40) < 0.3
    s = np.round(rng.random(40), 1)  # ties count one half
    pos, neg = s[t], s[~t]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    assert M.roc_auc(t, s) == pytest.approx(wins / (len(pos) * len(neg)))
    assert np.isnan(M.roc_auc(np.ones(5, bool), np.arange(5.0)))
    out = M.classification_metrics([0.9, 0.1, 0.6, 0.2], [0.8, 0.3, 0.2, 0.1], cited=[True, False, False, False])
    assert out["auc"] == pytest.approx(0.75) and out["qa_auc"] == pytest.approx(1.0)


def _write_fold(run: Path, fold: int, stage: str, seed: int, df, manifest: dict | None) -> None:
    d = run / f"fold{fold}" / stage / f"seed{seed}"
    d.mkdir(parents=True, exist_ok=True)
    df.assign(stage=stage, seed=seed).to_parquet(d / "predictions.parquet", index=False)
    if manifest is not None:
        (run / f"fold{fold}" / "fold.json").write_text(json.dumps({"fold": fold, "conversations": manifest}))


def test_evaluation_pools_out_of_fold_predictions_with_auc_and_qa_lift(locomo: Path, tmp_path: Path):
    import pandas as pd

    from memprune.evaluate import EvaluationError, evaluate_run

    bullets, qa, _ = _tables(locomo)
    qa_lab = _by_id(qa_labels(bullets, qa).labels)
    rows = pd.DataFrame([{"bullet_id": b, "conversation_id": c, "session_index": s, "label": qa_lab[b][0]}
                         for b, c, s in zip(*bullets.select(["bullet_id", "conversation_id", "session_index"])
                                            .to_pydict().values())])
    run = tmp_path / "run"
    convs = [M1, M2]
    for fold, held in enumerate(convs):
        other = [c for c in convs if c != held]
        test = rows[rows.conversation_id == held]
        valid = rows[rows.conversation_id != held]  # validation rows of the other fold: never pooled
        for seed in (0, 1):
            df = pd.concat([test.assign(split="test"), valid.assign(split="valid")])
            for stage, good in (("vanilla", False), ("stage1", True)):
                rng = np.random.default_rng(10 * fold + seed + (5 if good else 0))
                score = 0.6 * df["label"] + 0.4 * rng.random(len(df)) if good else rng.random(len(df))
                _write_fold(run, fold, stage, seed, df.assign(score=score),
                            {"train": other, "valid": [], "test": [held]})
    res = evaluate_run(run, tmp_path / "eval", data_dir=locomo, tokenizer="whitespace", qa_draws=50, figures=False)
    f = res["folds"]
    assert f["k"] == 2 and f["n_conversations"] == 2 and f["manifests_checked"] == 2
    test = res["splits"]["test"]
    assert list(res["splits"]) == ["test"] and test["n_bullets"] == 11  # every bullet once, out of fold
    auc = test["aggregate"]["stage1"]["classification"]
    assert auc["auc"]["n_seeds"] == 2 and auc["auc"]["mean"] > 0.7
    # the labels are the QA labels here, so the two AUCs coincide
    assert auc["qa_auc"]["mean"] == pytest.approx(auc["auc"]["mean"])
    q = test["aggregate"]["stage1"]["pruning"]["t0.5_k1"]["qa"]
    assert q["lift"]["mean"] == pytest.approx(q["model_pct"]["mean"] / q["random_expected_pct"]["mean"], rel=0.2)
    report = (tmp_path / "eval" / "report.md").read_text()
    assert "k-fold run: 2 folds" in report and "AUC (QA-cited)" in report and "lift over random" in report

    # a conversation held out by two folds, or predicted by a fold that trained on it, is an error
    bad = tmp_path / "bad"
    shutil.copytree(run, bad)
    (bad / "fold1" / "fold.json").write_text(json.dumps({"conversations": {"train": [M1, M2], "test": [M2]}}))
    with pytest.raises(EvaluationError, match="test split and in the training"):
        evaluate_run(bad, tmp_path / "e2", figures=False, tokenizer="whitespace")
    (bad / "fold1" / "fold.json").unlink()
    df = rows.assign(split="test", score=0.5)
    _write_fold(bad, 1, "stage1", 0, df, None)
    _write_fold(bad, 1, "vanilla", 0, df, None)
    with pytest.raises(EvaluationError, match="fold 0 and fold 1|folds"):
        evaluate_run(bad, tmp_path / "e3", figures=False, tokenizer="whitespace")


# ---------------------------------------------------------------- training: mixing label tables, k-fold by conversation


def _synth(root: Path, conversations: int, seed: int = 3) -> tuple[Path, pa.Table]:
    from memprune.synth import generate

    generate(conversations=conversations, sessions=3, out=root / "data", seed=seed)
    return root / "data", pq.read_table(root / "data" / "bullets.parquet")


def _write_labels(root: Path, ids: list[str], values: list[float], source: str | None) -> Path:
    """A labels dir; source None writes a table without the `source` column (an older table)."""
    cols = {"bullet_id": ids, "label": pa.array(values, pa.float64()),
            "n_pairs": pa.array([1] * len(ids), pa.int32()), "aggregation": ["max"] * len(ids)}
    if source is not None:
        cols["source"] = [source] * len(ids)
    write_table(pa.table(cols), root / "labels.parquet", "labels")
    return root


def test_batch_loss_per_row_weights():
    import torch

    from memprune.train import LossConfig, batch_loss, combine_parts

    logits = torch.tensor([0.0, 2.0, -1.0])
    labels = torch.tensor([1.0, 0.5, 0.0])
    groups = torch.zeros(3, dtype=torch.long)
    err2 = (torch.sigmoid(logits) - labels) ** 2
    w = torch.tensor([1.0, 3.0, 0.5])
    value, parts = batch_loss(logits, labels, groups, LossConfig(), w)
    assert float(value) == pytest.approx(float((w * err2).sum() / w.sum()))
    assert combine_parts(parts, LossConfig())["mse"] == pytest.approx(float(value))
    plain, _ = batch_loss(logits, labels, groups, LossConfig())
    ones, _ = batch_loss(logits, labels, groups, LossConfig(), torch.ones(3))
    assert float(plain) == pytest.approx(float(ones)) == pytest.approx(float(err2.mean()))


def test_mixed_label_tables_weights_and_conflict_rule(tmp_path: Path):
    from memprune.io import JsonlSink
    from memprune.train import TrainConfig, prepare_data

    data, bullets = _synth(tmp_path, 4)
    ids = bullets.column("bullet_id").to_pylist()
    gold_ids = ids[::3]
    judge = _write_labels(tmp_path / "judge", ids, [0.3] * len(ids), None)  # an older table: read as judge
    gold = _write_labels(tmp_path / "qa", gold_ids + ["ghost:s1:b0"], [1.0] * len(gold_ids) + [1.0], "qa")

    def prepared(labels: list[Path], weights: dict[str, float]):
        cfg = TrainConfig(data=data, labels=labels, out=tmp_path / "out", label_weights=weights,
                          split={"valid": 1, "test": 1})
        sink = JsonlSink(tmp_path / "rejects.jsonl")
        ledger = Ledger(sink)
        table, counts = prepare_data(cfg, ledger)
        sink.close()
        rows = {r["bullet_id"]: (r["label"], r["weight"], r["source"]) for r in table.to_pylist()}
        return rows, counts, ledger

    # qa weighs 4: it wins every conflict; every row carries its source's weight
    rows, counts, ledger = prepared([judge, gold], {"qa": 4.0})
    assert all(rows[b] == (1.0, 4.0, "qa") for b in gold_ids if b in rows)
    assert all(v == (0.3, 1.0, "judge") for b, v in rows.items() if b not in set(gold_ids))
    assert counts["labels_superseded"] == len(gold_ids) and counts["labels_rejected"] == 1
    assert counts["labels_by_source"] == {"judge": len(ids) - len(gold_ids), "qa": len(gold_ids)}
    assert ledger.summary()["conservation"] == "ok"
    rejects = [json.loads(x) for x in (tmp_path / "rejects.jsonl").read_text().splitlines()]
    superseded = [r for r in rejects if r["reason"].startswith("superseded")]
    assert len(superseded) == len(gold_ids) and all("'qa' (weight 4)" in r["reason"] for r in superseded)
    assert all(r["source"] == str(judge / "labels.parquet") for r in superseded)

    # equal weights: the table listed first wins
    rows, _, _ = prepared([judge, gold], {})
    assert {v[0] for v in rows.values()} == {0.3}
    rows, _, _ = prepared([gold, judge], {})
    assert all(rows[b][0] == 1.0 for b in gold_ids if b in rows)
    # judge weighs more than qa: judge wins
    rows, _, _ = prepared([gold, judge], {"judge": 2.0, "qa": 1.5})
    assert {v[0] for v in rows.values()} == {0.3}
    with pytest.raises(ValueError, match="unknown source"):
        TrainConfig(data=data, labels=[judge], out=tmp_path / "o", label_weights={"gold": 2.0})


@pytest.mark.slow
def test_kfold_training_never_predicts_a_conversation_from_its_own_labels(
        ray_local, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import memprune.train as T
    from memprune.evaluate import evaluate_run

    data, bullets = _synth(tmp_path, 6, seed=4)
    ids = bullets.column("bullet_id").to_pylist()
    recurs = np.asarray(bullets.column("recurs").to_pylist(), dtype=float)
    rng = np.random.default_rng(0)
    judge = _write_labels(tmp_path / "judge", ids, list(np.clip(0.2 + 0.5 * recurs + rng.normal(0, 0.15, len(ids)), 0, 1)),
                          "judge")
    gold_ids = [b for b in ids if b.startswith(bullets.column("conversation_id")[0].as_py())]
    gold = _write_labels(tmp_path / "usage", gold_ids, [float(recurs[ids.index(b)]) for b in gold_ids], "usage")

    fed: dict[str, dict[str, set[str]]] = {}  # fold dir -> split -> conversations the trainer was given
    from memprune.train import recipe

    real = recipe.run_stage

    def spy(cfg, inputs, stage, seed):
        fed[str(cfg.out)] = {s: set(inputs.tables[s].column("conversation_id").to_pylist()) for s in ("train", "valid")}
        assert "weight" in inputs.tables["train"].column_names
        return real(cfg, inputs, stage, seed)

    monkeypatch.setattr(recipe, "run_stage", spy)
    cfg = T.TrainConfig(
        data=data, labels=[judge, gold], out=tmp_path / "run", folds=3, label_weights={"usage": 3.0},
        stages=["vanilla", "stage1"], seeds=[0], max_length=24, split={"valid": 1},
        head={"hidden": 16}, stage1={"epochs": 2, "lr": 3e-3, "batch_size": 32, "patience": 2},
        embed={"batch_size": 64, "actors": 1}, ray={"num_workers": 0},
    )
    summary = T.run_training(cfg)
    evaluate_run(cfg.out, cfg.out / "eval", data_dir=data)  # `memprune train` and the pipeline chain this step
    assert summary["folds"] == 3 and len(summary["per_fold"]) == 3
    assert summary["labels_counts"]["labels_by_source"]["usage"] == len(gold_ids)

    all_convs = set(bullets.column("conversation_id").to_pylist())
    held_out: list[set[str]] = []
    for i in range(3):
        fold_dir = tmp_path / "run" / f"fold{i}"
        manifest = json.loads((fold_dir / "fold.json").read_text())["conversations"]
        pred = pq.read_table(fold_dir / "stage1" / "seed0" / "predictions.parquet")
        test_convs = set(pred.filter(pc.equal(pred.column("split"), "test")).column("conversation_id").to_pylist())
        assert test_convs == set(manifest["test"]) and test_convs
        # the trainer of this fold never saw a held-out conversation, neither to train nor to select epochs
        assert not test_convs & (fed[str(fold_dir)]["train"] | fed[str(fold_dir)]["valid"])
        assert fed[str(fold_dir)]["train"] and fed[str(fold_dir)]["valid"]
        held_out.append(test_convs)
    assert set.union(*held_out) == all_convs and sum(map(len, held_out)) == len(all_convs)

    metrics = json.loads((tmp_path / "run" / "eval" / "metrics.json").read_text())
    test = metrics["splits"]["test"]
    assert metrics["folds"]["k"] == 3 and metrics["folds"]["manifests_checked"] == 3
    assert test["n_bullets"] == len(ids)  # every labelled bullet predicted once, out of fold
    assert test["aggregate"]["stage1"]["classification"]["auc"]["mean"] is not None
    # a rerun reuses every fold's finished runs
    again = T.run_training(cfg)
    assert all(r["reused"] for r in again["runs"])


def test_cli_train_mixing_and_folds_options_are_validated(locomo: Path, tmp_path: Path):
    runner = CliRunner()
    base = ["train", "--data", str(locomo), "--labels", str(tmp_path / "a"), "--labels", str(tmp_path / "b"),
            "--out", str(tmp_path / "o")]
    res = runner.invoke(app, [*base, "--label-weight", "qa"])
    assert res.exit_code == 2 and "SOURCE=WEIGHT" in res.output.replace("\n", "")
    res = runner.invoke(app, [*base, "--label-weight", "gold=2"])
    assert res.exit_code == 2 and "unknown source" in res.output.replace("\n", "")
    res = runner.invoke(app, [*base, "--label-weight", "qa=-1"])
    assert res.exit_code == 2 and "positive" in res.output.replace("\n", "")
    res = runner.invoke(app, [*base, "--folds", "1"])
    assert res.exit_code == 2
    from memprune.config import load_config
    from memprune.train import TrainConfig

    cfg = load_config(None, ["folds=4", "label_weights.usage=3"], TrainConfig,
                      {"data": str(locomo), "labels": [str(tmp_path / "a"), str(tmp_path / "b")], "out": "o"})
    assert cfg.folds == 4 and cfg.weight_of("usage") == 3.0 and cfg.weight_of("judge") == 1.0 and len(cfg.labels) == 2
    one = load_config(None, [], TrainConfig, {"data": "d", "labels": "one", "out": "o"}).labels
    assert len(one) == 1 and Path(one[0]).name == "one"


def test_every_label_source_is_one_registry_entry():
    from pydantic import ValidationError

    from memprune.label.config import LabelSettings
    from memprune.label.sources import SOURCES

    assert list(SOURCES) == ["judge", "qa", "usage"]
    with pytest.raises(ValidationError, match="source=nope: no such label source; the sources: judge, qa"):
        LabelSettings(source="nope")
    for name, source in SOURCES.items():
        assert source.name == name and (source.run is None) == source.judged
