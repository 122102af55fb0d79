"""How fast the shipped `default` scorer loads and scores on this machine's CPU (issue 54: under 5 s to load).

Each load runs in a fresh Python process (imports included: what a user's first `MemoryPruner()` pays), then one
process scores `--texts` MSC facts in batches of 64 and prints memories per second; `--threads` caps torch's.

    python bench/default_scorer_bench.py --loads 3 --texts 2000
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

LOAD = """
import time
t = time.perf_counter()
from memprune.scorer import Scorer
from memprune.scorers import resolve_scorer
Scorer.load(resolve_scorer(None))
print(time.perf_counter() - t)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loads", type=int, default=3)
    ap.add_argument("--texts", type=int, default=2000)
    ap.add_argument("--msc", default=str(Path(__file__).resolve().parents[2] / "shared/data/msc/msc_personasummary"))
    args = ap.parse_args()
    loads = [float(subprocess.run([sys.executable, "-c", LOAD], check=True, capture_output=True, text=True)
                   .stdout.strip().splitlines()[-1]) for _ in range(args.loads)]
    from memprune.scorer import Scorer
    from memprune.scorers import SHIPPED, resolve_scorer

    texts = [t["persona_text"] for line in open(Path(args.msc) / "session_1" / "valid.txt", encoding="utf-8")
             for t in json.loads(line)["dialog"] if t.get("persona_text")][:args.texts]
    scorer = Scorer.load(resolve_scorer(None))
    scorer.score(texts[:64])  # warm
    start = time.perf_counter()
    scorer.score(texts, batch_size=64)
    seconds = time.perf_counter() - start
    size = sum(p.stat().st_size for p in SHIPPED["default"].directory.rglob("*") if p.is_file())
    print(json.dumps({"artifact_bytes": size, "load_seconds": loads, "texts": len(texts),
                      "memories_per_second": round(len(texts) / seconds, 1)}, indent=2))


if __name__ == "__main__":
    main()
