"""Benchmark the external stores: read + score + decide on Mem0 (local Qdrant), Lance and a mapped Parquet
table against memprune's own Parquet path (a bullets table), same memories, same scorer.

For each size, the memories are a synthetic bullets store (`memprune synth`, reused under --out):
`bullet_id` -> memory id, `text` -> memory, `conversation_id` -> user, the session -> created_at.
They are written as (a) the bullets Parquet itself (the baseline: `memprune prune --input DIR`),
(b) a mapped Parquet export (`table:`, one file), (b') the same rows as a directory of 8 Parquet files
(`table-dir`: a `table:` store of 8 partitions), (c) a Lance dataset with a 384-d vector column (`lance:`),
(d) a Mem0 store on a local Qdrant path (`mem0:`); `--kinds` picks which are built and pruned. Mem0's own `Memory.add(infer=False)` embeds
each memory with MiniLM one call at a time; its rate is measured on `--mem0-add-sample` memories
and the time for the whole store extrapolated; the rest is bulk-loaded through Mem0's own vector
store (`Memory.vector_store.insert`, Mem0's payload layout, random unit vectors: the prune job reads
the text, never the vectors). Each prune (dry run: decision only, group by user, threshold 0.5,
top-k 5) runs in a fresh process with a fresh local Ray; we record wall time, the store read /
scan / sort times, the Ray Data job's throughput, and the peak PSS of the whole process tree.

    python bench/store_bench.py --memories 10000 100000 --encoder tiny --out /work/runs/stores/bench
    python bench/store_bench.py --memories 100000 --kinds bullets table table-dir --out /tmp/sb   # no Mem0 build
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PeakMemory, make_scorers, make_store, run_child  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("bullets", "table", "table-dir", "lance", "mem0")
TABLE_DIR_FILES = 8  # the files of the `table-dir` store
MARK = "STORE_BENCH_RESULT "  # the child's result line (Ray and the libraries print to stdout too)
MAP = {"table": "id=memory_id,text=memory,group=user,time=created_at", "lance": "id=memory_id,text=memory,group=user,time=created_at",
       "mem0": ""}
MAP["table-dir"] = MAP["table"]


def _mem0_config(d: Path) -> dict[str, Any]:
    from memprune.encoders import minilm_path

    return {"vector_store": {"provider": "qdrant", "config": {"collection_name": "memories", "path": str(d / "qdrant"),
                                                              "embedding_model_dims": 384, "on_disk": True}},
            "embedder": {"provider": "huggingface", "config": {"model": minilm_path()}},
            "llm": {"provider": "openai", "config": {"api_key": "unused", "openai_base_url": "http://127.0.0.1:9/v1"}},
            "history_db_path": str(d / "history.db")}


def make_stores(n: int, out: Path, kinds: list[str]) -> dict[str, Any]:
    """The stores of `kinds` with `n` memories under `out/n{n}` (each reused when present); returns inputs and the
    Mem0 build times."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = out / f"n{n}"
    d.mkdir(parents=True, exist_ok=True)
    info_path = d / "stores.json"
    info = json.loads(info_path.read_text()) if info_path.is_file() else {"n": n, "inputs": {}, "mem0_load": None}
    need = [k for k in kinds if k not in info["inputs"]]
    if not need:
        return info
    synth = make_store(n, out)
    b = pq.read_table(synth / "bullets.parquet").slice(0, n)
    inputs = info["inputs"]
    if "bullets" in need:
        (d / "bullets").mkdir(exist_ok=True)
        pq.write_table(b, d / "bullets" / "bullets.parquet")
        inputs["bullets"] = str(d / "bullets")
    created = [f"2024-01-{1 + s % 28:02d}T00:00:{i % 60:02d}Z" for i, s in enumerate(b.column("session_index").to_pylist())]
    export = pa.table({"memory_id": b.column("bullet_id"), "memory": b.column("text"), "user": b.column("conversation_id"),
                       "created_at": created})
    pq.write_table(export, d / "export.parquet")
    if "table" in need:
        inputs["table"] = f"table:{d / 'export.parquet'}"
    if "table-dir" in need:  # the same rows as 8 Parquet files of one directory: 8 partitions
        (d / "export-dir").mkdir(exist_ok=True)
        step = -(-n // TABLE_DIR_FILES)
        for k in range(TABLE_DIR_FILES):
            pq.write_table(export.slice(k * step, step), d / "export-dir" / f"part-{k}.parquet")
        inputs["table-dir"] = f"table:{d / 'export-dir'}"
    if "lance" in need:
        import lance

        rng = np.random.default_rng(0)
        vec = rng.standard_normal((n, 384)).astype(np.float32)
        vec /= np.linalg.norm(vec, axis=1, keepdims=True)
        lance.write_dataset(export.append_column("vector", pa.FixedSizeListArray.from_arrays(pa.array(vec.ravel()), 384)),
                            str(d / "mem.lance"), mode="overwrite")
        inputs["lance"] = f"lance:{d / 'mem.lance'}"
    if "mem0" in need:
        cfg = _mem0_config(d / "mem0")
        (d / "mem0").mkdir(exist_ok=True)
        (d / "mem0" / "mem0.json").write_text(json.dumps(cfg))
        info["mem0_load"] = run_child(__file__, "mem0_load", {"config": str(d / "mem0" / "mem0.json"),
                                                    "export": str(d / "export.parquet"), "sample": ARGS.mem0_add_sample},
                                      mark=MARK)
        inputs["mem0"] = f"mem0:{d / 'mem0' / 'mem0.json'}"
    info_path.write_text(json.dumps(info, indent=2))
    return info


def child_mem0_load(a: dict[str, Any]) -> dict[str, Any]:
    """Fill a Mem0 store: `sample` memories through Memory.add(infer=False), the rest in bulk through its vector store."""
    import os

    import numpy as np
    import pyarrow.parquet as pq

    os.environ["MEM0_TELEMETRY"] = "False"
    from mem0 import Memory

    rows = pq.read_table(a["export"]).to_pylist()
    m = Memory.from_config(json.loads(Path(a["config"]).read_text()))
    t0 = time.perf_counter()
    for r in rows[: a["sample"]]:
        m.add([{"role": "user", "content": r["memory"]}], user_id=r["user"], infer=False)
    add_s = time.perf_counter() - t0
    rng = np.random.default_rng(1)
    t1 = time.perf_counter()
    rest = rows[a["sample"]:]
    for i in range(0, len(rest), 1000):
        part = rest[i:i + 1000]
        vec = rng.standard_normal((len(part), 384)).astype(np.float32)
        vec /= np.linalg.norm(vec, axis=1, keepdims=True)
        payloads = [{"data": r["memory"], "hash": hashlib.md5(r["memory"].encode()).hexdigest(), "user_id": r["user"],
                     "role": "user", "created_at": r["created_at"], "updated_at": r["created_at"],
                     "text_lemmatized": r["memory"]} for r in part]
        import uuid

        m.vector_store.insert(vectors=vec.tolist(), payloads=payloads,
                              ids=[str(uuid.uuid5(uuid.NAMESPACE_URL, r["memory_id"])) for r in part])
    bulk_s = time.perf_counter() - t1
    m.vector_store.client.close()
    per_add = add_s / max(1, a["sample"])
    return {"add_sample": a["sample"], "add_s": round(add_s, 2), "add_per_memory_s": round(per_add, 4),
            "add_extrapolated_full_s": round(per_add * len(rows), 1), "bulk_rows": len(rest), "bulk_s": round(bulk_s, 2)}


def child_prune(a: dict[str, Any]) -> dict[str, Any]:
    """One dry-run prune of one store in this (fresh) process, with peak memory of the process tree."""
    from memprune.raysession import ensure_ray
    from memprune.stores import StorePruneConfig, parse_map, run

    ensure_ray()
    mem = PeakMemory()
    mem.start()
    t0 = time.perf_counter()
    group = "conversation"  # = user: the stores group by user (their `group` field) too
    cfg = StorePruneConfig(scorer=a["scorer"], input=a["input"], out=a["out"], progress=False, limit_rows=a.get("score_rows"),
                      rule={"threshold": 0.5, "top_k": 5, "group_by": group}, store={"map": parse_map(a["map"])})
    s = run(cfg)
    wall = time.perf_counter() - t0
    peak = mem.stop()
    store = s.get("store", {})
    scored = s["input"].get("rows") if a["kind"] == "bullets" else s["decision"]["decided"]
    job_s = s["timing"].get("pipeline_s") or 0.0
    export_s = sum((store.get("export_timing") or {}).values())
    # The whole store read (+ scan + sort) always; scoring on the first `score_rows` (whole groups) when set:
    # the full run's time is estimated as wall + job time x (unscored rows / scored rows).
    est = wall + job_s * (a["n"] - scored) / scored if scored else wall
    return {"kind": a["kind"], "n": a["n"], "scored": scored, "wall_s": round(wall, 2), "export_s": round(export_s, 2),
            "export_memories_per_s": round(a["n"] / export_s, 1) if export_s else None,
            "est_full_s": round(est, 1), "memories_per_s": round(a["n"] / est, 1),
            "job_bullets_per_s": s["timing"].get("bullets_per_s"), "job_pipeline_s": s["timing"].get("pipeline_s"),
            "export": store.get("export_timing"), "kept": s["result"]["bullets_total_after"],
            "peak_tree_pss_mib": round(peak / 2**20, 1)}


def main() -> None:
    global ARGS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--memories", type=int, nargs="+", default=[100_000])
    p.add_argument("--encoder", default="tiny", choices=["tiny", "minilm"])
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--mem0-add-sample", type=int, default=100)
    p.add_argument("--score-rows", type=int, default=None,
                   help="score only the first N rows (whole groups) of every store; the read is always whole")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "store-bench")
    p.add_argument("--child", nargs=2)
    ARGS = p.parse_args()
    if ARGS.child:
        result = {"mem0_load": child_mem0_load, "prune": child_prune}[ARGS.child[0]](json.loads(ARGS.child[1]))
        print(MARK + json.dumps(result), flush=True)
        return
    ARGS.out.mkdir(parents=True, exist_ok=True)
    scorer = make_scorers(ARGS.out, [ARGS.encoder])[ARGS.encoder]
    rows, loads = [], {}
    for n in ARGS.memories:
        info = make_stores(n, ARGS.out, ARGS.kinds)
        if info.get("mem0_load"):
            loads[n] = info["mem0_load"]
        for kind in ARGS.kinds:
            out = ARGS.out / f"n{n}" / f"run-{kind}"
            r = run_child(__file__, "prune", {"kind": kind, "n": n, "scorer": str(scorer), "input": info["inputs"][kind],
                                    "map": MAP.get(kind, ""), "out": str(out), "score_rows": ARGS.score_rows},
                          mark=MARK)
            rows.append(r)
            print(json.dumps(r), flush=True)
    base = {r["n"]: r for r in rows if r["kind"] == "bullets"}
    for r in rows:
        r["ratio_vs_parquet"] = round(r["memories_per_s"] / base[r["n"]]["memories_per_s"], 3) if r["n"] in base else None
    result = {"encoder": ARGS.encoder, "rows": rows, "mem0_load": loads}
    (ARGS.out / "store_bench.json").write_text(json.dumps(result, indent=2))
    lines = ["| store | memories | scored | wall s | est. full s | memories/s (full) | ratio vs Parquet | job bullets/s | "
             "read / scan / sort s | read+scan+sort memories/s | peak tree PSS MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        e = r["export"] or {}
        lines.append(f"| {r['kind']} | {r['n']} | {r['scored']} | {r['wall_s']} | {r['est_full_s']} | {r['memories_per_s']} | "
                     f"{r['ratio_vs_parquet']} | "
                     f"{r['job_bullets_per_s']} | {' / '.join(str(round(e.get(k, 0), 1)) for k in ('read_s', 'scan_s', 'sort_s')) or '-'} | "
                     f"{r['export_memories_per_s']} | "
                     f"{r['peak_tree_pss_mib']} |")
    for n, ld in loads.items():
        lines.append(f"\nMem0 n={n}: Memory.add(infer=False) {ld['add_per_memory_s']} s/memory on {ld['add_sample']} "
                     f"(extrapolated {ld['add_extrapolated_full_s']} s for all); bulk insert of {ld['bulk_rows']} "
                     f"through Mem0's vector store {ld['bulk_s']} s")
    (ARGS.out / "store_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


ARGS: Any = None

if __name__ == "__main__":
    main()
