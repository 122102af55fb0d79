"""Where work runs: the device policy, actor pools, errors from workers, quiet output, and `jobs/`.

- the Ray session (`ensure_ray`, `init_local_ray`): `memprune.raysession`.
- `use_gpu` / `torch_device`: one rule for "auto" (a GPU when the cluster or machine has one).
- `plan_actors`: the size and per-actor requests of an encoder actor pool.
- `check_resources`: a request that a fixed-size cluster can never place is an error up front.
- `user_error`: the memprune error behind a failed Ray task or actor, as one line; `worker_error`: any other
  failure in a worker (a Ray Train worker group's) as one line naming its cause, the traceback in a log file.
- `configure_output`: quiet by default: dependency warnings and Ray's INFO chatter go to a log file.
- `run_job`: the shared body of every `jobs/<stage>.py`: config + overrides -> `run(cfg)` -> JSON.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel

from memprune.errors import MemPruneError

M = TypeVar("M", bound=BaseModel)
GpuSetting = bool | Literal["auto"]


# Worker-side settings of the quiet mode: no download/loading bars from Hugging Face, no advisory warnings.
QUIET_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error",
             "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1", "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"}
_VERBOSE = False
_LOG_FILE: Path | None = None


def log_dir() -> Path:
    """Where memprune writes its log files: MEMPRUNE_LOG_DIR, else a directory in the system temp dir."""
    root = Path(os.environ.get("MEMPRUNE_LOG_DIR") or Path(tempfile.gettempdir()) / "memprune-logs")
    root.mkdir(parents=True, exist_ok=True)
    return root


def configure_output(verbose: bool | None = None, command: str = "memprune", native: bool = False) -> Path | None:
    """Quiet by default: progress bars and memprune's own lines stay on the terminal; Python warnings from
    dependencies, Ray's INFO lines and its workers' start-up chatter go to a log file (returned).

    `verbose` (the CLI's --verbose, or MEMPRUNE_LOG=debug) shows everything, as Ray and the libraries print it.
    With `native` (the `memprune` executable), what native code writes to file descriptor 2 (Ray's C++ log
    lines, and every process Ray starts) goes to the log file too; Python's own stderr stays on the terminal.
    """
    global _VERBOSE, _LOG_FILE
    if _LOG_FILE is not None:  # once per process
        return _LOG_FILE
    _VERBOSE = bool(verbose) or os.environ.get("MEMPRUNE_LOG", "").lower() in ("debug", "info", "verbose")
    if _VERBOSE:
        logging.basicConfig(level=logging.DEBUG if os.environ.get("MEMPRUNE_LOG") == "debug" else logging.INFO)
        return None
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    path = log_dir() / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    handler = logging.FileHandler(path, encoding="utf-8", delay=True)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)  # warnings -> the "py.warnings" logger -> the log file, not the terminal
    warnings.simplefilter("default")
    quiet_ray_data()
    if native:
        terminal = os.dup(2)
        log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        sys.stderr = os.fdopen(terminal, "w", buffering=1, encoding=sys.stderr.encoding, errors="backslashreplace")
    _LOG_FILE = path
    return path


def verbose() -> bool:
    """Whether output is verbose (`configure_output`): Ray's and the libraries' lines on the terminal."""
    return _VERBOSE


def quiet_ray_data() -> None:
    """Ray Data logs every dataset's start and progress at INFO on the console: keep warnings only there."""
    if _VERBOSE:
        return
    try:
        import ray.data  # noqa: F401  (configures the "ray.data" logger)
    except ImportError:  # pragma: no cover
        return
    for handler in logging.getLogger("ray.data").handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            handler.setLevel(logging.WARNING)


class PathNotVisibleError(MemPruneError):
    """A local path the job needs is not the same on every node of the cluster."""


def _probe(path: str, stamp: tuple[int, int] | None) -> bool:
    """On one node: is `path` there (a file of this (size, mtime_ns), or a directory)?"""
    p = Path(path)
    if stamp is None:
        return p.is_dir()
    return p.is_file() and (p.stat().st_size, p.stat().st_mtime_ns) == tuple(stamp)


def check_paths_visible(paths: Mapping[str, str | os.PathLike[str] | None]) -> None:
    """On a multi-node cluster, refuse (one line, before any work) a local path that some node cannot see.

    `paths`: what the user called it (`--input`) -> the path. A URI, and every path on a one-node
    instance, passes. A file must be on every node with the same size and time. For a directory (or a
    path that does not exist yet, an output: its nearest existing parent) the driver writes a probe
    file into it and every node must see that file; a directory this process may not write into is
    only looked for. One tiny task per alive node looks.
    """
    import uuid

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from memprune.storage import location

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) < 2:
        return
    probe = ray.remote(num_cpus=0, max_retries=0)(_probe)
    for what, value in paths.items():
        loc = None if value is None else location(value)
        if loc is None or not loc.local:
            continue
        target = Path(loc.path).resolve()
        made = None
        if target.is_file():
            st = target.stat()
            check, stamp = target, (st.st_size, st.st_mtime_ns)
        else:
            folder = target if target.is_dir() else next(p for p in target.parents if p.exists())
            try:
                made = folder / f".memprune-probe-{uuid.uuid4().hex[:12]}"
                made.write_text("probe\n")
                st = made.stat()
                check, stamp = made, (st.st_size, st.st_mtime_ns)
            except OSError:
                made, check, stamp = None, folder, None
        try:
            seen = ray.get([probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                            .remote(str(check), stamp) for n in nodes], timeout=120)
        finally:
            if made is not None:
                made.unlink(missing_ok=True)
        blind = [n for n, ok in zip(nodes, seen) if not ok]
        if blind:
            node = blind[0]
            raise PathNotVisibleError(
                f"{what} {value}: not visible from node {node.get('NodeManagerAddress')} "
                f"({node['NodeID'][:12]}; {len(blind)} of {len(nodes)} nodes): on a cluster whose nodes have their "
                "own disks give a URI (s3://..., gs://...) or a path on a filesystem every node mounts")


