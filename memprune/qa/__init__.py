"""QA evaluation: answer accuracy against memory tokens under memory conditions (`memprune qa-eval`).

    from memprune.qa import QAEvalConfig, run
    summary = run(QAEvalConfig(data="runs/locomo", pruned="runs/locomo-pruned", out="runs/locomo-qa",
                               llm_config="configs/llm/vllm-gpu.yaml", judge_llm_config="configs/llm/vllm-gpu.yaml"))

- `config`: `QAEvalConfig` (on `memprune.memory.MemoryEvalConfig`).
- `plan`: questions, the memory scope of a question, the conditions (`none`, `all`, `pruned`,
  `retrieval`, `dialogue`) and the answer rows: pure, no Ray, no model.
- `metrics`: LoCoMo's answer normalisation, token F1, BLEU-1, abstention: pure.
- `scoring`: scores per category and condition with bootstrap intervals, paired differences, tokens.
- `stage`: `run(cfg)`: answers through `run_llm(task="answer")`, verdicts through
  `run_llm(task="qa_judge")`, both resumable on Ray Data; `report`: qa.md and qa.png. See docs/qa-eval.md.

The pruned store, the bullets and their pools, the bootstrap, the cost table and the report cells are
`memprune.memory`'s, shared with dialogue-eval; prompt and memory tokens are `memprune.llm.tokens`'s.
Nothing here imports the dialogue package (its sibling on `memprune.memory`).
"""

from __future__ import annotations

from memprune.qa.config import LOCOMO_CATEGORIES, QAEvalConfig
from memprune.qa.metrics import (
    ABSTAIN,
    bleu1,
    is_abstention,
    multi_answer_f1,
    normalize_answer,
    score_answer,
    token_f1,
)
from memprune.qa.plan import CONDITIONS, Corpus, QAError, Question, build_rows, load_questions, select_questions
from memprune.qa.report import render_markdown, write_figure
from memprune.qa.scoring import score_groups
from memprune.qa.stage import run, run_qa_eval

__all__ = [
    "ABSTAIN",
    "CONDITIONS",
    "Corpus",
    "LOCOMO_CATEGORIES",
    "QAError",
    "QAEvalConfig",
    "Question",
    "bleu1",
    "build_rows",
    "is_abstention",
    "load_questions",
    "multi_answer_f1",
    "normalize_answer",
    "render_markdown",
    "run",
    "run_qa_eval",
    "score_answer",
    "score_groups",
    "select_questions",
    "token_f1",
    "write_figure",
]
