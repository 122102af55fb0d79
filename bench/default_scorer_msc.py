"""The paper's measure on MSC for the shipped `default` against the current stage-1 recipe (issue 54).

Both are measured on the same held-back MSC valid episodes: the `default` recipe's own test episodes (the seeded
split of `configs/default-scorer.yaml`, never used to fit its head or calibration), against the same labels: the
similarity judge's (`configs/label-similarity.yaml`: a bullet x the next session's turns, the CPU proxy of the
paper's LLM judge). The stage-1 recipe (`configs/train-local.yaml`, stage 1, three seeds) is trained on the labels
of every other episode. Printed: session-level Spearman (mean over sessions, as `memprune evaluate`) per scorer.

    python bench/default_scorer_msc.py --out runs/bench-default-msc
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/bench-default-msc")
    ap.add_argument("--seeds", default="0,1,2")
    args = ap.parse_args()
    out = Path(args.out)
    from memprune.config import load_config
    from memprune.evaluate.metrics import session_spearman
    from memprune.ingest import IngestConfig
    from memprune.ingest import run as ingest
    from memprune.io import write_table
    from memprune.label import LabelConfig, run_label
    from memprune.scorer import Scorer
    from memprune.scorers import resolve_scorer
    from memprune.train import TrainConfig, run_training
    from memprune.train.shipped import ShippedRecipe, split_episodes

    recipe = load_config(Path("configs/default-scorer.yaml"), [], ShippedRecipe)
    if not (out / "msc" / "bullets.parquet").is_file():
        ingest(load_config(Path("configs/ingest-msc.yaml"), [], IngestConfig, values={"out": str(out / "msc")}))
    if not (out / "labels" / "labels.parquet").is_file():
        run_label(load_config(Path("configs/label-similarity.yaml"), [], LabelConfig,
                              values={"data": str(out / "msc"), "out": str(out / "labels")}))
    labels = pq.read_table(out / "labels" / "labels.parquet")
    bullets = pq.read_table(out / "msc" / "bullets.parquet").select(["bullet_id", "conversation_id", "session_index",
                                                                     "text"]).to_pandas()
    convs = bullets["conversation_id"].to_numpy()
    held = set(convs[split_episodes(convs, recipe) == 2])
    rows = bullets.merge(labels.select(["bullet_id", "label"]).to_pandas(), on="bullet_id")
    test = rows[rows["conversation_id"].isin(held)].reset_index(drop=True)
    rest = labels.filter(pc.invert(pc.is_in(labels.column("bullet_id"), value_set=pa.array(test["bullet_id"].tolist()))))
    write_table(rest, out / "labels-train" / "labels.parquet", "labels")
    seeds = [int(s) for s in args.seeds.split(",")]
    train = load_config(Path("configs/train-local.yaml"), [], TrainConfig, values={
        "data": str(out / "msc"), "labels": [str(out / "labels-train")], "out": str(out / "stage1-recipe"),
        "stages": ["stage1"], "seeds": seeds})
    run_training(train)

    def spearman(scores: np.ndarray) -> float:
        frame = test.assign(score=scores)
        return float(np.nanmean([session_spearman(g["label"], g["score"])
                                 for _, g in frame.groupby(["conversation_id", "session_index"])]))

    texts = test["text"].tolist()
    result = {"held_back_episodes": len(held), "bullets": len(test),
              "default": spearman(Scorer.load(resolve_scorer(None)).score(texts)),
              "stage1_recipe": {seed: spearman(Scorer.load(out / "stage1-recipe" / "stage1" / f"seed{seed}").score(texts))
                                for seed in seeds}}
    result["stage1_recipe_mean"] = float(np.mean(list(result["stage1_recipe"].values())))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
