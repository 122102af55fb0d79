"""Settings of `memprune tune`: the base train settings, the two search spaces, the scheduler, the budget.

`TuneSettings` holds every option; `TuneConfig` adds the paths (data, labels, out). A search space maps
a dotted train-settings key (`stage2.lora.r`, `loss.rank_weight`) to a list of choices or an interval;
every choice is checked against `TrainSettings` here, so a bad value fails before Ray starts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, field_validator, model_validator

from memprune.config import ConfigModel, Place
from memprune.errors import MemPruneError
from memprune.storage import canonical
from memprune.train.config import TrainSettings, out_place


class TuneError(MemPruneError):
    """The search cannot run as configured (bad space key or value, no trial finished); the message says which."""


# what each search may vary: stage 1 its optimiser, stage 2 its optimiser, LoRA shape, head and the loss
STAGE1_KEYS = ("stage1.lr", "stage1.epochs", "stage1.patience", "stage1.weight_decay", "stage1.batch_size")
STAGE2_KEYS = ("stage2.lr", "stage2.epochs", "stage2.patience", "stage2.weight_decay", "stage2.batch_size",
               "stage2.lora.r", "stage2.lora.alpha", "stage2.lora.dropout", "stage2.lora.target_modules",
               "stage2.train_head", "loss.rank_weight", "loss.rank_temperature")
METRIC = "val_session_spearman"
# list-valued settings travel through Tune as JSON strings (Tune would read a list as nested config paths)
LIST_KEYS = ("stage2.lora.target_modules",)


class Interval(ConfigModel):
    """A continuous (or integer) range sampled uniformly, or log-uniformly with `log: true`."""

    low: float
    high: float
    log: bool = False
    integer: bool = False

    @model_validator(mode="after")
    def _order(self) -> "Interval":
        if not self.low < self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        if self.log and self.low <= 0:
            raise ValueError("a log interval needs low > 0")
        return self


Dimension = list[Any] | Interval


def _default_stage1_space() -> dict[str, Dimension]:
    return {"stage1.lr": Interval(low=3e-4, high=1e-2, log=True), "stage1.weight_decay": [0.0, 0.01, 0.1]}


def _default_stage2_space() -> dict[str, Dimension]:
    return {
        "stage2.lr": Interval(low=1e-4, high=2e-3, log=True),
        "stage2.epochs": [2, 3],
        "stage2.lora.r": [4, 8, 16],
        "stage2.lora.alpha": [8, 16, 32],
        "stage2.lora.dropout": [0.0, 0.1],
        "stage2.lora.target_modules": [["query", "value"], ["query", "key", "value", "dense"]],
        "stage2.train_head": [True, False],
        "loss.rank_weight": [0.0, 0.5, 1.0],
        "loss.rank_temperature": [0.05, 0.1, 0.3],
    }


class SchedulerSettings(ConfigModel):
    """ASHA over the per-epoch validation session Spearman of the stage-2 trials."""

    grace_period: int = Field(1, ge=1, description="epochs every trial gets before it can be stopped")
    reduction_factor: float = Field(2.0, gt=1.0, description="keep the best 1/factor of trials at each rung")


def set_key(data: dict[str, Any], key: str, value: Any) -> None:
    """Set dotted `key` in nested dict `data` (creating sections)."""
    *parents, last = key.split(".")
    for p in parents:
        data = data.setdefault(p, {})
    data[last] = value


def get_key(data: dict[str, Any], key: str) -> Any:
    """The value of dotted `key` in nested dict `data`."""
    for p in key.split("."):
        data = data[p]
    return data


def apply_point(base: TrainSettings, point: dict[str, Any]) -> TrainSettings:
    """`base` with the dotted keys of `point` replaced, validated as train settings."""
    data = base.model_dump(mode="json")
    for key, value in point.items():
        if key in LIST_KEYS and isinstance(value, str):
            value = json.loads(value)
        set_key(data, key, value)
    return TrainSettings.model_validate(data)


class TuneSettings(ConfigModel):
    """Every option of `memprune tune` except the paths."""

    train: TrainSettings = Field(default_factory=TrainSettings, description="the base train settings of every trial")
    seed: int = Field(0, description="the training seed of every trial (the chosen settings then run on train.seeds)")
    stage1_space: dict[str, Dimension] = Field(default_factory=_default_stage1_space)
    stage1_trials: int = Field(6, ge=0, description="stage-1 trials (0 = keep train.stage1)")
    stage2_space: dict[str, Dimension] = Field(default_factory=_default_stage2_space)
    stage2_trials: int = Field(8, ge=0, description="stage-2 trials (0 = search stage 1 only)")
    points: list[dict[str, Any]] = Field(
        default_factory=list, description="stage-2 settings tried first (dotted keys), before random samples")
    include_base: bool = Field(True, description="try the base train settings first in both searches")
    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings)
    search_seed: int = Field(0, description="seed of the random sampling of the spaces (reruns sample the same)")
    max_concurrent: int | None = Field(None, ge=1, description="trials at once; None = what the cluster fits")
    train_fraction: float = Field(1.0, gt=0.0, le=1.0, description="share of the train conversations the trials "
                                  "use (a stable subset); validation stays whole")

    def space(self, stage: str) -> dict[str, Dimension]:
        """The search space of a trained stage (`<stage>_space`)."""
        return getattr(self, f"{stage}_space")

    def trials(self, stage: str) -> int:
        """How many trials a trained stage's search runs (`<stage>_trials`)."""
        return int(getattr(self, f"{stage}_trials"))

    @field_validator("stage1_space", "stage2_space")
    @classmethod
    def _space_keys(cls, v: dict[str, Dimension], info: Any) -> dict[str, Dimension]:
        allowed = STAGE1_KEYS if info.field_name == "stage1_space" else STAGE2_KEYS
        for key, dim in v.items():
            if key not in allowed:
                raise ValueError(f"{key!r} cannot be searched here; searchable: {', '.join(allowed)}")
            if isinstance(dim, list) and not dim:
                raise ValueError(f"{key}: give at least one choice")
        return v

    @model_validator(mode="after")
    def _check_values(self) -> "TuneSettings":
        if (self.stage1_trials or self.stage2_trials) and self.train.ray.num_workers < 1:
            raise ValueError("train.ray.num_workers: trials run on Ray Train workers (>= 1), which report every "
                             "epoch to Tune; Ray Train's local mode (0) cannot run inside a Tune trial")
        for name in ("stage1_space", "stage2_space"):
            for key, dim in getattr(self, name).items():
                values = dim if isinstance(dim, list) else [dim.low, dim.high]
                for value in values:
                    if isinstance(dim, Interval) and dim.integer:
                        value = int(value)
                    try:
                        apply_point(self.train, {key: value})
                    except Exception as exc:  # pydantic's message names the key
                        raise ValueError(f"{name}.{key}: value {value!r} is not valid: {exc}") from None
        for i, point in enumerate(self.points):
            bad = [k for k in point if k not in STAGE2_KEYS]
            if bad:
                raise ValueError(f"points[{i}]: {bad} cannot be searched; searchable: {', '.join(STAGE2_KEYS)}")
            try:
                apply_point(self.train, point)
            except Exception as exc:
                raise ValueError(f"points[{i}]: not valid train settings: {exc}") from None
        return self


