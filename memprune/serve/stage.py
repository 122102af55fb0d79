"""`run(cfg)`: start the service on Ray Serve, print its URL, and (with `block`) serve until Ctrl-C."""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

from memprune.raysession import ensure_ray, ray_host
from memprune.serve.config import ServeConfig

APP = "memprune"


def check_stores(cfg: ServeConfig) -> None:
    """Open every configured store with its mapping once: a store that cannot be opened, or lacks a mapped column,
    is one line at startup, not a 400 on every /v1/prune."""
    from memprune.stores import StoreError

    for name, store in cfg.stores.items():
        try:
            store.open().close()
        except StoreError as exc:
            raise StoreError(f"stores.{name}: {exc}") from None


def exposure(cfg: ServeConfig) -> str | None:
    """What the service exposes when its host is not loopback, in one line (None on loopback)."""
    import ipaddress
    import os

    try:
        if cfg.host == "localhost" or ipaddress.ip_address(cfg.host).is_loopback:
            return None
    except ValueError:
        pass
    every = cfg.host in ("0.0.0.0", "::")
    token = (f"apply needs the bearer token in {cfg.token_env}" if os.environ.get(cfg.token_env) else
             f"apply is refused ({cfg.token_env} is unset)")
    stores = ", ".join(sorted(cfg.stores)) or "none"
    return (f"memprune serve: listening on {'every interface' if every else cfg.host} (port {cfg.port}), reachable "
            f"from other machines: /healthz, /v1/score and /v1/decide answer anyone; /v1/prune reads the configured "
            f"stores ({stores}) for anyone and {token}; Ray itself listens on "
            f"{ray_host() or '127.0.0.1 only'}")


def run(cfg: ServeConfig) -> dict[str, Any]:
    """Check the scorer, start Ray (or join `ray_address`) and the app; the summary: URL, scorer, stores.

    With `block`, serves until Ctrl-C or SIGTERM, then shuts the app down and the Ray it started, in order."""
    from memprune.scorer import check_scorer

    scorer = check_scorer(cfg.scorer)  # a broken artifact is one line here, not a replica crash loop
    check_stores(cfg)
    exposed = exposure(cfg)
    if exposed:
        print(exposed, file=sys.stderr, flush=True)
    url = f"http://{cfg.host}:{cfg.port}"
    summary = {"url": url, "docs": f"{url}/docs", "scorer": scorer, "stores": sorted(cfg.stores),
               "replicas": cfg.deployment_options().get("num_replicas", "autoscaling"), "rule": cfg.rule.describe()}
    if not cfg.block:
        ensure_ray(cfg.ray_address)
        _start(cfg)
        print(f"memprune serve: {url}", flush=True)
        return summary
    with _sigterm_to_this_process_only():
        ensure_ray(cfg.ray_address)
    previous = signal.signal(signal.SIGTERM, _interrupt)  # after ray.init, which installs a handler that aborts
    try:
        _start(cfg)
        print(f"memprune serve: {url} (OpenAPI: {url}/docs; Ctrl-C or SIGTERM stops)", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal does not cut the shutdown short
        _stop()
        print("memprune serve: stopped", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return summary


def _start(cfg: ServeConfig) -> None:
    from ray import serve

    from memprune.serve.app import build_app

    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    serve.run(build_app(cfg), name=APP, route_prefix="/", blocking=False)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _stop() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


@contextlib.contextmanager
def _sigterm_to_this_process_only() -> Iterator[None]:
    """While Ray starts, SIGTERM is blocked, so the processes it starts inherit the block (Ray does the same with
    SIGINT): a stop sent to the service's process group (a service manager's, `kill -- -PGID`) reaches this process
    alone, which shuts Serve and Ray down in order (Ray then stops its own processes, SIGKILL after 1 s). A Ray that
    is already running (a cluster, RAY_ADDRESS) is not touched."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
