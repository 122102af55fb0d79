"""The training data: bullets joined with their labels (several tables mixed by source weight), split by
conversation, and the content fingerprint that keys every checkpoint.

Bullets without a label are counted (`unlabeled_bullets`); labels that are unusable (NaN, outside
[0, 1], unknown bullet) or superseded by a higher-weight source go to the rejects with the reason.
"""

from __future__ import annotations

import math
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from memprune.io import read_table
from memprune.rejects import Ledger
from memprune.train.config import TrainConfig, TrainError
from memprune.train.splits import UNUSED, split_conversations
from memprune.work import table_digest


def load_labels(cfg: TrainConfig, known: set[str], ledger: Ledger) -> tuple[pa.Table, dict[str, Any]]:
    """Read every label table of `cfg.labels`, reject unusable rows, resolve bullets labelled twice.

    Each row gets the loss weight of its source (`cfg.label_weights`; a table without a
    `source` column is `judge`), times its agreement factor with `label_weight_by: agreement`
    (`TrainSettings.agreement_factor`, from the `agreement` column of consensus labels; tables
    without that column keep factor 1, and no such table at all is an error). Conflict rule:
    a bullet labelled by several rows keeps the
    row whose source has the highest weight; on a tie, the row of the table listed first.
    Superseded rows are rejected with the winner named (so seen = written + rejected holds).
    Returns (bullet_id, label, weight, source) sorted by bullet_id, and the counts.
    """
    best: dict[str, tuple[float, int, float, str, str]] = {}  # bullet -> (weight, -table, label, source, path)
    factor: dict[str, float] = {}  # bullet -> agreement factor of its winning row
    n_rows = n_invalid = n_superseded = 0
    by_source: dict[str, int] = {}
    with_agreement = 0
    for t_index, label_dir in enumerate(cfg.labels):
        labels_path = f"{label_dir}/labels.parquet"
        table = read_table(labels_path, "labels")
        n = table.num_rows
        n_rows += n
        ledger.saw("label", n)
        sources = table.column("source").to_pylist() if "source" in table.column_names else ["judge"] * n
        has_agreement = "agreement" in table.column_names
        with_agreement += has_agreement
        agreements = table.column("agreement").to_pylist() if has_agreement else [None] * n
        for bid, y, src, agr in zip(table.column("bullet_id").to_pylist(), table.column("label").to_pylist(), sources,
                                    agreements):
            reason = None
            if bid not in known:
                reason = "label for a bullet_id that is not in bullets.parquet"
            elif y is None or not math.isfinite(y):
                reason = "label is not a finite number"
            elif not 0.0 <= y <= 1.0:
                reason = "label outside [0, 1]"
            if reason is not None:
                n_invalid += 1
                ledger.reject(source=str(labels_path), record=str(bid), field="label", kind="label", reason=reason,
                              value=y)
                continue
            row = (cfg.weight_of(src), -t_index, float(y), src, str(labels_path))
            cur = best.get(bid)
            if cur is None or row[:2] > cur[:2]:
                best[bid] = row
                factor[bid] = cfg.agreement_factor(agr)
                loser = cur
            else:
                loser = row
            if loser is not None:
                winner = best[bid]
                n_superseded += 1
                ledger.reject(source=loser[4], record=str(bid), field="label", kind="label",
                              reason=f"superseded: the bullet is also labelled by source {winner[3]!r} "
                                     f"(weight {winner[0]:g}) in {winner[4]}", value=loser[2])
    if cfg.label_weight_by == "agreement" and not with_agreement:
        where = ", ".join(f"{d}/labels.parquet" for d in cfg.labels)
        raise TrainError(f"label_weight_by=agreement: no label table has an `agreement` column ({where}); it is written "
                         "by `memprune label --judge-set A.yaml,B.yaml` or `--judge-samples k`")
    ledger.wrote("label", len(best))
    ids = sorted(best)
    for bid in ids:
        by_source[best[bid][3]] = by_source.get(best[bid][3], 0) + 1
    resolved = pa.table({
        "bullet_id": pa.array(ids, pa.string()),
        "label": pa.array([best[b][2] for b in ids], pa.float64()),
        "weight": pa.array([best[b][0] * factor[b] for b in ids], pa.float64()),
        "source": pa.array([best[b][3] for b in ids], pa.string()),
    })
    counts = {"labels": n_rows, "labels_rejected": n_invalid, "labels_superseded": n_superseded,
              "labels_by_source": dict(sorted(by_source.items()))}
    if cfg.label_weight_by == "agreement":
        f = [factor[b] for b in ids]
        counts["agreement_weight"] = {"floor": cfg.agreement_floor, "mean_factor": sum(f) / len(f) if f else None,
                                      "tables_with_agreement": with_agreement}
    return resolved, counts


def prepare_data(cfg: TrainConfig, ledger: Ledger,
                 assignment: dict[str, str] | None = None) -> tuple[pa.Table, dict[str, Any]]:
    """Join bullets with labels, reject unusable labels, split by conversation.

    Returns the labelled table (bullet_id, conversation_id, session_index, group, text,
    label, weight, source, split; sorted by bullet_id, 'unused' conversations dropped) and
    the counts. `assignment` (conversation -> split, e.g. one fold of `run_folds`) replaces
    the split of `cfg.split`; conversations it does not name are unused.
    """
    bullets_path = f"{cfg.data}/bullets.parquet"
    bullets = read_table(bullets_path, "bullets").select(["bullet_id", "conversation_id", "session_index", "text"])
    labels, label_counts = load_labels(cfg, set(bullets.column("bullet_id").to_pylist()), ledger)

    joined = bullets.join(labels, "bullet_id", join_type="inner")
    n_unlabeled = bullets.num_rows - joined.num_rows
    if joined.num_rows == 0:
        where = ", ".join(f"{d}/labels.parquet" for d in cfg.labels)
        raise TrainError(f"{where}: no usable label matches a bullet of {bullets_path}")
    joined = joined.sort_by("bullet_id")
    group = pc.binary_join_element_wise(
        joined.column("conversation_id"), pc.cast(joined.column("session_index"), pa.string()), "\x1fs"
    )
    conv_ids = joined.column("conversation_id").to_pylist()
    if assignment is None:
        conv_split = split_conversations(conv_ids, cfg.split)
    else:
        conv_split = {c: assignment.get(c, UNUSED) for c in sorted(set(conv_ids))}
    split = pa.array([conv_split[c] for c in conv_ids], pa.string())
    table = joined.append_column("group", group).append_column("split", split)
    table = table.filter(pc.not_equal(table.column("split"), UNUSED))
    table = table.select(["bullet_id", "conversation_id", "session_index", "group", "text", "label", "weight",
                          "source", "split"])

    split_names = ("train", "valid", "test", UNUSED)
    conv_counts = {s: sum(1 for v in conv_split.values() if v == s) for s in split_names}
    bullet_counts = {s: int(pc.sum(pc.equal(split, s)).as_py() or 0) for s in split_names}
    counts = {
        "bullets": bullets.num_rows,
        **label_counts,
        "labeled_bullets": joined.num_rows,
        "unlabeled_bullets": n_unlabeled,
        "conversations": conv_counts,
        "bullets_per_split": bullet_counts,
    }
    return table, counts




def data_fingerprint(table: pa.Table) -> str:
    """Content hash of the training inputs (ids, texts, labels, splits): checkpoints are keyed by it."""
    cols = ["bullet_id", "text", "label", "split"]
    if "weight" in table.column_names and pc.any(pc.not_equal(table.column("weight"), 1.0)).as_py():
        cols.append("weight")
    return table_digest(table, cols)
