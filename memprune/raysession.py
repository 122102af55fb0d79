"""One way for every stage to get a Ray session: the given cluster, RAY_ADDRESS, or a new local Ray."""

from __future__ import annotations

import os
from typing import Any


def ensure_ray(address: str | None = None) -> None:
    """Connect to `address` (or RAY_ADDRESS), else start an embedded local Ray; no-op when connected.

    Without either, a new local instance is started (`address="local"`) rather than attaching to
    whatever cluster /tmp/ray/ray_current_cluster names: on a shared machine that may be another
    process's instance. `address: auto` attaches to a running local cluster on purpose.
    `ray job submit` sets RAY_ADDRESS, so jobs run on the cluster they were submitted to.
    """
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    kwargs: dict[str, Any] = {"include_dashboard": False, "configure_logging": False}
    kwargs["address"] = address or os.environ.get("RAY_ADDRESS") or "local"
    ray.init(**kwargs)
