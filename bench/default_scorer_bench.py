"""How fast the shipped `default` scorer loads and scores on this machine's CPU (issue 54: under 5 s to load).

Each load runs in a fresh Python process and is timed in two parts: importing torch and transformers (what any
use of an encoder pays first), then `Scorer.load` (the artifact, the encoder's weights, the tokenizer). Then one
process scores `--texts` MSC facts in batches of 64 and prints memories per second.

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
import transformers.modeling_utils
from memprune.scorer import Scorer
from memprune.scorers import resolve_scorer
imported = time.perf_counter()
Scorer.load(resolve_scorer(None))
print(imported - t, time.perf_counter() - imported)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loads", type=int, default=3)
    ap.add_argument("--texts", type=int, default=2000)
    ap.add_argument("--msc", default=str(Path(__file__).resolve().parents[2] / "shared/data/msc/msc_personasummary"))
    args = ap.parse_args()
    runs = [[float(x) for x in subprocess.run([sys.executable, "-c", LOAD], check=True, capture_output=True,
                                              text=True).stdout.split()[-2:]] for _ in range(args.loads)]
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
    print(json.dumps({"artifact_bytes": size, "import_torch_transformers_seconds": [round(r[0], 2) for r in runs],
                      "load_seconds_after_imports": [round(r[1], 2) for r in runs], "texts": len(texts),
                      "memories_per_second": round(len(texts) / seconds, 1)}, indent=2))


if __name__ == "__main__":
    main()
