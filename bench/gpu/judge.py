"""A Llama-3-8B-shaped model dir (config.json, no weights: vLLM's `load_format: dummy` fills random
ones) with a byte-level BPE tokenizer trained here on the MSC text. memprune's `run_llm` (ray.data.llm) on
MSC pairs over a one-factor-at-a-time sweep of `max_num_seqs`, `batch_size` (block rows follow it) and
chunked prefill; the best setting then runs on `long_factor` times the pairs (the extra pairs' rate has no
engine start in it), the listwise judge (`memprune label`), and vLLM's own `LLM.generate` on the same
prompts and sampling (whose prefix-cache counters give the hit rate)."""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import shutil
from pathlib import Path
from typing import Any

from pydantic import NonNegativeInt, PositiveInt

from .shared import REPO, Goal, Some, Sizes, one_line, progress, table, wait_gpu_free

LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
             "vocab_size": 32000, "torch_dtype": "bfloat16"}
RATE = ["pairs", "pairs_per_s", "prompt_tokens_per_s", "generated_tokens_per_s"]
GOALS = (Goal("ratio_steady", "judge: memprune / vLLM LLM.generate pairs/s (the long run's extra pairs: no engine "
              "start)", 0.9),)


class JudgeSizes(Sizes):
    """The model (`base`: its configs/llm YAML; `shape`: its config, {} for tiny_llm's), its MSC pairs (`episodes`:
    the first episodes of the first `sessions` sessions; None: all of MSC valid) and the engine settings swept (the
    first of each list starts the sweep)."""

    base: str = "vllm-gpu.yaml"
    shape: dict[str, Any] = LLAMA3_8B
    vocab: PositiveInt = 32000
    max_positions: PositiveInt = 8192
    episodes: PositiveInt | None = None
    sessions: PositiveInt = 4
    pairs: PositiveInt = 4000
    listwise_conversations: NonNegativeInt = 20
    max_num_seqs: Some[PositiveInt] = [256, 512]
    batch_sizes: Some[PositiveInt] = [64, 256]
    chunked: Some[bool] = [True, False]
    long_factor: PositiveInt = 2

    @classmethod
    def tiny(cls, bf16: bool) -> JudgeSizes:  # MSC cut to its first 8 episodes of 2 sessions
        return cls(base="vllm-cpu.yaml", shape={}, vocab=4000, max_positions=2048, episodes=8, sessions=2, pairs=32,
                   listwise_conversations=1, max_num_seqs=[16], batch_sizes=[16], chunked=[True], long_factor=1)


def unavailable() -> str | None:
    return "vllm is not installed" if importlib.util.find_spec("vllm") is None else None


def judge_model(data: Path, path: Path, sizes: JudgeSizes) -> Path:
    """The judge model dir: config of `sizes.shape`, no weights, BPE tokenizer trained on the MSC turns and bullets."""
    from tiny_llm import build_tiny_llm  # on sys.path once label_bench is imported

    from memprune.io import read_table

    sessions = read_table(data / "sessions.parquet", "sessions").column("turns").to_pylist()
    texts = [t["text"] for turns in sessions for t in turns]
    texts += read_table(data / "bullets.parquet", "bullets").column("text").to_pylist()
    return build_tiny_llm(path, vocab_size=sizes.vocab, max_positions=sizes.max_positions, texts=texts,
                          shape=sizes.shape, weights=False)


