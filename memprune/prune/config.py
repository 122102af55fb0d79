"""The pruning rule and the prune stage's config, validated once here.

`PruneRule` (threshold, top-k, group-by) is the one place that holds the rule's defaults
(0.5, 5, session) and its checks; the prune job, `MemoryPruner`, `memprune evaluate` and the
pipeline all carry one.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, SerializeAsAny, field_validator, model_serializer, model_validator

from memprune.config import ConfigModel, validate
from memprune.errors import MemPruneError
from memprune.precision import Precision, precision_field
from memprune.prune.lifecycle import Retention
from memprune.prune.policies import Policy, RulePolicy, owner_of, policy_of
from memprune.prune.supersede import Supersede

GroupBy = Literal["session", "conversation", "speaker"]
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
    """The pruning decision: near-duplicate merging, a policy (`memprune.prune.policies`), a floor, min-keep.

    In YAML and on the command line the rule is flat: `policy` names the policy (`rule`, the paper's
    threshold then top-k, the default; `budget`; `fraction`; or a registered one) and its settings sit
    beside it (`threshold`, `top_k`; `budget_tokens`; `fraction`). A setting of another policy is an
    error, never a no-op, and a policy's own setting names it: `budget_tokens: 120` alone means
    `policy: budget`, on the command line as in YAML. For every policy: duplicates merged first
    (`dedup`), an optional score `floor`, and `min_keep`.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    policy: SerializeAsAny[Policy] = Field(default_factory=RulePolicy,
                                           description="the policy and its settings (flat in YAML: policy: NAME + its keys)")
    min_keep: int = Field(1, ge=0, description="never leave a group with fewer than m bullets if it had them "
                                               "(wins over floor, threshold and budget); the default 1 never empties a "
                                               "group, 0 allows it (the paper's rule)")
    floor: float | None = Field(None, ge=0.0, le=1.0, description="any policy: drop bullets scored below this")
    dedup: bool = Field(True, description="merge exact and near-duplicate bullets of a group before deciding")
    dedup_threshold: float = Field(DEDUP_THRESHOLD, gt=0.0, le=1.0,
                                   description="cosine similarity of the scorer's encoder embeddings at which two "
                                               "bullets are near-duplicates")
    group_by: GroupBy = Field("session", description="what the policy applies to: session, conversation or speaker")
    pin_field: str | None = Field(None, min_length=1,
                                  description="boolean column (mapping key) of pinned bullets: never dropped, outside "
                                              "the policy and min-keep; null = no pins")
    retention: Retention = Field(default_factory=Retention,
                                 description="forgetting (half_life, recall_boost) and expiry (max_age), measured at now")
    supersede: Supersede = Field(default_factory=Supersede,
                                 description="supersession of outdated facts (judge, scope, subject, band low..high)")

    @model_validator(mode="after")
    def _band_below_dedup(self) -> "PruneRule":
        lo, hi = self.supersede.band(self.dedup_threshold)
        if self.supersede.on and (hi > self.dedup_threshold or lo >= hi):
            raise ValueError(f"supersede band [{lo:g}, {hi:g}) must be non-empty and lie below the duplicate "
                             f"threshold {self.dedup_threshold:g}")
        return self

    @model_validator(mode="before")
    @classmethod
    def _flat_policy(cls, data: Any) -> Any:
        """`policy: NAME` + that policy's keys (flat) -> the policy's own model; another policy's key is an error."""
        if not isinstance(data, dict) or isinstance(data.get("policy"), Policy):
            return data
        data = dict(data)
        given = data.pop("policy", None)
        owners = {k: owner_of(k) for k in data if k not in cls.model_fields}
        named = sorted({o for o in owners.values() if o is not None and o != "rule"})
        name = given or (named[0] if len(named) == 1 else "rule")
        model = policy_of(name)
        for k in [k for k, o in owners.items() if o is not None and k not in model.model_fields and data[k] is None]:
            del data[k], owners[k]  # another policy's setting given as null (as older prune.json files record it)
        stray = [k for k, o in owners.items() if o is not None and k not in model.model_fields]
        if stray:
            raise ValueError(f"{stray[0]} is a setting of policy {owners[stray[0]]!r}, but the policy is {name!r}")
        own = {k: data.pop(k) for k in list(data) if k in model.model_fields}
        if given is not None or own:
            data["policy"] = model.model_validate(own)
        return data

    @model_serializer(mode="wrap")
    def _flat(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        if "policy" not in out:  # model_dump(exclude={"policy"}): the shared settings only
            return out
        return {"policy": self.policy.name, **out.pop("policy"), **out}

    @classmethod
    def of(cls, **fields: Any) -> "PruneRule":
        """A rule from keyword fields (flat, as in YAML), with an invalid value as a `PruneError` naming the field."""
        try:
            return validate(cls, fields, "pruning rule")
        except MemPruneError as exc:
            raise PruneError(str(exc)) from exc

    @property
    def name(self) -> str:
        """Stable display key of the rule, e.g. 't0.5_k5', 't0.5_kall', 'budget120' or 'fraction0.4'."""
        return self.policy.key

    @property
    def label(self) -> str:
        """What a downstream report calls a memory pruned by this rule, e.g. 't=0.5, k=5' or 'budget 120 tokens'."""
        return self.policy.label

    def describe(self) -> str:
        """The decision in words, e.g. 'budget: ... <= 120 per session; at least 1 kept per session; no duplicate merging'."""
        unit = self.group_by
        extras = []
        if self.floor is not None:
            extras.append(f"score floor {self.floor:g}")
        if self.min_keep:
            extras.append(f"at least {self.min_keep} kept per {unit}")
        extras.append(f"duplicates merged at cosine {self.dedup_threshold:g}" if self.dedup else "no duplicate merging")
        if self.retention.on:
            extras.append(self.retention.describe())
        if self.supersede.on:
            extras.append(self.supersede.describe(self.dedup_threshold))
        if self.pin_field is not None:
            extras.append(f"bullets with {self.pin_field} = true pinned (never dropped)")
        return f"{self.policy.describe(unit)}; {'; '.join(extras)}"

    @property
    def keys(self) -> tuple[str, ...]:
        """The columns whose values form a group."""
        return GROUP_KEYS[self.group_by]

    @property
    def unit_keys(self) -> tuple[str, ...]:
        """The columns of what one decision must see whole: the group, and with supersession also its scope
        (their common prefix, e.g. the conversation for sessions and a conversation scope)."""
        if not self.supersede.on:
            return self.keys
        common = []
        for a, b in zip(self.keys, self.supersede.keys):
            if a != b:
                break
            common.append(a)
        return tuple(common)

    def at(self, now: Any) -> "PruneRule":
        """This rule with its retention's `now` fixed (when unset and retention is on)."""
        retention = self.retention.at(now)
        return self if retention is self.retention else self.model_copy(update={"retention": retention})

    def with_policy(self, policy: Policy) -> "PruneRule":
        """This rule with another policy (the same dedup, floor, min-keep, group)."""
        return PruneRule.model_validate({**self.model_dump(exclude={"policy"}), "policy": policy})

    def variants(self, top_ks: list[int]) -> list["PruneRule"]:
        """The rules prune.json reports: this one first, then its policy's sweep."""
        return [self, *(self.with_policy(p) for p in self.policy.sweep(top_ks)[1:])]


def rule_label(recorded: dict[str, Any]) -> str:
    """The label of a rule as a prune.json records it (its `label`; older files: rebuilt from its fields)."""
    if recorded.get("label"):
        return str(recorded["label"])
    fields = {k: v for k, v in recorded.items() if k not in ("name", "label", "description", "keys", "ties")}
    try:
        return PruneRule.of(**fields).label
    except PruneError:
        return str(recorded.get("name") or "rule")


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
    dry_run: bool = Field(False, description="decide and report (prune.json, prune.md, preview.jsonl) but write no store")
    preview_groups: int = Field(20, ge=0, description="dry run: about this many groups (a hash sample) in preview.jsonl")
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


class PruneConfig(PruneSettings):
    """Config of the prune stage on a bullets store (`memprune.prune.run`): the settings plus the paths.

    `memprune prune` and `jobs/prune.py` load `memprune.stores.StorePruneConfig`, this plus the external
    store options, so the same command prunes a bullets table or a `KIND:LOCATION` store.
    """

    scorer: str = Field(description="scorer artifact directory (scorer.json + head.safetensors)")
    input: str = Field(description="bullets store: a Parquet file, or a directory of them (a corpus dir: its bullets.parquet)")
    out: str = Field(description="output directory: pruned/ (the store), prune.json, prune.md")