def started_by_this_process() -> bool:
    """Whether `ray.init()` in this process started the cluster (a fixed-size local instance, by memprune or by
    the caller), rather than connecting to one that may autoscale."""
    import ray._private.worker as ray_worker

    node = getattr(ray_worker, "_global_node", None)
    return bool(getattr(node, "ray_init_cluster", False))


def check_resources(requests: Mapping[str, Mapping[str, float]], cluster: Mapping[str, float] | None = None,
                    fixed: bool | None = None) -> None:
    """Refuse, before any work starts, a request (by config key) that no node of this cluster can ever place.

    `requests` maps a config key to the resources one unit of it needs (e.g. one Ray Train worker).
    On a fixed-size cluster (a local Ray that this process's `ray.init()` started, or `fixed=True`) a request beyond the cluster's
    total is an error naming the key and what the cluster has; on an autoscaling cluster it may be
    placed later, so it only waits.
    """
    import ray

    cluster = ray.cluster_resources() if cluster is None else cluster
    fixed = started_by_this_process() if fixed is None else fixed
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
    memprune error is found in the cause chain, or failing that in the wrapped text. It is the
    plain error, never Ray's wrapper: a RayTaskError's class derives from its cause's (so it is
    a MemPruneError too), but its text is Ray's header and the worker's traceback.
    """
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        cause = _wrapped(e)  # a Ray wrapper: what it wraps (itself possibly a wrapper)
        if cause is not None:
            e = cause
            continue
        if isinstance(e, MemPruneError):
            return e
        e = e.__cause__ or e.__context__
    names = _memprune_error_names()
    found = [m for m in _ERROR_LINE.findall(str(exc)) if m[0] in names]
    return MemPruneError(found[-1][1].strip()) if found else None


def _wrapped(e: BaseException) -> BaseException | None:
    """What a Ray wrapper wraps: a RayTaskError's cause, the first worker failure of a Ray Train worker group
    (WorkerGroupError), the exception a Ray Train worker raised (its wrapper keeps it as `_base_exc`); else None."""
    for inner in (getattr(e, "cause", None), *(getattr(e, "worker_failures", None) or {}).values(),
                  getattr(e, "_base_exc", None)):
        if isinstance(inner, BaseException):
            return inner
    return None


class WorkerError(MemPruneError):
    """A Ray worker failed with an error that is not a memprune one: its cause in one line, the traceback logged."""


def worker_error(exc: BaseException, what: str, command: str) -> MemPruneError:
    """The one line for a failure Ray reports from its workers (a RayTaskError, Ray Train's WorkerGroupError):
    the memprune error behind it, else `what` and the innermost cause's type and first line, with the whole
    traceback (every worker's) in a log file."""
    found = user_error(exc)
    if found is not None:
        return found
    seen: set[int] = set()
    cause = exc
    while id(cause) not in seen and (inner := _wrapped(cause) or cause.__cause__) is not None:
        seen.add(id(cause))
        cause = inner
    first = next((ln.strip() for ln in str(cause).splitlines() if ln.strip()), "")
    return WorkerError(f"{what}: {type(cause).__name__}: {first} (details: {log_exception(exc, command)})")


def _memprune_error_names() -> set[str]:
    """The class names of every memprune error (the subclasses of MemPruneError loaded so far)."""
    out, todo = set(), [MemPruneError]
    while todo:
        cls = todo.pop()
        out.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return out


def log_exception(exc: BaseException, command: str) -> Path:
    """Write the full traceback of `exc` to a log file (see `log_dir`); return its path."""
    path = log_dir() / f"{command}-error-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
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
    configure_output(command=name)
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