def run(sizes: JudgeSizes, out: Path) -> dict[str, Any]:
    import label_bench as lb  # puts REPO and REPO/tests on sys.path
    import yaml

    from memprune.llm import LLMConfig
    from memprune.raysession import ensure_ray

    work = out / "judge"
    shutil.rmtree(work, ignore_errors=True)
    raw = Path(lb.MSC_RAW)
    for k in range(1, sizes.sessions + 1) if sizes.episodes else ():  # a cut: the first episodes of the first sessions
        with open(raw / f"session_{k}" / "valid.txt", encoding="utf-8") as src:
            (work / "msc-raw" / f"session_{k}").mkdir(parents=True)
            cut = "".join(itertools.islice(src, sizes.episodes))
            (work / "msc-raw" / f"session_{k}" / "valid.txt").write_text(cut)
    raw = work / "msc-raw" if sizes.episodes else raw
    data = lb.ingested_msc(argparse.Namespace(data=None, msc_raw=raw, conversations=0), work)
    model = judge_model(data, work / "model", sizes)
    progress(f"judge model {model}: {json.loads((model / 'config.json').read_text())['num_hidden_layers']} layers, "
             f"no weights (load_format dummy)")
    rows = lb.judge_rows(data, sizes.pairs)
    base = REPO / "configs" / "llm" / sizes.base
    fixed = [f"model={model}", "max_retries=0", "engine_kwargs.load_format=dummy",
             "engine_kwargs.disable_log_stats=false"]  # vLLM's stats: the prefix-cache counters
    ensure_ray()
    sweep: list[dict[str, Any]] = []
    configs: dict[int, Any] = {}

    def point(max_num_seqs: int, batch_size: int, chunked: bool) -> dict[str, Any]:
        cfg = LLMConfig.from_yaml(base, [*fixed, f"batch_size={batch_size}",
                                         f"engine_kwargs.max_num_seqs={max_num_seqs}",
                                         f"engine_kwargs.enable_chunked_prefill={str(chunked).lower()}"])
        rec: dict[str, Any] = {"max_num_seqs": max_num_seqs, "batch_size": batch_size, "chunked_prefill": chunked,
                               "block_rows": max(batch_size, len(rows) // 16)}
        try:
            r = lb.bench_run_llm(rows, cfg, block_rows=rec["block_rows"])
            rec.update(r, prompt_tokens_per_s=round(r["tokens_in"] / r["wall_s"], 1),
                       generated_tokens_per_s=round(r["tokens_out"] / r["wall_s"], 1))
        except Exception as exc:  # one setting the engine refuses is a finding, not the end of the sweep
            rec["error"] = one_line(exc)
        configs[len(sweep)] = cfg
        sweep.append(rec)
        progress(f"judge: max_num_seqs {max_num_seqs}, batch_size {batch_size}, chunked prefill {chunked}: "
                 + (f"{rec['pairs_per_s']} pairs/s" if "pairs_per_s" in rec else rec["error"]))
        wait_gpu_free()
        return rec

    def best() -> int:
        ok = [i for i, r in enumerate(sweep) if "error" not in r]
        if not ok:
            raise RuntimeError(f"every judge setting failed; the first: {sweep[0]['error']}")
        return max(ok, key=lambda i: sweep[i]["pairs_per_s"])

    bs0, ch0 = sizes.batch_sizes[0], sizes.chunked[0]
    for m in sizes.max_num_seqs:
        point(m, bs0, ch0)
    m_best = sweep[best()]["max_num_seqs"]
    for bs in sizes.batch_sizes[1:]:
        point(m_best, bs, ch0)
    bs_best = sweep[best()]["batch_size"]
    for ch in sizes.chunked[1:]:
        point(m_best, bs_best, ch)
    top = best()
    ours, cfg = sweep[top], configs[top]
    marginal = None
    if sizes.long_factor > 1:  # the best setting on k times the pairs: the extra pairs' rate has no engine start
        rows = lb.judge_rows(data, sizes.pairs * sizes.long_factor)
        ours = {**ours, **lb.bench_run_llm(rows, cfg, block_rows=ours["block_rows"])}
        extra_s = ours["wall_s"] - sweep[top]["wall_s"]
        marginal = round((ours["pairs"] - sweep[top]["pairs"]) / extra_s, 2) if extra_s > 0 else None
        ours.update(prompt_tokens_per_s=round(ours["tokens_in"] / ours["wall_s"], 1), marginal_pairs_per_s=marginal,
                    generated_tokens_per_s=round(ours["tokens_out"] / ours["wall_s"], 1))
        progress(f"judge: {ours['pairs']} pairs at the best setting: {ours['pairs_per_s']} pairs/s, {marginal} "
                 f"pairs/s beyond the first {sweep[top]['pairs']}")
        wait_gpu_free()

    best_yaml = work / "best.yaml"  # the listwise judge: the whole label stage with the best setting
    best_yaml.write_text(yaml.safe_dump(json.loads(cfg.model_dump_json())), encoding="utf-8")
    sample = lb.ingested_msc(argparse.Namespace(data=str(data), msc_raw=raw,
                                                conversations=sizes.listwise_conversations), work / "listwise-data")
    listwise = lb.bench_replicas(sample, work, str(best_yaml), str(model), 1, "listwise")
    tokens = json.loads((work / "replicas-listwise-1" / "label.json").read_text())["tokens"]
    listwise.update(prompt_tokens=tokens["in"], generated_tokens=tokens["out"],
                    prompt_tokens_per_s=round(tokens["in"] / listwise["judge_s"], 1),
                    generated_tokens_per_s=round(tokens["out"] / listwise["judge_s"], 1))
    progress(f"judge listwise: {listwise['pairs_per_s']} pairs/s")
    wait_gpu_free()

    ref = lb.bench_vllm_offline(rows, cfg)  # with its prefix-cache hit rate (the stats are on: `fixed`)
    ref.update(prompt_tokens_per_s=round(ours["tokens_in"] / ref["generate_s"], 1),
               generated_tokens_per_s=round(ref["tokens_out"] / ref["generate_s"], 1))
    return {"model": {"dir": str(model), "shape": sizes.shape or "tiny", "load_format": "dummy",
                      "vocab_size": json.loads((model / "config.json").read_text())["vocab_size"]},
            "pairs": len(rows), "sweep": sweep, "best": ours, "listwise": listwise, "offline": ref,
            "ratio": round(ours["pairs_per_s"] / ref["pairs_per_s_generate"], 3),
            "ratio_with_init": round(ours["pairs_per_s"] / ref["pairs_per_s_with_init"], 3),
            "ratio_steady": round(marginal / ref["pairs_per_s_generate"], 3) if marginal else None}


def headline(r: dict[str, Any]) -> str:
    return (f"{r['best']['pairs_per_s']} pairs/s via memprune (best of {len(r['sweep'])} settings), "
            f"{r['offline']['pairs_per_s_with_init']} with LLM.generate (engine start included on both: ratio "
            f"{r['ratio_with_init']}; steady state: {r['ratio_steady']}); listwise {r['listwise']['pairs_per_s']} "
            "pairs/s")


def markdown(r: dict[str, Any]) -> list[str]:
    b, o = r["best"], r["offline"]
    md = [f"Model: {'tiny' if r['model']['shape'] == 'tiny' else 'Llama-3-8B'} shape, vocab "
          f"{r['model']['vocab_size']}, no weights (load_format dummy); MSC pairs. Sweep of memprune's "
          "`run_llm` (pairwise judge, engine start included):", ""]
    md += table(r["sweep"], ["max_num_seqs", "batch_size", "block_rows", "chunked_prefill", *RATE, "ok", "errors",
                             "error"])
    md += ["Best setting against vLLM's own `LLM.generate` (same prompts and sampling) and the listwise judge "
           "(`memprune label`, same setting). The prefix-cache hit rate is vLLM's counter of the LLM.generate "
           "run; inside the Ray actors it is not read.", ""]
    beyond = [{"path": "memprune run_llm, pairwise, the pairs beyond the sweep's (no engine start)",
               "pairs": b["pairs"] - r["sweep"][0]["pairs"], "pairs_per_s": b["marginal_pairs_per_s"]}
              ] if b.get("marginal_pairs_per_s") else []
    md += table([{"path": "memprune run_llm, pairwise, engine start included", **b}, *beyond,
                 {"path": "vLLM LLM.generate, generate only", **o, "pairs_per_s": o["pairs_per_s_generate"]},
                 {"path": "vLLM LLM.generate, engine start included", "pairs": o["pairs"],
                  "pairs_per_s": o["pairs_per_s_with_init"]},
                 {"path": "memprune label, listwise, engine start included", **r["listwise"]}],
                ["path", *RATE, "prefix_cache_hit_rate"])
    steady = r["ratio_steady"] or "not measured (needs judge.long_factor > 1)"
    return md + [f"Ratio memprune / LLM.generate: {steady} in steady state (memprune's pairs beyond the sweep's over "
                 f"generate alone), {r['ratio_with_init']} with engine start on both sides, {r['ratio']} of memprune "
                 "end to end over generate alone.", ""]
