"""The pruning view of evaluation (DESIGN step 5 on the test split): what a pruning rule keeps.

Each setting is decided by `memprune.decision.decide`, the decision `memprune prune` makes (with the rule's policy,
floor and min-keep alone: the evaluation has scores, not texts or times), so any policy can be evaluated; the paper's rule
gives its Table 4 and threshold sweep.

Per setting: bullets and tokens per session before and after, reductions, relevant bullets and
label mass kept; with QA evidence, the share of cited bullets kept against random same-size
pruning and against keeping the most recent bullets.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np
import pandas as pd

from memprune.evaluate.config import EvalSettings, EvaluationError
from memprune.decision import Bullets, PruneRule, decide


def evaluation_rules(rule: PruneRule, ks: tuple[int, ...], thresholds: tuple[float, ...]) -> dict[str, list[PruneRule]]:
    """The rules of each pruning table the evaluation reports (the policy's `evaluation`: for the paper's rule,
    Table 4 at its threshold and the threshold sweep at its cap), each with `rule`'s floor and min-keep."""
    return {name: [rule.with_policy(p) for p in policies] for name, policies in rule.policy.evaluation(ks, thresholds).items()}


def pruning_settings(config: EvalSettings) -> list[PruneRule]:
    """Every rule the evaluation decides with, once each, in table order."""
    out: dict[str, PruneRule] = {}
    for rules in evaluation_rules(config.rule, config.ks, config.thresholds).values():
        for r in rules:
            out.setdefault(r.name, r)
    return list(out.values())