class TuneConfig(TuneSettings):
    """Everything `memprune tune` needs: the settings plus the corpus, label and output directories."""

    data: Place = Field(description="corpus directory or URI with bullets.parquet")
    labels: list[Place] = Field(min_length=1, description="label dirs or URIs (labels.parquet); several are mixed")
    out: Annotated[Path | str, BeforeValidator(out_place)] = Field(
        description="output directory, or a storage URI: the search then runs in a working copy and is committed "
                    "there (see tune/stage.py)")
    tuned_config: Path | None = Field(None, description="also write the best settings as a train config here "
                                      "(always in OUT/train-tuned.yaml)")
    trial_storage: str | None = Field(None, description="where every Ray Train run of the search keeps its "
                                      "checkpoints, one folder per run (a path every node sees, or a URI); default "
                                      "`train.ray.storage_path`, else each run's OUT/ray; with a URI `out`, <out>/ray")

    @field_validator("labels", mode="before")
    @classmethod
    def _labels_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, (str, os.PathLike)) else v

    @model_validator(mode="after")
    def _paths(self) -> "TuneConfig":
        self.data, self.labels = canonical(os.path.expanduser(self.data)), [
            canonical(os.path.expanduser(p)) for p in self.labels]
        if self.tuned_config is not None:
            self.tuned_config = Path(self.tuned_config).expanduser().resolve()
        return self

    def train_config(self, out: Path, settings: TrainSettings | None = None) -> Any:
        """A `TrainConfig` of `settings` (default the base) with this run's data and labels, writing into `out`."""
        from memprune.train import TrainConfig

        base = (settings or self.train).model_dump(mode="json")
        # a stage-1 run inside a trial reports to Tune from Ray Train workers (local mode cannot run in a trial);
        # one worker trains exactly as local mode does, so the chosen settings reproduce in `memprune train`
        base["ray"]["stage1_workers"] = max(1, base["ray"]["stage1_workers"])
        root = self.trial_storage or base["ray"]["storage_path"]
        if root is not None:  # one folder per run: Ray Train resumes a run it finds under the same name
            base["ray"]["storage_path"] = f"{root.rstrip('/')}/{Path(out).relative_to(self.out).as_posix()}"
        return TrainConfig.model_validate({**base, "data": self.data, "labels": self.labels, "out": out})
