"""The review page of a pruning decision (`review.html`): look before you apply.

    from memprune.review import Layout, write_review
    write_review(out_dir, decided_table, Layout("bullet_id", ("conversation_id", "session_index")), prune_summary)

Every `memprune prune` run writes it next to prune.md (a dry run, an applied decision, `--emit split`, an
external store), `memprune review OUT` writes it again for an output (`--open` serves it on 127.0.0.1), and the
service's dry-run `/v1/prune` links one. The page shows the run in words and numbers, the score distribution with
the policy's cut, the groups that lose the most and every record, searchable, filterable by reason and fate,
sortable, each dropped duplicate or superseded record linked to the one that replaced it; records selected there
export an ids file for `memprune restore --ids`.

- `data`: the page's records and counts from a decided table (`Layout`: which columns hold what).
- `page`: the HTML file (style, script and data inside; data files beside it past 20 MB).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from memprune.review.data import Layout, records
from memprune.review.page import MAX_BYTES, PAGE, PARTS, safe_json, write_page, written_at
from memprune.times import parse_time

__all__ = ["MAX_BYTES", "PAGE", "PARTS", "Layout", "meta_of", "safe_json", "write_review"]


def _cut(rule: dict[str, Any], score_used: str) -> tuple[float | None, str]:
    """Where the policy cuts on the score axis (the rule's threshold; None for the others) and the cut in words."""
    policy = rule.get("policy")
    on = "calibrated score" if score_used == "calibrated" else "score"
    if policy == "rule":
        words = [f"keeps {on} >= {rule['threshold']}" if rule.get("threshold") is not None else "",
                 f"the top {rule['top_k']} per group" if rule.get("top_k") else ""]
        return rule.get("threshold"), "; then ".join(w for w in words if w) or "keeps everything"
    return None, ""


def meta_of(summary: dict[str, Any], out: str) -> dict[str, Any]:
    """The run in words for the page: title, state, facts, the cut, the `now` ages are measured at, and for an
    applied decision what was archived and how to undo it."""
    rule, result, scorer = summary["rule"], summary["result"], summary.get("scorer") or {}
    life = summary.get("lifecycle") or {}
    store = summary.get("store")
    source = f"{store['kind']}:{store['location']}" if store else str(summary["input"]["path"])
    applied = summary.get("apply") or None
    state = "applied" if applied else "dry run" if summary.get("dry_run") else "decided, not applied" if store else "decided"
    cut, cut_note = _cut(rule, (summary.get("score") or {}).get("used", "raw"))
    tokens = (f"{result.get('tokens_total_before')} -> {result.get('tokens_total_after')} ({summary.get('tokenizer')})"
              if result.get("tokens_total_before") is not None else "–")
    facts = [("input", source), ("output", out),
             ("scorer", f"{scorer.get('path')} (fingerprint {scorer.get('fingerprint', '–')}; {scorer.get('encoder')}; "
                        f"stage {scorer.get('stage') or '–'}, seed {scorer.get('seed')})" if scorer
              else "the service's (memprune serve)"),
             ("scores", (summary.get("score") or {}).get("used", "raw")), ("tokens", tokens),
             ("ages at (--now)", life.get("now") or "–"), ("decision fingerprint", summary.get("fingerprint", "–"))]
    if life.get("keep_ids"):
        facts.append(("kept ids (--keep-ids)", f"{life['keep_ids']['file']}: {life['keep_ids']['ids']} records kept "
                                               "whatever the decision said"))
    archive = (applied or {}).get("archive") or ((summary.get("emitted") or {}).get("dropped") or {}).get("path")
    apply = None
    if archive:
        what = (f"{applied.get('deleted', 0)} records deleted from the store after being archived in {archive}"
                if applied else f"the dropped records are archived in {archive} (--emit split)")
        apply = {"text": what, "restore": f"memprune restore --archive {archive} --all"}
    now = life.get("now")
    return {"title": f"memprune review: {source}", "subtitle": f"{state} · {result.get('label', '')} · {written_at()}",
            "rule": rule.get("description", ""), "facts": facts, "cut": cut, "cut_note": cut_note,
            "now_epoch": parse_time(now).timestamp() if now else None, "apply": apply,
            "restore_ids": f"memprune restore --archive {archive} --ids memprune-ids.txt" if archive else
            "memprune prune ... --keep-ids memprune-ids.txt (decide again keeping them; then --apply)",
            "pins": bool(rule.get("pin_field") or (store or {}).get("map", {}).get("pin"))}


def write_review(directory: Any, decided: pa.Table, layout: Layout, summary: dict[str, Any], out: str,
                 count: Callable[[Sequence[str]], np.ndarray] | None = None) -> str:
    """`directory/review.html` (a path, a URI or a `Location`) for the decided table of the run `summary` describes
    (`out`: where the run's outputs are, as the user sees it; `count`: the run's token counter, None for none)."""
    return write_page(directory, records(decided, layout, count), meta_of(summary, out))
