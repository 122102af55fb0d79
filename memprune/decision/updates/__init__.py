"""Update judges by registry: does a later bullet B replace an earlier bullet A of the same subject?

The supersession step (`memprune.decision.supersede`) finds candidate pairs (same scope and subject, A earlier,
cosine of the scorer's embeddings in the band) and asks the rule's judge about all of them at once. Each
judge module (`slot`: built-in, no LLM; `llm`: asks an LLM) registers one `UpdateJudgeEntry` in `registry`;
adding a judge is one module and one entry (its import below).
"""

from __future__ import annotations

from memprune.decision.updates import llm, slot  # noqa: F401  (the judges register themselves)
from memprune.decision.updates.registry import (
    NO_VERDICT,
    UPDATE_JUDGES,
    Pairs,
    UpdateJudgeEntry,
    register,
    update_judge,
)

__all__ = ["NO_VERDICT", "UPDATE_JUDGES", "Pairs", "UpdateJudgeEntry", "register", "update_judge"]
