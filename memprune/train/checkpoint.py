"""The one checkpoint codec of training: safetensors for tensors, JSON for the rest, never pickle.

A checkpoint directory holds the current trainable weights (`weights.safetensors`), the best
ones so far (`best.safetensors`), the optimizer state (`optimizer.safetensors` + `optimizer.json`)
and the loop state (`state.json`: epoch, history, early stopping). `save` writes one, `restore`
loads one into a model and optimizer, `read_result` reads the best weights and state of a
finished run.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable


@dataclass
class LoopState:
    """Where a training run stands: epochs done, their metrics, early-stopping bookkeeping, attempt starts."""

    epoch: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    best_epoch: int | None = None
    best_val_loss: float = math.inf
    bad_epochs: int = 0
    starts: list[int] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "history": self.history,
            "best_epoch": self.best_epoch,
            "best_val_loss": self.best_val_loss if math.isfinite(self.best_val_loss) else None,
            "bad_epochs": self.bad_epochs,
            "starts": self.starts,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "LoopState":
        best = d.get("best_val_loss")
        return cls(
            epoch=int(d["epoch"]),
            history=list(d["history"]),
            best_epoch=d.get("best_epoch"),
            best_val_loss=math.inf if best is None else float(best),
            bad_epochs=int(d["bad_epochs"]),
            starts=list(d.get("starts", [])),
        )


def optimizer_tensors(optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """An optimizer state dict split into safetensors-able tensors and JSON metadata (no pickle)."""
    import torch

    sd = optimizer.state_dict()
    tensors: dict[str, Any] = {}
    scalars: dict[str, Any] = {}
    for idx, state in sd["state"].items():
        for name, value in state.items():
            if torch.is_tensor(value):
                tensors[f"{idx}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{idx}.{name}"] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def optimizer_state(tensors: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """Rebuild an optimizer state dict from `optimizer_tensors` output."""
    state: dict[int, dict[str, Any]] = {}
    for key, value in list(tensors.items()) + list(meta.get("scalars", {}).items()):
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def save(directory: Path, weights: dict[str, Any], best: dict[str, Any], optimizer: Any, state: LoopState,
         meta: dict[str, Any]) -> None:
    """Write a checkpoint directory: current and best weights, optimizer state, loop state (+ `meta`)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(directory / "weights.safetensors"))
    save_file(best, str(directory / "best.safetensors"))
    tensors, opt_meta = optimizer_tensors(optimizer)
    save_file(tensors, str(directory / "optimizer.safetensors"))
    (directory / "optimizer.json").write_text(json.dumps(opt_meta), encoding="utf-8")
    (directory / "state.json").write_text(json.dumps({**state.to_json(), **meta}), encoding="utf-8")


def save_result(directory: Path, best: dict[str, Any], state: LoopState, meta: dict[str, Any]) -> None:
    """Write a finished seed's part of a checkpoint: its best weights and loop state (no optimizer)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file(best, str(directory / "best.safetensors"))
    (directory / "state.json").write_text(json.dumps({**state.to_json(), **meta}), encoding="utf-8")


def restore(directory: Path, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any], LoopState]:
    """Load a checkpoint: (current weights, best weights, loop state); the optimizer state is loaded in place."""
    from safetensors.torch import load_file

    optimizer.load_state_dict(optimizer_state(load_file(str(directory / "optimizer.safetensors")),
                                              json.loads((directory / "optimizer.json").read_text(encoding="utf-8"))))
    weights = load_file(str(directory / "weights.safetensors"))
    best = load_file(str(directory / "best.safetensors"))
    return weights, best, LoopState.from_json(json.loads((directory / "state.json").read_text(encoding="utf-8")))


def read_result(directory: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The best weights and the state JSON of a finished run's checkpoint."""
    from safetensors.torch import load_file

    state = json.loads((directory / "state.json").read_text(encoding="utf-8"))
    return load_file(str(directory / "best.safetensors")), state


def latest_local(root: Path) -> Path | None:
    """The newest complete local-mode checkpoint under `root` (local mode has no Ray Train storage)."""
    done = sorted(p for p in root.glob("step_*") if p.is_dir()) if root.exists() else []
    return done[-1] if done else None


def save_local(root: Path, name: str, write: Callable[[Path], None]) -> Path:
    """Local mode: `write` a checkpoint into `root/name` atomically (temp dir, then rename); drop the older ones."""
    target = root / name
    tmp = root / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    for old in root.glob("step_*"):
        if old != target:
            shutil.rmtree(old, ignore_errors=True)
    return target
