"""Labels (DESIGN step 2): how useful each bullet is for the next session's real replies.

    from memprune.label import LabelConfig, run
    run(LabelConfig(data="runs/msc", out="runs/msc-labels", judge="similarity"))

- `config`: `LabelSettings` / `LabelConfig` (validated once).
- `pairs`: bullets of session t x turns of the sessions after it (pure).
- `similarity` / `llm_judge` / `listwise` / `likelihood`: the judges (CPU proxy / the paper's pairwise
  LLM judge / one prompt per target turn / log-probability gain), in resumable shards (`shards`).
- `judges`: the `JUDGES` registry (one `JudgeEntry` per kind, declared in its module); `judging` runs the
  model judges; `consensus` + `agreement`: several judges, their mean, spread and
  agreement (Spearman, Krippendorff's alpha).
- `cost`: calls, tokens, prefix-cache reuse and GPU-hours (`--plan`, and `label.json` -> `cost`).
- `aggregate`: pairs -> labels (max or mean, horizon decay).
- `sources`: labels from QA evidence or a usage log instead of a judge (pure).
- `stage`: `run(cfg)`; `summary`: label.json; `report`: label.md and plan.md.
"""

from __future__ import annotations

from memprune.label import likelihood, listwise, llm_judge, similarity  # noqa: F401  (register the judges)
from memprune.label.aggregate import ALL_PAIRS_FAILED, aggregate, decay_weight
from memprune.label.config import LabelConfig, LabelError, LabelSettings
from memprune.label.stage import run

run_label = run

__all__ = [
    "ALL_PAIRS_FAILED",
    "LabelConfig",
    "LabelError",
    "LabelSettings",
    "aggregate",
    "decay_weight",
    "run",
    "run_label",
]
