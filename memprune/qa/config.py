"""Settings of `memprune qa-eval`: questions, memory conditions, the answer and judge LLMs, scoring, bootstrap."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from memprune.llm import LLMConfig
from memprune.memory.config import MemoryEvalConfig
from memprune.qa.plan import CONDITIONS, needs_keep

# LoCoMo's categories as its released data numbers them (the paper's Table 2 order differs).
LOCOMO_CATEGORIES: dict[int, str] = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop",
                                     5: "adversarial"}


class QAEvalConfig(MemoryEvalConfig):
    """Config of the QA evaluation (`jobs/qa_eval.py`, `memprune qa-eval`); `llm` is the answering model."""

    CONDITIONS: ClassVar[tuple[str, ...]] = CONDITIONS

    data: str = Field(..., description="Corpus directory or URI with qa.parquet, sessions.parquet and "
                                       "bullets.parquet.")
    judge_llm_config: str | None = Field(None, description="YAML file of the judge LLM (CORRECT/WRONG); none = no judge.")
    judge_llm: dict[str, Any] | None = Field(None, description="Inline judge LLM config (instead of judge_llm_config).")
    judge_llm_overrides: list[str] = Field(default_factory=list, description="key=value overrides of the judge LLM.")
    conditions: list[str] = Field(default_factory=lambda: list(CONDITIONS), description="Memory conditions.")
    scope: Literal["last_session", "evidence"] = Field(
        "last_session", description="Sessions before a question: all of its conversation (asked after the last "
                                    "session, as in LoCoMo), or up to its latest evidence session.")
    retrieval_k: int | Literal["pruned", "pruned_tokens"] = Field(
        "pruned_tokens", description="Bullets retrieved per question: a number, 'pruned' (as many as pruned memory "
                                     "has) or 'pruned_tokens' (as many as fit in pruned memory's tokens).")
    dialogue_tokens: int | None = Field(8192, ge=1, description="Token budget of the dialogue condition: the most "
                                                                 "recent turns that fit; null = every turn.")
    questions: int | None = Field(None, ge=1, description="Evaluate at most this many questions (hash-sampled); "
                                                           "null = all.")
    categories: list[int] | None = Field(None, description="Only these question categories; null = all.")
    seed: int = Field(0, description="Seed of the question sampling (with `questions`).")
    f1_rules: Literal["locomo", "plain"] = Field(
        "locomo", description="locomo: LoCoMo's category rules (1: multi-answer F1, 3: gold before ';'); plain: F1.")
    category_names: dict[int, str] = Field(default_factory=lambda: dict(LOCOMO_CATEGORIES),
                                           description="Report names of the categories (LoCoMo's by default).")
    encoder: str | None = Field(None, description="Encoder of the retrieval baseline (local dir or hub id; "
                                                  "None = the local all-MiniLM-L6-v2); also the token unit "
                                                  "when the answering model is not a local directory.")
    chunk_questions: int = Field(128, ge=1, description="Questions per resumable generation chunk.")
    figures: bool = Field(True, description="Draw qa.png (accuracy against memory tokens).")

    @field_validator("retrieval_k")
    @classmethod
    def _retrieval_k(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError(f"retrieval_k must be >= 1, 'pruned' or 'pruned_tokens', got {value}")
        return value

    @model_validator(mode="after")
    def _checks(self) -> "QAEvalConfig":
        if self.judge_llm is not None and self.judge_llm_config is not None:
            raise ValueError("set at most one of `judge_llm_config` (a YAML file) or an inline `judge_llm` section")
        if needs_keep(self.conditions, self.retrieval_k) and not self.pruned:
            raise ValueError("the pruned condition (and retrieval_k: pruned / pruned_tokens) needs `pruned` "
                             "(a `memprune prune` output)")
        return self

    def judge_settings(self) -> LLMConfig | None:
        """The judge LLM's config, or None when no judge is configured (no CORRECT/WRONG verdicts)."""
        if self.judge_llm is None and self.judge_llm_config is None:
            return None
        return LLMConfig.resolve(self.judge_llm_config, self.judge_llm, self.judge_llm_overrides)
