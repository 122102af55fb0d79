"""Issue 54: pruning works out of the box with the shipped `default` scorer; its recipe rebuilds a loadable artifact;
retention and the heuristic baselines are measured as the card says."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from memprune.cli import app
from memprune.scorers import DEFAULT_SCORER, SHIPPED, resolve_scorer

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def test_the_shipped_default_is_small_carded_and_named_by_name_or_nothing() -> None:
    from memprune.prune.config import PruneConfig
    from memprune.scorer import check_scorer
    from memprune.serve.config import ServeConfig

    directory = SHIPPED[DEFAULT_SCORER].directory
    assert sum(p.stat().st_size for p in directory.rglob("*") if p.is_file()) <= 5 * 2**20
    assert resolve_scorer(None) == resolve_scorer("default") == str(directory)
    assert resolve_scorer("runs/train/stage1/seed0") == "runs/train/stage1/seed0"
    assert PruneConfig(input="in", out="out").scorer == str(directory)
    assert ServeConfig().scorer == ServeConfig(scorer="default").scorer == str(directory)
    info = check_scorer(ServeConfig().scorer)
    card = SHIPPED[DEFAULT_SCORER].card()
    assert (info["name"], info["version"]) == ("default", card["version"]) and len(info["fingerprint"]) == 16
    assert info["calibration"] is not None
    # the card's own figures: every baseline at every budget, the lift over the best of them, more kept than random
    lo = card["locomo"]
    assert set(lo["baselines"]) == {"random", "longest", "most digits", "first in session", "newest"}
    for b, v in lo["scorer"].items():
        assert lo["lift_over_best_baseline"][b] == pytest.approx(v - max(x[b] for x in lo["baselines"].values()))
        assert v > lo["baselines"]["random"][b] + 0.03
    assert card["msc"]["test"]["ece_calibrated"] <= 0.05


def test_memory_pruner_needs_no_scorer_and_scores_like_the_artifact() -> None:
    from memprune.prune import MemoryPruner
    from memprune.scorer import Scorer

    bullets = ["Alice moved to Oslo on 3 May 2024.", "It rained.", "Alice's daughter Mia starts school in August.",
               "They said hi.", "Alice is allergic to peanuts."]
    pruner = MemoryPruner(top_k=2)
    kept = pruner.prune(bullets)
    assert len(kept) == 2 and {k.text for k in kept} <= set(bullets)
    raw = Scorer.load(resolve_scorer(None)).score(bullets)
    assert pruner.scorer.score(bullets) == pytest.approx(raw, abs=1e-6)
    assert [k.text for k in kept] == [bullets[i] for i in sorted(np.argsort(-raw)[:2])]  # the best two, input order
    assert pruner.calibrated  # `auto` uses the shipped calibration
    # the shipped scorer ranks: a rule that sets no threshold has none; one that sets it keeps it
    assert pruner.rule.policy.threshold is None
    assert MemoryPruner(top_k=2, threshold=0.9).rule.policy.threshold == 0.9


def test_a_rule_without_a_threshold_takes_the_scorers(scorer_dir) -> None:
    from memprune.prune.config import PruneConfig
    from memprune.serve.config import ServeConfig

    assert PruneConfig(input="i", out="o").rule.policy.threshold is None
    assert PruneConfig(input="i", out="o", rule={"threshold": 0.5}).rule.policy.threshold == 0.5
    assert PruneConfig(input="i", out="o", scorer=str(scorer_dir)).rule.policy.threshold == 0.5  # a trained scorer's
    assert ServeConfig().rule.policy.threshold is None
    assert PruneConfig(input="i", out="o", rule={"policy": "fraction", "fraction": 0.4}).rule.policy.fraction == 0.4
    # the threshold survives the config's round trips (the store config re-validates its bullets config)
    cfg = PruneConfig(input="i", out="o", rule={"top_k": 3})
    assert PruneConfig.model_validate(cfg.model_dump()).rule.policy.threshold is None


def test_scorers_lists_the_shipped_cards() -> None:
    res = CliRunner().invoke(app, ["scorers"])
    assert res.exit_code == 0, res.output
    assert "default version" in res.output and "retention on LoCoMo" in res.output
    res = CliRunner().invoke(app, ["scorers", "--json"])
    assert json.loads(res.output)["default"]["name"] == "default"


def test_retention_and_baselines_on_a_hand_made_session() -> None:
    from memprune.evaluate.baselines import baseline_retention, lift, retention

    frame = pd.DataFrame({"conversation_id": ["c"] * 5, "session_index": [1] * 5,
                          "text": ["a 1", "bb", "ccc 22", "d", "eeeeeeeee"],
                          "evidence": [["c:s1:t4"], ["c:s1:t0"], ["c:s1:t1"], ["c:s1:t3"], ["c:s1:t2"]],
                          "cited": [True, False, True, False, False]})
    scores = np.array([0.9, 0.1, 0.8, 0.2, 0.3])
    assert retention(frame, scores, 0.4) == 1.0  # ceil(0.4 * 5) = 2 kept: both cited
    assert retention(frame, scores, 0.2) == 0.5
    assert retention(frame, np.zeros(5), 0.4) == 0.5  # ties: the earlier rows
    base = baseline_retention(frame, (0.4,), draws=50)
    assert base["most digits"]["q=0.4"] == 1.0 and base["longest"]["q=0.4"] == 0.5
    assert base["first in session"]["q=0.4"] == 0.5 and base["newest"]["q=0.4"] == 0.5  # t0,t1 / t4,t3
    assert 0.2 < base["random"]["q=0.4"] < 0.6
    assert lift({"q=0.4": 0.75}, base) == pytest.approx({"q=0.4": -0.25})
    assert math.isnan(retention(frame.assign(cited=False), scores, 0.4))


@pytest.mark.slow
def test_the_recipe_on_a_small_subset_builds_an_artifact_the_same_code_loads(tmp_path) -> None:
    from memprune.prune import MemoryPruner
    from memprune.scorer import Scorer, check_scorer
    from memprune.train.shipped import RecipeError, ShippedRecipe, run

    out = tmp_path / "mini"
    cfg = ShippedRecipe(msc=str(SHARED / "msc" / "msc_personasummary"), episodes=40, calibration_share=0.3,
                        test_share=0.3, locomo=str(SHARED / "locomo-dev" / "locomo_dev.json"), name="mini", out=str(out))
    card = run(cfg)
    assert {"scorer.json", "head.safetensors", "calibration.json", "card.json", "card.md"} <= {p.name for p in out.iterdir()}
    assert check_scorer(out)["name"] == "mini" and card["msc"]["episodes"]["train"] == 16
    texts = ["Bob has two cats, Tom and Jerry.", "ok"]
    assert Scorer.load(out).score(texts) == pytest.approx(
        Scorer.load(out).score_embeddings(Scorer.load(out).embed(texts)), abs=1e-6)
    assert len(MemoryPruner(str(out), top_k=1).prune(texts)) == 1
    assert set(card["locomo"]["baselines"]) >= {"random", "newest"} and "probe_loco" in card["locomo"]
    assert "| **mini** |" in (out / "card.md").read_text()
    # the same seed rebuilds the same head; a directory that is not a built scorer is never overwritten
    again = run(cfg.model_copy(update={"out": str(tmp_path / "again"), "locomo": None}))
    assert (tmp_path / "again" / "head.safetensors").read_bytes() == (out / "head.safetensors").read_bytes()
    assert again["msc"]["test"] == pytest.approx(card["msc"]["test"])
    (tmp_path / "mine").mkdir()
    with pytest.raises(RecipeError, match="not a built scorer"):
        run(cfg.model_copy(update={"out": str(tmp_path / "mine"), "locomo": None}))


@pytest.mark.slow
def test_prune_apply_and_restore_a_table_with_no_scorer(ray_local, tmp_path) -> None:
    store = tmp_path / "mem.csv"
    rows = ["id,text,user,created"] + [f"{i:04d},Fact number {i} about user {i % 2}: likes {w},u{i % 2},2024-01-{i + 1:02d}"
                                       for i, w in enumerate(["tea", "jazz", "Oslo", "cats", "chess", "rain", "maps",
                                                              "1984", "kayaks", "Mia"])]
    store.write_text("\n".join(rows) + "\n")
    before = store.read_bytes()
    args = ["prune", "--input", f"table:{store}", "--map", "group=user,time=created", "--top-k", "2",
            "--set", "progress=false", "--set", "actors=1"]
    res = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "dry")])
    assert res.exit_code == 0, res.output
    assert store.read_bytes() == before
    summary = json.loads((tmp_path / "dry" / "prune.json").read_text())
    assert summary["scorer"]["name"] == "default" and summary["scorer"]["version"]
    res = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "dry"), "--apply"])
    assert res.exit_code == 0, res.output
    assert len(store.read_text().splitlines()) == 1 + 4
    res = CliRunner().invoke(app, ["restore", "--archive", str(tmp_path / "dry" / "archive"), "--all"])
    assert res.exit_code == 0, res.output
    assert sorted(store.read_text().splitlines()) == sorted(before.decode().splitlines())


@pytest.mark.slow
def test_train_init_default_adapts_the_shipped_scorer_to_a_usage_log(ray_local, tmp_path) -> None:
    """`memprune train --init default`: vanilla is the shipped scorer as it is, stage 1 starts from its head and
    learns a usage log's labels; the encoder settings and head shape come from it; calibration is refitted."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from safetensors.torch import load_file

    import memprune.train as T
    from memprune.label import LabelConfig, run_label
    from memprune.synth import generate

    generate(conversations=12, sessions=3, out=tmp_path / "data", seed=5)
    bullets = pq.read_table(tmp_path / "data" / "bullets.parquet")
    rng = np.random.default_rng(0)
    rows = [{"bullet_id": b, "used": bool(r) != (rng.random() < 0.05)}  # the bot draws on the facts that recur
            for b, r in zip(bullets.column("bullet_id").to_pylist(), bullets.column("recurs").to_pylist())
            for _ in range(3)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "usage.parquet")
    run_label(LabelConfig(data=tmp_path / "data", out=tmp_path / "labels", source="usage",
                          usage={"log": tmp_path / "usage.parquet", "aggregation": "mean"}))
    settings = dict(data=tmp_path / "data", labels=[tmp_path / "labels"], out=tmp_path / "run", init="default",
                    stages=["vanilla", "stage1"], seeds=[0], split={"valid": 2, "test": 2},
                    stage1={"epochs": 30, "lr": 3e-2, "batch_size": 64, "patience": 30},
                    embed={"batch_size": 64, "actors": 1}, ray={"num_workers": 0})
    cfg = T.TrainConfig(**settings)
    assert (cfg.normalize, cfg.head.hidden, cfg.init) == (True, 0, resolve_scorer("default"))
    with pytest.raises(ValueError, match="leave head unset"):
        T.TrainConfig(**settings, head={"hidden": 16})
    T.run_training(cfg)
    shipped = load_file(SHIPPED["default"].directory / "head.safetensors")
    vanilla = load_file(tmp_path / "run" / "vanilla" / "seed0" / "head.safetensors")
    stage1 = load_file(tmp_path / "run" / "stage1" / "seed0" / "head.safetensors")
    assert all((vanilla[k] == shipped[k]).all() for k in shipped)
    assert any((stage1[k] != shipped[k]).any() for k in shipped)
    assert (tmp_path / "run" / "stage1" / "seed0" / "calibration.json").is_file()

    def auc(stage: str) -> float:
        from memprune.evaluate.metrics import roc_auc

        pred = pq.read_table(tmp_path / "run" / stage / "seed0" / "predictions.parquet").to_pandas()
        test = pred[pred["split"] == "test"]
        return roc_auc(test["label"] >= 0.5, test["score"])

    assert auc("stage1") > auc("vanilla") + 0.05  # adapted: it learned what this bot uses (0.745 vs 0.672)
