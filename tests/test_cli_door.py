"""One door for parameters: every command's options reach its config as typed values, never as YAML text.

A directory named `2024`, `true`, `null` or `a: b` stays a path for every command that takes one, and
`--threshold` reaches the pruning rule as a float, validated once by `PruneRule`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from memprune.cli import app
from memprune.errors import MemPruneError

ODD_NAMES = ["2024", "true", "null", "a: b", "run #1"]


class Captured(MemPruneError):
    """Raised by the stub `run`: the CLI prints it as a one-line error and exits 2."""


@pytest.fixture()
def captured(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Replace every stage's `run` by a stub that records the config it receives."""
    import memprune.dialogue
    import memprune.evaluate
    import memprune.label
    import memprune.prune
    import memprune.qa
    import memprune.stores
    import memprune.summarize
    import memprune.train

    got: dict[str, Any] = {}

    def stub(cfg: Any) -> dict[str, Any]:
        got["cfg"] = cfg
        raise Captured("captured")

    for module in (memprune.dialogue, memprune.evaluate, memprune.label, memprune.prune, memprune.qa,
                   memprune.stores, memprune.summarize, memprune.train):
        monkeypatch.setattr(module, "run", stub)
    return got


def _commands(d: Path, llm: Path) -> dict[str, tuple[list[str], dict[str, Path]]]:
    """command -> (argv, {config field: the path given})."""
    return {
        "summarize": (["summarize", "--data", str(d / "data"), "--out", str(d / "out"), "--llm-config", str(llm)],
                      {"data": d / "data", "out": d / "out", "llm_config": llm}),
        "label": (["label", "--data", str(d / "data"), "--out", str(d / "out"), "--judge", "llm", "--llm-config", str(llm)],
                  {"data": d / "data", "out": d / "out", "llm_config": llm}),
        "train": (["train", "--data", str(d / "data"), "--labels", str(d / "labels"), "--out", str(d / "out")],
                  {"data": d / "data", "out": d / "out"}),
        "evaluate": (["evaluate", "--run", str(d / "run"), "--out", str(d / "out"), "--data", str(d / "data")],
                     {"run": d / "run", "out": d / "out", "data": d / "data"}),
        "prune": (["prune", "--scorer", str(d / "scorer"), "--input", str(d / "data"), "--out", str(d / "out")],
                  {"scorer": d / "scorer", "input": d / "data", "out": d / "out"}),
        "dialogue-eval": (["dialogue-eval", "--data", str(d / "data"), "--pruned", str(d / "pruned"), "--out",
                           str(d / "out"), "--llm-config", str(llm)],
                          {"data": d / "data", "pruned": d / "pruned", "out": d / "out", "llm_config": llm}),
        "qa-eval": (["qa-eval", "--data", str(d / "data"), "--pruned", str(d / "pruned"), "--out", str(d / "out"),
                     "--llm-config", str(llm), "--judge-llm", str(llm)],
                    {"data": d / "data", "pruned": d / "pruned", "out": d / "out", "llm_config": llm,
                     "judge_llm_config": llm}),
    }


@pytest.mark.parametrize("command", ["summarize", "label", "train", "evaluate", "prune", "dialogue-eval", "qa-eval"])
@pytest.mark.parametrize("name", ODD_NAMES)
def test_odd_path_names_reach_the_config_as_paths(tmp_path: Path, captured: dict[str, Any], command: str,
                                                  name: str) -> None:
    root = tmp_path / name
    root.mkdir()
    llm = root / f"{name}.yaml"
    llm.write_text("engine: hf\nmodel: m\n")
    argv, want = _commands(root, llm)[command]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2 and "captured" in result.output, result.output
    cfg = captured["cfg"]
    for field, path in want.items():
        assert str(getattr(cfg, field)) == str(path), (field, getattr(cfg, field))
    if command == "train":
        assert [str(p) for p in cfg.labels] == [str(root / "labels")]


@pytest.mark.parametrize("name", ODD_NAMES)
def test_odd_path_names_for_synth_ingest_and_stats(tmp_path: Path, name: str) -> None:
    """The commands that run in a second do it for real."""
    runner = CliRunner()
    root = tmp_path / name
    result = runner.invoke(app, ["synth", "--conversations", "2", "--sessions", "2", "--out", str(root / "synth")])
    assert result.exit_code == 0, result.output
    assert json.loads((root / "synth" / "synth.json").read_text())["counts"]["conversations"] == 2
    src = root / "in.jsonl"
    src.write_text(json.dumps({"conversation_id": "c1", "sessions": [
        {"turns": [{"speaker": "a", "text": "I have a cat."}], "bullets": [{"text": "a has a cat.", "evidence": [0]}]},
        {"turns": [{"speaker": "a", "text": "My cat is fine."}]}]}) + "\n")
    result = runner.invoke(app, ["ingest", "--format", "jsonl", "--input", str(src), "--out", str(root / "corpus")])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["stats", str(root / "corpus")])
    assert result.exit_code == 0 and json.loads(result.stdout[result.stdout.index("{"):])["bullets"] == 1


def test_threshold_reaches_the_rule_as_a_float_validated_once(tmp_path: Path, captured: dict[str, Any]) -> None:
    base = ["prune", "--scorer", str(tmp_path), "--input", str(tmp_path), "--out", str(tmp_path / "o")]
    runner = CliRunner()
    assert runner.invoke(app, [*base, "--threshold", "0.7", "--top-k", "0"]).exit_code == 2
    rule = captured["cfg"].rule
    assert isinstance(rule.policy.threshold, float) and rule.policy.threshold == 0.7 and rule.policy.top_k is None
    for bad in ("2", "-0.1", "nan"):
        captured.clear()
        result = runner.invoke(app, [*base, "--threshold", bad])
        assert result.exit_code == 2 and "rule.threshold" in result.output and "cfg" not in captured, result.output
    yaml = tmp_path / "prune.yaml"
    yaml.write_text("rule: {threshold: 0.3, top_k: 2}\n")
    assert runner.invoke(app, [*base, "--config", str(yaml), "--threshold", "0.6"]).exit_code == 2
    assert (captured["cfg"].rule.policy.threshold, captured["cfg"].rule.policy.top_k) == (0.6, 2)  # the flag wins, the file stays


def test_no_command_takes_an_option_it_would_ignore() -> None:
    """`score` decides nothing: it has no supersession options (they were accepted and dropped); `prune`'s band help
    gives the rule's own default."""
    from memprune.decision.supersede import Supersede

    runner = CliRunner()
    result = runner.invoke(app, ["score", "--scorer", "s", "--input", "i", "--out", "o", "--supersede", "slot"])
    assert result.exit_code == 2 and "No such option" in result.output, result.output
    help_text = " ".join(runner.invoke(app, ["prune", "--help"], terminal_width=400).output.split())
    assert f"[default: {Supersede.model_fields['low'].default:g}:dedup threshold]" in help_text, help_text
