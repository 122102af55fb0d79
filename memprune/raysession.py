"""The Ray session memprune works in: a given cluster, RAY_ADDRESS (set by `ray job submit`), or a new local Ray.

- `ensure_ray`: connect, or start an embedded local Ray; a failure is one line (`RayStartError`).
- `init_local_ray`: a new local Ray reachable from this machine only (its node, and every server of it, on
  127.0.0.1; `memprune --ray-host ADDRESS`: on ADDRESS instead), with its own dashboard (`local_ray_options`).
- `token_auth_if_available`: a cluster with Ray's token auth is joined with the token from the standard places.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

from memprune import runtime
from memprune.errors import MemPruneError


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
    if not runtime.verbose():
        options.update(log_to_driver=False, logging_level=logging.WARNING,
                       runtime_env={"env_vars": dict(runtime.QUIET_ENV)})
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
    runtime.quiet_ray_data()
    if not runtime.verbose():
        _log_cluster_messages()


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
