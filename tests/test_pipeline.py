"""The chained pipeline (jobs/pipeline.py, memprune quickstart) on a tiny synthetic corpus."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from memprune.pipeline import PipelineConfig, headline, quickstart_config, run_pipeline

pytestmark = pytest.mark.slow

TINY_TRAIN = {
    "stages": ["vanilla", "stage1"],
    "seeds": [0],
    "max_length": 24,
    "stage1": {"epochs": 3, "lr": 0.003, "batch_size": 32, "patience": 2},
    "ray": {"num_workers": 0},
}


def test_pipeline_to_a_storage_uri(tmp_path: Path) -> None:
    """Steps run in a local staging dir and each finished step is uploaded to the URI."""
    remote = tmp_path / "bucket" / "run1"
    cfg = PipelineConfig(
        out=f"file://{remote}",
        staging_dir=str(tmp_path / "staging"),
        corpus={"format": "synth", "conversations": 8, "sessions": 3, "seed": 1},
        train=TINY_TRAIN,
        evaluate={"figures": False},
        rule={"threshold": 0.5, "top_k": 2},
        prune={"progress": False},
    )
    summary = run_pipeline(cfg)
    assert list(summary["steps"]) == ["data", "label", "train", "evaluate", "prune"]
    for stage in ("data", "label", "train", "report", "prune"):
        assert (remote / stage).is_dir(), f"stage {stage} was not uploaded"
    assert json.loads((remote / "pipeline.json").read_text())["out"] == cfg.out
    bullets = pq.read_table(remote / "data" / "bullets.parquet")
    prune_summary = json.loads((remote / "prune" / "prune.json").read_text())
    assert prune_summary["input"]["rows"] == prune_summary["output"]["rows"] == bullets.num_rows
    assert summary["steps"]["prune"]["rows_out"] == bullets.num_rows
    metrics = json.loads((remote / "report" / "metrics.json").read_text())
    assert set(metrics["splits"]["test"]["stages"]) == {"vanilla", "stage1"}
    assert "Spearman" in headline(remote / "report")

    # a second run of only the last stage fetches what it needs from the URI
    staging2 = tmp_path / "staging2"
    again = run_pipeline(cfg.model_copy(update={"steps": ["prune"], "staging_dir": str(staging2)}))
    assert list(again["steps"]) == ["prune"] and (staging2 / "train").is_dir()


def test_quickstart_config_and_bad_data_spec() -> None:
    cfg = quickstart_config("runs/q")
    assert cfg.corpus.format == "synth" and cfg.train.seeds == [0, 1, 2]
    assert quickstart_config("runs/q", "msc:/data/msc").corpus.split == "valid"
    with pytest.raises(ValueError, match="FORMAT:PATH"):
        quickstart_config("runs/q", "parquet:/x")
