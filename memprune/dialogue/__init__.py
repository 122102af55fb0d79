"""Dialogue evaluation (DESIGN step 6): next-session replies under memory conditions, scored against the real turns.

    from memprune.dialogue import DialogueEvalConfig, run
    summary = run(DialogueEvalConfig(data="runs/msc", pruned="runs/msc-pruned", out="runs/dialogue",
                                     llm_config="configs/llm/vllm-gpu.yaml"))

- `config`: `DialogueEvalConfig` and its metric settings.
- `plan`: target sampling, the memory conditions (`none`, `all`, `pruned`, `retrieval`) and the
  generation rows: pure, no Ray, no model.
- `metrics`: BLEU (sacrebleu), ROUGE-L (rouge-score), BERTScore (bert-score, local encoder),
  MAUVE (mauve-text on our encoder features) and the bootstrap.
- `scoring`: metrics per condition with intervals, paired differences, cost per condition.
- `stage`: `run(cfg)`: generation through `memprune.llm.run_llm(task="reply")` on Ray Data, scoring;
  `report`: dialogue.md. See docs/dialogue.md.
"""

from __future__ import annotations

from memprune.dialogue.config import DialogueEvalConfig
from memprune.dialogue.plan import (
                                    CONDITIONS,
                                    Bullet,
                                    Candidates,
                                    DialogueError,
                                    SampleSettings,
                                    Target,
                                    build_rows,
                                    bullets_by_session,
                                    memory_pool,
                                    retrieval_query,
                                    sample_targets,
                                    top_k,
)
from memprune.dialogue.report import render_markdown
from memprune.dialogue.scoring import score_replies
from memprune.dialogue.stage import generate_replies, load_keep, run, run_dialogue_eval

__all__ = [
    "CONDITIONS",
    "Bullet",
    "Candidates",
    "DialogueError",
    "DialogueEvalConfig",
    "SampleSettings",
    "Target",
    "build_rows",
    "bullets_by_session",
    "generate_replies",
    "load_keep",
    "memory_pool",
    "render_markdown",
    "retrieval_query",
    "run",
    "run_dialogue_eval",
    "sample_targets",
    "score_replies",
    "top_k",
]
