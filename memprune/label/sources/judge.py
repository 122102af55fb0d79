"""source=judge: labels from the judges of `memprune.label` (`label/stage.py:run_judge` runs them)."""

from __future__ import annotations

from typing import Any

from memprune.label.sources.common import LabelSource, register


def _check(settings: Any) -> None:
    if settings.judge_entry().needs_llm and settings.llm is None and settings.llm_config is None \
            and not settings.judge_set and not settings.plan:
        raise ValueError(f"judge={settings.judge} needs an LLM config: set `llm_config` (a YAML file), an inline "
                         "`llm` section or `judge_set`")


JUDGE = register(LabelSource(name="judge", judged=True, check=_check,
                             description="a judge (LLM or similarity) over bullet x next-session turn pairs"))
