"""Where work runs: the Ray session, the device policy, actor pools, and the `jobs/` entry point.

- `ensure_ray`: the given cluster, RAY_ADDRESS (set by `ray job submit`), or a new local Ray.
- `use_gpu` / `torch_device`: one rule for "auto" (a GPU when the cluster or machine has one).
- `plan_actors`: the size and per-actor requests of an encoder actor pool.
- `run_job`: the shared body of every `jobs/<stage>.py`: config + overrides -> `run(cfg)` -> JSON.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import BaseModel

from memprune.errors import MemPruneError

M = TypeVar("M", bound=BaseModel)
GpuSetting = bool | Literal["auto"]


def ensure_ray(address: str | None = None) -> None:
    """Connect to `address` (or RAY_ADDRESS), else start an embedded local Ray; no-op when connected.

    Without either, a new local instance is started (`address="local"`) rather than attaching to
    whatever cluster /tmp/ray/ray_current_cluster names: on a shared machine that may be another
    process's instance. `address: auto` attaches to a running local cluster on purpose.
    """
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address=address or os.environ.get("RAY_ADDRESS") or "local", include_dashboard=False,
             configure_logging=False)


def use_gpu(setting: GpuSetting, cluster: Mapping[str, float] | None = None) -> bool:
    """Whether to request GPUs: `auto` = the Ray cluster has one; `true` on a cluster without one is an error."""
    if cluster is None:
        import ray

        cluster = ray.cluster_resources()
    has = float(cluster.get("GPU", 0)) >= 1
    if setting == "auto":
        return has
    if setting and not has:
        raise MemPruneError("use_gpu is true but the Ray cluster has no GPU")
    return bool(setting)


def torch_device(setting: str = "auto") -> str:
    """A torch device name for in-process work: `auto` = cuda when this machine has it, else cpu."""
    if setting != "auto":
        return setting
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class ActorResources:
    """How an actor pool is laid out: pool size, device, torch threads and Ray requests per actor."""

    actors: int
    device: str
    threads: int
    cpus: float
    gpus: int


def plan_actors(cluster: Mapping[str, float], gpu: GpuSetting = "auto", actors: int | None = None,
                cpus_per_actor: float = 1.0, reserve_cpus: float = 0.0) -> ActorResources:
    """Pool size and per-actor requests: one actor per GPU, else one per `cpus_per_actor` CPUs.

    `reserve_cpus` is left to the tasks around the pool (read, write), so that a pool sized to
    the whole cluster never starves them.
    """
    cpus = float(cluster.get("CPU", 1.0))
    threads = max(1, round(cpus_per_actor))
    if use_gpu(gpu, cluster):
        n = actors or int(cluster.get("GPU", 1))
        return ActorResources(n, "cuda", threads, min(cpus_per_actor, max(0.1, (cpus - reserve_cpus) / n)), 1)
    n = actors or max(1, int(cpus // cpus_per_actor))
    return ActorResources(n, "cpu", threads, round(min(cpus_per_actor, max(0.05, (cpus - reserve_cpus) / n)), 3), 0)


USAGE = "usage: python jobs/{name}.py [CONFIG.yaml] [key=value ...]"


def split_args(argv: list[str]) -> tuple[str | None, list[str]]:
    """The optional config path (first argument without '=') and the key=value overrides."""
    path = argv[0] if argv and "=" not in argv[0] else None
    return path, argv[1:] if path is not None else argv


def run_job(name: str, model: type[M], fn: Callable[[M], dict[str, Any]], argv: list[str] | None = None) -> int:
    """Parse config + overrides into `model`, run `fn`, print its summary as JSON; 2 on a user error."""
    from memprune.config import load_config

    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE.format(name=name))
        print(json.dumps(model.model_json_schema(), indent=2))
        return 0
    path, overrides = split_args(argv)
    try:
        summary = fn(load_config(path, overrides, model))
    except (MemPruneError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2, sort_keys=True, default=str))
    return 0
