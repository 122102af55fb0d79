"""The LLM backends: one config and one entry point for three engines (vllm, http, hf).

    config = LLMConfig.from_yaml("configs/llm/vllm-gpu.yaml", ["sampling.max_tokens=32"])
    out = run_llm(ds, config, task="judge")   # or "summarize" / "reply" / "answer" / "qa_judge"

`run_llm` builds the prompts from the versioned templates in `memprune/prompts`, runs the
configured engine on Ray Data, parses the outputs strictly (JSON schema) with a lenient
fallback, re-sends rows that fail (bounded), and returns error rows (with the raw text)
for what still fails. See docs/llm.md.
"""

from __future__ import annotations

from memprune.llm.config import LLMConfig, Sampling
from memprune.llm.engines import LLMError
from memprune.llm.parsing import (
    JUDGE_SCHEMA,
    QA_JUDGE_SCHEMA,
    SUMMARY_SCHEMA,
    VERDICTS,
    Parsed,
    parse_answer,
    parse_judge,
    parse_qa_judge,
    parse_reply,
    parse_summary,
)
from memprune.llm.prompts import PromptError
from memprune.llm.run import outcome_summary, output_fields, run_llm
from memprune.llm.tasks import TASKS, TaskSpec, load_template

__all__ = [
    "JUDGE_SCHEMA",
    "LLMConfig",
    "LLMError",
    "Parsed",
    "PromptError",
    "QA_JUDGE_SCHEMA",
    "SUMMARY_SCHEMA",
    "TASKS",
    "TaskSpec",
    "VERDICTS",
    "Sampling",
    "load_template",
    "outcome_summary",
    "output_fields",
    "parse_answer",
    "parse_judge",
    "parse_qa_judge",
    "parse_reply",
    "parse_summary",
    "run_llm",
]
