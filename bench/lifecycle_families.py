"""`bench/lifecycle_bench.py`'s parts 2 and 3: supersession on the phrasing families and on the real labelled pairs.

`run_families` decides one split of `memprune.synth.families` (fit or held-out families) with the judge and reports
recall by kind and by form, false supersession and the distractors superseded; `run_real` asks the judge about the
pairs of `bench/real_updates.py`. The markdown functions print their tables.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np


def family_corpus(split: str, conversations: int, seed: int,
                  first: int = 0) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """`corpus` of the phrasing-family development set (`memprune.synth.families`): one split's conversations
    numbered first, first + 1, ...; the truth also knows each bullet's value, kind, the family of the update that
    made it stale and whether a distractor followed it."""
    from memprune.synth.families import family_conversation

    rows: list[dict[str, Any]] = []
    truth: dict[str, list[Any]] = {k: [] for k in ("slot", "value", "stale", "family", "distracted", "kind")}
    for i in range(first, first + conversations):
        conv = family_conversation(split, seed, i)  # type: ignore[arg-type]
        for k, b in enumerate(conv.bullets):
            rows.append({"bullet_id": f"{conv.conversation_id}-{k:03d}", "text": b.text, "speaker": conv.speaker,
                         "conversation_id": conv.conversation_id, "session_index": b.session,
                         "time": conv.times[b.session]})
            for key in truth:
                truth[key].append(getattr(b, key))
    return rows, {k: (np.array(v) if k in ("stale", "distracted") else v) for k, v in truth.items()}


def rate(hit: np.ndarray, among: np.ndarray) -> dict[str, Any]:
    """How many of `among` there are and the share of them in `hit`."""
    return {"n": int(among.sum()), "share": float(hit[among].mean()) if among.any() else None}


def run_families(split: str, seed: int, args: argparse.Namespace, scorer: Any) -> dict[str, Any]:
    """The decision's supersession (judge `args.judge`, band low `args.low`, everything else kept) on one split of the
    phrasing-family set: precision, recall of stale bullets (overall, by kind, by the forms of the stale bullet and
    its update, by family), false supersession of unchanged bullets (by kind) and the share of bullets followed by a
    compatible related fact (a distractor) that were superseded."""
    from memprune.prune import MemoryPruner

    t0 = time.perf_counter()
    rows, truth = family_corpus(split, args.families, seed)
    p = MemoryPruner(scorer, supersede={**args.supersede, "low": args.low}, min_keep=0, threshold=0.0)
    sup = p.decisions(rows, [(r["conversation_id"], r["session_index"]) for r in rows])[1].superseded_by >= 0
    stale, family, kind = truth["stale"], np.array([f or "" for f in truth["family"]]), np.array(
        [k or "" for k in truth["kind"]])
    form = np.array([f.split("/")[1] if f else "" for f in family])
    unchanged = ~stale
    out: dict[str, Any] = {"split": split, "seed": seed, "bullets": len(rows), "low": args.low,
                           "superseded": int(sup.sum()), "precision": float((sup & stale).sum() / max(sup.sum(), 1)),
                           "recall": rate(sup, stale), "false_supersession": rate(sup, unchanged),
                           "distractors_superseded": rate(sup, truth["distracted"])}
    out["recall_by_form"] = {f: rate(sup, stale & (form == f)) for f in sorted(set(form[stale]))}
    out["recall_by_kind"] = {k: rate(sup, stale & (kind == k)) for k in sorted(set(kind[stale]))}
    out["recall_by_family"] = {f: rate(sup, stale & (family == f)) for f in sorted(set(family[stale]))}
    out["false_by_kind"] = {k or "(no kind)": rate(sup, unchanged & (kind == k)) for k in sorted(set(kind))}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def run_real(args: argparse.Namespace, scorer: Any, high: float) -> dict[str, Any]:
    """The judge on the real pairs labelled in LoCoMo and MSC (`bench/real_updates.py`): per corpus and label, how
    many pairs the judge calls an update and how many lie in the candidate band at all."""
    from memprune.decision.supersede import Supersede
    from memprune.decision.updates import Pairs, update_judge
    from real_updates import LABELS
    from real_updates import pairs as real_pairs

    shared = Path(args.shared)
    if not shared.is_dir():
        return {"skipped": f"no {shared}"}
    data = real_pairs(shared)
    ea = scorer.embed([x["a_text"] for x in data])
    eb = scorer.embed([x["b_text"] for x in data])
    u = lambda e: e / np.maximum(np.linalg.norm(e, axis=1, keepdims=True), 1e-12)  # noqa: E731
    cos = (u(ea) * u(eb)).sum(1)
    said = np.asarray(update_judge(args.judge).judge(
        Pairs([x["a_text"] for x in data], [x["b_text"] for x in data], cos, scorer.embed, ea, eb),
        Supersede(**args.supersede))) > 0
    band = (cos >= args.low) & (cos < high)
    out: dict[str, Any] = {}
    for corpus in ("all", "locomo", "msc"):
        for label in LABELS:
            m = np.array([x["label"] == label and corpus in ("all", x["corpus"]) for x in data])
            out[f"{corpus}/{label}"] = {"pairs": int(m.sum()), "judged_update": int((said & m).sum()),
                                       "in_band": int((band & m).sum()),
                                       "judged_update_in_band": int((said & band & m).sum())}
    return out


def family_markdown(r: dict[str, Any]) -> str:
    pct = lambda v: "-" if v["share"] is None else f"{100 * v['share']:.1f}% ({v['n']})"  # noqa: E731
    which = "held-out families (never fitted on)" if r["split"] == "held" else "fit families (other conversations)"
    lines = [f"### {which}: seed {r['seed']}, {r['bullets']} bullets, band low {r['low']:g} ({r['seconds']} s)", "",
             f"recall {pct(r['recall'])}, precision {r['precision']:.3f}, false supersession "
             f"{pct(r['false_supersession'])}, distractors superseded {pct(r['distractors_superseded'])}", "",
             "| kind | recall | " + " | ".join(r["recall_by_form"]) + " | false supersession |",
             "|---|---|" + "---|" * len(r["recall_by_form"]) + "---|"]
    for k, v in r["recall_by_kind"].items():
        cells = [pct(r["recall_by_family"].get(f"{k}/{f}", {"share": None, "n": 0})) for f in r["recall_by_form"]]
        lines.append(f"| {k} | {pct(v)} | " + " | ".join(cells) + f" | {pct(r['false_by_kind'][k])} |")
    lines.append("| all | " + pct(r["recall"]) + " | " + " | ".join(pct(v) for v in r["recall_by_form"].values())
                 + f" | {pct(r['false_supersession'])} |")
    return "\n".join(lines) + "\n"


def real_markdown(r: dict[str, Any]) -> str:
    if "skipped" in r:
        return f"real pairs: skipped ({r['skipped']})\n"
    lines = ["### real pairs labelled in LoCoMo (development subset) and MSC valid", "",
             "| corpus / label | pairs | judged an update | in the band | judged an update, in the band |",
             "|---|---|---|---|---|"]
    lines += [f"| {k} | {v['pairs']} | {v['judged_update']} | {v['in_band']} | {v['judged_update_in_band']} |"
              for k, v in r.items()]
    return "\n".join(lines) + "\n"
