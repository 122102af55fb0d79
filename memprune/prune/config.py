"""The pruning rule and the prune stage's config, validated once here.

`PruneRule` (threshold, top-k, group-by) is the one place that holds the rule's defaults
(0.5, 5, session) and its checks; the prune job, `MemoryPruner`, `memprune evaluate` and the
pipeline all carry one.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from memprune.config import ConfigModel, validate
from memprune.errors import MemPruneError
from memprune.precision import Precision
from memprune.prune.rule import setting_name

GroupBy = Literal["session", "conversation", "speaker"]
Policy = Literal["rule", "budget", "fraction"]
# The default near-duplicate cosine: chosen by bench/dedup_bench.py on `memprune synth --duplicates 0.2`.
DEDUP_THRESHOLD = 0.88
GROUP_KEYS: dict[str, tuple[str, ...]] = {
    "session": ("conversation_id", "session_index"),
    "conversation": ("conversation_id",),
    "speaker": ("conversation_id", "speaker"),
}


class PruneError(MemPruneError):
    """The store, scorer or config cannot be pruned; the message names the file, column or key."""


class PruneRule(ConfigModel):
    """The pruning decision: near-duplicate merging, a policy (the paper's `rule`, `budget`, `fraction`), min-keep.

    `rule` (the default, DESIGN step 5): drop scores below `threshold`, then keep the `top_k` best
    of each group. `budget`: keep the best while the group's kept tokens stay <= `budget_tokens`.
    `fraction`: keep the top ceil(`fraction` * n) of the group's n distinct bullets. For all:
    duplicates merged first (`dedup`), an optional score `floor`, and `min_keep`.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    policy: Policy = Field("rule", description="rule (threshold then top-k, the paper's), budget or fraction")
    threshold: float | None = Field(0.5, ge=0.0, le=1.0,
                                    description="rule: drop bullets scored below this (scores are in [0, 1]); null = no threshold")
    top_k: int | None = Field(5, ge=1, description="rule: keep at most k bullets per group; null = no cap")
    budget_tokens: int | None = Field(None, ge=0, description="budget: kept tokens per group never exceed this")
    fraction: float | None = Field(None, gt=0.0, le=1.0, description="fraction: keep the top ceil(q * n) of each group")
    min_keep: int = Field(1, ge=0, description="never leave a group with fewer than m bullets if it had them "
                                               "(wins over floor, threshold and budget); the default 1 never empties a "
                                               "group, 0 allows it (the paper's rule)")
    floor: float | None = Field(None, ge=0.0, le=1.0, description="any policy: drop bullets scored below this")
    dedup: bool = Field(True, description="merge exact and near-duplicate bullets of a group before deciding")
    dedup_threshold: float = Field(DEDUP_THRESHOLD, gt=0.0, le=1.0,
                                   description="cosine similarity of the scorer's encoder embeddings at which two "
                                               "bullets are near-duplicates")
    group_by: GroupBy = Field("session", description="what the policy applies to: session, conversation or speaker")

    @model_validator(mode="after")
    def _policy_fields(self) -> "PruneRule":
        if self.policy == "budget" and self.budget_tokens is None:
            raise ValueError("policy 'budget' needs budget_tokens (--budget-tokens B)")
        if self.policy == "fraction" and self.fraction is None:
            raise ValueError("policy 'fraction' needs fraction (--fraction q, 0 < q <= 1)")
        for name, policy in (("budget_tokens", "budget"), ("fraction", "fraction")):
            if getattr(self, name) is not None and self.policy != policy:
                raise ValueError(f"{name} is set but the policy is {self.policy!r}: it applies to policy {policy!r} only")
        return self

    @classmethod
    def of(cls, **fields: Any) -> "PruneRule":
        """A rule from keyword fields, with an invalid value as a `PruneError` naming the field."""
        try:
            return validate(cls, fields, "pruning rule")
        except MemPruneError as exc:
            raise PruneError(str(exc)) from exc

    @property
    def name(self) -> str:
        """Stable display key of the rule, e.g. 't0.5_k5', 't0.5_kall', 'budget120' or 'fraction0.4'."""
        if self.policy == "budget":
            return f"budget{self.budget_tokens}"
        if self.policy == "fraction":
            return f"fraction{self.fraction:g}"
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

    def variants(self, top_ks: list[int]) -> list["PruneRule"]:
        """The rules prune.json reports: this one first; for policy `rule` also its top-k sweep."""
        if self.policy != "rule":
            return [self]
        return [self.model_copy(update={"threshold": t, "top_k": k}) for t, k in self.sweep(top_ks)]


class ScoringRuntime(ConfigModel):
    """How the scorer runs on Ray Data: the settings `memprune prune` and `memprune score` share."""

    batch_size: int = Field(128, ge=1, description="encoder forward batch size inside an actor")
    block_rows: int = Field(2048, ge=1, description="rows per Ray Data block (cut at group boundaries)")
    actors: int | None = Field(None, ge=1, description="actor pool size; default: one per GPU, else CPUs / actor_cpus")
    actor_cpus: float = Field(1.0, gt=0, description="torch threads per actor (rounded) and its default CPU request")
    use_gpu: bool | Literal["auto"] = "auto"
    io_cpus: float = Field(0.1, gt=0, description="Ray CPU request of each read/write/decide task")
    precision: Precision = Field(
        "auto", description="of the scorer's forward passes: fp32, bf16 or fp16 autocast over fp32 weights; "
        "auto = bf16 on CUDA devices that support it, else fp32")
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
    rows_per_file: int = Field(100_000, ge=1, description="minimum rows per output Parquet file")
    sort_by_length: bool = Field(True, description="score texts in length order inside a block (less padding)")
    tokenizer: str = Field("encoder", description="token unit: encoder, whitespace, or a tokenizer.json (or its dir)")
    columns: list[str] | None = Field(None, description="extra input columns to carry; null = all")
    limit_rows: int | None = Field(None, ge=1, description="only the first N rows, rounded up to whole groups (trials)")
    dry_run: bool = Field(False, description="decide and report (prune.json, prune.md, preview.jsonl) but write no store")
    preview_groups: int = Field(20, ge=0, description="dry run: about this many groups (a hash sample) in preview.jsonl")
    emit: Literal["keep", "split"] = Field(
        "keep", description="keep: pruned/ (every bullet + score, keep, reason); split: also kept/ (the kept bullets, "
        "input columns) and dropped/ (the archive: score, reason, run fingerprint; `memprune restore`)")

    @field_validator("sweep_top_k")
    @classmethod
    def _sweep(cls, v: list[int]) -> list[int]:
        if any(k < 1 for k in v):
            raise ValueError(f"sweep_top_k values must be >= 1, got {v}")
        return sorted(set(v))

    def settings(self) -> list[PruneRule]:
        """The rule first, then (policy `rule`) its top-k sweep reported beside it."""
        return self.rule.variants(self.sweep_top_k)


class PruneConfig(PruneSettings):
    """Config of the prune stage on a bullets store (`memprune.prune.run`): the settings plus the paths.

    `memprune prune` and `jobs/prune.py` load `memprune.stores.StorePruneConfig`, this plus the external
    store options, so the same command prunes a bullets table or a `KIND:LOCATION` store.
    """

    scorer: str = Field(description="scorer artifact directory (scorer.json + head.safetensors)")
    input: str = Field(description="bullets store: a Parquet file, or a directory of them (a corpus dir: its bullets.parquet)")
    out: str = Field(description="output directory: pruned/ (the store), prune.json, prune.md")
