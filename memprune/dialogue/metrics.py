"""Reply metrics of dialogue-eval on the real libraries, and their bootstrap resamples.

- BLEU: `sacrebleu` corpus BLEU (default 13a tokenizer, 0-100). For the bootstrap each
  reply's sufficient statistics (n-gram matches and totals, lengths) are extracted once by
  sacrebleu and summed per resample, which gives exactly `corpus_bleu` of that resample.
- ROUGE-L: `rouge_score` F-measure of the LCS (0-1), per reply, averaged; stemming on.
- BERTScore: `bert_score.BERTScorer` F1 (0-1) per reply, averaged, with a *local* encoder
  (`model_type` = a directory; `num_layers` = all its layers unless set; no baseline
  rescaling, no idf). Nothing is downloaded.
- MAUVE: `mauve.compute_mauve(p_features=references, q_features=replies)` (0-1) on
  mean-pooled features from a local encoder that we compute; a corpus-level score.

Bootstrap: the resamples, intervals and paired differences are `memprune.memory.bootstrap`
(shared with qa-eval); here are only the resampled values of the corpus-level metrics (BLEU from
summed statistics, MAUVE reclustered per resample).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# ---------------------------------------------------------------- BLEU


def bleu_stats(hypotheses: Sequence[str], references: Sequence[str]) -> np.ndarray:
    """sacrebleu's per-sentence BLEU sufficient statistics, int64 [n, 2 + 2 * max_ngram]."""
    from sacrebleu.metrics import BLEU

    _check_pairs(hypotheses, references)
    if not len(hypotheses):
        return np.zeros((0, 10), dtype=np.int64)
    stats = BLEU()._extract_corpus_statistics(list(hypotheses), [list(references)])
    return np.asarray(stats, dtype=np.int64)


def bleu_from_stats(summed: np.ndarray) -> float:
    """Corpus BLEU (0-100) from summed sufficient statistics (sacrebleu's own formula)."""
    from sacrebleu.metrics import BLEU

    return float(BLEU()._compute_score_from_stats([int(x) for x in summed]).score)


def corpus_bleu(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """Corpus BLEU (0-100) of replies against one reference each: `sacrebleu.corpus_bleu`."""
    import sacrebleu

    _check_pairs(hypotheses, references)
    return float(sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score)


# ---------------------------------------------------------------- ROUGE-L


def rouge_l(hypotheses: Sequence[str], references: Sequence[str], use_stemmer: bool = True) -> np.ndarray:
    """ROUGE-L F-measure (0-1) of each reply against its reference (`rouge_score`)."""
    from rouge_score import rouge_scorer

    _check_pairs(hypotheses, references)
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=use_stemmer)
    return np.array([scorer.score(r, h)["rougeL"].fmeasure for h, r in zip(hypotheses, references)], dtype=np.float64)


# ---------------------------------------------------------------- BERTScore


def encoder_layers(model_dir: str) -> int:
    """Number of hidden layers of a local encoder (its config.json), for BERTScore's `num_layers`."""
    config = Path(model_dir) / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{config}: not found (BERTScore needs a local encoder directory; nothing is downloaded)")
    data = json.loads(config.read_text(encoding="utf-8"))
    for key in ("num_hidden_layers", "n_layers", "num_layers"):
        if isinstance(data.get(key), int):
            return int(data[key])
    raise ValueError(f"{config}: no num_hidden_layers; set bertscore num_layers explicitly")


class BertScore:
    """`bert_score.BERTScorer` over a local encoder directory (loaded once, reused for every condition)."""

    def __init__(self, model_dir: str, num_layers: int | None = None, batch_size: int = 64,
                 device: str | None = None) -> None:
        from bert_score import BERTScorer

        if not Path(model_dir).is_dir():
            raise FileNotFoundError(f"{model_dir}: BERTScore needs a local encoder directory (nothing is downloaded)")
        self.model_dir = model_dir
        self.num_layers = num_layers if num_layers is not None else encoder_layers(model_dir)
        self.scorer = BERTScorer(model_type=model_dir, num_layers=self.num_layers, lang=None,
                                 rescale_with_baseline=False, idf=False, batch_size=batch_size,
                                 device=device, use_fast_tokenizer=True)

    def __call__(self, hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, np.ndarray]:
        """Per-pair precision, recall and F1 (0-1)."""
        _check_pairs(hypotheses, references)
        if not len(hypotheses):
            empty = np.zeros(0, dtype=np.float64)
            return {"precision": empty, "recall": empty, "f1": empty}
        p, r, f = self.scorer.score(list(hypotheses), list(references), verbose=False)
        return {"precision": p.double().numpy(), "recall": r.double().numpy(), "f1": f.double().numpy()}


# ---------------------------------------------------------------- MAUVE


@dataclass
class MauveSettings:
    """compute_mauve settings; `num_buckets` None = the library's 'auto' (n / 10, at least 2)."""

    num_buckets: int | None = None
    kmeans_num_redo: int = 5
    kmeans_max_iter: int = 500
    seed: int = 25
    scaling_factor: float = 5.0


def mauve_score(reference_features: np.ndarray, reply_features: np.ndarray, settings: MauveSettings) -> float:
    """MAUVE (0-1) of reply features against reference features (`mauve.compute_mauve`)."""
    import mauve

    p = np.asarray(reference_features, dtype=np.float32)
    q = np.asarray(reply_features, dtype=np.float32)
    n = min(len(p), len(q))
    buckets: Any = "auto" if settings.num_buckets is None else min(int(settings.num_buckets), n)
    out = mauve.compute_mauve(p_features=p, q_features=q, num_buckets=buckets,
                              kmeans_num_redo=settings.kmeans_num_redo, kmeans_max_iter=settings.kmeans_max_iter,
                              seed=settings.seed, mauve_scaling_factor=settings.scaling_factor, verbose=False)
    return float(out.mauve)


# ---------------------------------------------------------------- bootstrap resamples (indices: memprune.memory.bootstrap)


def bleu_bootstrap(stats: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Corpus BLEU of each resample: the per-sentence statistics summed over the resample."""
    return np.array([bleu_from_stats(stats[row].sum(axis=0)) for row in idx], dtype=np.float64)


def mauve_bootstrap(p: np.ndarray, q: np.ndarray, idx: np.ndarray, settings: MauveSettings) -> np.ndarray:
    """MAUVE of each resample (references and replies resampled together)."""
    return np.array([mauve_score(p[row], q[row], settings) for row in idx], dtype=np.float64)


def _check_pairs(hypotheses: Sequence[str], references: Sequence[str]) -> None:
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} replies but {len(references)} references")

