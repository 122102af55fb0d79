"""Dialogue evaluation (DESIGN step 6): next-session replies under memory conditions, scored against the real turns.

    from memprune.dialogue import DialogueEvalConfig, run_dialogue_eval
    summary = run_dialogue_eval(DialogueEvalConfig(data="runs/msc", pruned="runs/msc-pruned", out="runs/dialogue",
                                                   llm_config="configs/llm/vllm-gpu.yaml"))

- `plan`: target sampling, the memory conditions (`none`, `all`, `pruned`, `retrieval`) and the
  generation rows: pure, no Ray, no model.
- `metrics`: BLEU (sacrebleu), ROUGE-L (rouge-score), BERTScore (bert-score, local encoder),
  MAUVE (mauve-text on our encoder features) and the bootstrap.
- `run`: generation through `memprune.llm.run_llm(task="reply")` on Ray Data, scoring, report.
See docs/dialogue.md.
"""

from __future__ import annotations

from memprune.dialogue.plan import (CONDITIONS, Bullet, Candidates, DialogueError, SampleSettings, Target, build_rows,
                                    bullets_by_session, memory_pool, retrieval_query, sample_targets, top_k)
from memprune.dialogue.run import (DialogueEvalConfig, generate_replies, load_keep, render_markdown, run,
                                   run_dialogue_eval, score_replies)

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
