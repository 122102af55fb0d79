"""The pruning rule and the prune stage's config, validated once here.

`PruneRule` (threshold, top-k, group-by) is the one place that holds the rule's defaults
(0.5, 5, session) and its checks; the prune job, `MemoryPruner`, `memprune evaluate` and the
pipeline all carry one.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator

from memprune.config import ConfigModel, validate
from memprune.errors import MemPruneError
from memprune.precision import Precision
from memprune.prune.rule import setting_name
from memprune.stores.config import StoreOptions

GroupBy = Literal["session", "conversation", "speaker"]
GROUP_KEYS: dict[str, tuple[str, ...]] = {
    "session": ("conversation_id", "session_index"),
    "conversation": ("conversation_id",),
    "speaker": ("conversation_id", "speaker"),
}


class PruneError(MemPruneError):
    """The store, scorer or config cannot be pruned; the message names the file, column or key."""


class PruneRule(ConfigModel):
    """DESIGN step 5: drop scores below `threshold`, then keep the `top_k` best of each group."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    threshold: float | None = Field(0.5, ge=0.0, le=1.0,
                                    description="drop bullets scored below this (scores are in [0, 1]); null = no threshold")
    top_k: int | None = Field(5, ge=1, description="keep at most k bullets per group; null = no cap")
    group_by: GroupBy = Field("session", description="what top-k applies to: session, conversation or speaker")

    @classmethod
    def of(cls, **fields: Any) -> "PruneRule":
        """A rule from keyword fields, with an invalid value as a `PruneError` naming the field."""
        try:
            return validate(cls, fields, "pruning rule")
        except MemPruneError as exc:
            raise PruneError(str(exc)) from exc

    @property
    def name(self) -> str:
        """Stable display key of the rule's (threshold, top-k), e.g. 't0.5_k5' or 't0.5_kall'."""
        return setting_name(self.threshold, self.top_k)

    @property
    def keys(self) -> tuple[str, ...]:
        """The columns whose values form a group."""
        return GROUP_KEYS[self.group_by]

    def sweep(self, top_ks: list[int]) -> list[tuple[float | None, int | None]]:
        """(threshold, top-k) settings: this rule's first, then `top_ks` and 'no cap' at its threshold."""
        out = [(self.threshold, self.top_k)]
        for k in [*top_ks, None]:
            if (self.threshold, k) not in out:
                out.append((self.threshold, k))
        return out


class PruneSettings(ConfigModel):
    """Every option of the prune stage except the paths (the pipeline's `prune:` section)."""

    rule: PruneRule = Field(default_factory=PruneRule)
    grouping: Literal["auto", "contiguous", "shuffle"] = Field(
        "auto", description="auto: stream when groups are contiguous, else shuffle; contiguous: require it; shuffle: always"
    )
    sweep_top_k: list[int] = Field(default_factory=lambda: [1, 3, 5], description="extra top-k values reported in prune.json")
    batch_size: int = Field(128, ge=1, description="encoder forward batch size inside an actor")
    block_rows: int = Field(2048, ge=1, description="rows per Ray Data block (cut at group boundaries)")
    actors: int | None = Field(None, ge=1, description="actor pool size; default: one per GPU, else CPUs / actor_cpus")
    actor_cpus: float = Field(1.0, gt=0, description="torch threads per actor (rounded) and its default CPU request")
    use_gpu: bool | Literal["auto"] = "auto"
    io_cpus: float = Field(0.1, gt=0, description="Ray CPU request of each read/write/decide task")
    rows_per_file: int = Field(100_000, ge=1, description="minimum rows per output Parquet file")
    precision: Precision = Field(
        "auto", description="of the scorer's forward passes: fp32, bf16 or fp16 autocast over fp32 weights; "
        "auto = bf16 on CUDA devices that support it, else fp32")
    sort_by_length: bool = Field(True, description="score texts in length order inside a block (less padding)")
    tokenizer: str = Field("encoder", description="token unit: encoder, whitespace, or a tokenizer.json (or its dir)")
    columns: list[str] | None = Field(None, description="extra input columns to carry; null = all")
    limit_rows: int | None = Field(None, ge=1, description="only the first N rows, rounded up to whole groups (trials)")
    ray_address: str | None = None
    progress: bool = True

    @field_validator("sweep_top_k")
    @classmethod
    def _sweep(cls, v: list[int]) -> list[int]:
        if any(k < 1 for k in v):
            raise ValueError(f"sweep_top_k values must be >= 1, got {v}")
        return sorted(set(v))

    def settings(self) -> list[tuple[float | None, int | None]]:
        """The rule's (threshold, top-k) first, then the sweep values reported beside it."""
        return self.rule.sweep(self.sweep_top_k)


class PruneConfig(PruneSettings):
    """Config of the prune stage (`jobs/prune.py`, `memprune prune`): the settings plus the paths."""

    scorer: str = Field(description="scorer artifact directory (scorer.json + head.safetensors)")
    input: str = Field(description="bullets store: a Parquet file, or a directory of them (a corpus dir: its bullets.parquet); "
                       "or an external store KIND:LOCATION (table:PATH, lance:PATH, mem0:CONFIG; see memprune.stores)")
    out: str = Field(description="output directory: pruned/ (the store), prune.json, prune.md")
    store: StoreOptions = Field(default_factory=StoreOptions,
                                description="external stores only: column map, --apply mode (memprune.stores)")
