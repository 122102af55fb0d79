"""The built-in update judge `slot`: same slot, different value, from text and the scorer's embeddings (no LLM).

For a pair (A earlier, B later) the words they share are the slot's frame ("Nora loves ..."; or the value, when
a fact is restated in other words), the rest their values. Features (`features`): seven text features (the
cosine of the whole texts, of the two residual spans (what differs), the word overlap (Jaccard), the best
cosine between a residual word of A and one of B, the residual lengths, the shared words after the first (the
subject)) and five vectors of embeddings: |ea - eb| and ea * eb of the whole texts (the scorer's own
embeddings: what kind of fact), of the residual spans (what kind of value), and the shared span's own (a frame
or a value). A small network (one hidden layer) over them says "B updates A" at probability >= its threshold. Its
weights are `slot.safetensors` next to this module (safetensors: no pickle), written by
`bench/lifecycle_bench.py --fit` on `memprune synth --updates 0.3` (seed 0) with the all-MiniLM-L6-v2 encoder;
the same bench reports its precision and recall on other seeds. A scorer whose encoder embeds in another
width is one clear error (refit with `--fit --scorer S`).
"""

from __future__ import annotations

import functools
import re
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np

from memprune.decision.updates.registry import Pairs, UpdateJudgeEntry, register

WEIGHTS = Path(__file__).with_name("slot.safetensors")
N_TEXT = 7  # the text features, before the five embedding vectors
N_VEC = 5
_WORD = re.compile(r"\w+")


def _words(text: str) -> list[str]:
    """The words of `duplicates.normalize_text` (NFKC, case-folded, punctuation dropped)."""
    return _WORD.findall(unicodedata.normalize("NFKC", text).casefold())


def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def features(pairs: Pairs) -> np.ndarray:
    """Per pair: [cosine, residual cosine, Jaccard, best residual-word cosine, |residual A|, |residual B|, |shared|,
    |ea - eb|, ea * eb, |ra - rb|, ra * rb, s] (e: the texts' embeddings, r: the residual spans', s: the shared
    span's, the first word left out)."""
    if pairs.encode is None:
        raise ValueError("update judge 'slot' needs the scorer's encoder (a scorer with embed())")
    res = []
    for a, b in zip(pairs.a, pairs.b):
        wa, wb = _words(a), _words(b)
        sa, sb = set(wa), set(wb)
        res.append((" ".join(w for w in wa if w not in sb), " ".join(w for w in wb if w not in sa),
                    " ".join(w for w in wa[1:] if w in sb), len(sa & sb) / max(len(sa | sb), 1)))
    spans = {s or "-" for r in res for s in r[:3]}
    words = {w for ra, rb, _, _ in res for w in f"{ra} {rb}".split()}
    new = sorted(spans | words | (set() if pairs.ea is not None else {*pairs.a, *pairs.b}))
    emb = dict(zip(new, _unit(pairs.encode(new)))) if new else {}
    ea, eb = ((pairs.ea, pairs.eb) if pairs.ea is not None else
              (np.array([emb[t] for t in pairs.a]), np.array([emb[t] for t in pairs.b])))
    ea, eb = _unit(ea), _unit(eb)
    out = np.zeros((len(pairs), N_TEXT + N_VEC * (ea.shape[1] if len(pairs) else 0)), dtype=np.float32)
    for i, (ra, rb, shared, jac) in enumerate(res):
        xa, xb, xs = emb[ra or "-"], emb[rb or "-"], emb[shared or "-"]
        wa, wb = ra.split(), rb.split()
        best = float(np.max(np.array([emb[w] for w in wa]) @ np.array([emb[w] for w in wb]).T)) if wa and wb else 0.0
        out[i, :N_TEXT] = (pairs.cosine[i], xa @ xb, jac, best, len(wa), len(wb), len(shared.split()))
        out[i, N_TEXT:] = np.concatenate([np.abs(ea[i] - eb[i]), ea[i] * eb[i], np.abs(xa - xb), xa * xb, xs])
    return out


@functools.lru_cache(maxsize=4)
def _weights(path: str, mtime: float) -> dict[str, np.ndarray]:  # keyed by mtime: a refit file is read again
    from safetensors.numpy import load_file

    return load_file(path)


def weights(path: Path = WEIGHTS) -> dict[str, np.ndarray]:
    """The fitted network: `mean`, `scale` (standardisation), `w1`, `b1` (hidden layer), `w2`, `b2`, `threshold`."""
    if not path.exists():
        raise ValueError(f"update judge 'slot': no fitted weights at {path} (bench/lifecycle_bench.py --fit)")
    return _weights(str(path), path.stat().st_mtime)


def probability(x: np.ndarray, w: dict[str, np.ndarray]) -> np.ndarray:
    """P(B updates A) of each pair's features `x`."""
    if x.shape[1] != len(w["mean"]):
        raise ValueError(f"update judge 'slot' was fitted on {(len(w['mean']) - N_TEXT) // N_VEC}-dimensional "
                         f"embeddings; this scorer's encoder gives {(x.shape[1] - N_TEXT) // N_VEC} (refit it: "
                         "bench/lifecycle_bench.py --fit --scorer S)")
    h = np.maximum(((x - w["mean"]) / w["scale"]) @ w["w1"].T + w["b1"], 0.0)
    return 1.0 / (1.0 + np.exp(-(h @ w["w2"] + w["b2"][0])))


def update_probability(x: np.ndarray, w: dict[str, np.ndarray]) -> np.ndarray:
    """`probability`, and 0 for a pair that differs in no word or where one side only adds words (never an update)."""
    return np.where((x[:, 4] > 0) & (x[:, 5] > 0), probability(x, w), 0.0)


def judge(pairs: Pairs, settings: Any = None) -> np.ndarray:
    """B updates A where `update_probability` is >= the threshold stored with the weights."""
    if not len(pairs):
        return np.zeros(0, dtype=bool)
    x, w = features(pairs), weights()
    return update_probability(x, w) >= w["threshold"][0]


ENTRY = register(UpdateJudgeEntry(
    "slot", "built-in: same slot (frame and kind of value), different value; a small network over text features and "
    "the pair's embeddings, fitted on synthetic updates", judge, needs_encoder=True))
