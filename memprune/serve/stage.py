"""`run(cfg)`: start the service on Ray Serve, print its URL, and (with `block`) serve until Ctrl-C."""

from __future__ import annotations

import signal
import sys
import time
from typing import Any

from memprune.runtime import ensure_ray, ray_host
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

    With `block`, serves until Ctrl-C or SIGTERM, then shuts the app down (and the Ray it started)."""
    from ray import serve

    from memprune.prune import check_scorer
    from memprune.serve.app import build_app

    scorer = check_scorer(cfg.scorer)  # a broken artifact is one line here, not a replica crash loop
    check_stores(cfg)
    exposed = exposure(cfg)
    if exposed:
        print(exposed, file=sys.stderr, flush=True)
    ensure_ray(cfg.ray_address)
    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    serve.run(build_app(cfg), name=APP, route_prefix="/", blocking=False)
    url = f"http://{cfg.host}:{cfg.port}"
    summary = {"url": url, "docs": f"{url}/docs", "scorer": scorer, "stores": sorted(cfg.stores),
               "replicas": cfg.deployment_options().get("num_replicas", "autoscaling"), "rule": cfg.rule.describe()}
    print(f"memprune serve: {url} (OpenAPI: {url}/docs; Ctrl-C stops)" if cfg.block else f"memprune serve: {url}",
          flush=True)
    if cfg.block:
        _serve_until_stopped()
    return summary


def _serve_until_stopped() -> None:
    """Wait until Ctrl-C or SIGTERM (a service manager's stop), then shut Serve down and the Ray this process
    started, in order (Ray's own SIGTERM handling of a driver ends in SIGABRT)."""
    import ray
    from ray import serve

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal does not cut the shutdown short
        serve.shutdown()
        ray.shutdown()
        print("memprune serve: stopped", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
