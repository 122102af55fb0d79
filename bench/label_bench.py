"""Labeling throughput: pairs/s of the judges on the real MSC data.

    python bench/label_bench.py                       # similarity (local + ray) and hf/tiny
    python bench/label_bench.py --vllm-model PATH     # + vllm vs vLLM's own LLM.generate (CUDA + vllm)
    python bench/label_bench.py --vllm-cpu            # the vllm comparison on CPU (vllm-cpu, tiny model)
    python bench/label_bench.py --vllm-cpu --skip-similarity --skip-hf --skip-vllm-compare --replicas 1,2

Sections:
1. `similarity` judge, the whole `memprune label` stage on the MSC valid split (fresh work
   dir), in-process and with the Ray Data actor pool (`--executors`).
2. `hf` engine with the tiny random Llama (tests/tiny_llm.py) on the first `--llm-pairs`
   MSC pairs in judging order, through `memprune.llm.run_llm` (what each label shard runs).
3. `vllm` engine through `run_llm` (ray.data.llm) against vLLM's offline `LLM.generate` on
   the same rendered prompts and sampling; the ratio memprune / vLLM is the figure that
   matters. Runs when CUDA and vLLM are present (or with `--vllm-cpu`).
4. `--replicas 1,2`: the whole `memprune label` stage with the LLM judges of `--replica-judge`
   (pairwise, listwise, likelihood) on the `vllm` engine with 1, 2, ... engine replicas (one per
   GPU, or per 0.5-CPU bundle with `--vllm-cpu`) on the pairs of `--replica-conversations`
   conversations; pairs/s includes the engine start of each run (one pass, no retries).

Prints one line per measurement and a JSON summary (also written with `--json PATH`).
Speed figures depend on the machine and its load; nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MSC_RAW = REPO.parent / "shared" / "data" / "msc" / "msc_personasummary"


def ingested_msc(args: argparse.Namespace, tmp: Path) -> Path:
    """An ingested MSC valid split (`--data`, else ingested now), cut to `--conversations` if set."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from memprune.io import read_table, write_table

    if args.data:
        data = Path(args.data)
    else:
        from memprune.ingest import ingest

        data = tmp / "msc"
        ingest("msc", args.msc_raw, data, split="valid")
    if not args.conversations:
        return data
    sessions = read_table(data / "sessions.parquet", "sessions")
    bullets = read_table(data / "bullets.parquet", "bullets")
    keep = pa.array(sorted(set(sessions.column("conversation_id").to_pylist()))[: args.conversations])
    out = tmp / f"msc-{args.conversations}"
    write_table(sessions.filter(pc.is_in(sessions.column("conversation_id"), keep)), out / "sessions.parquet", "sessions")
    write_table(bullets.filter(pc.is_in(bullets.column("conversation_id"), keep)), out / "bullets.parquet", "bullets")
    return out


def bench_similarity(data: Path, tmp: Path, executor: str, shard_size: int) -> dict[str, Any]:
    """The full label stage with the similarity judge, fresh output dir."""
    from memprune.label import LabelConfig, run_label

    cfg = LabelConfig(data=data, out=tmp / f"sim-{executor}", judge="similarity", shard_size=shard_size,
                      similarity={"executor": executor}, progress=True)
    t0 = time.perf_counter()
    s = run_label(cfg)
    wall = time.perf_counter() - t0
    t = s["throughput"]
    return {"judge": s["judge"], "executor": executor, "pairs": s["counts"]["pairs"],
            "labels": s["counts"]["bullets_labelled"], "texts": t["texts_encoded"],
            "judge_s": t["judge_s"], "pairs_per_s": t["pairs_per_s"], "wall_s": round(wall, 2),
            "texts_per_s": round(t["texts_encoded"] / t["judge_s"], 1) if t["judge_s"] else None}


def judge_rows(data: Path, n: int) -> list[dict[str, Any]]:
    """The first `n` MSC pairs in judging order, as judge input rows."""
    from memprune.io import read_table
    from memprune.label.pairs import PairOptions, build_pairs

    plan = build_pairs(read_table(data / "sessions.parquet", "sessions"), read_table(data / "bullets.parquet", "bullets"),
                       PairOptions())
    cols = ["bullet_id", "turn_id", "bullet", "context", "target", "target_speaker"]
    return plan.pairs.slice(0, n).select(cols).to_pylist()


def bench_run_llm(rows: list[dict[str, Any]], config: Any, block_rows: int = 16) -> dict[str, Any]:
    """`run_llm(task="judge")` end to end on `rows` (engine start included)."""
    import pyarrow as pa
    import ray

    from memprune.llm import outcome_summary, run_llm

    table = pa.Table.from_pylist(rows)
    ds = ray.data.from_arrow([table.slice(i, block_rows) for i in range(0, table.num_rows, block_rows)])
    t0 = time.perf_counter()
    out = pa.Table.from_pylist(run_llm(ds, config, task="judge").take_all())
    wall = time.perf_counter() - t0
    summary = outcome_summary(out)
    return {"engine": config.engine, "model": Path(config.model).name, "pairs": len(rows), "wall_s": round(wall, 2),
            "pairs_per_s": round(len(rows) / wall, 2), "ok": summary["ok"], "errors": summary["errors"],
            "tokens_in": summary["tokens_in"], "tokens_out": summary["tokens_out"]}


