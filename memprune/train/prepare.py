"""What a training run needs before it trains: its inputs (`prepare_inputs`), what its workers ask of the cluster
(`requests_of`) and how many seed chains train at once (`chains_at_once`); `memprune tune` prepares and sizes its
trials with the same functions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.compute as pc
from rich.console import Console

from memprune.io import JsonlSink, write_table
from memprune.outputs import OutputSet
from memprune.raysession import ensure_ray
from memprune.rejects import Ledger
from memprune.runtime import check_paths_visible, check_resources, use_gpu
from memprune.train.config import TrainConfig
from memprune.train.data import data_fingerprint, prepare_data
from memprune.train.embed import compute_embeddings, embedding_column
from memprune.train.stages import STAGE_SPECS
from memprune.train.trainer import Inputs, storage_path

console = Console(stderr=True)


def prepare_inputs(cfg: TrainConfig, assignment: dict[str, str] | None, cache_dir: Path, outputs: OutputSet
                   ) -> tuple[Inputs, Ledger, dict[str, Any] | None]:
    """Labelled, split tables (with embeddings when a stage needs them), the label ledger, the embedding facts.

    The inputs are read and the cluster checked before anything is computed, so a bad path, table or
    setting fails in seconds, not after Ray has started workers.
    """
    with JsonlSink(outputs.path("rejects.jsonl")) as rejects:
        ledger = Ledger(rejects)
        table, counts = prepare_data(cfg, ledger, assignment)
    ensure_ray(cfg.ray.address)
    if any(STAGE_SPECS[s].trained and STAGE_SPECS[s].workers(cfg) for s in cfg.stages):
        # Ray Train workers write their checkpoints to its storage (default OUT/ray): every node must see it
        check_paths_visible({"train.ray.storage_path": storage_path(cfg)} if cfg.ray.storage_path else
                            {"--out": cfg.out})
    check_resources(requests_of(cfg))
    write_table(table.group_by(["conversation_id", "split"]).aggregate([]).sort_by("conversation_id"),
                outputs.path("splits.parquet"))
    if counts["bullets_per_split"]["test"] == 0:
        console.print("[yellow]warning:[/] the test split is empty", highlight=False)
    embed_info: dict[str, Any] | None = None
    dim: int | None = None
    if any(STAGE_SPECS[s].needs_embeddings for s in cfg.stages):
        console.print(f"embedding {table.num_rows} labelled bullets with {cfg.encoder} (Ray Data)", highlight=False)
        emb, embed_info = compute_embeddings(table, cfg.scorer_config(), cfg.embed, cache_dir, cfg.precision)
        dim = int(emb.shape[1])
        table = table.append_column("embedding", embedding_column(emb))
    tables = {s: table.filter(pc.equal(table.column("split"), s)) for s in ("train", "valid", "test")}
    return Inputs(tables, dim, data_fingerprint(table), counts), ledger, embed_info


def chains_at_once(cfg: TrainConfig, n_chains: int) -> int:
    """How many seed chains can train at once on this cluster."""
    import ray

    if cfg.ray.max_concurrent is not None:
        return max(1, min(cfg.ray.max_concurrent, n_chains))
    res = ray.cluster_resources()
    fits = int(res.get("CPU", 1) // (cfg.ray.cpus_per_worker * max(1, cfg.ray.num_workers)))
    if cfg.ray.num_workers > 0 and use_gpu(cfg.ray.use_gpu, res):
        fits = min(fits, int(res.get("GPU", 0) // cfg.ray.num_workers))
    return max(1, min(fits, n_chains))


def requests_of(cfg: TrainConfig) -> dict[str, dict[str, float]]:
    """What one Ray Train worker and one embedding actor need, by the config key that sets it."""
    requests: dict[str, dict[str, float]] = {"embed.cpus_per_actor": {"CPU": cfg.embed.cpus_per_actor}}
    if cfg.embed.use_gpu is True:
        requests["embed.use_gpu"] = {"GPU": 1}
    if cfg.ray.num_workers > 0 or cfg.ray.stage1_workers > 0:
        requests["ray.cpus_per_worker"] = {"CPU": cfg.ray.cpus_per_worker}
        if cfg.ray.use_gpu is True:
            requests["ray.use_gpu"] = {"GPU": 1}
    return requests
