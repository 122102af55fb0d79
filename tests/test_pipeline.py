"""The chained pipeline (jobs/pipeline.py, memprune quickstart) on a tiny synthetic corpus."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from memprune.pipeline import headline, quickstart_config, run_pipeline

pytestmark = pytest.mark.slow

def test_quickstart_config_and_bad_data_spec() -> None:
    cfg = quickstart_config("runs/q")
    assert cfg.corpus.format == "synth" and cfg.train.seeds == [0, 1, 2]
    assert quickstart_config("runs/q", "msc:/data/msc").corpus.split == "valid"
    with pytest.raises(ValueError, match="FORMAT:PATH"):
        quickstart_config("runs/q", "parquet:/x")


def test_quickstart_to_a_storage_uri_with_a_quiet_terminal(tmp_path: Path) -> None:
    """The `memprune` executable runs the quickstart into a storage URI: steps run in a local staging dir and
    each finished step is uploaded. The terminal keeps progress, one line per step and the summary; Ray's
    INFO lines and dependency warnings go to the log file."""
    import os
    import re
    import subprocess
    import sys

    from memprune.runtime import QUIET_ENV

    remote = tmp_path / "bucket" / "run1"
    env = {k: v for k, v in os.environ.items() if k not in QUIET_ENV and k != "MEMPRUNE_LOG"}
    env.update(MEMPRUNE_LOG_DIR=str(tmp_path / "logs"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", COLUMNS="100")
    sets = {"out": f"file://{remote}", "staging_dir": str(tmp_path / "staging"), "corpus.conversations": 8,
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
        assert (remote / stage).is_dir(), f"stage {stage} was not uploaded"
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

    # a second run of only the last stage fetches what it needs from the URI
    cfg = quickstart_config(sets["out"], overrides=[f"{k}={v}" for k, v in sets.items()])
    staging2 = tmp_path / "staging2"
    again = run_pipeline(cfg.model_copy(update={"steps": ["prune"], "staging_dir": str(staging2)}))
    assert list(again["steps"]) == ["prune"] and (staging2 / "train").is_dir()
