"""Dialogue evaluation (DESIGN step 6): next-session replies under memory conditions, scored against the real turns.

    from memprune.dialogue import DialogueEvalConfig, run
    summary = run(DialogueEvalConfig(data="runs/msc", pruned="runs/msc-pruned", out="runs/dialogue",
                                     llm_config="configs/llm/vllm-gpu.yaml"))

- `config`: `DialogueEvalConfig` (on `memprune.memory.MemoryEvalConfig`) and its metric settings.
- `plan`: target sampling, the memory conditions (`none`, `all`, `pruned`, `retrieval`) and the
  generation rows: pure, no Ray, no model.
- `metrics`: BLEU (sacrebleu), ROUGE-L (rouge-score), BERTScore (bert-score, local encoder),
  MAUVE (mauve-text on our encoder features) and their bootstrap resamples.
- `scoring`: metrics per condition with intervals and paired differences.
- `stage`: `run(cfg)`: generation through `memprune.llm.run_llm(task="reply")` on Ray Data, scoring;
  `report`: dialogue.md. See docs/dialogue.md.

The pruned store, the bullets and their pools, the bootstrap, the cost table and the report cells are
`memprune.memory`'s, shared with qa-eval; prompt tokens are `memprune.llm.tokens`'s. Nothing here
imports the qa package (its sibling on `memprune.memory`).
"""

from __future__ import annotations

from memprune.dialogue.config import DialogueEvalConfig
from memprune.dialogue.plan import (
                                    CONDITIONS,
                                    Candidates,
                                    DialogueError,
                                    SampleSettings,
                                    Target,
                                    build_rows,
                                    retrieval_query,
                                    sample_targets,
)
from memprune.dialogue.report import render_markdown
from memprune.dialogue.scoring import score_replies
from memprune.dialogue.stage import generate_replies, run, run_dialogue_eval

__all__ = [
    "CONDITIONS",
    "Candidates",
    "DialogueError",
    "DialogueEvalConfig",
    "SampleSettings",
    "Target",
    "build_rows",
    "generate_replies",
    "render_markdown",
    "retrieval_query",
    "run",
    "run_dialogue_eval",
    "sample_targets",
    "score_replies",
]
