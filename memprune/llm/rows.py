"""What every engine shares: the row contract's columns and helpers, sampling per attempt, the Ray pieces.

The engines (`memprune.llm.engines`: vllm, http; `memprune.llm.hf_engine`; the log-likelihood pass,
`memprune.llm.loglik`) all build on this module and on nothing of each other's.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import pyarrow as pa

from memprune.errors import MemPruneError
from memprune.llm.config import LLMConfig

OUT_COLUMNS = ("_mp_text", "_mp_n_in", "_mp_n_out", "_mp_engine_error")
ERROR_SNIPPET = 500


class LLMError(MemPruneError, RuntimeError):
    """The engine cannot be set up at all (not a per-row failure): missing package, no GPUs, bad URL."""


def sampling_for(config: LLMConfig, task: str, attempt: int) -> dict[str, Any]:
    """Temperature, top_p, max_tokens and seed for `attempt` (1-based) of `task`."""
    s = config.sampling
    return {
        "temperature": s.temperature_for(attempt),
        "top_p": s.top_p,
        "max_tokens": s.max_tokens_for(task, attempt),
        "seed": s.seed_for(attempt),
    }


def row_sampling(params: dict[str, Any], override: str | None, attempt: int) -> dict[str, Any]:
    """One row's sampling: the attempt's `params` with the row's `_mp_sampling` JSON overrides applied.

    `seed_offset` is added to the seed (independent samples of one prompt stay reproducible),
    `temperature` replaces the first attempt's (retries keep at least the retry temperature),
    `max_tokens` replaces the attempt's budget (a retry keeps the larger of the two).
    """
    if not override:
        return params
    extra = json.loads(override)
    out = dict(params)
    out["seed"] = int(out.get("seed") or 0) + int(extra.get("seed_offset") or 0)
    if extra.get("temperature") is not None:
        t = float(extra["temperature"])
        out["temperature"] = t if attempt <= 1 else max(t, float(out["temperature"]))
    if extra.get("max_tokens") is not None:
        m = int(extra["max_tokens"])
        out["max_tokens"] = m if attempt <= 1 else max(m, int(out["max_tokens"]))
    return out


def mp_columns(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k.startswith("_mp_")}


def short(text: Any) -> str:
    text = str(text)
    return text if len(text) <= ERROR_SNIPPET else text[:ERROR_SNIPPET] + "..."


def normalize_engine_output(batch: pa.Table) -> pa.Table:
    """Keep only `_mp_*` columns; Ray's `__inference_error__` (rows that bypassed postprocess) -> `_mp_engine_error`."""
    rows = batch.to_pylist()
    out = []
    for row in rows:
        keep = mp_columns(row)
        inference_error = row.get("__inference_error__")
        if inference_error:
            keep["_mp_engine_error"] = f"engine: {short(inference_error)}"
            keep["_mp_text"] = None
            keep["_mp_n_in"] = keep["_mp_n_out"] = None
        for col in OUT_COLUMNS:
            keep.setdefault(col, None)
        out.append(keep)
    return engine_table(out)


def engine_table(rows: list[dict[str, Any]]) -> pa.Table:
    """A table from rows with the engine output columns typed even when all null."""
    table = pa.Table.from_pylist(rows)
    types = {"_mp_text": pa.string(), "_mp_engine_error": pa.string(), "_mp_n_in": pa.int64(), "_mp_n_out": pa.int64()}
    for name, typ in types.items():
        if name in table.column_names and not table.schema.field(name).type.equals(typ):
            table = table.set_column(table.schema.get_field_index(name), name, table.column(name).cast(typ))
    return table


def ray_data_llm() -> Any:
    """`ray.data.llm`, or an LLMError saying what to install."""
    try:
        import ray.data.llm as rdl
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise LLMError(f"engines vllm and http need ray.data.llm and aiohttp (pip install aiohttp): {exc}") from exc
    return rdl


def map_kwargs(config: LLMConfig) -> dict[str, Any]:
    """The Ray CPU request of an engine's pre/postprocess stages (`stage_num_cpus`), if set."""
    return {"num_cpus": config.stage_num_cpus} if config.stage_num_cpus is not None else {}


@lru_cache(maxsize=4)
def chat_tokenizer(model: str, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
