"""Benchmark the review page (issue 55) at store scale: write it, open it and filter it in headless Chromium.

A decided table of `--records` memories (synthetic conversations' bullet texts, `memprune synth`; the groups are
their sessions) is decided by `memprune.decision.decide` (threshold and top-k per session, near-duplicates merged on
embeddings where the synthetic corpus injected duplicates, an age limit): the reasons, duplicate links and times a
real decision has. Then `memprune.review.write_review` writes the page (data files beside it past 20 MB), and the
system's Chromium (Playwright, `executable_path`; nothing downloaded) opens it from file:// and is timed on:

- open: from navigation until the page is ready (every record parsed, the first 100 rows drawn);
- search: typing a word until the count of matching records is shown (includes the page's 120 ms input debounce);
- filters: fate = dropped, reason = the commonest reason, a group, sort by score (each: the change until shown);
- size: review.html and its data files; the page's JS heap once open.

    python bench/review_bench.py                       # 10^5 records
    python bench/review_bench.py --join 4                     # 10^5 records of about 170 characters: data files
    python bench/review_bench.py --records 20000 --runs 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BROWSER_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                "--no-first-run", "--disable-sync"]
NOW = 1_735_689_600.0  # 2025-01-01: the synthetic sessions fall in 2023-2024


def decided_table(records: int, seed: int, join: int = 1) -> pa.Table:
    """`records` decided memories (whole synthetic conversations, cut to `records`; `join`: each text the next
    `join` bullet texts of its session joined, for memories as long as a Mem0 store's)."""
    from memprune.decision import Bullets, PruneRule, decide
    from memprune.synth import SynthSettings, synth_conversation

    settings = SynthSettings(conversations=1, sessions=6, seed=seed, duplicates=0.1)
    rows: list[dict[str, Any]] = []
    i = 0
    while len(rows) < records:
        conv = synth_conversation(i, settings)
        bullets = conv.bullets
        rows += [{"id": b.bullet_id, "group": f"{conv.conversation_id}/s{b.session_index}",
                  "text": " ".join(x.text for x in bullets[k:k + join] if x.session_index == b.session_index),
                  "dup": b.dup_source} for k, b in enumerate(bullets)]
        i += 1
    rows = rows[:records]
    rng = np.random.default_rng(seed)
    n = len(rows)
    emb = rng.normal(size=(n, 32)).astype(np.float32)
    at = {r["id"]: k for k, r in enumerate(rows)}
    for k, r in enumerate(rows):  # an injected duplicate lies next to its source
        if r["dup"] in at:
            emb[k] = emb[at[r["dup"]]] + rng.normal(scale=0.01, size=32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    scores = rng.beta(2.0, 2.5, size=n)
    times = NOW - rng.uniform(0, 730 * 86400, size=n)
    groups = [r["group"] for r in rows]
    texts = [r["text"] for r in rows]
    rule = PruneRule.of(threshold=0.35, top_k=8, retention={"max_age": "540d", "now": "2025-01-01T00:00:00Z"})
    d = decide(Bullets.of(scores, groups, texts=texts, embeddings=emb, since=times), rule)
    ids = [r["id"] for r in rows]
    return pa.table({"id": ids, "group": groups, "text": texts, "score": scores, "keep": d.keep,
                     "reason": [None if k else str(r) for k, r in zip(d.keep, d.reason)],
                     "duplicate_of": [ids[j] if j >= 0 and j != k else None for k, j in enumerate(d.duplicate_of)],
                     "time": times})


def measure(page_path: Path, table: pa.Table, chromium: str) -> dict[str, Any]:
    """Open the page once and time the open and each filter."""
    from playwright.sync_api import sync_playwright

    keep = np.asarray(table.column("keep"))
    reasons = [r for r in table.column("reason").to_pylist() if r]
    common = max(set(reasons), key=reasons.count)
    texts = [t.lower() for t in table.column("text").to_pylist()]
    word = "cat"
    group = table.column("group")[len(table) // 2].as_py()
    out: dict[str, Any] = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=BROWSER_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        asked: list[str] = []
        page.on("request", lambda r: asked.append(r.url))
        t = time.perf_counter()
        page.goto(page_path.resolve().as_uri())
        page.wait_for_selector("body[data-ready='1']", timeout=120_000)
        out["open_s"] = time.perf_counter() - t

        def timed(name: str, act: Any, expect: int) -> None:
            t = time.perf_counter()
            act()
            page.locator(f"#shown[data-n='{expect}']").wait_for(timeout=120_000)
            out[f"{name}_s"] = time.perf_counter() - t

        timed("search", lambda: page.fill("#q", word), sum(word in x for x in texts))
        page.fill("#q", "")
        page.locator(f"#shown[data-n='{len(table)}']").wait_for(timeout=120_000)
        timed("dropped", lambda: page.select_option("#state", "dropped"), int((~keep).sum()))
        timed("reason", lambda: page.select_option("#reason", common), reasons.count(common))
        page.select_option("#reason", "")
        page.select_option("#state", "")
        groups = table.column("group").to_pylist()
        timed("group", lambda: (page.fill("#group", group), page.dispatch_event("#group", "change")),
              groups.count(group))
        page.fill("#group", "")
        page.dispatch_event("#group", "change")
        page.locator(f"#shown[data-n='{len(table)}']").wait_for(timeout=120_000)
        t = time.perf_counter()
        page.select_option("#sort", "score-desc")
        top = table.column("id")[int(np.argmax(np.asarray(table.column("score"))))].as_py()
        page.locator(f"tr.rec[data-id='{top}']").first.wait_for(timeout=120_000)
        out["sort_s"] = time.perf_counter() - t
        out["js_heap_mb"] = page.evaluate("performance.memory ? performance.memory.usedJSHeapSize / 1e6 : null")
        out["requests_beyond_file"] = len([u for u in asked if not u.startswith("file://")])
        browser.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--runs", type=int, default=3, help="browser opens (the median is reported)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--join", type=int, default=1, help="texts of this many bullets joined per record (longer texts)")
    ap.add_argument("--out", type=Path, default=None, help="keep the page here (default: a temporary directory)")
    args = ap.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("no Chromium (Debian: apt-get install chromium)")
    from memprune.review import PARTS, Layout, write_review

    t = time.perf_counter()
    table = decided_table(args.records, args.seed, args.join)
    made_s = time.perf_counter() - t
    summary = {"rule": {"policy": "rule", "threshold": 0.35, "top_k": 8,
                        "description": "rule: score >= 0.35, top 8 per session; duplicates merged; max age 540d"},
               "result": {"label": f"bench {args.records}"}, "input": {"path": "synthetic"}, "fingerprint": "bench",
               "lifecycle": {"now": "2025-01-01T00:00:00Z"}}
    out = args.out or Path(tempfile.mkdtemp(prefix="review-bench-"))
    t = time.perf_counter()
    page = Path(write_review(out, table, Layout("id", ("group",), time="time"), summary, str(out),
                             lambda texts: np.array([len(x.split()) for x in texts])))
    write_s = time.perf_counter() - t
    parts = sorted((out / PARTS).glob("*.js")) if (out / PARTS).is_dir() else []
    runs = [measure(page, table, chromium) for _ in range(args.runs)]
    median = {k: float(np.median([r[k] for r in runs])) if runs[0][k] is not None else None for k in runs[0]}
    chars = float(np.mean([len(t) for t in table.column("text").to_pylist()]))
    result = {"records": table.num_rows, "mean_text_chars": round(chars, 1), "dropped": int((~np.asarray(table.column("keep"))).sum()),
              "groups": len(set(table.column("group").to_pylist())), "decide_s": round(made_s, 2),
              "write_s": round(write_s, 2), "page_mb": round(page.stat().st_size / 1e6, 2),
              "data_files": len(parts), "data_files_mb": round(sum(p.stat().st_size for p in parts) / 1e6, 2),
              "largest_file_mb": round(max([page.stat().st_size, *(p.stat().st_size for p in parts)]) / 1e6, 2),
              "runs": args.runs, **{k: (round(v, 3) if v is not None else None) for k, v in median.items()},
              "chromium": chromium}
    print("| measure | value |\n|---|---|")
    for k, v in result.items():
        print(f"| {k} | {v} |")
    print(json.dumps(result))
    if args.out is None:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
