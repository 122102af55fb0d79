"""The built-in update judge `slot`: same slot, different value, from text and the scorer's encoder (no LLM).

For a pair (A earlier, B later) the words they share are the slot's frame ("Nora loves ..."), the rest their
values. Features: the cosine of the whole texts, of the two residual spans (what differs), the word overlap
(Jaccard), the best cosine between a residual word of A and one of B (values of the same kind: two cuisines,
two jobs), and the residual lengths. A logistic model over them says "B updates A" at probability >= 0.5;
its coefficients were fitted by `bench/lifecycle_bench.py --fit` on `memprune synth --updates 0.3` (seed 0)
with the all-MiniLM-L6-v2 encoder, and its precision and recall are reported by the same bench on another seed.
"""

from __future__ import annotations

import re
import unicodedata

import numpy as np

from memprune.prune.updates.registry import Pairs, UpdateJudgeEntry, register

# fitted by `bench/lifecycle_bench.py --fit` (see the module docstring); order of `features`
COEF = np.array([3.3214, 8.3876, 1.2427, 0.6069, -0.3502, -0.2633])
INTERCEPT = -5.2171
_WORD = re.compile(r"\w+")


def _words(text: str) -> list[str]:
    """The words of `policy.normalize_text` (NFKC, case-folded, punctuation dropped)."""
    return _WORD.findall(unicodedata.normalize("NFKC", text).casefold())


def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def features(pairs: Pairs) -> np.ndarray:
    """Per pair: [cosine, residual cosine, Jaccard, best residual-word cosine, |residual A|, |residual B|]."""
    if pairs.encode is None:
        raise ValueError("update judge 'slot' needs the scorer's encoder (a scorer with embed())")
    n = len(pairs)
    out = np.zeros((n, 6), dtype=np.float64)
    if not n:
        return out
    res = []
    for a, b in zip(pairs.a, pairs.b):
        wa, wb = _words(a), _words(b)
        sa, sb = set(wa), set(wb)
        jaccard = len(sa & sb) / max(len(sa | sb), 1)
        res.append(([w for w in wa if w not in sb], [w for w in wb if w not in sa], jaccard))
    spans = sorted({" ".join(r) or "-" for ra, rb, _ in res for r in (ra, rb)})
    words = sorted({w for ra, rb, _ in res for w in (*ra, *rb)})
    emb = dict(zip(spans + words, _unit(pairs.encode(spans + words))))
    for i, (ra, rb, jac) in enumerate(res):
        span = float(emb[" ".join(ra) or "-"] @ emb[" ".join(rb) or "-"])
        best = float(np.max(np.array([emb[w] for w in ra]) @ np.array([emb[w] for w in rb]).T)) if ra and rb else 0.0
        out[i] = (pairs.cosine[i], span, jac, best, len(ra), len(rb))
    return out


def judge(pairs: Pairs) -> np.ndarray:
    """B updates A where the probability is >= 0.5; a pair that differs in no word (or one side only adds
    words) is never an update."""
    if not len(pairs):
        return np.zeros(0, dtype=bool)
    f = features(pairs)
    p = 1.0 / (1.0 + np.exp(-(f @ COEF + INTERCEPT)))  # module globals: the bench's --fit replaces them
    return (p >= 0.5) & (f[:, 4] > 0) & (f[:, 5] > 0)


ENTRY = register(UpdateJudgeEntry(
    "slot", "built-in: same slot (frame and kind of value), different value; a logistic model over text and "
    "encoder features fitted on synthetic updates", judge, needs_encoder=True))
