"""The scorer's stages (vanilla, stage 1, stage 2) as a registry of specs: everything that differs per stage.

What a stage is (name, report label, start, baseline) comes from `memprune.stages`, the floor's registry of
facts; a `StageSpec` adds whether the stage trains, which optimiser section it uses, how many torch threads a
worker takes, which input column the train loop reads (cached embeddings or texts), how its trainable module is
built, and how its artifact predicts. The recipe and the train loop never compare stage names.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from memprune import stages as registry
from memprune.precision import Precision, Resolved
from memprune.scorer import ScorerConfig
from memprune.train.config import OptimConfig, TrainError, TrainSettings
from memprune.work import digest

TRAIN_FORMAT = 1


class HeadModel:
    """Stage 1: the regression head alone, on the frozen encoder's cached embeddings (always fp32: it is tiny)."""

    def __init__(self, scorer: ScorerConfig, seed: int, embedding_dim: int | None, init_head: bytes | None,
                 precision: Precision, device: Any) -> None:
        from memprune.scorer import build_head

        if embedding_dim is None:
            raise TrainError("stage1 needs embedding_dim")
        self.module = build_head(embedding_dim, scorer.head, seed).to(device)
        if init_head is not None:  # `train --init`: the head starts from that scorer's
            from safetensors.torch import load

            self.module.load_state_dict(load(init_head))
        self.precision: Resolved = "fp32"  # what its passes run at

    def trainable_state(self) -> dict[str, Any]:
        """Head weights as `head.*` (CPU copies)."""
        return {f"head.{k}": v.detach().cpu().clone() for k, v in self.module.state_dict().items()}

    def load_trainable(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict({k[5:]: v for k, v in state.items() if k.startswith("head.")})

    def logits(self, net: Any, rows: dict[str, Any], idx: np.ndarray, device: Any) -> Any:
        """Logits of rows `idx` through `net` (the head, or its DDP wrapper)."""
        import torch

        return net(torch.as_tensor(rows["embedding"][idx], device=device))


class LoraModel:
    """Stage 2: the encoder with fresh LoRA adapters and the stage-1 head of the same seed, trained together."""

    def __init__(self, scorer: ScorerConfig, seed: int, embedding_dim: int | None, init_head: bytes | None,
                 precision: Precision, device: Any) -> None:
        from safetensors.torch import load

        from memprune.scorer import Scorer

        if init_head is None:
            raise TrainError("stage2 needs the stage-1 head of the same seed (init_head)")
        if scorer.lora is None:
            raise TrainError("stage2 needs LoRA settings")
        # autocast of the encoder's forward and backward passes at `precision`, resolved on `device`
        model = Scorer.build(scorer.model_copy(update={"lora": None}), seed=seed, device=device, precision=precision)
        model.head.load_state_dict(load(init_head))
        model.add_lora(scorer.lora, seed=seed)
        model.to(device)  # the new adapters too
        model.freeze_encoder()
        self.module = model
        self.precision: Resolved = model.precision

    def trainable_state(self) -> dict[str, Any]:
        """Head weights as `head.*`, LoRA adapter weights as `adapter.*` (CPU copies)."""
        out = {f"head.{k}": v.clone() for k, v in self.module.head_state().items()}
        out.update({f"adapter.{k}": v.clone() for k, v in self.module.adapter_state().items()})
        return out

    def load_trainable(self, state: dict[str, Any]) -> None:
        self.module.head.load_state_dict({k[5:]: v for k, v in state.items() if k.startswith("head.")})
        self.module.load_adapter_state({k[8:]: v for k, v in state.items() if k.startswith("adapter.")})

    def logits(self, net: Any, rows: dict[str, Any], idx: np.ndarray, device: Any) -> Any:
        """Logits of rows `idx` through `net` (the scorer, or its DDP wrapper: DDP hooks need `net(...)`)."""
        import torch

        tokens = self.module.tokenize([rows["text"][i] for i in idx], device)
        if isinstance(net, torch.nn.parallel.DistributedDataParallel):
            return net(**tokens, return_logits=True)
        return net.logits(**tokens)


def head_scores(head_state: dict[str, Any], cfg: TrainSettings, dim: int, embeddings: np.ndarray) -> np.ndarray:
    """Scores of precomputed embeddings under a head (vanilla and stage 1 predict this way)."""
    import torch

    from memprune.scorer import Head

    head = Head(dim, cfg.head)
    head.load_state_dict(head_state)
    head.eval()
    with torch.no_grad():
        return torch.sigmoid(head(torch.from_numpy(np.array(embeddings, dtype=np.float32)))).double().numpy()


def _predict_on_embeddings(cfg: TrainSettings, artifact: Path, head_state: dict[str, Any], dim: int,
                           texts: list[str], embeddings: np.ndarray | None) -> np.ndarray:
    if embeddings is None:
        raise TrainError("this stage predicts from the cached embeddings, which were not computed")
    return head_scores(head_state, cfg, dim, embeddings)


def _predict_with_scorer(cfg: TrainSettings, artifact: Path, head_state: dict[str, Any], dim: int,
                         texts: list[str], embeddings: np.ndarray | None) -> np.ndarray:
    import torch

    from memprune.scorer import Scorer

    device = "cuda" if torch.cuda.is_available() else None
    return Scorer.load(artifact, device=device, precision=cfg.precision).score(texts, batch_size=cfg.predict_batch_size)


@dataclass(frozen=True)
class StageSpec:
    """How one stage trains and predicts: its model, inputs, optimiser, threads; the facts from `memprune.stages`."""

    facts: registry.StageFacts  # name, label, init_from, baseline (memprune/stages.py)
    model: type[HeadModel] | type[LoraModel] | None  # None: not trained (vanilla)
    column: str  # what the train loop reads: "embedding" (cached) or "text"
    settings: tuple[str, ...]  # optimiser sections the result depends on (its own last)
    predict: Callable[..., np.ndarray]
    threads_from_workers: bool = False  # False: one torch thread (a head on [batch, d] only spins more)
    per_seed_run: bool = False  # one Ray Train run per seed (spread over GPUs); else every seed in one run
    workers_key: str = "num_workers"  # the `ray` setting that sizes its Ray Train runs
    section: str | None = None  # its optimiser section of `TrainSettings` (None: the one named as the stage)

    def __post_init__(self) -> None:
        if self.facts.trained != (self.model is not None):
            raise TrainError(f"stage {self.facts.name}: a model class exactly when it is trained (not the baseline)")

    @property
    def name(self) -> str:
        return self.facts.name

    @property
    def init_from(self) -> str | None:
        return self.facts.init_from

    @property
    def label(self) -> str:
        return self.facts.label

    @property
    def baseline(self) -> bool:
        return self.facts.baseline

    @property
    def display(self) -> str:
        return self.label

    @property
    def trained(self) -> bool:
        return self.model is not None

    @property
    def needs_embeddings(self) -> bool:
        return self.column == "embedding"

    def optim(self, cfg: TrainSettings) -> OptimConfig | None:
        """This stage's optimiser section (None for an untrained stage)."""
        return getattr(cfg, self.section or self.name) if self.trained else None

    def workers(self, cfg: TrainSettings) -> int:
        """Ray Train workers of this stage's runs (0: local mode, in-process)."""
        return int(getattr(cfg.ray, self.workers_key))

    def threads(self, cfg: TrainSettings) -> int:
        return max(1, int(cfg.ray.cpus_per_worker)) if self.threads_from_workers else 1

    def precision(self, cfg: TrainSettings) -> Precision:
        """What its training passes are asked to run at: the encoder's (text stages) gain from 16 bits, a head not."""
        return cfg.precision if self.column == "text" else "fp32"

    def columns(self) -> list[str]:
        """The columns of the train loop's datasets."""
        return ["bullet_id", "group", "label", "weight", self.column]

    def fingerprint(self, cfg: TrainSettings, seed: int, data_fp: str) -> str:
        """Everything the (stage, seed) result depends on: a rerun with the same one reuses the artifact."""
        payload: dict[str, Any] = {
            "format": TRAIN_FORMAT,
            "stage": self.name,
            "seed": seed,
            "data": data_fp,
            "scorer": cfg.scorer_config(self.name, seed).model_dump(mode="json"),
            "split": cfg.split.model_dump(mode="json"),
            "precision": cfg.precision,  # of the embeddings (vanilla, stage 1) or of stage 2's passes
        }
        if cfg.init is not None:
            from memprune.scorer import artifact_fingerprint

            payload["init"] = artifact_fingerprint(cfg.init)
        if self.settings:
            payload.update({s: _settings_payload(getattr(cfg, s)) for s in self.settings})
            payload["loss"] = cfg.loss.model_dump(mode="json")
            payload["workers"] = max(1, self.workers(cfg))  # data shards: local mode and one worker train alike
            start = STAGE_SPECS[self.init_from].workers(cfg) if self.init_from else 0
            if start > 1:  # a sharded start stage; left out otherwise, so earlier runs stay valid
                payload[f"{self.init_from}_workers"] = start
        return digest(payload)


# settings added after artifacts existed: left out of the fingerprint at their default, so old runs are reused
_NEUTRAL_DEFAULTS: dict[str, Any] = {"train_head": True}


def _settings_payload(section: OptimConfig) -> dict[str, Any]:
    """An optimiser section as fingerprinted: its JSON dump without later-added settings left at their default."""
    dump = section.model_dump(mode="json")
    return {k: v for k, v in dump.items() if not (k in _NEUTRAL_DEFAULTS and v == _NEUTRAL_DEFAULTS[k])}


_SPECS = (
    StageSpec(registry.VANILLA, None, "embedding", (), _predict_on_embeddings),
    StageSpec(registry.STAGE1, HeadModel, "embedding", (registry.STAGE1.name,), _predict_on_embeddings,
              workers_key="stage1_workers"),
    StageSpec(registry.STAGE2, LoraModel, "text", (registry.STAGE1.name, registry.STAGE2.name), _predict_with_scorer,
              threads_from_workers=True, per_seed_run=True),
)
STAGE_SPECS: dict[str, StageSpec] = {s.name: _s for s in registry.STAGES for _s in _SPECS if _s.facts is s}
if list(STAGE_SPECS) != list(registry.stage_names()):
    raise TrainError(f"STAGE_SPECS {list(STAGE_SPECS)} does not cover memprune.stages {list(registry.stage_names())}")


def register_spec(spec: StageSpec) -> StageSpec:
    """Add a stage: its facts to `memprune.stages` and its spec here. Its optimiser sections (`section`, `settings`)
    must be sections of `TrainSettings`."""
    missing = [s for s in (spec.section or spec.name, *spec.settings) if spec.trained and s not in TrainSettings.model_fields]
    if missing:
        raise TrainError(f"stage {spec.name}: no optimiser section {missing[0]!r} in TrainSettings")
    registry.register(spec.facts)
    STAGE_SPECS[spec.name] = spec
    return spec


def trained_chain() -> list[StageSpec]:
    """The trained stages in start order (`memprune.stages.trained_chain`): stage 1, stage 2. What `memprune tune`
    searches, one after the other."""
    return [STAGE_SPECS[s.name] for s in registry.trained_chain()]
