"""Settings of `memprune label`, validated once: label source, pair building, judge, aggregation, sharding.

`LabelSettings` holds every option and is what the pipeline's `label:` section is; `LabelConfig`
adds the corpus directory (`data`) and the output directory (`out`).
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from memprune.config import ConfigModel
from memprune.errors import MemPruneError
from memprune.label.pairs import PairOptions

DEFAULT_SHARD_SIZE = {"similarity": 4096, "llm": 4096}


class LabelError(MemPruneError):
    """The labeling stage cannot run with these inputs or settings (the message says why)."""


class SimilarityOptions(ConfigModel):
    """Settings of the similarity (encoder proxy) judge."""

    model: str | None = Field(None, description="Encoder path or hub id; default: local all-MiniLM-L6-v2.")
    batch_size: int = Field(128, ge=1)
    max_length: int = Field(128, ge=8)
    mapping: Literal["clip", "affine"] = "clip"
    device: str = "cpu"
    executor: Literal["local", "ray"] = Field("local", description="Encode shards in-process or on a Ray Data actor pool.")
    actors: int = Field(2, ge=1, description="Actor pool size for executor=ray.")


class QALabelSettings(ConfigModel):
    """source=qa: how QA evidence becomes labels (see `memprune.label.sources.qa_labels`)."""

    grading: Literal["binary", "graded"] = Field("binary", description="binary: cited at all; graded: by citing questions")
    grade_cap: int = Field(3, ge=1, description="graded: label = min(1, n_citing / grade_cap)")
    later_only: bool = Field(False, description="count only questions whose evidence reaches a later session")
    categories: list[int] | None = Field(None, description="only QA items of these categories (None = all)")


class UsageLabelSettings(ConfigModel):
    """source=usage: the usage log and how its events become labels (see `memprune.label.sources.usage_labels`)."""

    log: Path | None = Field(None, description="usage log: a .parquet/.jsonl file or a directory of them")
    aggregation: Literal["max", "mean"] = Field("max", description="label = max or mean of the event values")
    missing: Literal["unlabelled", "zero"] = Field("unlabelled", description="bullets without events")
    since: datetime | None = Field(None, description="count only events at or after this time")
    until: datetime | None = Field(None, description="count only events at or before this time")


class LabelSettings(ConfigModel):
    """Every option of `memprune label` except the paths (the pipeline's `label:` section)."""

    source: Literal["judge", "qa", "usage"] = Field("judge", description="judge (LLM/similarity), qa or usage")
    qa: QALabelSettings = Field(default_factory=QALabelSettings)
    usage: UsageLabelSettings = Field(default_factory=UsageLabelSettings)
    judge: Literal["llm", "similarity"] = "similarity"
    speaker: Literal["all", "same", "other"] = "all"
    context_turns: int = Field(4, ge=0)
    horizon: int = Field(1, ge=1)
    decay: float = Field(0.5, gt=0.0, le=1.0)
    aggregation: Literal["max", "mean"] = "max"
    order: Literal["target", "bullet"] = "target"
    shard_size: int | None = Field(None, ge=1, description="Texts (similarity) or pairs (llm) per shard.")
    similarity: SimilarityOptions = Field(default_factory=SimilarityOptions)
    llm_config: Path | None = Field(None, description="A YAML file of memprune.llm.LLMConfig fields.")
    llm: dict[str, Any] | None = Field(None, description="LLMConfig fields set inline (merged over llm_config).")
    llm_overrides: list[str] = Field(default_factory=list, description="key=value LLMConfig overrides, applied last.")
    llm_block_rows: int = Field(64, ge=1, description="Rows per Ray Data block fed to the LLM judge.")
    progress: bool = True

    @model_validator(mode="after")
    def _judge_settings(self) -> "LabelConfig":
        if self.source == "usage" and self.usage.log is None:
            raise ValueError("source=usage needs the usage log: set `usage.log` (CLI: --usage-log)")
        if self.source == "judge" and self.judge == "llm" and self.llm is None and self.llm_config is None:
            raise ValueError("judge=llm needs an LLM config: set `llm_config` (a YAML file) or an inline `llm` section")
        return self

    def pair_options(self) -> PairOptions:
        return PairOptions(speaker=self.speaker, context_turns=self.context_turns, horizon=self.horizon,
                           order=self.order)

    def effective_shard_size(self) -> int:
        return self.shard_size or DEFAULT_SHARD_SIZE[self.judge]

    def llm_settings(self) -> Any:
        """The judge's `memprune.llm.LLMConfig`: the `llm_config` file, then the inline `llm`, then `llm_overrides`."""
        from memprune.llm import LLMConfig

        return LLMConfig.resolve(self.llm_config, self.llm, self.llm_overrides)


class LabelConfig(LabelSettings):
    """Everything `memprune label` needs: the settings plus the corpus and output directories."""

    data: Path
    out: Path
