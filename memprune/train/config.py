"""Settings of `memprune train`, validated once: stages, seeds, encoder, optimisation, Ray Train layout.

`TrainSettings` holds every option and is what the pipeline's `train:` section is;
`TrainConfig` adds the paths (data, labels, out) that `memprune train` and `jobs/train.py` take.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from memprune import stages as registry
from memprune.config import ConfigModel, Place
from memprune.errors import MemPruneError
from memprune.precision import Precision, precision_field
from memprune.scorer import (
    DEFAULT_ENCODER,
    HeadSettings,
    LoraSettings,
    ScorerConfig,
    canonical_encoder,
    read_scorer_config,
)
from memprune.scorers import SHIPPED, resolve_scorer
from memprune.storage import canonical, is_uri, location
from memprune.train.splits import SplitConfig


INIT_FIELDS = ("encoder", "max_length", "normalize", "text_prefix", "head")  # what `init` takes from its artifact


class TrainError(MemPruneError):
    """The training inputs or settings cannot be used; the message names the file or key."""


class OptimConfig(ConfigModel):
    """Optimisation of one trained stage: AdamW, epochs with early stopping on validation loss."""

    epochs: int = Field(ge=1)
    lr: float = Field(gt=0)
    batch_size: int = Field(ge=1)
    patience: int = Field(ge=1, description="stop after this many epochs without a validation improvement")
    weight_decay: float = Field(0.01, ge=0)
    min_delta: float = Field(0.0, ge=0, description="an improvement must lower val_loss by more than this")


class Stage2Config(OptimConfig):
    """Stage 2: LoRA adapters on the encoder, trained with the head."""

    lora: LoraSettings = Field(default_factory=LoraSettings)
    train_head: bool = Field(True, description="false: the stage-1 head stays frozen and only the adapters train")


class LossConfig(ConfigModel):
    """MSE plus an optional within-session listwise ranking term (off by default)."""

    rank_weight: float = Field(0.0, ge=0)
    rank_temperature: float = Field(0.1, gt=0, description="softmax temperature applied to the labels")


class RayTrainSettings(ConfigModel):
    """How the trainers run: workers per trainer (0 = local mode, in-process), GPUs, fault tolerance."""

    address: str | None = Field(None, description="ray.init address; None = RAY_ADDRESS or a local instance")
    num_workers: int = Field(1, ge=0, description="workers of each stage-2 run (one run per seed)")
    stage1_workers: int = Field(
        0, ge=0, description="workers of the stage-1 run (every seed's head on the cached embeddings, in turn); "
        "0 = Ray Train's local mode in this process: a worker group costs more than heads this small")
    use_gpu: bool | Literal["auto"] = "auto"
    cpus_per_worker: float = Field(1.0, gt=0)
    max_concurrent: int | None = Field(None, ge=1, description="trainers at once; None = what the cluster fits")
    max_failures: int = Field(2, ge=-1)
    num_to_keep: int = Field(2, ge=1, description="checkpoints kept by validation loss (the latest is always kept)")
    storage_path: str | None = Field(None, description="Ray Train storage (shared on clusters); default OUT/ray")
    label_selector: dict[str, str] | None = Field(
        None, description="Ray node labels the Ray Train workers must run on, e.g. {ray.io/accelerator-type: H100}")
    poll_interval_s: float = Field(
        0.5, gt=0, description="how often a Ray Train controller polls its workers (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S): "
        "each epoch's report waits for the next poll, up to 2 s at Ray's default; shorter polls cost the cluster CPU")


class EmbedSettings(ConfigModel):
    """Ray Data batch inference of the frozen-encoder embeddings."""

    batch_size: int = Field(128, ge=1)
    actors: int | None = Field(None, ge=1, description="actor pool size; None = one per GPU, else one per CPU")
    cpus_per_actor: float = Field(1.0, gt=0)
    use_gpu: bool | Literal["auto"] = "auto"


class CalibrationSettings(ConfigModel):
    """The map from raw score to P(label >= relevance_threshold), fitted on each trained stage's validation split."""

    enabled: bool = Field(True, description="fit calibration.json after each trained stage (stage 1, stage 2)")
    relevance_threshold: float = Field(0.5, ge=0.0, le=1.0, description="a bullet is relevant when label >= this")
    methods: list[Literal["isotonic", "platt"]] = Field(
        default_factory=lambda: ["isotonic", "platt"], min_length=1,
        description="candidates; the one with the lower cross-fitted validation Brier score is kept")
    cv_folds: int = Field(5, ge=2, description="folds (by conversation) of the cross-fitting that picks the method")
    select: Literal["lowest", "one_se"] = Field(
        "one_se", description="lowest: the lower cross-fitted Brier; one_se: Platt unless isotonic is lower by more "
        "than one standard error of the paired difference")
    bins: int = Field(10, ge=2, description="equal-width bins of the ECE and the reliability diagram")
    min_rows: int = Field(50, ge=2, description="fewer validation rows: no calibration (raw scores only)")


