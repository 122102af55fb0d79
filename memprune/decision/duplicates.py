"""Duplicates: bullets of a group with the same normalised text, or whose encoder embeddings have cosine similarity
>= the rule's `dedup_threshold`, form clusters (transitively); one bullet represents a cluster (a pinned one first,
then one that has not expired, then the highest effective score, then the earliest), the others go with reason
`duplicate`.
"""

from __future__ import annotations

import re
import unicodedata

import numpy as np

from memprune.decision.bullets import Bullets
from memprune.decision.retention import Standing

_PUNCT = re.compile(r"[^\w\s]+")
_SPACE = re.compile(r"\s+")
DUPLICATE = "duplicate"


def _order(n: int, order: np.ndarray | None) -> np.ndarray:
    return np.arange(n) if order is None else np.asarray(order)


def normalize_text(text: str) -> str:
    """The text compared for exact duplicates: NFKC, case-folded, punctuation dropped, spaces collapsed."""
    text = unicodedata.normalize("NFKC", text).casefold()
    return _SPACE.sub(" ", _PUNCT.sub(" ", text)).strip()


def unify_equal_texts(bullets: Bullets) -> Bullets:
    """The bullets with equal texts of a group given the score (and embedding) of their earliest copy.

    In-process and inside one block equal texts already score exactly equal (each distinct text is
    scored once); the batch job's shuffle path scores a group's rows in different blocks, where
    batch padding moves the last bits. Unifying makes ties, and so the decision, the same everywhere.
    """
    n, codes, texts = len(bullets), bullets.groups, bullets.texts
    if n < 2 or texts is None:
        return bullets
    first: dict[tuple[int, str], int] = {}
    for i in np.argsort(_order(n, bullets.order), kind="stable"):
        first.setdefault((int(codes[i]), texts[i]), int(i))
    src = np.fromiter((first[(int(c), t)] for c, t in zip(codes, texts)), dtype=np.int64, count=n)
    if (src == np.arange(n)).all():
        return bullets
    emb = bullets.embeddings
    return bullets.with_(scores=bullets.scores[src], embeddings=None if emb is None else np.asarray(emb)[src])


# Similarity cells computed at once (a row chunk x its group) and links held before they are merged: they bound the
# memory of a duplicate search whatever the group's size (2x10^4 near-identical bullets in one group: 204 MB at peak).
SIM_CELLS = 1 << 20
PENDING_LINKS = 1 << 20


def _merge(labels: np.ndarray, a: list[np.ndarray], b: list[np.ndarray]) -> np.ndarray:
    """`labels` (a component label per bullet, in 0..n-1) after linking the labels `a[k]` with `b[k]`."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    n = len(labels)
    r, c = np.concatenate(a), np.concatenate(b)
    graph = coo_matrix((np.ones(len(r), dtype=np.int8), (r, c)), shape=(n, n))
    return connected_components(graph, directed=False)[1][labels]


def find_duplicates(bullets: Bullets, threshold: float | None, stand: Standing | None = None) -> np.ndarray:
    """Index of each bullet's cluster representative (-1 for a representative or a singleton).

    Clusters are connected components, within a group, of "same normalised text" (when the bullets have
    `texts`) or "cosine >= threshold" (when they have `embeddings` and a threshold is given); the
    representative is the member of highest priority (`stand.priority`: pinned, then not expired), then
    highest (effective) score, ties broken by `order`/position. The cosines are computed a row chunk at
    a time (`SIM_CELLS`) and their links merged into component labels as they come (`PENDING_LINKS`), so a
    group of near-identical bullets never holds all its pairs.
    """
    scores = bullets.scores if stand is None else stand.effective
    priority = None if stand is None else stand.priority
    codes, texts, embeddings, order = bullets.groups, bullets.texts, bullets.embeddings, bullets.order
    n = len(scores)
    dup_of = np.full(n, -1, dtype=np.int64)
    if n < 2 or (texts is None and (embeddings is None or threshold is None)):
        return dup_of
    labels = np.arange(n)
    a: list[np.ndarray] = []
    b: list[np.ndarray] = []
    pending = 0
    if texts is not None:  # exact duplicates: same (group, normalised text) -> link to the first seen
        first: dict[tuple[int, str], int] = {}
        # a text with nothing left after normalisation (e.g. "?!") is only equal to itself
        f = np.fromiter((first.setdefault((int(c), normalize_text(t) or t), i) for i, (c, t) in enumerate(zip(codes, texts))),
                        dtype=np.int64, count=n)
        linked = np.flatnonzero(f != np.arange(n))
        a.append(linked)
        b.append(f[linked])
        pending += len(linked)
    if embeddings is not None and threshold is not None:
        emb = np.asarray(embeddings, dtype=np.float32)
        if emb.shape[0] != n:
            raise ValueError(f"embeddings ({emb.shape[0]}) and scores ({n}) differ in length")
        norms = np.linalg.norm(emb, axis=1, keepdims=True)
        emb = emb / np.maximum(norms, 1e-12)
        by_group = np.argsort(codes, kind="stable")
        bounds = np.flatnonzero(np.diff(codes[by_group])) + 1
        for idx in np.split(by_group, bounds):
            if len(idx) < 2:
                continue
            step = max(1, min(1024, SIM_CELLS // len(idx)))
            for lo in range(0, len(idx), step):
                i, j = np.nonzero(emb[idx[lo:lo + step]] @ emb[idx].T >= threshold)
                la, lb = labels[idx[lo + i]], labels[idx[j]]
                new = la != lb  # only pairs not yet in one component
                a.append(la[new])
                b.append(lb[new])
                pending += int(new.sum())
                if pending > PENDING_LINKS:
                    labels, a, b, pending = _merge(labels, a, b), [], [], 0
    if pending:
        labels = _merge(labels, a, b)
    if (labels == np.arange(n)).all():
        return dup_of
    comp = labels
    prio = np.zeros(n, dtype=np.int64) if priority is None else np.asarray(priority, dtype=np.int64)
    rank = np.lexsort((_order(n, order), -np.asarray(scores, dtype=np.float64), -prio, comp))
    sorted_comp = comp[rank]
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_comp)) + 1]
    rep_of_comp = np.empty(comp.max() + 1, dtype=np.int64)
    rep_of_comp[sorted_comp[starts]] = rank[starts]
    rep = rep_of_comp[comp]
    dup_of[rep != np.arange(n)] = rep[rep != np.arange(n)]
    return dup_of
