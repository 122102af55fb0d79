"""Real fact updates and distractors, labelled by hand on the shared LoCoMo dev and MSC validation data.

`bench/data/real_updates.json` holds only references and labels: each entry names two facts of the same
person, `a` from an earlier session and `b` from a later one, with a kind (residence, job, ...) and a label:

- `update`: the later fact means the earlier value no longer holds (moved, new job, broke up, pet died, ...);
- `distractor`: the later fact is related (same person, same topic) but compatible with the earlier one;
- `unchanged`: the later fact restates the same value.

A LoCoMo ref is `{"session", "speaker", "evidence", "index"}`: the `index`-th fact of that speaker in
`session_<session>_observation`, whose evidence must equal `evidence`. An MSC ref is
`{"session", "turn", "speaker"}`: the `persona_text` of turn `turn` of the episode in `session_<session>`.
`pairs(shared)` resolves them against the data under `shared` (the folder that holds `data/`), so the texts
themselves never live in the repository.

    python bench/real_updates.py [--shared ../shared]   # counts by corpus, kind and label; checks every ref
"""

from __future__ import annotations

import json
from pathlib import Path

LABELS = ("update", "distractor", "unchanged")
KINDS = ("residence", "job", "relationship", "pet", "vehicle", "preference", "health", "plans", "possessions",
         "other")
DATA = Path(__file__).resolve().parent / "data" / "real_updates.json"
DEFAULT_SHARED = Path(__file__).resolve().parents[2] / "shared"


def _entries(path: Path = DATA) -> list[dict]:
    return json.loads(path.read_text(encoding="utf-8"))


def _evidence(ev) -> str:
    return "; ".join(str(e) for e in ev) if isinstance(ev, list) else str(ev)


def _locomo(shared: Path) -> dict[str, dict]:
    samples = json.loads((shared / "data" / "locomo-dev" / "locomo_dev.json").read_text(encoding="utf-8"))
    return {s["sample_id"]: s for s in samples}


def _msc(shared: Path, ids: set[str]) -> dict[tuple[str, int], dict]:
    """(initial_data_id, session) -> record, only for the episodes the entries name."""
    out: dict[tuple[str, int], dict] = {}
    for k in range(1, 5):
        path = shared / "data" / "msc" / "msc_personasummary" / f"session_{k}" / "valid.txt"
        with path.open(encoding="utf-8") as fh:
            for line in fh:
                if not line.strip():
                    continue
                rec = json.loads(line)
                if rec["initial_data_id"] in ids:
                    out[(rec["initial_data_id"], k)] = rec
    return out


def _resolve_locomo(samples: dict[str, dict], conv: str, ref: dict, where: str) -> str:
    sample = samples.get(conv)
    if sample is None:
        raise ValueError(f"{where}: no LoCoMo conversation {conv!r}")
    try:
        facts = sample["observation"][f"session_{int(ref['session'])}_observation"][ref["speaker"]]
        text, ev = facts[int(ref["index"])]
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ValueError(f"{where}: LoCoMo ref {ref} does not resolve ({exc!r})") from None
    if _evidence(ev) != str(ref["evidence"]):
        raise ValueError(f"{where}: LoCoMo ref {ref} has evidence {_evidence(ev)!r}, not {ref['evidence']!r}")
    return text


def _resolve_msc(records: dict[tuple[str, int], dict], conv: str, ref: dict, where: str) -> str:
    try:
        rec = records[(conv, int(ref["session"]))]
        turn = rec["dialog"][int(ref["turn"])]
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ValueError(f"{where}: MSC ref {ref} does not resolve ({exc!r})") from None
    if turn.get("id") != ref["speaker"]:
        raise ValueError(f"{where}: MSC ref {ref} is a turn of {turn.get('id')!r}, not {ref['speaker']!r}")
    text = turn.get("persona_text")
    if not text:
        raise ValueError(f"{where}: MSC ref {ref} has no persona_text")
    return text


def pairs(shared: Path, path: Path = DATA) -> list[dict]:
    """The labelled pairs with their texts looked up under `shared`; ValueError naming the entry if a ref fails."""
    shared = Path(shared)
    entries = _entries(path)
    need_locomo = any(e.get("corpus") == "locomo" for e in entries)
    samples = _locomo(shared) if need_locomo else {}
    records = _msc(shared, {e["conversation"] for e in entries if e.get("corpus") == "msc"})
    out = []
    for i, e in enumerate(entries):
        corpus, conv, a, b = e.get("corpus"), e.get("conversation"), e.get("a"), e.get("b")
        where = f"entry {i} ({corpus} {conv} {a} -> {b})"
        if e.get("label") not in LABELS:
            raise ValueError(f"{where}: unknown label {e.get('label')!r}")
        if e.get("kind") not in KINDS:
            raise ValueError(f"{where}: unknown kind {e.get('kind')!r}")
        if not isinstance(a, dict) or not isinstance(b, dict):
            raise ValueError(f"{where}: a and b must be refs")
        if a.get("speaker") != b.get("speaker"):
            raise ValueError(f"{where}: a and b name different speakers")
        if not int(a["session"]) < int(b["session"]):
            raise ValueError(f"{where}: a must come from an earlier session than b")
        if corpus == "locomo":
            a_text = _resolve_locomo(samples, conv, a, where)
            b_text = _resolve_locomo(samples, conv, b, where)
        elif corpus == "msc":
            a_text = _resolve_msc(records, conv, a, where)
            b_text = _resolve_msc(records, conv, b, where)
        else:
            raise ValueError(f"{where}: unknown corpus {corpus!r}")
        out.append({"corpus": corpus, "conversation": conv, "kind": e["kind"], "label": e["label"],
                    "a_text": a_text, "b_text": b_text, "a_session": int(a["session"]),
                    "b_session": int(b["session"]), "speaker": a["speaker"], "why": e.get("why", "")})
    return out


def _counts(rows: list[dict]) -> None:
    from collections import Counter

    print(f"{len(rows)} pairs, every ref resolves")
    for field in ("corpus", "kind", "label"):
        print(f"by {field}: " + ", ".join(f"{k} {v}" for k, v in sorted(Counter(r[field] for r in rows).items())))
    print("by corpus and label:")
    for (c, lab), n in sorted(Counter((r["corpus"], r["label"]) for r in rows).items()):
        print(f"  {c:7s} {lab:10s} {n}")
    print("by kind and label:")
    by = Counter((r["kind"], r["label"]) for r in rows)
    for kind in KINDS:
        print(f"  {kind:12s} " + "  ".join(f"{lab} {by.get((kind, lab), 0):3d}" for lab in LABELS))


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", type=Path, default=DEFAULT_SHARED, help="folder holding data/ (default ../shared)")
    _counts(pairs(ap.parse_args().shared))
