"""The `hf` engine end to end: transformers generate in a Ray Data actor pool on the tiny random LLM."""

from __future__ import annotations

import pyarrow as pa
import pytest
from tiny_llm import check_judge_output, judge_dataset, judge_rows

from memprune.llm import LLMConfig, outcome_summary, run_llm

pytestmark = pytest.mark.slow


def test_hf_judge_malformed_outputs_become_error_rows_after_retries(ray_local, tiny_llm):
    config = LLMConfig(engine="hf", model=tiny_llm, dtype="float32", max_model_len=1024, max_retries=1,
                       batch_size=4, stage_num_cpus=0.25, sampling={"max_tokens": 3})
    rows = judge_rows(5)
    out = run_llm(judge_dataset(rows), config, task="judge").take_all()
    by_id = check_judge_output(rows, out, max_attempts=2)

    # the random model with 3 new tokens writes noise: unparseable -> retried -> error rows with the raw text
    garbage = [r for r in out if r["error"] and "unparseable" in r["error"]]
    assert garbage, "expected the tiny random model to produce unparseable output"
    for r in garbage:
        assert r["attempts"] == 2 and r["raw"] is not None and "gave up after 2 attempt(s)" in r["error"]
        assert r["tokens_in"] > 0 and 0 < r["tokens_out"] <= 2 * 3
    # a prompt longer than the model: an engine error for that row only, retried, never a crash
    long = by_id["c:s0:long"]
    assert long["attempts"] == 2 and "exceeds the model length 1024" in long["error"] and long["raw"] is None
    # an unusable input row is reported, not sent
    empty = by_id["c:s0:empty"]
    assert empty["attempts"] == 0 and empty["error"].startswith("input:") and "'bullet'" in empty["error"]

    summary = outcome_summary(pa.Table.from_pylist(out))
    assert summary["rows"] == 7 and summary["ok"] + summary["errors"] == 7
    assert summary["errors_by_kind"]["input"] == 1 and summary["errors_by_kind"]["engine"] == 1
    assert summary["attempts"].get(2, 0) >= 1 + len(garbage)
    assert summary["tokens_in"] == sum(r["tokens_in"] or 0 for r in out)
