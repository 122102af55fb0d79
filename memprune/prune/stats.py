"""Per-group statistics of a prune run: additive counters per block, merged, then per-group averages.

Every block of the batch job holds whole groups, so its counters (rows, groups, tokens, kept
per setting) are computed locally and summed; `summarize_stats` turns the sums into the
bullets and tokens per group before/after and the reductions that prune.json reports.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from memprune.decision import Bullets, Decision, PruneRule, apply, prepare, reasons
from memprune.decision.supersede import JUDGED


def stable_hash(key: Any) -> int:
    """A 64-bit hash of a group key that is the same in every process (Python's str hash is salted)."""
    if isinstance(key, (list, tuple)):
        key = tuple(k.item() if isinstance(k, np.generic) else k for k in key)
    elif isinstance(key, np.generic):
        key = key.item()
    return int.from_bytes(hashlib.blake2b(repr(key).encode("utf-8"), digest_size=8).digest(), "little", signed=True)


def empty_stats(settings: Sequence[PruneRule]) -> dict[str, Any]:
    """Additive counters of the prune job (merged over blocks by `merge_stats`)."""
    return {
        "rows": 0, "groups": 0, "tokens": 0, "score_sum": 0.0, "score_min": None, "score_max": None,
        "duplicates": 0, "pinned": 0, "age_unknown": 0, **dict.fromkeys(JUDGED, 0),
        "settings": {r.name: {"kept": 0, "tokens_kept": 0, "groups_emptied": 0, "groups_over_budget": 0, "rescued": 0,
                              "kept_by_pin": 0, "reasons": dict.fromkeys(reasons(), 0), "kept_hist": {}}
                     for r in settings},
    }


def block_stats(bullets: Bullets, groups: Sequence[Any], settings: Sequence[PruneRule]) -> tuple[dict[str, Any], Decision]:
    """Counters of one block that holds whole groups (and whole supersession scopes; `groups`: each bullet's group
    key, for the groups' hashes), and the decision of the first setting (the one written).

    The shared steps (pins, retention, expiry, duplicates, supersession: `decision.prepare`) run once for the
    rule; each setting's own steps after (`decision.apply`). `bullets.tokens` are required (the counters).
    """
    codes, scores, tokens = bullets.groups, bullets.scores, bullets.tokens
    n_groups = int(codes.max()) + 1 if len(codes) else 0
    first = np.unique(codes, return_index=True)[1] if len(codes) else np.zeros(0, dtype=np.int64)
    stats = empty_stats(settings)
    stats.update(
        rows=len(scores), groups=n_groups, tokens=int(tokens.sum()), score_sum=float(scores.sum()),
        score_min=float(scores.min()) if len(scores) else None, score_max=float(scores.max()) if len(scores) else None,
        group_hashes=np.fromiter((stable_hash(groups[i]) for i in first), dtype=np.int64, count=len(first)),
    )
    main = settings[0]
    found = prepare(bullets, main)
    stats.update(found.judged or {})
    stats["duplicates"] = int((found.duplicate_of >= 0).sum()) if found.duplicate_of is not None else 0
    stats["pinned"] = int(found.standing.pinned.sum())
    stats["age_unknown"] = int((~found.standing.age_known).sum()) if main.retention.on else 0
    decisions = []
    for rule in settings:
        d = apply(bullets, rule, found)
        decisions.append(d)
        kept = np.bincount(codes[d.keep], minlength=n_groups)
        budgeted = d.keep & ~found.standing.pinned  # pinned bullets stand outside the budget
        kept_tokens = np.bincount(codes[budgeted], weights=tokens[budgeted], minlength=n_groups)
        hist = np.bincount(kept)
        stats["settings"][rule.name] = {
            "kept": int(d.keep.sum()), "tokens_kept": int(tokens[d.keep].sum()),
            "groups_emptied": int((kept == 0).sum()),
            "groups_over_budget": rule.policy.groups_over(kept_tokens),
            "rescued": int(d.rescued.sum()), "kept_by_pin": d.pin_counts()["kept_by_pin"], "reasons": d.reason_counts(),
            "kept_hist": {str(i): int(c) for i, c in enumerate(hist) if c},
        }
    return stats, decisions[0]


def merge_stats(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Sum two counter dicts from `block_stats`/`empty_stats` (min/max combined, histograms added)."""
    out = dict(a)
    for key in ("rows", "groups", "tokens", "score_sum", "duplicates", "pinned", "age_unknown", *JUDGED):
        out[key] = a.get(key, 0) + b.get(key, 0)
    for key, fn in (("score_min", min), ("score_max", max)):
        vals = [v for v in (a[key], b[key]) if v is not None]
        out[key] = fn(vals) if vals else None
    settings = {}
    for name, sa in a["settings"].items():
        sb = b["settings"][name]
        hist = dict(sa["kept_hist"])
        for k, v in sb["kept_hist"].items():
            hist[k] = hist.get(k, 0) + v
        settings[name] = {key: sa[key] + sb[key] for key in ("kept", "tokens_kept", "groups_emptied",
                                                              "groups_over_budget", "rescued", "kept_by_pin")}
        settings[name]["reasons"] = {r: sa["reasons"][r] + sb["reasons"][r] for r in sa["reasons"]}
        settings[name]["kept_hist"] = hist
    out["settings"] = settings
    return out


def summarize_stats(stats: dict[str, Any], settings: Sequence[PruneRule]) -> dict[str, Any]:
    """Per setting: bullets and tokens per group before/after, reductions in percent, groups emptied, reasons."""
    rows, groups, tokens = stats["rows"], stats["groups"], stats["tokens"]
    per = max(groups, 1)
    out: dict[str, Any] = {}
    for rule in settings:
        s = stats["settings"][rule.name]
        out[rule.name] = {
            "policy": rule.policy.name, **rule.policy.model_dump(), "label": rule.label,
            "floor": rule.floor, "min_keep": rule.min_keep,
            "dedup_threshold": rule.dedup_threshold if rule.dedup else None,
            "bullets_before": rows / per, "bullets_after": s["kept"] / per,
            "bullet_reduction_pct": 100.0 * (1 - s["kept"] / rows) if rows else None,
            "tokens_before": tokens / per, "tokens_after": s["tokens_kept"] / per,
            "token_reduction_pct": 100.0 * (1 - s["tokens_kept"] / tokens) if tokens else None,
            "groups_emptied": s["groups_emptied"],
            "groups_emptied_pct": 100.0 * s["groups_emptied"] / groups if groups else None,
            "groups_over_budget": s["groups_over_budget"], "kept_by_min_keep": s["rescued"],
            "pinned": stats.get("pinned", 0), "kept_by_pin": s.get("kept_by_pin", 0),
            "dropped_by_reason": s["reasons"],
            "bullets_total_before": rows, "bullets_total_after": s["kept"],
            "tokens_total_before": tokens, "tokens_total_after": s["tokens_kept"],
            "kept_per_group_hist": dict(sorted(s["kept_hist"].items(), key=lambda kv: int(kv[0]))),
        }
    return out