class RandomKeep:
    """Random same-size pruning per session, drawn once per split and reused for every model.

    For each of `draws` draws, every session's bullets get a uniformly random order;
    keeping n bullets of a session keeps the first n in that order. Only the ranks of
    the QA-cited bullets are stored, which is all the retention share needs.
    """

    def __init__(self, codes: np.ndarray, cited: np.ndarray, draws: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.cited_idx = np.flatnonzero(cited)
        self.cited_codes = codes[self.cited_idx]
        ranks = np.empty((draws, len(self.cited_idx)), dtype=np.int32)
        n = len(codes)
        for d in range(draws):
            order = np.lexsort((rng.random(n), codes))
            starts = np.r_[0, np.flatnonzero(np.diff(codes[order])) + 1]
            rank = np.empty(n, dtype=np.int64)
            rank[order] = np.arange(n) - np.repeat(starts, np.diff(np.r_[starts, n]))
            ranks[d] = rank[self.cited_idx]
        self.ranks = ranks

    def shares(self, kept_per_session: np.ndarray) -> np.ndarray:
        """Share of cited bullets kept, per draw, when session c keeps kept_per_session[c] bullets."""
        if not len(self.cited_idx):
            return np.full(self.ranks.shape[0], math.nan)
        return (self.ranks < kept_per_session[self.cited_codes][None, :]).mean(axis=1)


def pruning_view(
    df: pd.DataFrame,
    config: EvalSettings,
    tokens: np.ndarray | None = None,
    cited: np.ndarray | None = None,
    recency_rank: np.ndarray | None = None,
    random_keep: RandomKeep | None = None,
    heuristic_ranks: Mapping[str, np.ndarray] | None = None,
) -> dict[str, dict[str, Any]]:
    """Per pruning setting: bullets (and tokens) per session before/after, reductions, what is lost.

    `tokens` are per-row token counts (NaN where unknown). With `cited` (QA-evidence
    bullets), also the share of cited bullets kept against random same-size pruning and
    against keeping the most recent bullets (`recency_rank`: 0 = most recent in session) and the same number kept by
    each heuristic of `memprune.evaluate.baselines` (`heuristic_ranks`: name -> rank in session, 0 = first kept), with
    the lift over the best of them.
    """
    scores, labels = df["score"].to_numpy(), df["label"].to_numpy()
    bullets = Bullets.of(scores, df["session"].to_numpy(), order=df["position"].to_numpy(),
                         tokens=None if tokens is None else np.nan_to_num(tokens, nan=0.0).astype(np.int64))
    codes = bullets.groups
    n_sessions = int(codes.max() + 1) if len(codes) else 0
    relevant = labels >= config.relevance_threshold
    out: dict[str, dict[str, Any]] = {}
    for rule in pruning_settings(config):
        if rule.needs_tokens and bullets.tokens is None:
            raise EvaluationError(f"the {rule.policy.name} rule needs token counts: give the corpus (--data)")
        keep = decide(bullets, rule.scores_only()).keep
        kept_per_session = np.bincount(codes[keep], minlength=n_sessions)
        row: dict[str, Any] = {
            "setting": {**rule.model_dump(mode="json"), "name": rule.name, "label": rule.label},
            "bullets_before": len(df) / max(n_sessions, 1),
            "bullets_after": float(keep.sum()) / max(n_sessions, 1),
            "bullet_reduction_pct": 100.0 * (1 - keep.mean()) if len(df) else math.nan,
            "sessions_emptied_pct": 100.0 * float((kept_per_session == 0).mean()) if n_sessions else math.nan,
            "relevant_kept_pct": 100.0 * keep[relevant].mean() if relevant.any() else math.nan,
            "label_mass_kept_pct": 100.0 * labels[keep].sum() / labels.sum() if labels.sum() > 0 else math.nan,
            "mean_label_kept": float(labels[keep].mean()) if keep.any() else math.nan,
        }
        if tokens is not None:
            known = np.isfinite(tokens)
            t_all, t_keep = tokens[known].sum(), tokens[known & keep].sum()
            row.update(
                tokens_before=float(t_all) / max(n_sessions, 1),
                tokens_after=float(t_keep) / max(n_sessions, 1),
                token_reduction_pct=100.0 * (1 - t_keep / t_all) if t_all > 0 else math.nan,
            )
        if cited is not None and random_keep is not None and recency_rank is not None:
            n_cited = int(cited.sum())
            draws = random_keep.shares(kept_per_session)
            recent_keep = recency_rank < kept_per_session[codes]
            row["qa"] = {
                "n_cited": n_cited,
                "model_pct": 100.0 * keep[cited].mean() if n_cited else math.nan,
                "random_mean_pct": 100.0 * float(draws.mean()) if n_cited else math.nan,
                "random_std_pct": 100.0 * float(draws.std(ddof=1)) if n_cited and len(draws) > 1 else math.nan,
                "random_p2_5_pct": 100.0 * float(np.quantile(draws, 0.025)) if n_cited else math.nan,
                "random_p97_5_pct": 100.0 * float(np.quantile(draws, 0.975)) if n_cited else math.nan,
                "random_expected_pct": 100.0 * expected_random_share(codes, cited, kept_per_session),
                "recency_pct": 100.0 * recent_keep[cited].mean() if n_cited else math.nan,
                "model_beats_random_share": float((keep[cited].mean() > draws).mean()) if n_cited else math.nan,
            }
            q = row["qa"]
            # Lift: the model's cited-kept share over what random same-size pruning keeps in expectation.
            q["lift"] = (q["model_pct"] / q["random_expected_pct"]
                         if n_cited and q["random_expected_pct"] > 0 else math.nan)
            q["lift_pp"] = q["model_pct"] - q["random_expected_pct"] if n_cited else math.nan
            if heuristic_ranks:
                shares = {name: 100.0 * (r < kept_per_session[codes])[cited].mean() if n_cited else math.nan
                          for name, r in heuristic_ranks.items()}
                q.update({f"{name.replace(' ', '_')}_pct": v for name, v in shares.items()})
                q["best_heuristic_pct"] = max(q["random_mean_pct"], *shares.values())
                q["lift_over_best_heuristic_pp"] = q["model_pct"] - q["best_heuristic_pct"]
        out[rule.name] = row
    return out


def expected_random_share(codes: np.ndarray, cited: np.ndarray, kept_per_session: np.ndarray) -> float:
    """Exact expected share of cited bullets kept by random same-size pruning: sum_s n_keep_s c_s / n_s / C."""
    sizes = np.bincount(codes, minlength=len(kept_per_session))
    c = np.bincount(codes[cited], minlength=len(kept_per_session))
    total = c.sum()
    if total == 0:
        return math.nan
    with np.errstate(invalid="ignore", divide="ignore"):
        per = np.where(sizes > 0, kept_per_session * c / np.maximum(sizes, 1), 0.0)
    return float(per.sum() / total)

