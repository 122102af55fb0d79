"""The update judge `llm`: asks the configured LLM, per candidate pair, "does the later note B replace A?".

The prompt is `memprune/prompts/update_v1.txt` (`LLMConfig.update_prompt`), the answer `{"update": "yes" | "no"}`
(the JSON schema constrains it on vllm and http; the hf engine generates free text, parsed strictly, then
leniently). All pairs of one decision (a block of the prune job, one `MemoryPruner` call) go to the engine in
one call; the engine is built once per process (`memprune.llm.local`: in the prune job's actor or task itself,
no Ray Data pipeline of its own). An answer that still does not parse after `max_retries` re-sends is no
verdict (`NO_VERDICT`): not an update, counted in prune.json (`supersede_no_verdict`), never an error of the run.
Its settings: `supersede.llm_config` (`--supersede-llm FILE`) and/or an inline `supersede.llm` section.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from memprune.decision.updates.registry import NO_VERDICT, Pairs, UpdateJudgeEntry, register
from memprune.llm.local import local_engine, run_rows


def judge(pairs: Pairs, settings: Any) -> np.ndarray:
    """1 where the LLM says B replaces A, 0 where it says not, `NO_VERDICT` where no answer parsed."""
    if not len(pairs):
        return np.zeros(0, dtype=np.int64)
    config = settings.llm_settings()
    rows = run_rows([{"earlier": a, "later": b} for a, b in zip(pairs.a, pairs.b)], config, "update",
                    local_engine(config))
    return np.array([NO_VERDICT if r["update"] is None else int(r["update"]) for r in rows], dtype=np.int64)


ENTRY = register(UpdateJudgeEntry(
    "llm", "an LLM (supersede.llm_config) answers 'does the later note replace the earlier one?' per candidate pair; "
    "for clusters with a GPU", judge, needs_llm=True))
