"""The training objective: (weighted) MSE on the sigmoid scores, plus an optional within-session
listwise term (KL divergence between the softmax of the labels and of the predicted logits of
each session in a batch; `loss.rank_weight`, 0 = off).

`batch_loss` returns the objective and its additive parts (sum of squared errors, weight sum, KL
sum, sessions used), so an epoch's MSE and rank term are exact sums over batches and workers
(`combine_parts`), not means of batch means.
"""

from __future__ import annotations

from typing import Any

from memprune.train.config import LossConfig


def listwise_kl(logits: "Any", labels: "Any", groups: "Any", temperature: float) -> tuple["Any", int]:
    """Sum over sessions of KL(softmax(labels / T) || softmax(logits)), and the number of sessions used.

    Only sessions with at least two bullets and non-constant labels take part; the term
    is 0 exactly when the predicted logits order and space the bullets like the labels.
    """
    import torch

    total = logits.new_zeros(())
    used = 0
    for g in torch.unique(groups):
        idx = (groups == g).nonzero(as_tuple=True)[0]
        if idx.numel() < 2:
            continue
        y = labels[idx]
        if bool((y.max() - y.min()) <= 1e-12):
            continue
        target = torch.softmax(y / temperature, dim=0)
        log_q = torch.log_softmax(logits[idx], dim=0)
        total = total + torch.sum(target * (torch.log(target.clamp_min(1e-12)) - log_q))
        used += 1
    return total, used


def batch_loss(
    logits: "Any", labels: "Any", groups: "Any", loss: LossConfig, weights: "Any" = None
) -> tuple["Any", dict[str, float]]:
    """The training objective of one batch: (weighted) mean MSE (+ rank_weight x mean session KL); and its parts.

    With per-row `weights` (label-source weights) the MSE is sum(w * err^2) / sum(w);
    without, every row weighs 1 (the plain mean).
    """
    import torch

    scores = torch.sigmoid(logits)
    if weights is None:
        sse = torch.sum((scores - labels) ** 2)
        n = float(labels.numel())
    else:
        sse = torch.sum(weights * (scores - labels) ** 2)
        n = float(weights.sum())
    value = sse / max(1e-12, n) if n else sse
    parts = {"sse": float(sse.detach()), "n": n, "kl": 0.0, "groups": 0.0}
    if loss.rank_weight > 0:
        kl, used = listwise_kl(logits, labels, groups, loss.rank_temperature)
        if used:
            value = value + loss.rank_weight * kl / used
        parts["kl"], parts["groups"] = float(kl.detach()), float(used)
    return value, parts


def combine_parts(parts: dict[str, float], loss: LossConfig) -> dict[str, float]:
    """Summed batch parts -> mse, rank term and the objective (mse + rank_weight x rank)."""
    mse = parts["sse"] / parts["n"] if parts["n"] > 0 else 0.0
    rank = parts["kl"] / parts["groups"] if parts["groups"] else 0.0
    return {"mse": mse, "rank": rank, "loss": mse + (loss.rank_weight * rank if loss.rank_weight > 0 else 0.0)}
