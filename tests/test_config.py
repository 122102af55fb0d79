"""Config files with key=value overrides, and the job entrypoint runner."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from memprune.config import ConfigError, load_config, parse_overrides
from memprune.runtime import split_args

REPO = Path(__file__).resolve().parents[1]


class Inner(BaseModel):
    lr: float = 1e-3
    seeds: list[int] = [0]


class Cfg(BaseModel):
    name: str
    train: Inner = Inner()


def test_overrides_parse_yaml_scalars_and_nest() -> None:
    assert parse_overrides(["a.b=1", "c=x", "d=[0, 1]", "e=true", "f="]) == {
        "a": {"b": 1}, "c": "x", "d": [0, 1], "e": True, "f": ""}
    with pytest.raises(ConfigError, match="not key=value"):
        parse_overrides(["novalue"])


def test_load_config_merges_and_validates(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("name: run\ntrain:\n  lr: 0.1\n")
    cfg = load_config(path, ["train.seeds=[1,2]"], Cfg)
    assert cfg.train.lr == 0.1 and cfg.train.seeds == [1, 2] and cfg.name == "run"
    with pytest.raises(ConfigError, match=r"c.yaml: invalid config: train.lr"):
        load_config(path, ["train.lr=fast"], Cfg)
    path.write_text("- a list\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(path, [], Cfg)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml", [], Cfg)


def test_split_args() -> None:
    assert split_args(["c.yaml", "a=1"]) == ("c.yaml", ["a=1"])
    assert split_args(["a=1"]) == (None, ["a=1"])
    assert split_args([]) == (None, [])


@pytest.mark.slow
def test_ingest_job_entrypoint(msc_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(REPO / "jobs" / "ingest.py"), str(REPO / "configs" / "ingest-msc.yaml"),
                           f"input={msc_dir}", f"out={out}"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["counts"]["sessions"] == 2000
    proc = subprocess.run([sys.executable, str(REPO / "jobs" / "ingest.py"), "format=msc", "out=x"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2 and "input: Field required" in proc.stderr
