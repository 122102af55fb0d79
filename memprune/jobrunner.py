"""The shared body of every `jobs/<stage>.py` Ray job entrypoint.

`python jobs/<stage>.py CONFIG.yaml [key=value ...]` works locally (embedded Ray) and under
`ray job submit --working-dir . -- python jobs/<stage>.py ...` (Ray connects to the cluster
through RAY_ADDRESS, which `ray job submit` sets). The summary is printed as JSON on stdout.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel

from memprune.config import ConfigError, load_config

M = TypeVar("M", bound=BaseModel)

USAGE = "usage: python jobs/{name}.py [CONFIG.yaml] [key=value ...]"


def split_args(argv: list[str]) -> tuple[str | None, list[str]]:
    """The optional config path (first argument without '=') and the key=value overrides."""
    path = argv[0] if argv and "=" not in argv[0] else None
    return path, argv[1:] if path is not None else argv


def run_job(name: str, model: type[M], fn: Callable[[M], dict[str, Any]], argv: list[str] | None = None) -> int:
    """Parse config + overrides into `model`, run `fn`, print its summary as JSON; 2 on a config error."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE.format(name=name))
        print(json.dumps(model.model_json_schema(), indent=2))
        return 0
    path, overrides = split_args(argv)
    try:
        config = load_config(path, overrides, model)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    summary = fn(config)
    print(json.dumps(summary, indent=2, sort_keys=True, default=str))
    return 0
