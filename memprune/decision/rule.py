"""The pruning rule, validated once: `PruneRule` (a policy and its settings, duplicates, floor, min-keep, the
group, pins, retention, supersession) is the one place that holds the rule's defaults and its checks; the batch
job, `MemoryPruner`, the service, `memprune evaluate` and the pipeline all carry one. The rule also says what the
decision needs of the bullets (`needs_tokens`, `needs_embeddings`, `needs_times`, `needs_life`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, SerializeAsAny, model_serializer, model_validator

from memprune.config import ConfigModel, validate
from memprune.errors import MemPruneError
from memprune.decision.policies import Policy, RulePolicy, owner_of, policy_of
from memprune.decision.retention import Retention
from memprune.decision.supersede import Supersede

GroupBy = Literal["session", "conversation", "speaker"]
# The default near-duplicate cosine: chosen by bench/dedup_bench.py on `memprune synth --duplicates 0.2`.
DEDUP_THRESHOLD = 0.88
GROUP_KEYS: dict[str, tuple[str, ...]] = {
    "session": ("conversation_id", "session_index"),
    "conversation": ("conversation_id",),
    "speaker": ("conversation_id", "speaker"),
}


class PruneError(MemPruneError):
    """The rule, the bullets, the store, scorer or config cannot be pruned; the message names the file, column or
    key."""


class PruneRule(ConfigModel):
    """The pruning decision: near-duplicate merging, a policy (`memprune.decision.policies`), a floor, min-keep.

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
    def needs_tokens(self) -> bool:
        """The decision reads every bullet's token count (a budget)."""
        return self.policy.needs_tokens

    @property
    def needs_embeddings(self) -> bool:
        """The decision reads the scorer's embeddings (near-duplicates, supersession)."""
        return self.dedup or self.supersede.on

    @property
    def needs_times(self) -> bool:
        """The decision reads each bullet's time (forgetting, expiry, the order of updates)."""
        return self.retention.on or self.supersede.on

    @property
    def needs_life(self) -> bool:
        """The decision reads more of each bullet than its score, group and text: pins, times, recalls, scopes."""
        return self.pin_field is not None or self.needs_times

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

    def scores_only(self) -> "PruneRule":
        """This rule's policy, floor and min-keep alone (no duplicate merging, pins, retention or supersession): the
        decision of bullets known by their scores only (`memprune evaluate`'s tables)."""
        return self.model_copy(update={"dedup": False, "pin_field": None, "retention": Retention(),
                                       "supersede": Supersede()})

    def with_default_threshold(self, threshold: float | None) -> "PruneRule":
        """This rule with `threshold` (the scorer's, `ScorerConfig.threshold`) where its policy has a threshold that
        the rule never set; a threshold that was set is kept."""
        policy = self.policy
        if "threshold" not in type(policy).model_fields or "threshold" in policy.model_fields_set \
                or getattr(policy, "threshold") == threshold:
            return self
        return self.model_copy(update={"policy": policy.model_copy(update={"threshold": threshold})})  # fields set kept

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