def bench_vllm_offline(rows: list[dict[str, Any]], config: Any) -> dict[str, Any]:
    """vLLM's own `LLM.generate` on the same chat-rendered prompts, sampling and engine arguments."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from memprune.llm import JUDGE_SCHEMA, load_template
    from memprune.llm.engines import sampling_for, vllm_engine_kwargs
    from memprune.llm.prompts import judge_messages

    template = load_template(config.prompt_name("judge"), "judge")
    tok = AutoTokenizer.from_pretrained(config.model, trust_remote_code=config.trust_remote_code)
    prompts = [tok.apply_chat_template(judge_messages(r, template), tokenize=False, add_generation_prompt=True)
               for r in rows]
    sampling = sampling_for(config, "judge", 1)
    extra: dict[str, Any] = {}
    if config.structured_output:
        try:
            from vllm.sampling_params import StructuredOutputsParams

            extra["structured_outputs"] = StructuredOutputsParams(json=JUDGE_SCHEMA, disable_any_whitespace=True)
        except ImportError:  # older vLLM
            from vllm.sampling_params import GuidedDecodingParams

            extra["guided_decoding"] = GuidedDecodingParams(json=JUDGE_SCHEMA)
    params = SamplingParams(**sampling, **extra)
    for k, v in config.env.items():
        os.environ.setdefault(k, v)
    if config.accelerator == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.kv_cache_gb))
    t0 = time.perf_counter()
    llm = LLM(model=config.model, **vllm_engine_kwargs(config))
    t1 = time.perf_counter()
    outs = llm.generate(prompts, params)
    t2 = time.perf_counter()
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"engine": "vllm-offline", "prefix_cache_hit_rate": prefix_hit_rate(llm),
            "pairs": len(rows), "init_s": round(t1 - t0, 2), "generate_s": round(t2 - t1, 2),
            "pairs_per_s_generate": round(len(rows) / (t2 - t1), 2),
            "pairs_per_s_with_init": round(len(rows) / (t2 - t0), 2), "tokens_out": n_out}


def prefix_hit_rate(llm: Any) -> float | None:
    """vLLM's prefix-cache hits / queries (tokens) of an `LLM`; None where it keeps no stats
    (`engine_kwargs.disable_log_stats: false` turns them on) or has no such counters."""
    if not getattr(llm.llm_engine, "log_stats", False):
        return None
    counts = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
    queries = counts.get("vllm:prefix_cache_queries")
    return round(counts.get("vllm:prefix_cache_hits", 0) / queries, 4) if queries else None


def bench_replicas(data: Path, tmp: Path, base: str, model: str, replicas: int, judge: str) -> dict[str, Any]:
    """The label stage on the vllm engine with `replicas` replicas, fresh output dir, one shard, no retries."""
    from memprune.label import LabelConfig, run_label

    kind = {"judge": "likelihood"} if judge == "likelihood" else {"judge": "llm", "judge_mode": judge}
    cfg = LabelConfig(data=data, out=tmp / f"replicas-{judge}-{replicas}", llm_config=base, shard_size=1_000_000,
                      llm_overrides=[f"model={model}", f"concurrency={replicas}", "max_retries=0"], progress=True,
                      **kind)
    s = run_label(cfg)
    t = s["throughput"]
    served = (s.get("likelihood") or {}).get("replicas_served_per_pass")
    return {"judge": s["judge"], "replicas": replicas, "pairs": s["counts"]["pairs"],
            "pairs_scored": s["counts"]["pairs_scored"], "judge_s": t["judge_s"], "pairs_per_s": t["pairs_per_s"],
            "replicas_served_per_pass": served, "llm_calls": s["cost"]["measured"]["llm_calls"]}


def emit(results: dict[str, Any], path: str | None) -> None:
    """Print the JSON summary, and write it to `path` when given."""
    print(json.dumps(results, indent=2))
    if path:
        Path(path).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", help="An ingested MSC directory (default: ingest ../shared MSC valid now).")
    ap.add_argument("--msc-raw", default=str(MSC_RAW), help="Raw MSC persona-summary directory.")
    ap.add_argument("--conversations", type=int, default=0, help="Use only the first N conversations (0 = all 500).")
    ap.add_argument("--executors", default="local,ray", help="Similarity executors to measure (comma separated).")
    ap.add_argument("--shard-size", type=int, default=4096, help="Similarity: texts per shard.")
    ap.add_argument("--skip-similarity", action="store_true")
    ap.add_argument("--llm-pairs", type=int, default=48, help="Pairs for the hf/tiny measurement.")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--vllm-model", help="Model for the vllm comparison (default: the tiny random model).")
    ap.add_argument("--vllm-pairs", type=int, default=2000, help="Pairs for the vllm comparison.")
    ap.add_argument("--vllm-cpu", action="store_true", help="Run the vllm comparison on CPU (vllm-cpu).")
    ap.add_argument("--skip-vllm-compare", action="store_true", help="Skip section 3 (memprune vs LLM.generate).")
    ap.add_argument("--replicas", default="", help="vllm engine replica counts to compare, e.g. 1,2.")
    ap.add_argument("--replica-judge", default="pairwise,likelihood",
                    help="Comma list of judges for the replica runs: pairwise, listwise, likelihood.")
    ap.add_argument("--replica-conversations", type=int, default=4, help="Conversations for the replica runs.")
    ap.add_argument("--json", help="Also write the summary JSON here.")
    args = ap.parse_args()

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="label-bench-") as tmpname:
        tmp = Path(tmpname)
        data = ingested_msc(args, tmp)
        if not args.skip_similarity:
            for ex in [e for e in args.executors.split(",") if e]:
                r = bench_similarity(data, tmp, ex, args.shard_size)
                results[f"similarity_{ex}"] = r
                print(f"similarity/{ex}: {r['pairs']} pairs, {r['texts']} texts encoded once, "
                      f"{r['pairs_per_s']} pairs/s ({r['texts_per_s']} texts/s), wall {r['wall_s']} s", flush=True)

        need_llm = not args.skip_hf or args.vllm_model or args.vllm_cpu or args.replicas
        tiny = None
        if need_llm:
            from tiny_llm import build_tiny_llm

            from memprune.llm import LLMConfig
            from memprune.raysession import ensure_ray

            ensure_ray()  # a local instance of our own, never another process's cluster
            tiny = str(build_tiny_llm(tmp / "tiny-llm"))
        if not args.skip_hf:
            cfg = LLMConfig.from_yaml(REPO / "configs" / "llm" / "hf-tiny-cpu.yaml", [f"model={tiny}"])
            r = bench_run_llm(judge_rows(data, args.llm_pairs), cfg)
            results["hf_tiny"] = r
            print(f"hf/tiny: {r['pairs']} pairs, {r['pairs_per_s']} pairs/s end to end (engine start included), "
                  f"{r['ok']} parsed / {r['errors']} error rows (random model), wall {r['wall_s']} s", flush=True)

        cuda = importlib.util.find_spec("torch") is not None and __import__("torch").cuda.is_available()
        has_vllm = importlib.util.find_spec("vllm") is not None
        if (cuda or args.vllm_cpu) and has_vllm and not args.skip_vllm_compare:
            base = "vllm-cpu.yaml" if args.vllm_cpu or not cuda else "vllm-gpu.yaml"
            model = args.vllm_model or tiny
            cfg = LLMConfig.from_yaml(REPO / "configs" / "llm" / base, [f"model={model}", "max_retries=0"])
            rows = judge_rows(data, args.vllm_pairs)
            ours = bench_run_llm(rows, cfg, block_rows=max(16, len(rows) // 16))
            ref = bench_vllm_offline(rows, cfg)
            ratio = {"vs_generate": round(ours["pairs_per_s"] / ref["pairs_per_s_generate"], 3),
                     "vs_generate_with_init": round(ours["pairs_per_s"] / ref["pairs_per_s_with_init"], 3)}
            results["vllm"] = {"memprune": ours, "offline": ref, "ratio": ratio}
            print(f"vllm via memprune (ray.data.llm): {ours['pairs_per_s']} pairs/s end to end; "
                  f"vLLM LLM.generate: {ref['pairs_per_s_generate']} pairs/s ({ref['pairs_per_s_with_init']} "
                  f"with engine init); ratio {ratio['vs_generate']} ({ratio['vs_generate_with_init']} with init)",
                  flush=True)
        elif not args.replicas:
            reason = "no CUDA" if not cuda else "vLLM not installed"
            results["vllm"] = {"skipped": reason}
            print(f"vllm comparison skipped: {reason} (use --vllm-cpu to run it on CPU)", flush=True)

        counts = [int(r) for r in args.replicas.split(",") if r]
        if counts and (cuda or args.vllm_cpu) and has_vllm:
            base = str(REPO / "configs" / "llm" / ("vllm-cpu.yaml" if args.vllm_cpu or not cuda else "vllm-gpu.yaml"))
            sample = ingested_msc(argparse.Namespace(data=str(data), msc_raw=args.msc_raw,
                                                     conversations=args.replica_conversations), tmp / "replica-data")
            runs = [bench_replicas(sample, tmp, base, args.vllm_model or tiny, n, judge)
                    for judge in args.replica_judge.split(",") if judge for n in counts]
            results["replicas"] = runs
            for r in runs:
                print(f"vllm {r['judge']} with {r['replicas']} replica(s): {r['pairs']} pairs, {r['pairs_per_s']} pairs/s "
                      f"(judge {r['judge_s']} s, engine start included; replicas that served: "
                      f"{r['replicas_served_per_pass'] or 'n/a'})", flush=True)

    emit(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