class FaultInjection(ConfigModel):
    """Testing aid: SIGKILL the rank-0 worker once, mid-epoch, to exercise FailureConfig resume."""

    stage: str = Field(default_factory=lambda: registry.trained_chain()[0].name,
                       description="a trained stage (memprune/stages.py); default: the first")
    seed: int | None = Field(None, description="only this seed's trainer (None: whichever gets there first)")
    after_epoch: int = Field(1, ge=1, description="kill during the epoch after this one")
    marker: str = Field(description="file created before the kill; the kill happens only if it is absent")

    @field_validator("stage")
    @classmethod
    def _stage(cls, v: str) -> str:
        return registry.check([v], trained_only=True)[0]


class TrainSettings(ConfigModel):
    """Every option of `memprune train` except the paths (the pipeline's `train:` section)."""

    label_weights: dict[str, float] = Field(
        default_factory=dict, description="loss weight per label source (judge, qa, usage); 1 when not given")
    label_weight_by: Literal["none", "agreement"] = Field(
        "none", description="agreement: a row's weight is also floor + (1 - floor) * agreement of its judges "
                            "(labels of a consensus run); rows without an agreement keep their source weight")
    agreement_floor: float = Field(0.1, gt=0.0, lt=1.0, description="weight factor of a row whose judges disagree "
                                                                      "completely (agreement 0)")
    folds: int | None = Field(None, ge=2, description="k-fold by conversation: train K times, each fold held out once")
    stages: list[str] = Field(default_factory=lambda: list(registry.stage_names()),
                              description="among memprune/stages.py's")
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2])
    encoder: str = DEFAULT_ENCODER
    max_length: int = Field(64, ge=8)
    normalize: bool = False
    text_prefix: str = ""
    head: HeadSettings = Field(default_factory=HeadSettings)
    init: str | None = Field(None, description="start from a scorer: a shipped one's name (`default`) or a local "
                             "artifact directory; its encoder, pooling and head shape are taken, its head is the vanilla "
                             "baseline and where stage 1 starts, and calibration is refitted on these labels")
    split: SplitConfig = Field(default_factory=SplitConfig)
    stage1: OptimConfig = Field(
        default_factory=lambda: OptimConfig(epochs=60, lr=1e-3, batch_size=64, patience=6)
    )
    stage2: Stage2Config = Field(
        default_factory=lambda: Stage2Config(epochs=3, lr=3e-4, batch_size=32, patience=1)
    )
    loss: LossConfig = Field(default_factory=LossConfig)
    ray: RayTrainSettings = Field(default_factory=RayTrainSettings)
    embed: EmbedSettings = Field(default_factory=EmbedSettings)
    predict_batch_size: int = Field(64, ge=1)
    calibration: CalibrationSettings = Field(default_factory=CalibrationSettings)
    precision: Precision = precision_field("of the encoder passes (embedding, stage-2 training, prediction)")
    fault: FaultInjection | None = None

    @field_validator("label_weights")
    @classmethod
    def _weights(cls, v: dict[str, float]) -> dict[str, float]:
        from memprune.label.sources import SOURCES

        for source, w in v.items():
            if source not in SOURCES:
                raise ValueError(f"label_weights: unknown source {source!r}; known: {', '.join(SOURCES)}")
            if not (math.isfinite(w) and w > 0):
                raise ValueError(f"label_weights.{source}: weight must be a positive number, got {w}")
        return v

    @field_validator("stages")
    @classmethod
    def _stages(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("at least one stage is needed")
        return registry.in_order(registry.check(v))

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, v: list[int]) -> list[int]:
        if not v:
            raise ValueError("at least one seed is needed")
        if len(set(v)) != len(v):
            raise ValueError(f"duplicate seeds in {v}")
        return v

    @field_validator("encoder")
    @classmethod
    def _encoder(cls, v: str) -> str:
        return canonical_encoder(v)

    @model_validator(mode="after")
    def _init(self) -> "TrainSettings":
        """`init`: the artifact's directory, and its encoder settings and head shape in place of these (a different
        value set here is an error: the head could not start from the artifact's)."""
        if self.init is None:
            return self
        self.init = resolve_scorer(self.init)
        if is_uri(self.init) or not (Path(self.init) / "scorer.json").is_file():
            raise ValueError(f"init: {self.init} is neither a shipped scorer ({', '.join(SHIPPED)}) nor a local "
                             "scorer artifact directory (scorer.json + head.safetensors)")
        try:
            start = read_scorer_config(self.init)
        except MemPruneError as exc:
            raise ValueError(f"init: {exc}") from None
        for key in INIT_FIELDS:
            if key in self.model_fields_set and getattr(self, key) != getattr(start, key):
                raise ValueError(f"{key}: {getattr(self, key)!r}, but init {self.init} has {getattr(start, key)!r}: "
                                 f"leave {key} unset to start from it")
            setattr(self, key, getattr(start, key))
        return self

    def init_head(self) -> bytes | None:
        """The init artifact's head weights (safetensors bytes) where training starts from one."""
        return None if self.init is None else (Path(self.init) / "head.safetensors").read_bytes()

    def weight_of(self, source: str) -> float:
        """The loss weight of a label row from `source`."""
        return float(self.label_weights.get(source, 1.0))

    def agreement_factor(self, agreement: float | None) -> float:
        """The factor `label_weight_by: agreement` puts on a row: floor + (1 - floor) * agreement (1 without one)."""
        if self.label_weight_by != "agreement" or agreement is None:
            return 1.0
        a = min(1.0, max(0.0, float(agreement)))
        return self.agreement_floor + (1.0 - self.agreement_floor) * a

    def scorer_config(self, stage: str | None = None, seed: int | None = None) -> ScorerConfig:
        """The `ScorerConfig` of a (stage, seed) artifact (LoRA settings only for a stage that trains the encoder)."""
        return ScorerConfig(
            encoder=self.encoder,
            max_length=self.max_length,
            normalize=self.normalize,
            text_prefix=self.text_prefix,
            head=self.head,
            lora=getattr(self, stage).lora if registry.trains_encoder(stage) else None,  # its section's
            stage=stage,
            seed=seed,
        )


def out_place(value: Any) -> Any:
    """A storage URI stays as written; a local path (or file:// URI) becomes an absolute Path."""
    if isinstance(value, str) and is_uri(value):
        loc = location(value, "out")
        return Path(loc.path) if loc.local else value
    return Path(value).expanduser().resolve()


class TrainConfig(TrainSettings):
    """Everything `memprune train` needs: the settings plus the corpus, label and output directories (each a local
    path or a storage URI)."""

    data: Place
    labels: list[Place] = Field(min_length=1, description="label dirs (labels.parquet); several are mixed")
    out: Annotated[Path | str, BeforeValidator(out_place)] = Field(
        description="run directory, or a storage URI: the run is then committed there (see train/recipe.py)")

    @field_validator("labels", mode="before")
    @classmethod
    def _labels_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, (str, os.PathLike)) else v

    @model_validator(mode="after")
    def _paths(self) -> "TrainConfig":
        self.data, self.labels = canonical(os.path.expanduser(self.data)), [
            canonical(os.path.expanduser(p)) for p in self.labels]
        return self
