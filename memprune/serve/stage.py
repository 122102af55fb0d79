"""`run(cfg)`: start the service on Ray Serve, print its URL, and (with `block`) serve until Ctrl-C."""

from __future__ import annotations

import time
from typing import Any

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


def run(cfg: ServeConfig) -> dict[str, Any]:
    """Check the scorer, start Ray (or join `ray_address`) and the app; the summary: URL, scorer, stores."""
    from ray import serve

    from memprune.prune import check_scorer
    from memprune.runtime import ensure_ray
    from memprune.serve.app import build_app

    scorer = check_scorer(cfg.scorer)  # a broken artifact is one line here, not a replica crash loop
    check_stores(cfg)
    ensure_ray(cfg.ray_address)
    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    serve.run(build_app(cfg), name=APP, route_prefix="/", blocking=False)
    url = f"http://{cfg.host}:{cfg.port}"
    summary = {"url": url, "docs": f"{url}/docs", "scorer": scorer, "stores": sorted(cfg.stores),
               "replicas": cfg.deployment_options().get("num_replicas", "autoscaling"), "rule": cfg.rule.describe()}
    print(f"memprune serve: {url} (OpenAPI: {url}/docs; Ctrl-C stops)" if cfg.block else f"memprune serve: {url}",
          flush=True)
    if cfg.block:
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            serve.shutdown()
    return summary
