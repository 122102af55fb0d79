"""The usefulness scorer f_theta: bullet text -> y_hat in [0, 1].

A pretrained sentence encoder (any Hugging Face encoder, by local path or hub id),
masked mean pooling over the last hidden state, and a small regression head that
ends in a sigmoid. Stage 2 adds LoRA adapters (peft) to the encoder.

An artifact directory holds:

- `scorer.json`        the `ScorerConfig` (names the encoder, pooling, head shape, LoRA settings)
- `head.safetensors`   the head weights
- `adapter/`           stage 2 only: the peft LoRA adapter (`adapter_model.safetensors`,
                       `adapter_config.json`)
- `calibration.json`   optional (written by `memprune train`): the map from raw score to
                       P(relevant), see `memprune.calibration`

`score(texts)` returns raw scores as before; `score(texts, calibrated=True)` returns calibrated
probabilities and is an error for an artifact without a calibration.

Everything is safetensors or JSON: loading never unpickles. `Scorer.load(path)` then
`.score(texts)` works in-process, without Ray.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch
from pydantic import Field
from safetensors.torch import load_file, save_file
from torch import nn

from memprune.calibration import Calibration, CalibrationError, read_calibration, write_calibration
from memprune.config import ConfigModel
from memprune.encoders import (  # noqa: F401  (DEFAULT_ENCODER and the resolvers are part of this API)
    DEFAULT_ENCODER,
    EncoderError,
    canonical_encoder,
    check_encoder,
    load_encoder,
    mean_pool,
    resolve_encoder,
)
from memprune.errors import MemPruneError
from memprune.io import atomic_path, jsonable, write_json
from memprune.precision import DEFAULT_PRECISION, Precision, Resolved, autocast, resolve_precision

SCORER_FORMAT = 1


class ScorerError(MemPruneError):
    """A scorer artifact or encoder cannot be used; the message names the path and the problem."""


class LoraSettings(ConfigModel):
    """LoRA adapter shape for stage 2 (peft `LoraConfig`)."""

    r: int = Field(8, ge=1)
    alpha: int = Field(16, ge=1)
    dropout: float = Field(0.1, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(default_factory=lambda: ["query", "value"])


class HeadSettings(ConfigModel):
    """Regression head shape: Linear(d, hidden) -> GELU -> Dropout -> Linear(hidden, 1) -> sigmoid.

    `hidden: 0` makes the head a single linear layer (logistic regression on the embedding).
    """

    hidden: int = Field(256, ge=0)
    dropout: float = Field(0.1, ge=0.0, lt=1.0)


class ScorerConfig(ConfigModel):
    """Everything needed to rebuild a scorer, saved as `scorer.json` beside the weights."""

    format: int = SCORER_FORMAT
    encoder: str = DEFAULT_ENCODER
    max_length: int = Field(128, ge=8)
    normalize: bool = False
    text_prefix: str = ""
    embedding_dim: int | None = None
    head: HeadSettings = Field(default_factory=HeadSettings)
    lora: LoraSettings | None = None
    stage: str | None = None
    seed: int | None = None
    threshold: float | None = Field(0.5, ge=0.0, le=1.0,
                                    description="the threshold of the rule policy when a decision sets none: 0.5 (the "
                                                "paper's) for a trained scorer; null for a scorer that ranks, whose "
                                                "scores are not probabilities on every kind of memory (the shipped ones)")


def _load_encoder(name: str) -> tuple[nn.Module, Any]:
    """`memprune.encoders.load_encoder` with its error as a `ScorerError`."""
    try:
        return load_encoder(name)
    except EncoderError as exc:
        raise ScorerError(str(exc)) from exc


class Head(nn.Module):
    """The regression head: embedding -> logit (the sigmoid is applied by the caller)."""

    def __init__(self, dim: int, settings: HeadSettings) -> None:
        super().__init__()
        if settings.hidden:
            self.net = nn.Sequential(
                nn.Linear(dim, settings.hidden), nn.GELU(), nn.Dropout(settings.dropout), nn.Linear(settings.hidden, 1)
            )
        else:
            self.net = nn.Sequential(nn.Dropout(settings.dropout), nn.Linear(dim, 1))

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        return self.net(embeddings).squeeze(-1)


def build_head(dim: int, settings: HeadSettings, seed: int) -> Head:
    """A freshly initialised head whose weights depend only on `seed` (the global RNG is untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Head(dim, settings)


def artifact_path(path: str | os.PathLike[str]) -> Path:
    """An artifact directory on this node: the path itself, or (a URI) this node's cached copy of it."""
    from memprune.storage import StorageError, fetch_dir

    try:
        return fetch_dir(path, "scorer artifact")
    except StorageError as exc:
        raise ScorerError(str(exc)) from None


def read_scorer_config(path: str | os.PathLike[str]) -> ScorerConfig:
    """The `ScorerConfig` of an artifact directory (its scorer.json), checked; no weights are loaded."""
    path = artifact_path(path)
    cfg_path = path / "scorer.json"
    if not cfg_path.is_file():
        raise ScorerError(f"{path}: not a scorer artifact (no scorer.json)")
    try:
        config = ScorerConfig.model_validate(json.loads(cfg_path.read_text(encoding="utf-8")))
    except ValueError as exc:
        raise ScorerError(f"{cfg_path}: invalid scorer config: {exc}") from exc
    if config.format != SCORER_FORMAT:
        raise ScorerError(f"{cfg_path}: scorer format {config.format}, this version reads {SCORER_FORMAT}")
    return config


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; a missing or corrupted file is a `ScorerError` naming it."""
    from safetensors import SafetensorError

    if not path.is_file():
        raise ScorerError(f"{path.parent}: missing {path.name}" if path.name == "head.safetensors" else
                          f"{path.parent.parent}: scorer.json names LoRA settings but {path} is missing")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise ScorerError(f"{path}: not a readable safetensors file ({str(exc).splitlines()[0]})") from exc


def check_artifact(path: str | os.PathLike[str]) -> ScorerConfig:
    """Check a scorer artifact without building the model: its config, weights files, head shape and encoder.

    The driver of a Ray job calls this before any worker starts, so a broken artifact is one error line.
    """
    path = artifact_path(path)
    config = read_scorer_config(path)
    head = read_weights(path / "head.safetensors")
    if config.lora is not None:
        read_weights(path / "adapter" / "adapter_model.safetensors")
    if config.embedding_dim is not None:
        want = {k: tuple(v.shape) for k, v in Head(config.embedding_dim, config.head).state_dict().items()}
        got = {k: tuple(v.shape) for k, v in head.items()}
        if want != got:
            raise ScorerError(f"{path / 'head.safetensors'}: head weights do not match scorer.json "
                              f"(tensors {sorted(got)} vs {sorted(want)})")
    load_calibration(path)
    check_encoder(config.encoder)
    return config


def load_calibration(path: str | os.PathLike[str]) -> Calibration | None:
    """The artifact's calibration (None without calibration.json); a broken one is a `ScorerError` naming it."""
    try:
        return read_calibration(artifact_path(path))
    except CalibrationError as exc:
        raise ScorerError(str(exc)) from exc


def artifact_fingerprint(local: str | os.PathLike[str]) -> str:
    """16 hex digits of a local artifact's files (names and contents, the adapter's included): what prune.json,
    the review page and /healthz name a scorer by."""
    from memprune.work import digest, file_digest

    root = Path(local)
    return digest({str(p.relative_to(root)): file_digest(p) for p in sorted(root.rglob("*")) if p.is_file()})[:16]


def check_scorer(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Validate a scorer artifact where it is used, before Ray or a service starts: config, head weights, encoder,
    adapter, calibration; a broken one is one `ScorerError` line (not a failure in every actor or replica).
    Returns what prune.json and /healthz record of it."""
    from memprune.scorers import card_identity
    from memprune.storage import canonical

    try:
        local = artifact_path(path)  # a URI: fetched once, then checked here
        sc = check_artifact(local)
        cal = load_calibration(local)
    except EncoderError as exc:
        raise ScorerError(str(exc)) from exc
    return {"path": canonical(str(path)), **card_identity(local), "fingerprint": artifact_fingerprint(local),
            "encoder": sc.encoder, "stage": sc.stage, "seed": sc.seed, "lora": sc.lora is not None, "max_length": sc.max_length,
            "calibration": None if cal is None else {"method": cal.method,
                                                     "relevance_threshold": cal.relevance_threshold}}


class Scorer(nn.Module):
    """Encoder + mean pooling + head; `score(texts)` returns usefulness in [0, 1] as numpy."""

    def __init__(self, config: ScorerConfig, encoder: nn.Module, tokenizer: Any, head: Head) -> None:
        super().__init__()
        self.config = config
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.head = head
        self._precision: Resolved = "fp32"  # of the encoder's passes, set by `build`/`load`: see memprune.precision
        self.calibration: Calibration | None = None  # raw score -> P(relevant), from calibration.json
        self.source: Path | None = None  # the artifact directory it was loaded from
        self.tokenize_s = 0.0  # seconds spent in `tokenize` (the prune job reports it apart from the forward passes)

    # ------------------------------------------------------------- construction

    @property
    def precision(self) -> Resolved:
        """The precision its encoder passes run at (resolved from the device at `build`/`load`; read-only)."""
        return self._precision

    def _place(self, device: str | torch.device | None, precision: Precision) -> None:
        """Move to `device` (if given) and fix the precision of the passes there, once."""
        if device is not None:
            self.to(device)
        self._precision = resolve_precision(precision, self.device)  # a bad value fails here, not at the first batch

    @classmethod
    def build(cls, config: ScorerConfig, seed: int = 0, *, device: str | torch.device | None = None,
              precision: Precision = DEFAULT_PRECISION) -> "Scorer":
        """Load the pretrained encoder and add a head initialised from `seed` (the vanilla scorer), on `device`;
        `precision` is that of its forward passes (weights stay fp32)."""
        config = config.model_copy(update={"encoder": canonical_encoder(config.encoder)})
        encoder, tokenizer = _load_encoder(config.encoder)
        dim = int(encoder.config.hidden_size)
        config = config.model_copy(update={"embedding_dim": dim, "seed": seed if config.seed is None else config.seed})
        scorer = cls(config, encoder, tokenizer, build_head(dim, config.head, seed))
        if config.lora is not None:
            scorer.add_lora(config.lora, seed=seed)
        scorer.eval()
        scorer._place(device, precision)
        return scorer

    def add_lora(self, settings: LoraSettings, seed: int = 0) -> None:
        """Wrap the encoder with fresh LoRA adapters (seeded); only adapters and head stay trainable."""
        from peft import LoraConfig, get_peft_model

        if self.has_lora:
            raise ScorerError("the encoder already has LoRA adapters")
        lora = LoraConfig(
            r=settings.r,
            lora_alpha=settings.alpha,
            lora_dropout=settings.dropout,
            target_modules=list(settings.target_modules),
            bias="none",
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.encoder = get_peft_model(self.encoder, lora)
        self.config = self.config.model_copy(update={"lora": settings})

    @property
    def has_lora(self) -> bool:
        from peft import PeftModel

        return isinstance(self.encoder, PeftModel)

    def freeze_encoder(self) -> None:
        """Freeze every encoder weight except LoRA adapters (if any)."""
        for name, param in self.encoder.named_parameters():
            param.requires_grad = self.has_lora and "lora_" in name

    # ------------------------------------------------------------- forward

    def tokenize(self, texts: Sequence[str], device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """Tokenize a batch (prefix, truncation to `max_length`, padding to the longest)."""
        started = time.perf_counter()
        prefixed = [self.config.text_prefix + t for t in texts]
        enc = self.tokenizer(
            prefixed, padding=True, truncation=True, max_length=self.config.max_length, return_tensors="pt"
        )
        keep = {k: v for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
        self.tokenize_s += time.perf_counter() - started
        return {k: v.to(device) for k, v in keep.items()} if device is not None else keep

    def embed_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **extra: torch.Tensor) -> torch.Tensor:
        """Mean-pooled (optionally L2-normalised) fp32 sentence embeddings of a tokenized batch; the encoder
        runs at `self.precision`, the pooling (and the head after it) in fp32."""
        with autocast(self.precision, input_ids.device):
            out = self.encoder(input_ids=input_ids, attention_mask=attention_mask, **extra)
        pooled = mean_pool(out.last_hidden_state.float(), attention_mask)
        if self.config.normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=-1)
        return pooled

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **extra: torch.Tensor) -> torch.Tensor:
        """Pre-sigmoid scores of a tokenized batch (used by the training losses)."""
        return self.head(self.embed_tokens(input_ids, attention_mask, **extra))

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, return_logits: bool = False, **extra: torch.Tensor
    ) -> torch.Tensor:
        """Scores in [0, 1] of a tokenized batch (logits with `return_logits`, e.g. through DDP)."""
        logits = self.logits(input_ids, attention_mask, **extra)
        return logits if return_logits else torch.sigmoid(logits)

    @property
    def device(self) -> torch.device:
        return next(self.head.parameters()).device

    @torch.no_grad()
    def embed(self, texts: Sequence[str], batch_size: int = 64) -> np.ndarray:
        """Sentence embeddings (float32, shape [n, d]) of `texts`, in order."""
        was_training = self.training
        self.eval()
        try:
            chunks = [
                self.embed_tokens(**self.tokenize(texts[i : i + batch_size], self.device)).cpu().numpy()
                for i in range(0, len(texts), batch_size)
            ]
        finally:
            self.train(was_training)
        dim = self.config.embedding_dim or 0
        return np.concatenate(chunks) if chunks else np.zeros((0, dim), dtype=np.float32)

    def calibrate(self, raw: np.ndarray | Sequence[float]) -> np.ndarray:
        """Calibrated probabilities P(relevant) of this scorer's raw scores; `ScorerError` without a calibration."""
        if self.calibration is None:
            where = str(self.source) if self.source is not None else "this scorer"
            raise ScorerError(f"{where}: calibrated scores asked for, but the artifact has no calibration.json")
        return self.calibration.apply(raw)

    @torch.no_grad()
    def score(self, texts: Sequence[str] | Iterable[str], batch_size: int = 64, calibrated: bool = False) -> np.ndarray:
        """Usefulness scores in [0, 1] (float64, shape [n]) of `texts`, in order; eval mode, no Ray.

        Raw head outputs by default; `calibrated=True` maps them through the artifact's calibration."""
        texts = list(texts)
        bad = [i for i, t in enumerate(texts) if not isinstance(t, str)]
        if bad:
            raise TypeError(f"Scorer.score: texts[{bad[0]}] is {type(texts[bad[0]]).__name__}, expected str")
        was_training = self.training
        self.eval()
        try:
            out = [
                self(**self.tokenize(texts[i : i + batch_size], self.device)).double().cpu().numpy()
                for i in range(0, len(texts), batch_size)
            ]
        finally:
            self.train(was_training)
        raw = np.concatenate(out) if out else np.zeros(0, dtype=np.float64)
        return self.calibrate(raw) if calibrated else raw

    @torch.no_grad()
    def score_embeddings(self, embeddings: np.ndarray | torch.Tensor, calibrated: bool = False) -> np.ndarray:
        """Scores from precomputed embeddings of this scorer's encoder (the stage-1 shortcut); raw or calibrated."""
        was_training = self.head.training
        self.head.eval()
        try:
            emb = torch.as_tensor(np.asarray(embeddings, dtype=np.float32), device=self.device)
            raw = torch.sigmoid(self.head(emb)).double().cpu().numpy()
        finally:
            self.head.train(was_training)
        return self.calibrate(raw) if calibrated else raw

    # ------------------------------------------------------------- weights

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter weights (peft naming), empty without LoRA."""
        if not self.has_lora:
            return {}
        from peft import get_peft_model_state_dict

        return {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(self.encoder).items()}

    def load_adapter_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load LoRA weights saved by `adapter_state`; every adapter tensor must be present."""
        from peft import set_peft_model_state_dict

        if not self.has_lora:
            raise ScorerError("cannot load adapter weights: the scorer has no LoRA adapters")
        expected = set(self.adapter_state())
        missing = expected - set(state)
        if missing:
            raise ScorerError(f"adapter weights incomplete: {len(missing)} missing, e.g. {sorted(missing)[0]}")
        set_peft_model_state_dict(self.encoder, state)

    def head_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().contiguous() for k, v in self.head.state_dict().items()}

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write `scorer.json`, `head.safetensors`, (stage 2) `adapter/` and (if any) `calibration.json` into `path`."""
        return save_artifact(path, self.config, self.head_state(), self.adapter_state() or None, self.calibration)

    @classmethod
    def load(cls, path: str | os.PathLike[str], device: str | torch.device | None = None,
             precision: Precision = DEFAULT_PRECISION) -> "Scorer":
        """Load a saved scorer (any stage) from its artifact directory; safetensors and JSON only.
        `precision` is that of its forward passes (weights stay fp32); `path` may be a URI (fetched once per node)."""
        path = artifact_path(path)
        config = read_scorer_config(path)
        head_weights = read_weights(path / "head.safetensors")
        adapter_file = path / "adapter" / "adapter_model.safetensors"
        adapter_weights = read_weights(adapter_file) if config.lora is not None else None
        calibration = load_calibration(path)
        encoder, tokenizer = _load_encoder(config.encoder)
        dim = int(encoder.config.hidden_size)
        if config.embedding_dim is not None and config.embedding_dim != dim:
            raise ScorerError(f"{path / 'scorer.json'}: embedding_dim {config.embedding_dim} but encoder "
                              f"{config.encoder!r} has {dim}")
        head = Head(dim, config.head)
        try:
            head.load_state_dict(head_weights)
        except RuntimeError as exc:
            raise ScorerError(f"{path / 'head.safetensors'}: head weights do not match scorer.json: "
                              f"{str(exc).splitlines()[0]}") from exc
        scorer = cls(config.model_copy(update={"lora": None}), encoder, tokenizer, head)
        if config.lora is not None and adapter_weights is not None:
            scorer.add_lora(config.lora, seed=0)
            scorer.load_adapter_state(adapter_weights)
        scorer.eval()
        scorer.calibration, scorer.source = calibration, path
        scorer._place(device, precision)
        return scorer


def save_artifact(
    path: str | os.PathLike[str],
    config: ScorerConfig,
    head_state: dict[str, torch.Tensor],
    adapter_state: dict[str, torch.Tensor] | None = None,
    calibration: Calibration | None = None,
) -> Path:
    """Write a scorer artifact from weights alone (no encoder load): config, head, optional LoRA adapter,
    optional calibration (without one, a calibration.json left by earlier weights is removed).

    The adapter directory is a regular peft adapter (`PeftModel.from_pretrained` reads it).
    """
    from peft import LoraConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    head = {k: v.detach().cpu().contiguous() for k, v in head_state.items()}
    with atomic_path(path / "head.safetensors") as tmp:
        save_file(head, str(tmp), metadata={"format": "pt"})
    adapter = path / "adapter"
    if adapter_state:
        if config.lora is None:
            raise ScorerError(f"{path}: adapter weights given but the config has no LoRA settings")
        adapter.mkdir(exist_ok=True)
        tensors = {k: v.detach().cpu().contiguous() for k, v in adapter_state.items()}
        with atomic_path(adapter / "adapter_model.safetensors") as tmp:
            save_file(tensors, str(tmp), metadata={"format": "pt"})
        lora = LoraConfig(
            r=config.lora.r,
            lora_alpha=config.lora.alpha,
            lora_dropout=config.lora.dropout,
            target_modules=list(config.lora.target_modules),
            bias="none",
            base_model_name_or_path=config.encoder,
        )
        write_json(adapter / "adapter_config.json", jsonable(lora.to_dict()))
    elif config.lora is not None:
        raise ScorerError(f"{path}: the config names LoRA settings but no adapter weights were given")
    elif adapter.exists():
        raise ScorerError(f"{path}: holds an adapter/ from another run; use a fresh directory")
    write_calibration(path, calibration)
    write_json(path / "scorer.json", config.model_dump(mode="json"))
    return path


def head_input_dim(head_state: dict[str, torch.Tensor]) -> int:
    """The embedding size a saved head expects (input width of its first linear layer)."""
    first = min((k for k in head_state if k.endswith(".weight")), key=lambda k: int(k.split(".")[1]))
    return int(head_state[first].shape[-1])
