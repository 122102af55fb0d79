"""Where work runs: the Ray session, the device policy, actor pools, errors from workers, and `jobs/`.

- `ensure_ray`: the given cluster, RAY_ADDRESS (set by `ray job submit`), or a new local Ray.
- `use_gpu` / `torch_device`: one rule for "auto" (a GPU when the cluster or machine has one).
- `plan_actors`: the size and per-actor requests of an encoder actor pool.
- `check_resources`: a request that a fixed-size cluster can never place is an error up front.
- `user_error`: the memprune error behind a failed Ray task or actor, as one line.
- `run_job`: the shared body of every `jobs/<stage>.py`: config + overrides -> `run(cfg)` -> JSON.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel

from memprune.errors import MemPruneError

M = TypeVar("M", bound=BaseModel)
_EMBEDDED = False  # this process started its own local Ray: a fixed-size cluster
GpuSetting = bool | Literal["auto"]


def ensure_ray(address: str | None = None) -> None:
    """Connect to `address` (or RAY_ADDRESS), else start an embedded local Ray; no-op when connected.

    Without either, a new local instance is started (`address="local"`) rather than attaching to
    whatever cluster /tmp/ray/ray_current_cluster names: on a shared machine that may be another
    process's instance. `address: auto` attaches to a running local cluster on purpose.
    """
    import ray

    global _EMBEDDED
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    target = address or os.environ.get("RAY_ADDRESS") or "local"
    ray.init(address=target, include_dashboard=False, configure_logging=False)
    _EMBEDDED = target == "local"


def check_resources(requests: Mapping[str, Mapping[str, float]], cluster: Mapping[str, float] | None = None,
                    fixed: bool | None = None) -> None:
    """Refuse, before any work starts, a request (by config key) that no node of this cluster can ever place.

    `requests` maps a config key to the resources one unit of it needs (e.g. one Ray Train worker).
    On a fixed-size cluster (the local Ray `ensure_ray` started, or `fixed=True`) a request beyond the cluster's
    total is an error naming the key and what the cluster has; on an autoscaling cluster it may be
    placed later, so it only waits.
    """
    import ray

    cluster = ray.cluster_resources() if cluster is None else cluster
    fixed = _EMBEDDED if fixed is None else fixed
    if not fixed:
        return
    for key, need in requests.items():
        for resource, amount in need.items():
            have = float(cluster.get(resource, 0.0))
            if amount > have + 1e-9:
                raise MemPruneError(f"{key}: needs {amount:g} {resource} per unit but this Ray cluster has {have:g} "
                                    f"{resource} in all ({', '.join(f'{k} {v:g}' for k, v in sorted(cluster.items()) if k in ('CPU', 'GPU'))}); "
                                    "lower it or run on a cluster that has them")


_ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?(\w*Error): (.+)$", re.MULTILINE)


def user_error(exc: BaseException) -> MemPruneError | None:
    """The memprune error behind `exc` (raised here, or inside a Ray task or actor), else None.

    Ray wraps a worker's exception (RayTaskError, a Ray Data UserCodeException, ...); the
    memprune error is found in the cause chain, or failing that in the wrapped text.
    """
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, MemPruneError):
            return e
        cause = getattr(e, "cause", None)
        if isinstance(cause, MemPruneError):
            return cause
        e = e.__cause__ or e.__context__
    names = _memprune_error_names()
    found = [m for m in _ERROR_LINE.findall(str(exc)) if m[0] in names]
    return MemPruneError(found[-1][1].strip()) if found else None


def _memprune_error_names() -> set[str]:
    """The class names of every memprune error (the subclasses of MemPruneError loaded so far)."""
    out, todo = set(), [MemPruneError]
    while todo:
        cls = todo.pop()
        out.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return out


def log_exception(exc: BaseException, command: str) -> Path:
    """Write the full traceback of `exc` to a log file (MEMPRUNE_LOG_DIR, default a temp dir); return its path."""
    root = Path(os.environ.get("MEMPRUNE_LOG_DIR") or Path(tempfile.gettempdir()) / "memprune-logs")
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    path.write_text("".join(traceback.format_exception(exc)), encoding="utf-8")
    return path


def one_line(exc: BaseException) -> str:
    """An error as one line (messages never span lines in logs)."""
    return " ".join(str(exc).split())


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
    except Exception as exc:  # a user error is one line; anything else keeps its traceback
        error = user_error(exc) or (exc if isinstance(exc, FileNotFoundError) else None)
        if error is None:
            raise
        details = f" (details: {log_exception(exc, name)})" if error is not exc else ""
        print(f"error: {one_line(error)}{details}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2, sort_keys=True, default=str))
    return 0
