"""The prune job on 10^6 synthetic bullets with a BERT-base-shaped random encoder, bf16 and fp32,
against the raw length-sorted bf16 forward loop of `bench/raw_loop.py`."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Literal

from pydantic import PositiveInt

from .shared import REPO, Goal, Precision, Sizes, Some, gpu_sampled, keep_partial, progress, table

GOALS = (Goal("bf16_ratio", "prune: bf16 job / raw length-sorted bf16 loop bullets/s", 0.9),)


class PruneSizes(Sizes):
    """The store (`bullets`), the encoder (`tiny`: 2 layers), the job's precisions and batching, and how many of
    the bullets the raw loop runs over (`raw_rows`)."""

    bullets: PositiveInt = 1_000_000
    encoder: Literal["tiny", "bert-base"] = "bert-base"
    precisions: Some[Precision] = ["bf16", "fp32"]
    raw_rows: PositiveInt = 200_000
    batch_size: PositiveInt = 128
    block_rows: PositiveInt = 2048

    @classmethod
    def tiny(cls, bf16: bool) -> PruneSizes:  # one precision: bf16 where the CPU has its kernels
        return cls(bullets=2000, encoder="tiny", precisions=["bf16" if bf16 else "fp32"], raw_rows=2000,
                   block_rows=512)


def bert_base(path: Path) -> Path:
    """A BERT-base-shaped encoder (BertConfig's defaults: 12 layers, hidden 768), random weights, MiniLM's tokenizer."""
    if (path / "config.json").is_file():
        return path
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from memprune.encoders import minilm_path

    tok = AutoTokenizer.from_pretrained(minilm_path())
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=tok.vocab_size)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def run(sizes: PruneSizes, out: Path) -> dict[str, Any]:
    import pyarrow.parquet as pq
    import torch
    from common import make_store, run_child, tiny_encoder
    from raw_loop import raw_bf16_bullets_per_s

    from memprune.scorer import Scorer, ScorerConfig

    work = out / "prune"
    work.mkdir(parents=True, exist_ok=True)
    tiny = sizes.encoder == "tiny"
    encoder = tiny_encoder(work / "encoder-tiny") if tiny else bert_base(work / "encoder-bert-base")
    config = ScorerConfig(encoder=str(encoder))
    scorer = work / f"scorer-{sizes.encoder}"
    if not (scorer / "scorer.json").is_file():
        Scorer.build(config, seed=0).save(scorer)
    store = make_store(sizes.bullets, work)
    # the raw loop first (seconds), so that every job's ratio is known as soon as it ends (a budget may stop the rest)
    texts = pq.read_table(store / "bullets.parquet", columns=["text"]).column("text").to_pylist()[: sizes.raw_rows]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    raw = raw_bf16_bullets_per_s(str(encoder), texts, sizes.batch_size, config.max_length, device)
    if device == "cuda":
        torch.cuda.empty_cache()  # the jobs' GPU memory figures are of the whole device
    progress(f"prune raw bf16 loop: {raw:.1f} bullets/s over {len(texts)} bullets")
    jobs = []
    for precision in sizes.precisions:
        job_out = work / f"out-{precision}"
        shutil.rmtree(job_out, ignore_errors=True)
        with gpu_sampled({"precision": precision}) as rec:  # the Ray Data path, at any size
            job = run_child(str(REPO / "bench" / "prune_bench.py"), "job", {
                "scorer": str(scorer), "store": str(store), "out": str(job_out), "precision": precision,
                "batch_size": sizes.batch_size, "block_rows": sizes.block_rows, "dedup": True,
                "bullets": sizes.bullets, "execution": "ray"})
        jobs.append({**rec, **{k: job[k] for k in ("rows", "actors", "bullets_per_s", "pipeline_s", "overhead_share",
                                                   "peak_tree_pss_mib")},
                     "raw_bf16_loop_bullets_per_s": round(raw, 1), "ratio": round(job["bullets_per_s"] / raw, 3)})
        progress(f"prune job {precision}: {job['bullets_per_s']} bullets/s over {job['rows']} bullets")
        keep_partial(out, "prune", {"bullets": sizes.bullets, "encoder": sizes.encoder, "raw_rows": len(texts),
                                    "jobs": jobs})
    bf16 = [j["ratio"] for j in jobs if j["precision"] == "bf16"]
    return {"encoder": sizes.encoder, "device": device, "bullets": sizes.bullets, "raw_rows": len(texts),
            "batch_size": sizes.batch_size, "jobs": jobs, "bf16_ratio": bf16[0] if bf16 else None}


def headline(r: dict[str, Any]) -> str:
    return ", ".join(f"{j['precision']} {j['bullets_per_s']} bullets/s ({j['ratio']} of the raw bf16 loop)"
                     for j in r["jobs"])


def markdown(r: dict[str, Any]) -> list[str]:
    return [f"{r['bullets']} synthetic bullets, {r['encoder']} encoder (random weights) on {r['device']}, batch "
            f"{r['batch_size']}; the raw length-sorted bf16 loop ran over {r['raw_rows']} of them.", "",
            *table(r["jobs"], ["precision", "rows", "bullets_per_s", "raw_bf16_loop_bullets_per_s", "ratio", "actors",
                               "overhead_share", "gpu_util_mean_pct", "gpu_mem_peak_mib"])]
