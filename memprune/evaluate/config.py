"""Settings of `memprune evaluate`: the run to read, what to measure, and the pruning rule it reports."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from memprune import stages as registry
from memprune.config import ConfigModel, Place
from memprune.errors import MemPruneError
from memprune.evaluate.metrics import KS, RELEVANCE_THRESHOLD
from memprune.decision import PruneRule

SPLITS: tuple[str, ...] = ("test", "valid")
SPLIT_ALIASES: dict[str, str] = {"validation": "valid", "val": "valid"}


class EvaluationError(MemPruneError):
    """The run or corpus cannot be evaluated (missing files, no usable rows); the message says where."""


class EvalSettings(ConfigModel):
    """Every option of `memprune evaluate` except the paths (the pipeline's `evaluate:` section)."""

    rule: PruneRule = Field(default_factory=lambda: PruneRule(min_keep=0, dedup=False),
                            description="the pruning rule the tables report (default: the paper's rule, t=0.5 and top-5, "
                                        "Table 4 and the threshold sweep; any policy; duplicates are not merged)")
    ks: tuple[int, ...] = KS
    relevance_threshold: float = Field(RELEVANCE_THRESHOLD, ge=0.0, le=1.0, description="relevant = label >= this")
    thresholds: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
    splits: tuple[Literal["test", "valid"], ...] = ("test",)
    baseline: str = Field(default_factory=lambda: registry.baseline().name,
                          description="the stage every other is tested against (default: the registry's baseline)")
    tokenizer: str = Field("encoder", description="token unit: encoder (the run's encoder), whitespace, or a tokenizer.json")
    qa_draws: int = Field(1000, ge=1, description="random-pruning draws of the QA baseline")
    random_seed: int = 0
    histogram_bins: int = Field(20, ge=1)
    calibration_bins: int = Field(10, ge=1)
    figures: bool = True
    stage2_min_gain: float = Field(0.02, ge=0.0, description="stage 2 is recommended only when it beats stage 1 on "
                                   "test session Spearman by at least this much ...")
    stage2_alpha: float = Field(0.05, gt=0.0, lt=1.0, description="... with a Wilcoxon p-value over sessions below this")

    @field_validator("rule", mode="before")
    @classmethod
    def _evaluation_defaults(cls, v: object) -> object:
        """A rule given as keys (YAML, --threshold/--top-k) takes the evaluation's defaults for the rest: the paper's
        no min-keep, and no duplicate merging (the evaluation has scores, not texts)."""
        return {"min_keep": 0, "dedup": False, **v} if isinstance(v, dict) else v

    @field_validator("splits", mode="before")
    @classmethod
    def _split_names(cls, v: object) -> object:
        if isinstance(v, (list, tuple)):
            return tuple(SPLIT_ALIASES.get(s, s) if isinstance(s, str) else s for s in v)
        return v

    @field_validator("ks")
    @classmethod
    def _ks(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if not v or any(k < 1 for k in v):
            raise ValueError(f"ks must be positive integers, got {v}")
        return v

    @field_validator("thresholds")
    @classmethod
    def _thresholds(cls, v: tuple[float, ...]) -> tuple[float, ...]:
        if any(not 0.0 <= t <= 1.0 for t in v):  # also rejects NaN
            raise ValueError(f"thresholds must lie in [0, 1], got {v}")
        return v

    @model_validator(mode="after")
    def _checks(self) -> "EvalSettings":
        if not self.splits:
            raise ValueError(f"splits must be among {SPLITS}")
        if self.rule.group_by != "session":
            raise ValueError(f"evaluation measures sessions: rule.group_by must be session, got {self.rule.group_by!r}")
        if self.rule.dedup:
            raise ValueError("rule.dedup: the evaluation decides on scores without the bullets' texts, so it cannot "
                             "merge duplicates; set rule.dedup false")
        return self


class EvalConfig(EvalSettings):
    """Config of `memprune evaluate` (`jobs/evaluate.py`); every field is recorded in metrics.json."""

    run: Place = Field(description="run directory or URI with <stage>/seed<k>/predictions.parquet (or fold<i>/...)")
    out: str = Field(description="output directory or storage URI (s3://...): metrics.json, report.md, figures")
    data: Place | None = Field(None, description="corpus directory or URI: token counts and, with a qa table, QA "
                               "retention")
