"""The chained pipeline (jobs/pipeline.py, memprune quickstart) on a tiny synthetic corpus."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from typer.testing import CliRunner

from memprune.config import ConfigError, parse_overrides
from memprune.pipeline import PipelineConfig, headline, quickstart_config, run_pipeline

squeeze = lambda text: "".join(text.split())  # noqa: E731 - rich wraps long lines


def test_quickstart_config_and_bad_data_spec() -> None:
    cfg = quickstart_config("runs/q")
    assert cfg.corpus.format == "synth" and cfg.train.seeds == [0, 1, 2]
    assert quickstart_config("runs/q", "msc:/data/msc").corpus.split == "valid"
    with pytest.raises(ValueError, match="FORMAT:PATH"):
        quickstart_config("runs/q", "parquet:/x")


@pytest.mark.parametrize("override, message", [
    ("rule.group_by=conversation", "rule.group_by must be session, got 'conversation'"),
    ("evaluate.rule.group_by=conversation", "set the pruning rule once"),
    ("prune.rule.threshold=0.3", "set the pruning rule once"),
])
def test_a_rule_the_evaluate_step_refuses_fails_as_the_config_loads(
        override: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before, such a rule was copied into the evaluate settings unchecked (model_copy): the pipeline ran data,
    label and train, then evaluate died in a pydantic traceback. Now the config does not load: one line, no work."""
    from memprune.cli import app
    from memprune.runtime import run_job

    with pytest.raises(ConfigError, match=message):
        quickstart_config(str(tmp_path / "q"), overrides=[override])
    res = CliRunner().invoke(app, ["quickstart", "--out", str(tmp_path / "q"), "--set", override])
    assert res.exit_code == 2 and squeeze(res.output).startswith("error:") and squeeze(message) in squeeze(res.output)
    assert "Traceback" not in res.output and not (tmp_path / "q").exists()
    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump({"out": str(tmp_path / "job"), **parse_overrides([override])}))
    assert run_job("pipeline", PipelineConfig, run_pipeline, argv=[str(tmp_path / "pipeline.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error:") and message in err
    assert not (tmp_path / "job").exists()


def test_the_pipeline_rule_reaches_each_step_validated() -> None:
    """Prune gets the rule as given; evaluate gets its paper's view (threshold, top-k, sessions, min_keep 0).
    Without the evaluate step a rule only prune can use loads."""
    cfg = quickstart_config("runs/q", overrides=["rule.threshold=0.3", "rule.top_k=2", "rule.min_keep=2"])
    p = cfg.prune.rule
    assert (p.policy.threshold, p.policy.top_k, p.min_keep) == (0.3, 2, 2)
    e = cfg.evaluate.rule
    assert (e.policy.threshold, e.policy.top_k, e.group_by, e.min_keep, e.policy.name) == (0.3, 2, "session", 0, "rule")
    # another policy reaches the evaluation as it is (its table instead of the paper's Table 4)
    cfg = quickstart_config("runs/q", overrides=["rule.budget_tokens=40"])
    assert cfg.evaluate.rule.name == cfg.prune.rule.name == "budget40" and cfg.evaluate.rule.min_keep == 0
    cfg = quickstart_config("runs/q", overrides=["rule.group_by=conversation", "rule.threshold=null",
                                                 "steps=[data,label,train,prune]"])
    assert cfg.prune.rule.group_by == "conversation" and cfg.prune.rule.policy.threshold is None
    with pytest.raises(ConfigError, match="budget_tokens"):
        quickstart_config("runs/q", overrides=["rule.policy=budget"])


@pytest.mark.slow
def test_the_prune_step_warns_when_pruning_empties_groups(
        ray_local, fixtures_dir: Path, scorer_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The pipeline's (and so the quickstart's) prune step prints the emptied-groups warning of `memprune prune`,
    and records it in pipeline.json."""
    import shutil

    from memprune.ingest import ingest
    from memprune.prune.report import emptied_warning

    ingest("locomo", fixtures_dir / "locomo_mini.json", tmp_path / "data")
    shutil.copytree(scorer_dir, tmp_path / "train" / "vanilla" / "seed0")
    cfg = PipelineConfig.model_validate({
        "out": str(tmp_path), "steps": ["prune"], "train": {"stages": ["vanilla"], "seeds": [0]},
        "rule": {"threshold": 0.99, "min_keep": 0}, "prune": {"progress": False, "actors": 1}})
    summary = run_pipeline(cfg)
    warning = emptied_warning(json.loads((tmp_path / "prune" / "prune.json").read_text()))
    assert warning is not None and warning.startswith("100% of the sessions")
    assert squeeze(f"warning: {warning}") in squeeze(capsys.readouterr().err)
    assert summary["steps"]["prune"]["warning"] == warning
    assert json.loads((tmp_path / "pipeline.json").read_text())["steps"]["prune"]["warning"] == warning
    # the review page, though LoCoMo's session times ('1:56 pm on 8 May, 2023') are no times it can show
    assert summary["steps"]["prune"]["review"] == str(tmp_path / "prune" / "review.html")
    assert (tmp_path / "prune" / "review.html").is_file()


@pytest.mark.slow
def test_quickstart_to_a_storage_uri_with_a_quiet_terminal(tmp_path: Path) -> None:
    """The `memprune` executable runs the quickstart into a storage URI: every step reads from it and commits its
    output set there. The terminal keeps progress, one line per step and the summary; Ray's
    INFO lines and dependency warnings go to the log file."""
    import os
    import re
    import subprocess
    import sys

    from memprune.runtime import QUIET_ENV

    remote = tmp_path / "bucket" / "run1"
    env = {k: v for k, v in os.environ.items() if k not in QUIET_ENV and k != "MEMPRUNE_LOG"}
    env.update(MEMPRUNE_LOG_DIR=str(tmp_path / "logs"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", COLUMNS="100")
    sets = {"out": f"file://{remote}", "corpus.conversations": 8,
            "corpus.sessions": 3, "corpus.seed": 1, "train.seeds": "[0]", "train.stages": "[vanilla,stage1]",
            "train.max_length": 24, "train.stage1.epochs": 3, "evaluate.figures": "false", "rule.top_k": 2}
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("memprune")), "quickstart",
         *[arg for k, v in sets.items() for arg in ("--set", f"{k}={v}")]],
        env=env, capture_output=True, text=True, timeout=900,
    )
    terminal = proc.stdout + proc.stderr
    assert proc.returncode == 0, terminal[-3000:]
    lines = terminal.splitlines()
    noisy = [ln for ln in lines if re.search(r"\bINFO\b|Warning\b|warnings\.warn|\(raylet\)|\(pid=", ln)]
    assert not noisy, noisy[:5]
    assert len(lines) <= 60, f"{len(lines)} lines:\n{terminal}"
    assert re.search(r"^train: [\d.]+ s; compute [\d.]+ s, overhead", terminal, re.MULTILINE)
    assert any(ln.startswith("report:") for ln in lines[-3:])  # the closing summary (rich may wrap it)
    logs = list((tmp_path / "logs").glob("quickstart-*.log"))
    assert logs and logs[0].stat().st_size > 0  # what the terminal did not show is kept

    summary = json.loads((remote / "pipeline.json").read_text())
    assert set(summary["steps"]) == {"data", "label", "train", "evaluate", "prune"} and summary["out"] == sets["out"]
    for stage in ("data", "label", "train", "report", "prune"):
        assert json.loads((remote / stage / ".memprune.json").read_text())["state"] == "done", stage
    bullets = pq.read_table(remote / "data" / "bullets.parquet")
    prune_summary = json.loads((remote / "prune" / "prune.json").read_text())
    assert prune_summary["input"]["rows"] == prune_summary["output"]["rows"] == bullets.num_rows
    assert summary["steps"]["prune"]["rows_out"] == bullets.num_rows
    assert 0 < prune_summary["timing"]["compute_s"] < prune_summary["timing"]["wall_s"]
    metrics = json.loads((remote / "report" / "metrics.json").read_text())
    assert set(metrics["splits"]["test"]["stages"]) == {"vanilla", "stage1"}
    assert "Spearman" in headline(remote / "report")
    run = json.loads((remote / "train" / "run.json").read_text())
    t = run["timing"]
    assert t["compute_s"] > 0 and abs(t["compute_s"] + t["overhead_s"] - t["wall_s"]) < 0.01
    assert t["compute_s"] >= t["embed_s"] + t["stages"]["stage1"]["epochs_s"] - 0.01

    # a second run of only the last stage reads what it needs from the URI
    cfg = quickstart_config(sets["out"], overrides=[f"{k}={v}" for k, v in sets.items()])
    again = run_pipeline(cfg.model_copy(update={"steps": ["prune"]}))
    assert list(again["steps"]) == ["prune"] and again["steps"]["prune"]["dir"] == f"{sets['out']}/prune"
