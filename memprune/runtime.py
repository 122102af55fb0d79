"""Where work runs: the Ray session, the device policy, actor pools, errors from workers, and `jobs/`.

- `ensure_ray`: the given cluster, RAY_ADDRESS (set by `ray job submit`), or a new local Ray.
- `use_gpu` / `torch_device`: one rule for "auto" (a GPU when the cluster or machine has one).
- `plan_actors`: the size and per-actor requests of an encoder actor pool.
- `check_resources`: a request that a fixed-size cluster can never place is an error up front.
- `user_error`: the memprune error behind a failed Ray task or actor, as one line; `worker_error`: any other
  failure in a worker (a Ray Train worker group's) as one line naming its cause, the traceback in a log file.
- `configure_output`: quiet by default: dependency warnings and Ray's INFO chatter go to a log file.
- `run_job`: the shared body of every `jobs/<stage>.py`: config + overrides -> `run(cfg)` -> JSON.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping
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
    _quiet_ray_data()
    if native:
        terminal = os.dup(2)
        log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        sys.stderr = os.fdopen(terminal, "w", buffering=1, encoding=sys.stderr.encoding, errors="backslashreplace")
    _LOG_FILE = path
    return path


def _quiet_ray_data() -> None:
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


class RayStartError(MemPruneError):
    """Ray could not be started or reached; the message says which and what to check."""


RAY_HOST_ENV = "MEMPRUNE_RAY_HOST"  # `memprune --ray-host`: the address a Ray that memprune starts listens on
LOOPBACK = "127.0.0.1"
_CLUSTERS_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # Ray's switch: 0 = this machine only (its node on loopback)


def ray_host() -> str | None:
    """The address a local Ray that memprune starts is reachable at: MEMPRUNE_RAY_HOST (`memprune --ray-host`), else
    None (loopback only)."""
    return os.environ.get(RAY_HOST_ENV) or None


@contextlib.contextmanager
def _node_address(host: str | None) -> Iterator[dict[str, Any]]:
    """The `ray.init` options that put this node on `host`; None: on loopback only; "": wherever Ray finds it.

    Ray turns a loopback node address into the machine's reachable one, and then its GCS, raylet, workers and
    agents listen on every interface, unless clusters are switched off (its switch for machines that must not
    be reached, `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`): then the node is 127.0.0.1 and every server binds there.
    A driver joining such an instance needs the switch too (Ray would look for its GCS at the machine's address).
    The switch is on while Ray starts (the processes it starts inherit it) and restored after, so a later
    connection to a real cluster from this process is not affected.
    """
    if host == "":  # joining a cluster elsewhere: Ray finds this node's address
        yield {}
        return
    if host is not None:
        yield {"_node_ip_address": host}
        return
    from ray._private import ray_constants

    saved_env, saved = os.environ.get(_CLUSTERS_ENV), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_CLUSTERS_ENV], ray_constants.ENABLE_RAY_CLUSTER = "0", False
    try:
        yield {"_node_ip_address": LOOPBACK}
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved
        if saved_env is None:
            os.environ.pop(_CLUSTERS_ENV, None)
        else:
            os.environ[_CLUSTERS_ENV] = saved_env


def _loopback_only(address: str) -> bool:
    """Whether a Ray address (HOST:PORT) names a Ray on this machine that listens on loopback only (one memprune
    started): its host is loopback and its port answers there but not on the machine's own address (a Ray started
    with `ray start` listens on both, and Ray then joins it at the machine's address)."""
    import ipaddress
    import socket

    from ray._private.services import get_node_ip_address

    host, _, port = address.split("://", 1)[-1].rpartition(":")
    host = host.strip("[]")
    try:
        if host != "localhost" and not ipaddress.ip_address(host).is_loopback:
            return False
        machine = get_node_ip_address()
        if ipaddress.ip_address(machine).is_loopback:
            return True
        with socket.create_connection((machine, int(port)), timeout=2):
            return False
    except (ValueError, OSError):
        return True


def init_local_ray(**options: Any) -> None:
    """Start a new local Ray (`ray.init(address="local")`) reachable from this machine only (`ray_host()`: the user's
    address instead), with its own dashboard (`local_ray_options`); `options` go to `ray.init` (num_cpus, ...).
    Token auth stays off unless RAY_AUTH_MODE says otherwise: the instance is not reachable from elsewhere."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    host = ray_host()
    given = options.pop("runtime_env", {}).get("env_vars", {})
    for attempt in range(3):
        local = local_ray_options(host or LOOPBACK)
        env = {**given, **local.pop("runtime_env")["env_vars"]}
        try:
            with _node_address(host) as where:
                ray.init(address="local", **{**local, **where, **options}, runtime_env={"env_vars": env})
            return
        except Exception as exc:  # the dashboard's free port taken before Ray bound it (by one of Ray's own): again
            if attempt == 2 or "already occupied" not in str(exc):
                raise
            ray.shutdown()


def token_auth_if_available() -> None:
    """Before connecting to a cluster: with RAY_AUTH_MODE unset and a Ray token in the standard places (the
    RAY_AUTH_TOKEN variable, the file RAY_AUTH_TOKEN_PATH names, ~/.ray/auth_token), use token auth, as `ray.init()`
    does for a local cluster it finds (it does not for an explicit address). A token-mode client joins a cluster
    without auth too; RAY_AUTH_MODE=disabled is respected."""
    from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available

    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def ensure_ray(address: str | None = None) -> None:
    """Connect to `address` (or RAY_ADDRESS), else start an embedded local Ray; no-op when connected.

    Without either, a new local instance is started (`address="local"`, `init_local_ray`: on 127.0.0.1 only)
    rather than attaching to whatever cluster /tmp/ray/ray_current_cluster names: on a shared machine that may be
    another process's instance. `address: auto` attaches to a running local cluster on purpose. A cluster with
    token auth is joined with the token from the standard places (`token_auth_if_available`).
    """
    import ray

    if ray.is_initialized():
        return
    target = address or os.environ.get("RAY_ADDRESS") or "local"
    options: dict[str, Any] = {"configure_logging": False}
    if not _VERBOSE:
        options.update(log_to_driver=False, logging_level=logging.WARNING, runtime_env={"env_vars": dict(QUIET_ENV)})
    try:
        if target == "local":
            init_local_ray(**options)
        else:
            token_auth_if_available()
            with _node_address(None if _loopback_only(target) else "") as where:
                ray.init(address=target, include_dashboard=False, **where, **options)
    except Exception as exc:  # a dashboard or raylet that does not come up, an unreachable address: one line
        what = "start a local Ray instance" if target == "local" else f"connect to the Ray cluster at {target}"
        first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
        raise RayStartError(f"cannot {what}: {first[:300]} (a loaded machine: retry; a cluster: check "
                            "RAY_ADDRESS / --set ray_address; token auth: RAY_AUTH_TOKEN)") from exc
    _quiet_ray_data()
    if not _VERBOSE:
        _log_cluster_messages()


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


def local_ray_options(host: str = LOOPBACK) -> dict[str, Any]:
    """`ray.init` options of a new local instance: its own dashboard on `host`, and its processes pointed at it.

    Ray's state API (Ray Train's placement-group cleaner asks it whether the controller lives) otherwise
    finds its cluster through /tmp/ray/ray_current_cluster, which names whatever `ray start` ran last: a
    dead cluster there stalls the end of every Ray Train run by 12 s, a live one is asked about actors it
    has never seen.
    """
    import socket

    with socket.socket() as sock:  # a free port for the dashboard
        sock.bind((host, 0))
        port = int(sock.getsockname()[1])
    return {"include_dashboard": True, "dashboard_host": host, "dashboard_port": port,
            "runtime_env": {"env_vars": {"RAY_API_SERVER_ADDRESS": f"http://{host}:{port}"}}}


def _log_cluster_messages() -> None:
    """Ray's driver prints the cluster's messages (e.g. "8 worker processes have been started") to stdout from a
    listener thread, even with log_to_driver off; when quiet, they go to the logging system (the log file)."""
    import ray._private.worker as ray_worker

    log = logging.getLogger("memprune.ray_cluster")  # not under "ray", whose own handler prints to stderr

    def to_log(data: Mapping[str, Any], ignore_prefix: bool = False) -> None:
        for line in data.get("lines", []):
            log.warning("(%s) %s", data.get("pid", "ray"), line)

    ray_worker.print_to_stdstream = to_log


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
