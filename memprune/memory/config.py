"""The settings every evaluation of memory conditions with an LLM shares (dialogue-eval, qa-eval): the pruned
store, the output, the LLM, the encoder's batching, the bootstrap and the Ray Data blocks."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator

from memprune.config import ConfigModel
from memprune.llm.config import LLMSection


class BootstrapSettings(ConfigModel):
    """Bootstrap over evaluated items (targets, questions): resamples, interval level, seed."""

    samples: int = Field(1000, ge=0, description="Resamples of the targets (0 = no intervals).")
    confidence: float = Field(0.95, gt=0.0, lt=1.0, description="Percentile interval level.")
    seed: int = Field(0, description="Seed of the resampling (the same resamples for every condition).")


class MemoryEvalConfig(LLMSection):
    """The shared part of a memory evaluation's config. A subclass sets `CONDITIONS` and defines `data`,
    `conditions` and its own fields; `conditions` is checked here against the subclass's `CONDITIONS`."""

    CONDITIONS: ClassVar[tuple[str, ...]] = ()

    pruned: str | None = Field(None, description="Pruned store: a `memprune prune` output dir, its pruned/ dir, "
                                                 "or a Parquet file with bullet_id and keep (a path or a URI).")
    out: str = Field(..., description="Output directory or storage URI (s3://...).")
    encoder_max_length: int = Field(256, ge=8)
    encoder_batch_size: int = Field(64, ge=1)
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Device of the encoders on the driver.")
    pruned_missing: Literal["error", "drop"] = Field(
        "error", description="A memory bullet absent from the pruned store: error, or count it as not kept.")
    bootstrap: BootstrapSettings = Field(default_factory=BootstrapSettings)
    block_rows: int = Field(16, ge=1, description="Rows per Ray Data block (spreads work over engine replicas).")
    progress: bool = True

    @field_validator("conditions", check_fields=False)
    @classmethod
    def _conditions(cls, value: list[str]) -> list[str]:
        bad = [c for c in value if c not in cls.CONDITIONS]
        if bad or not value or len(set(value)) != len(value):
            raise ValueError(f"conditions must be distinct values among {list(cls.CONDITIONS)}, got {value}")
        return value
