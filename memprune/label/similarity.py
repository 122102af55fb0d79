"""The similarity judge: a non-LLM **proxy** of the paper's judge for CPU-only machines.

Score = cosine similarity between the bullet and the target utterance under a sentence encoder
(all-MiniLM-L6-v2 by default), mapped to [0, 1]. It ignores the dialogue context and measures
topical overlap, not contribution; labels from it are a cheap stand-in for the LLM judge, not a
reproduction of it. Every distinct text is encoded once, in resumable shards (in-process or on a
Ray Data actor pool), then the pairs are scored as dot products.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from memprune.encoders import EncoderActor, SentenceEncoder, model_label
from memprune.io import atomic_path
from memprune.label.config import LabelSettings
from memprune.label.judges import JudgeEntry, register
from memprune.label.judging import Judged, work_payload
from memprune.label.pairs import PairPlan, shard_bounds
from memprune.raysession import ensure_ray
from memprune.runtime import plan_actors
from memprune.timing import busy_seconds, now
from memprune.work import WorkDir

Mapping = Literal["clip", "affine"]
MAPPINGS: tuple[str, ...] = ("clip", "affine")


def cosine_to_score(cos: np.ndarray, mapping: str = "clip") -> np.ndarray:
    """Map cosine similarities to [0, 1]: `clip` = max(cos, 0); `affine` = (cos + 1) / 2.

    `clip` is the default: under MiniLM unrelated sentences sit near 0 and paraphrases
    near 0.7-0.9, so the 0.5 pruning threshold keeps its meaning; `affine` preserves the
    order of negative similarities but pushes every label above ~0.4.
    """
    cos = np.asarray(cos, dtype=np.float64)
    if mapping == "clip":
        return np.clip(cos, 0.0, 1.0)
    if mapping == "affine":
        return np.clip((cos + 1.0) / 2.0, 0.0, 1.0)
    raise ValueError(f"mapping must be one of {', '.join(MAPPINGS)}, got {mapping!r}")


class SimilarityJudge(SentenceEncoder):
    """Cosine similarity under a mean-pooled sentence encoder, batched by length."""

    kind = "similarity"

    def __init__(self, model: str | None = None, batch_size: int = 128, max_length: int = 128, mapping: str = "clip",
                 device: str = "cpu") -> None:
        if mapping not in MAPPINGS:
            raise ValueError(f"mapping must be one of {', '.join(MAPPINGS)}, got {mapping!r}")
        super().__init__(model, batch_size=batch_size, max_length=max_length, device=device)
        self.mapping = mapping

    @property
    def name(self) -> str:
        """The value written to the `judge` column: `similarity:<encoder>:<mapping>`."""
        return f"similarity:{model_label(self.model_name)}:{self.mapping}"

    def score_indices(self, embeddings: np.ndarray, bullet_idx: np.ndarray, target_idx: np.ndarray,
                      block: int = 65536) -> np.ndarray:
        """Scores in [0, 1] for pairs given as row indices into `embeddings` (each text encoded once).

        The pair scores are the entries of the bullets x targets similarity matrix E_b E_t^T
        that the pairs select, computed blockwise as batched dot products.
        """
        n = len(bullet_idx)
        cos = np.empty(n, dtype=np.float32)
        for start in range(0, n, block):
            b = embeddings[bullet_idx[start:start + block]]
            t = embeddings[target_idx[start:start + block]]
            cos[start:start + block] = np.einsum("ij,ij->i", b, t)
        return cosine_to_score(cos, self.mapping)

    def score(self, bullets: Sequence[str], targets: Sequence[str]) -> np.ndarray:
        """Scores in [0, 1] for the pairs (bullets[k], targets[k]); every distinct text is encoded once."""
        if len(bullets) != len(targets):
            raise ValueError(f"{len(bullets)} bullets but {len(targets)} targets")
        vocab = sorted(set(bullets) | set(targets))
        index = {t: i for i, t in enumerate(vocab)}
        emb = self.encode(vocab)
        b_idx = np.fromiter((index[t] for t in bullets), dtype=np.int64, count=len(bullets))
        t_idx = np.fromiter((index[t] for t in targets), dtype=np.int64, count=len(targets))
        return self.score_indices(emb, b_idx, t_idx)


class SimilarityEncoder(EncoderActor):
    """Ray Data actor: encodes one shard of texts per row (`texts` list) into float32 bytes."""

    REQUIRED_COLUMNS = ("shard", "texts")

    def setup(self, settings: dict[str, Any], device: str) -> None:
        self.encoder = SentenceEncoder(settings["model"], batch_size=settings["batch_size"],
                                       max_length=settings["max_length"], device=device)
        self.encoder.load()

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        shards, blobs, dims, spans = [], [], [], []
        for shard, texts in zip(batch["shard"], batch["texts"]):
            started = now()
            emb = self.encoder.encode([str(t) for t in texts])
            spans.append([started, now()])
            shards.append(int(shard))
            blobs.append(emb.tobytes())
            dims.append(emb.shape[1])
        return {"shard": np.array(shards, dtype=np.int64), "emb": np.array(blobs, dtype=object),
                "dim": np.array(dims, dtype=np.int64), "span": np.array(spans, dtype=np.float64)}


def _vocab(plan: PairPlan) -> list[str]:
    """The distinct texts of the plan (bullets and targets), sorted by (length, text) for low padding."""
    texts = set(plan.pairs.column("bullet").to_pylist()) | set(plan.pairs.column("target").to_pylist())
    return sorted(texts, key=lambda s: (len(s), s))


def _load_embedding(path: Path, rows: int) -> np.ndarray | None:
    """A finished embedding shard, or None if it is absent or does not have `rows` rows."""
    if not path.exists():
        return None
    try:
        arr = np.load(path, allow_pickle=False)
    except (OSError, ValueError):
        return None
    return arr if arr.ndim == 2 and arr.shape[0] == rows and arr.dtype == np.float32 else None


def _save_embedding(work: WorkDir, shard: int, emb: np.ndarray) -> None:
    path = work.piece("emb", shard, "npy")
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as fh:
            np.save(fh, np.ascontiguousarray(emb, dtype=np.float32), allow_pickle=False)
    work.keep(path)


def _encode_with_ray(cfg: LabelSettings, vocab: list[str], bounds: list[tuple[int, int]], pending: list[int],
                     work: WorkDir, judge: SimilarityJudge, bar: Any) -> list[tuple[float, float]]:
    """Encode the pending shards on a Ray Data actor pool; the driver writes each shard as it arrives.
    Returns the actors' encoding intervals."""
    import ray

    ensure_ray()
    res = plan_actors(ray.cluster_resources(), gpu=judge.device == "cuda", actors=cfg.similarity.actors)
    items = [{"shard": i, "texts": vocab[bounds[i][0]:bounds[i][1]]} for i in pending]
    settings = {"model": judge.model_name, "batch_size": judge.batch_size, "max_length": judge.max_length}
    ds = ray.data.from_items(items, override_num_blocks=len(items))
    ds = ds.map_batches(**SimilarityEncoder.map_kwargs(settings, res, batch_size=1, blocks=len(items)))
    spans: list[tuple[float, float]] = []
    for batch in ds.iter_batches(batch_size=1, batch_format="numpy"):
        for shard, blob, dim, span in zip(batch["shard"], batch["emb"], batch["dim"], batch["span"]):
            emb = np.frombuffer(blob, dtype=np.float32).reshape(-1, int(dim))
            _save_embedding(work, int(shard), emb)
            spans.append((float(span[0]), float(span[1])))
            bar.update(1)
    return spans


