"""Benchmark `memprune prune`: job throughput and peak memory vs the raw encoder loop, per store size.

For each size (bullets) a synthetic store is made with `memprune synth` (kept under --out and
reused). Then, each in a fresh subprocess so that peaks are its own:

- **job**: `run_prune` (streaming path, group by session) where `--execution` says: `auto` as a user's
  run picks (the driver up to `driver_rows`, else Ray), `ray` always on a fresh local Ray; bullets/s of
  the job (actor start-up included, Ray start-up excluded), the peak memory of the
  whole process tree (driver + raylet, GCS, workers, object store: summed PSS), and where the
  actors' time went (model load, forward passes, token counting, the rule).
- **raw**: the same scorer, same bullets, same batch size, in a plain loop in one process:
  the job's scoring helper ("sorted": each distinct text once, length order, per block) and
  `Scorer.score` in input order ("plain"), with 1 thread and with all threads.

The headline is job / limit, where limit = the better of (all threads in one loop) and
(one single-thread loop per core the job uses): every core busy with nothing but the forward
pass. `--limit-rows` caps the rows of MiniLM jobs (a prefix of the store, whole sessions) for
sizes where a full pass takes too long on this machine; every row of the report says how many
rows ran and `extrapolated_full_s` estimates the full run. `--encoders tiny` adds a 2-layer
random BERT (a real model built here, no download): its fast forward pass exposes the
pipeline's own cost per row and lets the full 10^6 store run through the job, to show that
memory stays flat.

    python bench/prune_bench.py --bullets 10000 100000 1000000 --limit-rows 100000 --encoders minilm tiny

`--dedup on off` runs each job with and without near-duplicate merging (the embeddings come from the
scoring pass itself; merging adds the per-group cosine matrices) and prints the difference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PeakMemory, make_scorers, make_store, run_child  # noqa: E402


# ------------------------------------------------------------------ measurements (child)


def child_job(a: dict[str, Any]) -> dict[str, Any]:
    """Run the prune job once and measure it."""
    import resource

    from memprune.prune import (
        GROUP_KEYS,
        PruneConfig,
        list_store_files,
        open_store,
        plan_store,
        run_prune,
    )
    from memprune.prune.stage import where_to_score
    from memprune.raysession import init_local_ray

    mem = PeakMemory()
    mem.start()
    cfg = PruneConfig(scorer=a["scorer"], input=a["store"], out=a["out"], batch_size=a["batch_size"],
                      block_rows=a["block_rows"], actors=a.get("actors"), actor_cpus=a.get("actor_cpus", 1.0),
                      limit_rows=a.get("limit_rows"), precision=a.get("precision", "auto"), progress=False,
                      rule={"dedup": a.get("dedup", True)}, execution=a.get("execution", "auto"))
    t0 = time.perf_counter()
    if where_to_score(cfg, a.get("limit_rows") or a["bullets"]) == "ray":
        # address="local": a fresh local instance even when a `ray start` cluster runs on this machine.
        init_local_ray(num_cpus=os.cpu_count(), include_dashboard=False, configure_logging=False, log_to_driver=False)
    init_s = time.perf_counter() - t0
    cpu0 = mem.cpu_snapshot()
    summary = run_prune(cfg)
    peak = mem.stop()
    cpu_s = sum(v - cpu0.get(pid, 0.0) for pid, v in mem.cpu.items())
    files, _, _ = open_store(list_store_files(a["store"]), None)
    full_scan = plan_store(files, GROUP_KEYS["session"], a["block_rows"]) if a.get("limit_rows") else None
    t = summary["timing"]
    return {
        "rows": summary["input"]["rows"], "store_rows": summary["input"]["rows_in_files"], "groups": summary["groups"],
        "mode": summary["grouping"]["mode"], "blocks": summary["grouping"]["blocks"],
        "execution": summary["resources"]["execution"],
        "actors": summary["resources"]["actors"], "threads_per_actor": summary["resources"]["threads_per_actor"],
        "ray_init_s": round(init_s, 2), "scan_s": t["scan_s"], "pipeline_s": t["pipeline_s"], "total_s": t["wall_s"],
        "compute_s": t["compute_s"], "overhead_share": t["overhead_share"],
        "bullets_per_s": t["bullets_per_s"],
        "full_store_scan_s": round(full_scan.scan_s, 3) if full_scan else t["scan_s"],
        "peak_tree_pss_mib": round(peak / 2**20, 1), "memory_samples": mem.samples,
        "cpu_s": round(cpu_s, 1), "cpu_ms_per_bullet": round(1000 * cpu_s / summary["input"]["rows"], 3),
        "work": t.get("work", {}), "parts": t.get("parts", {}), "underused_s": t.get("underused_s"),
        "actor_timing": t.get("actors", []),
        "driver_peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "kept_per_session": round(summary["result"]["bullets_after"], 3),
        "dedup": a.get("dedup", True), "duplicates": summary["duplicates"],
        "bullets_per_session": round(summary["result"]["bullets_before"], 3),
    }


def child_raw(a: dict[str, Any]) -> dict[str, Any]:
    """The scorer's forward pass over the same bullets in a plain loop (no Ray), 1 thread and all threads.

    "sorted" is the job's own scoring helper per block (each distinct text once, length order);
    "plain" is `Scorer.score` in input order. CPU ms per bullet come from process time. Then the
    sorted helper at each other precision (all threads), and on a GPU the raw bf16 loop.
    """
    import pyarrow.parquet as pq
    import torch

    from memprune.prune import list_store_files, score_texts
    from memprune.scorer import Scorer

    texts: list[str] = []
    for f in list_store_files(a["store"]):
        texts += pq.read_table(f, columns=["text"]).column("text").to_pylist()
        if len(texts) >= a["rows"]:
            break
    texts = texts[: a["rows"]]
    scorer = Scorer.load(a["scorer"], precision="fp32")
    block, bs = a["block_rows"], a["batch_size"]
    out: dict[str, Any] = {"rows": len(texts)}
    variants = {"sorted": lambda c: score_texts(scorer, c, bs), "plain": lambda c: scorer.score(c, batch_size=bs)}
    for threads in (1, os.cpu_count() or 1):
        torch.set_num_threads(threads)
        for name, fn in variants.items():
            fn(texts[:bs])  # warm-up
            t, cpu = time.perf_counter(), time.process_time()
            for i in range(0, len(texts), block):
                fn(texts[i : i + block])
            wall = time.perf_counter() - t
            out[f"{name}_{threads}t_bullets_per_s"] = round(len(texts) / wall, 1)
            out[f"{name}_{threads}t_cpu_ms_per_bullet"] = round(1000 * (time.process_time() - cpu) / len(texts), 3)
    out["threads_all"] = os.cpu_count() or 1
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for precision in a["precisions"]:
        if device == "cpu" and precision == "fp32":
            continue  # measured above (sorted, all threads)
        scorer = Scorer.load(a["scorer"], device=device, precision=precision)
        score_texts(scorer, texts[:bs], bs)  # warm-up
        t = time.perf_counter()
        for i in range(0, len(texts), block):
            score_texts(scorer, texts[i : i + block], bs)
        out[f"sorted_{precision}_{device}_bullets_per_s"] = round(len(texts) / (time.perf_counter() - t), 1)
    if device == "cuda":
        from raw_loop import raw_bf16_bullets_per_s

        out["raw_bf16_loop_bullets_per_s"] = round(raw_bf16_bullets_per_s(
            scorer.config.encoder, texts, bs, scorer.config.max_length), 1)
    return out


def child_inproc(a: dict[str, Any]) -> dict[str, Any]:
    """`MemoryPruner.prune` latency for one session of `n` bullets (median of repeated calls, no Ray)."""
    import statistics

    import pyarrow.parquet as pq
    import torch

    from memprune.prune import MemoryPruner, list_store_files

    torch.set_num_threads(os.cpu_count() or 1)
    texts = pq.read_table(list_store_files(a["store"])[0], columns=["text"]).column("text").to_pylist()
    pruner = MemoryPruner(a["scorer"], threshold=0.5, top_k=5)
    times = []
    for i in range(a["calls"] + 3):
        session = texts[i * a["n"] : (i + 1) * a["n"]]
        t = time.perf_counter()
        pruner.prune(session)
        if i >= 3:  # warm-up calls excluded
            times.append(time.perf_counter() - t)
    return {"bullets": a["n"], "calls": a["calls"], "median_ms": round(1000 * statistics.median(times), 2),
            "p90_ms": round(1000 * sorted(times)[int(0.9 * len(times))], 2)}


# ------------------------------------------------------------------ main


def _row(enc: str, precision: str, job: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
    """One report row: the job at one precision against the raw loops."""
    n_all = raw["threads_all"]
    gpu = "raw_bf16_loop_bullets_per_s" in raw
    if gpu:  # the reference on a GPU: the raw length-sorted bf16 forward loop
        limit = raw["raw_bf16_loop_bullets_per_s"]
    elif precision == "fp32":
        # The physical limit: every core busy with the forward pass, in the better of the two layouts
        # (one process with all threads, or `cores` independent single-thread loops).
        cores = min(job["actors"] * job["threads_per_actor"], n_all)
        limit = max(raw[f"sorted_{n_all}t_bullets_per_s"], cores * raw["sorted_1t_bullets_per_s"])
    else:
        limit = raw[f"sorted_{precision}_cpu_bullets_per_s"]
    row = {"encoder": enc, "precision": precision, "store_bullets": job["store_rows"], "job_rows": job["rows"], **job,
           "raw": raw, "limit": "raw bf16 loop" if gpu else f"raw {precision} loop", "limit_bullets_per_s": limit,
           "ratio": round(job["bullets_per_s"] / limit, 3),
           "ratio_vs_plain_all_threads": round(job["bullets_per_s"] / raw[f"plain_{n_all}t_bullets_per_s"], 3),
           "load_avg_1m_after": round(os.getloadavg()[0], 2)}
    if job["rows"] < job["store_rows"]:
        row["extrapolated_full_s"] = round(job["full_store_scan_s"] + job["store_rows"] / job["bullets_per_s"], 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bullets", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--encoders", nargs="+", default=["minilm"], help="minilm and/or tiny")
    parser.add_argument("--limit-rows", type=int, default=None,
                        help="cap rows per MiniLM job/raw run (sizes above it run a prefix of the store)")
    parser.add_argument("--raw-rows", type=int, default=20_000, help="bullets in the raw loop (at most the job's rows)")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--block-rows", type=int, default=2048)
    parser.add_argument("--actors", type=int, default=None)
    parser.add_argument("--actor-cpus", type=float, default=1.0)
    parser.add_argument("--execution", nargs="+", default=["auto"], choices=["auto", "ray", "driver"],
                        help="a job per item: where the bullets are scored (auto: as a user's run picks)")
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16", "fp16"],
                        help="a job per precision (bf16/fp16: autocast over fp32 weights)")
    parser.add_argument("--dedup", nargs="+", default=["on"], choices=["on", "off"],
                        help="a job per item, with or without near-duplicate merging (on off on off: its cost, "
                             "interleaved against drifting machine load)")
    parser.add_argument("--jobs-only", action="store_true",
                        help="only the jobs (no raw loops, no MemoryPruner timing): e.g. for --dedup on off")
    parser.add_argument("--out", type=Path, default=Path("/tmp/memprune-prune-bench"))
    parser.add_argument("--json", type=Path, default=None, help="report file (default OUT/prune_bench.json)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, payload = args.child
        result = {"job": child_job, "raw": child_raw, "inproc": child_inproc}[kind](json.loads(payload))
        print(json.dumps(result))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    scorers = make_scorers(args.out, args.encoders)
    rows_out: list[dict[str, Any]] = []
    load = os.getloadavg()[0]
    for size in args.bullets:
        store = make_store(size, args.out)
        for enc, scorer in scorers.items():
            limit = args.limit_rows if enc == "minilm" else None
            base = {"scorer": str(scorer), "store": str(store), "batch_size": args.batch_size,
                    "block_rows": args.block_rows}
            raw = None
            for precision in args.precisions:
                for dedup, execution in ((d, e) for d in args.dedup for e in args.execution):
                    job = run_child(__file__, "job", {**base, "out": str(args.out / f"out-{enc}-{size}-{precision}-dedup{dedup}"),
                                            "limit_rows": limit, "actors": args.actors, "actor_cpus": args.actor_cpus,
                                            "precision": precision, "dedup": dedup == "on", "bullets": size,
                                            "execution": execution})
                    if args.jobs_only:
                        rows_out.append({"encoder": enc, "precision": precision, "store_bullets": job["store_rows"],
                                         "job_rows": job["rows"], **job})
                    else:
                        raw = raw or run_child(__file__, "raw", {**base, "rows": min(args.raw_rows, job["rows"]),
                                                       "precisions": args.precisions})
                        rows_out.append(_row(enc, precision, job, raw))
                    print(json.dumps(rows_out[-1]), file=sys.stderr)
    inproc = {} if args.jobs_only else {
        enc: run_child(__file__, "inproc", {"scorer": str(sc), "store": str(make_store(args.bullets[0], args.out)),
                                  "n": 10, "calls": 50}) for enc, sc in scorers.items()}
    report = {"cpus": os.cpu_count(), "load_avg_1m_at_start": round(load, 2), "batch_size": args.batch_size,
              "block_rows": args.block_rows, "results": rows_out, "memory_pruner_10_bullets": inproc}
    json_path = args.json or args.out / "prune_bench.json"
    json_path.write_text(json.dumps(report, indent=2))
    print(f"\nprune benchmark ({os.cpu_count()} CPUs, batch {args.batch_size}, block {args.block_rows} rows; "
          f"load average at start {load:.1f})")
    header = ("encoder", "precision", "dedup", "scored on", "store", "job rows", "job b/s", "overhead share", "raw 1-thread b/s", "raw all-threads b/s", "limit b/s",
              "job/limit (limit: raw loop at that precision; GPU: raw bf16 loop)", "peak tree MiB", "pipeline s", "actor load s (sum)", "forward s (sum)", "scan s (full store)")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in (r for r in rows_out if "raw" in r):
        n_all, w = r["raw"]["threads_all"], r["work"]
        print(f"| {r['encoder']} | {r['precision']} | {'on' if r['dedup'] else 'off'} | {r['execution']} | {r['store_bullets']} | {r['job_rows']} | {r['bullets_per_s']} | "
              f"{r['overhead_share']} | "
              f"{r['raw']['sorted_1t_bullets_per_s']} | {r['raw'][f'sorted_{n_all}t_bullets_per_s']} | "
              f"{r['limit_bullets_per_s']} | {r['ratio']} | {r['peak_tree_pss_mib']} | {r['pipeline_s']} | "
              f"{w.get('actor_load_s')} | {w.get('score_s')} | {r['full_store_scan_s']} |")
    keys = sorted({(r["encoder"], r["precision"], r["store_bullets"], r["execution"]) for r in rows_out})
    for key in keys:  # dedup on vs off, averaged over repeats (`--dedup on off on off` interleaves them)
        runs = {d: [r for r in rows_out
                    if (r["encoder"], r["precision"], r["store_bullets"], r["execution"]) == key and r["dedup"] == d]
                for d in (True, False)}
        if not (runs[True] and runs[False]):
            continue
        bps = {d: sum(r["bullets_per_s"] for r in rs) / len(rs) for d, rs in runs.items()}
        per = {d: sum(sum(r["work"].get(w, 0.0) for w in ("score_s", "tokens_s", "decide_s")) / r["job_rows"]
                      for r in rs) / len(rs) for d, rs in runs.items()}
        dec = {d: sum(r["work"].get("decide_s", 0.0) / r["job_rows"] for r in rs) / len(rs) for d, rs in runs.items()}
        print(f"dedup cost ({key[0]}, {key[1]}, {key[2]} bullets, {key[3]}, {len(runs[True])}+{len(runs[False])} runs): job "
              f"{bps[True]:.1f} vs {bps[False]:.1f} bullets/s without ({100 * (bps[True] / bps[False] - 1):+.1f}%); "
              f"actor compute {1000 * per[True]:.3f} vs {1000 * per[False]:.3f} ms/bullet "
              f"({100 * (per[True] / per[False] - 1):+.1f}%), of which deciding {1000 * dec[True]:.4f} vs "
              f"{1000 * dec[False]:.4f} ms/bullet; {runs[True][0]['duplicates']} duplicates merged")
    for r in rows_out:  # where the job's wall time went (prune.json timing.parts)
        if r.get("parts"):
            print(f"time ({r['encoder']}, {r['precision']}, {r['job_rows']} rows, {r['execution']}): "
                  + ", ".join(f"{k[:-2]} {v:.1f} s" for k, v in r["parts"].items())
                  + f"; compute lost to idle actors {r['underused_s']:.1f} s; actors (ready s, load s, blocks, busy s): "
                  + "; ".join(f"{x['ready_s']:.1f}, {x['load_s']:.1f}, {x['blocks']}, {x['busy_s']:.1f}"
                              for x in r["actor_timing"]))
    for enc, r in inproc.items():
        print(f"MemoryPruner.prune, one session of {r['bullets']} bullets ({enc}): median {r['median_ms']} ms, "
              f"p90 {r['p90_ms']} ms")
    print(f"\nJSON: {json_path}")


if __name__ == "__main__":
    main()
