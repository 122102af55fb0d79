"""Benchmark: stage-1 epoch time against one encoder pass over the same bullets, and stage-2 epoch time, per precision.

Stage 1 trains only the head on cached embeddings, so one epoch should cost a tiny
fraction of one encoder pass; stage 2 runs the encoder (with LoRA) forward and backward.

    python bench/train_bench.py                          # synthetic corpus, 200 conversations x 4 sessions
    python bench/train_bench.py --data /tmp/msc --labels /tmp/msc-labels --threads 2

Prints a table (one row per `--precisions` value; on a GPU with the encoder pass's ratio to a raw
length-sorted bf16 forward loop, `bench/raw_loop.py`) and a JSON line. Everything runs through `memprune.train.run_training`
in local mode on a CPU (the TorchTrainer runs in-process, no worker start-up in the timings), on one
Ray Train worker on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def synthetic(root: Path, conversations: int, sessions: int) -> tuple[Path, Path]:
    """A `memprune synth` corpus and judge-like labels (recurring facts high, one-off remarks low, noise)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from memprune.io import write_table
    from memprune.synth import generate

    generate(conversations=conversations, sessions=sessions, out=root / "data", seed=0)
    bullets = pq.read_table(root / "data" / "bullets.parquet")
    rng = np.random.default_rng(0)
    recurs = np.asarray(bullets.column("recurs").to_pylist(), dtype=float)
    last = np.asarray(bullets.column("session_index").to_pylist()) == sessions - 1
    y = np.clip(0.15 + 0.6 * recurs + rng.normal(0, 0.15, len(recurs)), 0, 1)[~last]
    ids = bullets.column("bullet_id").filter(pa.array(~last))
    labels = pa.table({"bullet_id": ids, "label": pa.array(y), "n_pairs": pa.array(np.ones(len(ids), np.int32)),
                       "aggregation": pa.array(["max"] * len(ids))})
    write_table(labels, root / "labels" / "labels.parquet", "labels")
    return root / "data", root / "labels"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, help="corpus dir (default: a fresh synthetic corpus)")
    ap.add_argument("--labels", type=Path, help="labels dir (with --data)")
    ap.add_argument("--conversations", type=int, default=200)
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (CPU)")
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--stage1-epochs", type=int, default=10)
    ap.add_argument("--stage2-epochs", type=int, default=1)
    ap.add_argument("--out", type=Path, help="keep the run here (default: a temp dir)")
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16", "fp16"],
                    help="one training run and encoder pass per precision (bf16/fp16: autocast over fp32 weights)")
    args = ap.parse_args()

    import pyarrow.compute as pc
    import torch

    from memprune.raysession import init_local_ray
    from memprune.scorer import Scorer, ScorerConfig
    from memprune.train import TrainConfig, run_training

    init_local_ray(num_cpus=max(2, args.threads), configure_logging=False, log_to_driver=False)
    tmp = Path(tempfile.mkdtemp(prefix="train-bench-"))
    data, labels = (args.data, args.labels) if args.data else synthetic(tmp, args.conversations, args.sessions)
    out = args.out or tmp / "out"
    print(f"working in {tmp}", file=sys.stderr)
    cfg = TrainConfig.model_validate(
        {
            "data": data, "labels": labels, "out": out, "stages": ["stage1", "stage2"], "seeds": [0],
            "max_length": args.max_length,
            # no early stop: every requested epoch runs
            "stage1": {"epochs": args.stage1_epochs, "lr": 1e-3, "batch_size": 64, "patience": args.stage1_epochs},
            "stage2": {"epochs": args.stage2_epochs, "lr": 3e-4, "batch_size": 32, "patience": args.stage2_epochs},
            # on a GPU one Ray Train worker holds it (local mode trains on the CPU)
            "ray": {"num_workers": 1 if torch.cuda.is_available() else 0, "cpus_per_worker": args.threads},
            "embed": {"actors": 1, "cpus_per_actor": args.threads},
        }
    )
    from memprune.rejects import Ledger
    from memprune.train import prepare_data

    table, _ = prepare_data(cfg, Ledger())
    texts = table.filter(pc.equal(table.column("split"), "train")).column("text").to_pylist()
    n_train = len(texts)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(args.threads)
    results: list[dict[str, object]] = []
    for precision in args.precisions:
        run = run_training(cfg.model_copy(update={"out": out / precision, "precision": precision}))
        s1 = json.loads((out / precision / "stage1" / "seed0" / "train.json").read_text())
        s2 = json.loads((out / precision / "stage2" / "seed0" / "train.json").read_text())
        # one encoder pass over the same (train) bullets, same threads, same max_length, in-process
        scorer = Scorer.build(ScorerConfig(max_length=args.max_length), seed=0).to(device)
        scorer.precision = precision
        scorer.embed(texts[:64])  # warm-up
        t0 = time.perf_counter()
        scorer.embed(texts, batch_size=128)
        encoder_s = time.perf_counter() - t0
        s1_times = [e["epoch_s"] for e in s1["epochs"]]
        s2_epoch = statistics.median(e["epoch_s"] for e in s2["epochs"])
        results.append({
            "precision": precision,
            "device": device,
            "train_bullets": n_train,
            "encoder_pass_s": round(encoder_s, 3),
            "encoder_bullets_per_s": round(n_train / encoder_s, 1),
            "stage1_epoch_s": round(statistics.median(s1_times), 4),
            "stage1_epoch_over_encoder_pass": round(statistics.median(s1_times) / encoder_s, 5),
            "stage1_epoch_min_s": round(min(s1_times), 4),
            "stage2_epoch_s": round(s2_epoch, 3),
            "stage2_bullets_per_s": round(n_train / s2_epoch, 1),
            "stage2_epoch_over_encoder_pass": round(s2_epoch / encoder_s, 3),
            "embedding_cache_s": (run.get("embeddings") or {}).get("seconds"),
            "run_timing": run["timing"],
        })
    raw = None
    if device == "cuda":
        from raw_loop import raw_bf16_bullets_per_s

        raw = raw_bf16_bullets_per_s(cfg.encoder, texts, 128, args.max_length)
        for r in results:
            r["encoder_over_raw_bf16_loop"] = round(float(r["encoder_bullets_per_s"]) / raw, 3)  # type: ignore[arg-type]
    print(f"train bullets {n_train}  (threads {args.threads}, max_length {args.max_length}, {device})")
    print("| precision | encoder pass b/s | stage-1 epoch s (median) | stage-1 epoch / encoder pass "
          "| stage-2 epoch s | stage-2 b/s | run overhead share |" + (" encoder / raw bf16 loop |" if raw else ""))
    print("|---|---|---|---|---|---|---|" + ("---|" if raw else ""))
    for r in results:
        print(f"| {r['precision']} | {r['encoder_bullets_per_s']} | {r['stage1_epoch_s']} | "
              f"{r['stage1_epoch_over_encoder_pass']} | {r['stage2_epoch_s']} | {r['stage2_bullets_per_s']} | "
              f"{r['run_timing']['overhead_share']} |"  # type: ignore[index]
              + (f" {r['encoder_over_raw_bf16_loop']} |" if raw else ""))
    if raw:
        print(f"raw length-sorted bf16 forward loop: {raw:.1f} bullets/s")
    print(json.dumps({"threads": args.threads, "max_length": args.max_length, "raw_bf16_loop_bullets_per_s": raw,
                      "results": results,
                      "note": "epoch times include the validation pass; the stage-1 epochs read cached embeddings"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
