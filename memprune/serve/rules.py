"""A request's rule is data: the fields a client may set, checked before anything reads them. Pure: no Ray.

A `/v1/decide` or `/v1/prune` request may carry a pruning rule, flat as in YAML. It can choose among what the
server's own config allows and never name a server resource: the policy and its numbers, duplicate merging,
retention, pins by field name, and `supersede.judge` among the update judges the server allows
(`ServeConfig.judges`). An LLM update judge's engine, model, URL and key come only from the server's rule; a
path (`supersede.llm_config`), an inline LLM config (`supersede.llm`) or any field not listed here is refused
in one line naming it, before the rule is validated (validation itself would read a named file).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from memprune.decision import POLICIES, PruneRule

# The rule's fields a request may set (scalars), and those of its two sections. Every other field of
# `PruneRule`, `Retention` and `Supersede` is the server's alone (tests/test_serve_rules.py checks that each field
# is listed here or in SERVER_ONLY, so a new field is a decision, not an accident).
SHARED = frozenset({"policy", "min_keep", "floor", "dedup", "dedup_threshold", "group_by", "pin_field"})
SECTIONS: dict[str, frozenset[str]] = {
    "retention": frozenset({"half_life", "recall_boost", "max_age", "now"}),
    "supersede": frozenset({"judge", "scope", "subject", "low", "high"}),
}
SERVER_ONLY: dict[str, frozenset[str]] = {"supersede": frozenset({"llm_config", "llm"})}
SCALAR = (str, int, float, bool, type(None))


class RuleRefused(ValueError):
    """A request's rule names something only the server's config may (the message names the field)."""


def _scalar(where: str, value: Any) -> None:
    if not isinstance(value, SCALAR):
        raise RuleRefused(f"{where}: a number, a string, true/false or null, not {type(value).__name__}")


def _policy_fields() -> frozenset[str]:
    return frozenset(f for cls in POLICIES.values() for f in cls.model_fields)


def check_request_rule(rule: Mapping[str, Any], judges: Collection[str]) -> None:
    """Refuse (`RuleRefused`, naming `rule.FIELD`) any field a request may not set, a non-scalar value, and an
    update judge the server does not allow (`judges`)."""
    if not isinstance(rule, Mapping):
        raise RuleRefused(f"rule: a mapping of rule fields, not {type(rule).__name__}")
    allowed = SHARED | _policy_fields()
    for key, value in rule.items():
        where = f"rule.{key}"
        if key in SECTIONS:
            if value is None:
                continue
            if not isinstance(value, Mapping):
                raise RuleRefused(f"{where}: a mapping of its fields, not {type(value).__name__}")
            for sub, v in value.items():
                if sub not in SECTIONS[key]:
                    why = ("the server's config sets it" if sub in SERVER_ONLY.get(key, ())
                           else "not a field a request may set")
                    raise RuleRefused(f"{where}.{sub}: {why} (a request may set {', '.join(sorted(SECTIONS[key]))})")
                _scalar(f"{where}.{sub}", v)
            judge = value.get("judge") if key == "supersede" else None
            if judge is not None and judge not in judges:
                raise RuleRefused(f"{where}.judge: {judge!r} is not an update judge this server allows "
                                  f"(allowed: {', '.join(sorted(judges)) or 'none'})")
            continue
        if key not in allowed:
            raise RuleRefused(f"{where}: not a field a request may set (the policy and its settings, "
                              f"{', '.join(sorted(SHARED - {'policy'}))}, {', '.join(sorted(SECTIONS))})")
        _scalar(where, value)


def request_rule(rule: Mapping[str, Any] | None, server: PruneRule, judges: Collection[str]) -> PruneRule:
    """The rule a request decides with: the server's when it names none; else its fields, checked
    (`check_request_rule`), then validated as a `PruneRule`. A judge that needs an LLM takes the server rule's LLM
    settings (the only place they may come from)."""
    if rule is None:
        return server
    check_request_rule(rule, judges)
    fields = dict(rule)
    judge = (fields.get("supersede") or {}).get("judge")
    if judge is not None and judge == server.supersede.judge:
        llm = {k: v for k, v in (("llm_config", server.supersede.llm_config), ("llm", server.supersede.llm))
               if v is not None}
        fields["supersede"] = {**fields["supersede"], **llm}
    return PruneRule.of(**fields)
