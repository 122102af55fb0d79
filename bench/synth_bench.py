"""Benchmark `memprune synth`: wall time, bullets/s and peak RSS for corpora of given bullet counts.

Each size runs in a fresh subprocess, so its peak RSS (resource.getrusage ru_maxrss) is its own;
equal peaks across sizes show that memory is bounded. Usage:

    python bench/synth_bench.py --bullets 100000 1000000 [--sessions 4] [--out DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _child(bullets: int, sessions: int, seed: int, out: Path, batch_rows: int) -> dict:
    """Generate about `bullets` bullets into `out` and measure; runs inside the subprocess."""
    from memprune.synth import SynthSettings, generate, synth_conversation

    pilot = SynthSettings(conversations=200, sessions=sessions, seed=seed)
    per_conv = sum(len(synth_conversation(i, pilot).bullets) for i in range(200)) / 200
    conversations = max(1, math.ceil(bullets / per_conv))
    start, cpu_start = time.perf_counter(), time.process_time()
    summary = generate(conversations=conversations, sessions=sessions, out=out, seed=seed, batch_rows=batch_rows)
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    counts = summary["counts"]
    return {
        "target_bullets": bullets,
        "conversations": conversations,
        "sessions": counts["sessions"],
        "turns": counts["turns"],
        "bullets": counts["bullets"],
        "recurs_share": round(counts["recurs"] / counts["bullets"], 3),
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "bullets_per_s": round(counts["bullets"] / wall),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "bullets_parquet_mib": round((out / "bullets.parquet").stat().st_size / 2**20, 1),
        "sessions_parquet_mib": round((out / "sessions.parquet").stat().st_size / 2**20, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bullets", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-rows", type=int, default=50_000)
    parser.add_argument("--out", type=Path, default=None, help="Where to write (default: a temp dir, removed).")
    parser.add_argument("--keep", action="store_true", help="Keep the generated corpora.")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        result = _child(args.bullets[0], args.sessions, args.seed, args.out, args.batch_rows)
        print(json.dumps(result))
        return

    root = args.out or Path(tempfile.mkdtemp(prefix="synth-bench-"))
    rows = []
    for n in args.bullets:
        out = root / f"synth-{n}"
        cmd = [sys.executable, __file__, "--child", "--bullets", str(n), "--sessions", str(args.sessions),
               "--seed", str(args.seed), "--batch-rows", str(args.batch_rows), "--out", str(out)]
        proc = subprocess.run(cmd, check=True, capture_output=True, text=True)
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    if not args.keep and args.out is None:
        shutil.rmtree(root, ignore_errors=True)
    cols = ["bullets", "conversations", "sessions", "turns", "wall_s", "cpu_s", "bullets_per_s", "peak_rss_mib",
            "bullets_parquet_mib", "sessions_parquet_mib"]
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")


if __name__ == "__main__":
    main()
