"""The prune step's config, validated once here: how the scorer runs (`ScoringRuntime`), every option of the batch
job (`PruneSettings`: the rule, `memprune.decision.PruneRule`, plus scoring, grouping and output), and the paths
(`PruneConfig`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from memprune.config import ConfigModel
from memprune.decision import PruneRule
from memprune.precision import Precision, precision_field
from memprune.scorers import ScorerRef, declared_threshold, scorer_field


class ScoringRuntime(ConfigModel):
    """How the scorer runs on Ray Data: the settings `memprune prune` and `memprune score` share."""

    batch_size: int = Field(128, ge=1, description="encoder forward batch size inside an actor")
    block_rows: int = Field(2048, ge=1, description="rows per Ray Data block (cut at group boundaries)")
    actors: int | None = Field(None, ge=1, description="actor pool size; default: one per GPU, else CPUs / actor_cpus")
    actor_cpus: float = Field(1.0, gt=0, description="torch threads per actor (rounded) and its default CPU request")
    use_gpu: bool | Literal["auto"] = "auto"
    io_cpus: float = Field(0.1, gt=0, description="Ray CPU request of each read/write/decide task")
    precision: Precision = precision_field("of the scorer's forward passes")
    ray_address: str | None = None
    progress: bool = True


class PruneSettings(ScoringRuntime):
    """Every option of the prune stage except the paths (the pipeline's `prune:` section)."""

    rule: PruneRule = Field(default_factory=PruneRule)
    score: Literal["auto", "raw", "calibrated"] = Field(
        "auto", description="which scores the rule sees: calibrated P(relevant) from the artifact's calibration.json, "
        "raw head outputs, or auto = calibrated where the artifact has a calibration, else raw (noted in prune.json)")
    grouping: Literal["auto", "contiguous", "shuffle"] = Field(
        "auto", description="auto: stream when groups are contiguous, else shuffle; contiguous: require it; shuffle: always"
    )
    sweep_top_k: list[int] = Field(default_factory=lambda: [1, 3, 5], description="extra top-k values reported in prune.json")
    execution: Literal["auto", "ray", "driver"] = Field(
        "auto", description="where the bullets are scored: ray = the Ray Data job (an actor pool); driver = one scorer "
        "in this process, no Ray; auto = the driver for up to `driver_rows` rows when no cluster is named (no "
        "ray_address, no RAY_ADDRESS, not connected to a multi-node Ray) and the device is here, else Ray")
    driver_rows: int = Field(200_000, ge=0, description="execution auto: the most rows scored on the driver (on one "
                             "machine its two scoring threads outran the Ray pool at 2x10^4 and 10^5 rows; beyond, "
                             "Ray's parallel read and write pay for its start)")
    rows_per_file: int = Field(100_000, ge=1, description="minimum rows per output Parquet file")
    sort_in_memory: int = Field(100_000, ge=0, description="groups not contiguous: up to this many rows, the "
                                "scored rows are gathered on the driver and decided there as one block instead of "
                                "a distributed `Dataset.sort` (whose fixed cost dominates small inputs)")
    sort_by_length: bool = Field(True, description="score texts in length order inside a block (less padding)")
    tokenizer: str = Field("encoder", description="token unit: encoder, whitespace, or a tokenizer.json (or its dir)")
    columns: list[str] | None = Field(None, description="extra input columns to carry; null = all")
    limit_rows: int | None = Field(None, ge=1, description="only the first N rows, rounded up to whole groups (trials)")
    dry_run: bool = Field(False, description="decide and report (decision/, prune.json, prune.md, preview.jsonl, "
                          "review.html) but write no store")
    preview_groups: int = Field(20, ge=0, description="dry run: about this many groups (a hash sample) in preview.jsonl")
    review_rows: int = Field(1_000_000, ge=0, description="review.html for stores of up to this many bullets (the page "
                             "holds every record; past 20 MB in data files beside it); 0 = no page")
    keep_ids: str | None = Field(None, description="a file of bullet ids (one per line, # comments: the review page's "
                                 "export) kept whatever the decision says, as if pinned: the review's corrections")
    emit: Literal["keep", "split"] = Field(
        "keep", description="keep: pruned/ (every bullet + score, keep, reason); split: also kept/ (the kept bullets, "
        "input columns) and dropped/ (the archive: score, reason, run fingerprint; `memprune restore`)")
    usage_log: str | None = Field(None, description="retention: a usage log (the `usage` label source's format) giving "
                                  "each bullet's recalls and last access; every id must be in the store")

    @model_validator(mode="after")
    def _usage_needs_retention(self) -> "PruneSettings":
        if self.usage_log is not None and not self.rule.retention.on:
            raise ValueError("usage_log gives recalls and last access for forgetting: set rule.retention.half_life "
                             "(--half-life) or max_age (--max-age)")
        return self

    @field_validator("sweep_top_k")
    @classmethod
    def _sweep(cls, v: list[int]) -> list[int]:
        if any(k < 1 for k in v):
            raise ValueError(f"sweep_top_k values must be >= 1, got {v}")
        return sorted(set(v))

    def settings(self) -> list[PruneRule]:
        """The rule first, then (policy `rule`) its top-k sweep reported beside it."""
        return self.rule.variants(self.sweep_top_k)

    @property
    def decision_carry(self) -> list[str]:
        """The input columns a dry run's decision/ carries beside the decision's own (where the input has them):
        the group keys, the conversation and session, the pin column and the times (the review page's)."""
        pin = [self.rule.pin_field] if self.rule.pin_field else []
        return list(dict.fromkeys([*self.rule.keys, "conversation_id", "session_index", *pin, "time", "session_time"]))


class PruneConfig(PruneSettings):
    """Config of the prune stage on a bullets store (`memprune.prune.run`): the settings plus the paths.

    `memprune prune` and `jobs/prune.py` load `memprune.stores.StorePruneConfig`, this plus the external
    store options, so the same command prunes a bullets table or a `KIND:LOCATION` store.
    """

    scorer: ScorerRef = scorer_field()
    input: str = Field(description="bullets store: a Parquet file, or a directory of them (a corpus dir: its bullets.parquet)")
    out: str = Field(description="output directory: pruned/ (the store), prune.json, prune.md")

    @model_validator(mode="after")
    def _scorer_threshold(self) -> "PruneConfig":
        """A rule that sets no threshold takes the scorer's (`ScorerConfig.threshold`: none for a shipped scorer)."""
        self.rule = self.rule.with_default_threshold(declared_threshold(self.scorer))
        return self