def judge_similarity(cfg: LabelSettings, plan: PairPlan, work: WorkDir, judge: SimilarityJudge,
                     stats: dict[str, Any]) -> tuple[np.ndarray, list[str | None]]:
    """Encode every distinct text once (sharded, resumable), then score all pairs; (scores, errors)."""
    from tqdm import tqdm

    vocab = _vocab(plan)
    bounds = shard_bounds(len(vocab), cfg.effective_shard_size())
    pending = [i for i, (a, b) in enumerate(bounds) if _load_embedding(work.piece("emb", i, "npy"), b - a) is None]
    stats.update(shards_total=len(bounds), shards_reused=len(bounds) - len(pending), texts=len(vocab))
    t0 = time.perf_counter()
    spans: list[tuple[float, float]] = []
    if pending:
        bar = tqdm(total=len(pending), desc="label: encode shards", unit="shard", disable=not cfg.progress)
        if cfg.similarity.executor == "ray":
            spans = _encode_with_ray(cfg, vocab, bounds, pending, work, judge, bar)
        else:
            for i in pending:
                a, b = bounds[i]
                started = now()
                emb = judge.encode(vocab[a:b])
                spans.append((started, now()))
                _save_embedding(work, i, emb)
                bar.update(1)
        bar.close()
    parts = [_load_embedding(work.piece("emb", i, "npy"), b - a) for i, (a, b) in enumerate(bounds)]
    missing = [i for i, p in enumerate(parts) if p is None]
    if missing:
        raise RuntimeError(f"{work.path}: embedding shards {missing} are missing after encoding")
    dim = parts[0].shape[1] if parts else 1
    emb = np.concatenate(parts, axis=0) if parts else np.zeros((0, dim), dtype=np.float32)
    index = {t: i for i, t in enumerate(vocab)}
    n = plan.pairs.num_rows
    b_idx = np.fromiter((index[t] for t in plan.pairs.column("bullet").to_pylist()), dtype=np.int64, count=n)
    t_idx = np.fromiter((index[t] for t in plan.pairs.column("target").to_pylist()), dtype=np.int64, count=n)
    started = now()
    scores = judge.score_indices(emb, b_idx, t_idx)
    spans.append((started, now()))
    stats["judge_s"] = time.perf_counter() - t0
    stats["compute_s"] = busy_seconds(spans)  # the encoder passes and the pair scoring
    stats["pairs_judged"] = n if pending else 0
    return scores, [None] * n


def judge_all(cfg: LabelSettings, plan: PairPlan, inputs: dict[str, str]) -> Judged:
    """The similarity proxy over the whole plan: one judging instance, its scores and bookkeeping."""
    sim = cfg.similarity
    judge = SimilarityJudge(sim.model, batch_size=sim.batch_size, max_length=sim.max_length,
                            mapping=sim.mapping, device=sim.device)
    # The shards hold embeddings: the cosine -> score mapping is applied afterwards, on every run.
    work = WorkDir(cfg.out, work_payload(cfg, inputs, {"model": judge.model_name, "max_length": sim.max_length}))
    stats: dict[str, Any] = {}
    scores, errors = judge_similarity(cfg, plan, work, judge, stats)
    n = plan.pairs.num_rows
    return Judged(names=[judge.name], scores=scores.reshape(1, n), errors=[errors], modes=[[SIMILARITY.kind] * n],
                  judge_values=[[judge.name] * n], extras=[{}], stats=stats, work_dirs=[str(work)])


SIMILARITY = register(JudgeEntry(
    rank=0, kind="similarity", judge="similarity", needs_llm=False, context=False, proxy=True,
    description="cosine of the bullet and the target turn under a sentence encoder (a CPU proxy)",
    compute="encoder passes", judge_all=judge_all, executor=lambda cfg: cfg.similarity.executor))
