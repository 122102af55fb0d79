"""Live pruning on Ray Serve (`memprune serve`): the batch job's decision behind an HTTP API.

    memprune serve --scorer runs/train/stage2/seed0 --config configs/serve-local.yaml

- `config`: `ServeConfig` (scorer, host/port, stores by name, replicas, batching, request bounds, token env).
- `models`: the request/response schema (pure pydantic; OpenAPI at /docs).
- `app`: the deployment (FastAPI ingress: /v1/score, /v1/decide, /v1/prune, /healthz), `build_app`, `build`
  (the `serve run` / `serve deploy` import path `memprune.serve.app:build`).
- `client`: `ServiceClient`, the HTTP client (a `prune_table` that asks `/v1/decide`).
- `stage`: `run(cfg)`.
"""

from __future__ import annotations

from memprune.serve.config import ServeConfig
from memprune.serve.stage import run

__all__ = ["ServeConfig", "run"]
