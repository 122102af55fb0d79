"""The prune job's shuffle path on a small store: the distributed `Dataset.sort` against the driver-side sort.

The store and rule of `tests/test_prune_job_policies.py::test_fraction_shuffle_split...` (5 synthetic
conversations x 3 sessions with duplicates and updates, 242 bullets; fraction 0.5, floor 0.3, group by
speaker, slot supersession, `grouping: shuffle`, `block_rows: 24`, one scoring actor), run with
`sort_in_memory: 0` (distributed) and the default (driver), alternating, in one local Ray of 2 CPUs, so
that both see the same machine load. Prints the wall seconds of each run and one JSON line last.

    python bench/shuffle_sort_bench.py --pairs 2
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=2, help="distributed/driver pairs to run")
    args = ap.parse_args()
    from memprune.encoders import minilm_path
    from memprune.prune import PruneConfig, PruneRule, run_prune
    from memprune.raysession import init_local_ray
    from memprune.scorer import Scorer, ScorerConfig
    from memprune.synth import generate

    root = Path(tempfile.mkdtemp(prefix="memprune-shuffle-sort-"))
    generate(conversations=5, sessions=3, out=root / "corpus", seed=2, duplicates=0.3, updates=0.5)
    Scorer.build(ScorerConfig(encoder=minilm_path(), head={"hidden": 0, "dropout": 0.0}), seed=3).save(root / "scorer")
    init_local_ray(num_cpus=2, log_to_driver=False, configure_logging=False)
    rule = PruneRule.of(policy="fraction", fraction=0.5, floor=0.3, group_by="speaker", supersede={"judge": "slot"})
    walls: dict[str, list[float]] = {"distributed": [], "driver": []}
    for i in range(args.pairs):
        for sort, rows in (("distributed", 0), ("driver", 100_000)):
            t0 = time.perf_counter()
            summary = run_prune(PruneConfig(
                scorer=str(root / "scorer"), input=str(root / "corpus"), out=str(root / f"out-{i}-{sort}"), rule=rule,
                emit="split", grouping="shuffle", block_rows=24, progress=False, actors=1, sort_in_memory=rows))
            wall = round(time.perf_counter() - t0, 1)
            assert summary["grouping"]["sort"] == sort
            walls[sort].append(wall)
            print(f"{sort}: {wall} s over {summary['input']['rows']} rows", flush=True)
    print(json.dumps({"rows": summary["input"]["rows"], "wall_s": walls}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
