"""The `hf` engine: transformers in a Ray Data actor pool (CPU or GPU), for machines without vLLM.

`HFGenerator` runs batched, left-padded `generate` (rows with the same sampling together, so
per-row overrides work); `hf_pool_kwargs` / `hf_actor_kwargs` place any transformers actor pool
(also the likelihood judge's `memprune.llm.loglik.LoglikScorer`).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pyarrow as pa

from memprune.llm.config import LLMConfig
from memprune.llm.rows import OUT_COLUMNS, engine_table, mp_columns, row_sampling, sampling_for, short

log = logging.getLogger(__name__)


def load_causal_lm(model: str, trust_remote_code: bool, device: str, dtype: str, num_threads: int | None) -> Any:
    """A transformers causal LM on `device` in eval mode (`dtype` auto or a torch dtype name); sets CPU threads."""
    import torch
    from transformers import AutoModelForCausalLM

    if num_threads:
        torch.set_num_threads(num_threads)
    torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    return AutoModelForCausalLM.from_pretrained(model, trust_remote_code=trust_remote_code,
                                                dtype=torch_dtype).to(device).eval()


class HFGenerator:
    """A Ray Data actor holding one transformers causal LM; batched, left-padded `generate`."""

    def __init__(self, model: str, trust_remote_code: bool, device: str, dtype: str, max_model_len: int | None,
                 num_threads: int | None = None) -> None:
        import torch
        from transformers import AutoTokenizer

        self.torch = torch
        self.device = device
        self.tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = load_causal_lm(model, trust_remote_code, device, dtype, num_threads)
        limit = max_model_len or getattr(self.model.config, "max_position_embeddings", None)
        self.max_len = int(limit) if limit else None
        eos = self.model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos] if eos is not None else []
        self.eos_ids = set(eos) | ({self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set())

    def __call__(self, batch: pa.Table, sampling: dict[str, Any], attempt: int) -> pa.Table:
        rows = batch.to_pylist()
        results: list[dict[str, Any]] = [{} for _ in rows]
        groups: dict[tuple[float, float, int, int], list[tuple[int, list[int]]]] = {}
        for i, row in enumerate(rows):
            p = row_sampling(sampling, row.get("_mp_sampling"), attempt)
            try:
                ids = self.tokenizer.apply_chat_template(json.loads(row["_mp_messages"]), tokenize=True,
                                                         add_generation_prompt=True)
                if hasattr(ids, "keys"):
                    ids = ids["input_ids"]
                ids = list(ids)
            except Exception as exc:  # a template that rejects these messages: this row only
                results[i] = {"_mp_engine_error": f"engine: chat template failed: {short(exc)}"}
                continue
            if self.max_len is not None and len(ids) + p["max_tokens"] > self.max_len:
                results[i] = {"_mp_engine_error": f"engine: prompt of {len(ids)} tokens + max_tokens {p['max_tokens']} "
                                                  f"exceeds the model length {self.max_len}", "_mp_n_in": len(ids)}
                continue
            # rows with the same sampling are generated together (per-row overrides split the batch)
            groups.setdefault((p["temperature"], p["top_p"], p["max_tokens"], p["seed"]), []).append((i, ids))
        for (temperature, top_p, max_tokens, seed), todo in groups.items():
            try:
                self._generate(todo, results, temperature, top_p, max_tokens, seed)
            except Exception as exc:  # e.g. out of memory for the batch: retry rows one by one
                log.warning("hf generate failed for a batch of %d rows (%s); retrying one by one", len(todo), exc)
                for item in todo:
                    try:
                        self._generate([item], results, temperature, top_p, max_tokens, seed)
                    except Exception as row_exc:
                        results[item[0]] = {"_mp_engine_error": f"engine: {type(row_exc).__name__}: {short(row_exc)}"}
        out = []
        for row, res in zip(rows, results):
            keep = mp_columns(row)
            for col in OUT_COLUMNS:
                keep[col] = res.get(col)
            out.append(keep)
        return engine_table(out)

    def _generate(self, todo: list[tuple[int, list[int]]], results: list[dict[str, Any]], temperature: float,
                  top_p: float, max_tokens: int, seed: int) -> None:
        torch = self.torch
        width = max(len(ids) for _, ids in todo)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.full((len(todo), width), pad, dtype=torch.long)
        mask = torch.zeros((len(todo), width), dtype=torch.long)
        for r, (_, ids) in enumerate(todo):
            input_ids[r, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
            mask[r, width - len(ids):] = 1
        torch.manual_seed(seed)
        sample = temperature > 0
        kwargs: dict[str, Any] = {"max_new_tokens": max_tokens, "do_sample": sample, "pad_token_id": pad}
        if sample:
            kwargs.update(temperature=temperature, top_p=top_p)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        with torch.inference_mode():
            gen = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device),
                                      **kwargs)
        new = gen[:, width:].tolist()
        for r, (i, ids) in enumerate(todo):
            tokens = new[r]
            n = len(tokens)
            for k, tok in enumerate(tokens):
                if tok in self.eos_ids:
                    n = k + 1
                    break
            text = self.tokenizer.decode(tokens[:n], skip_special_tokens=True)
            results[i] = {"_mp_text": text, "_mp_n_in": len(ids), "_mp_n_out": n, "_mp_engine_error": None}


def hf_pool_kwargs(config: LLMConfig, replicas: int) -> dict[str, Any]:
    """`map_batches` placement of a pool of `replicas` transformers actors: GPU (1 GPU each) or CPU bundles."""
    import ray

    gpu = config.accelerator == "gpu"
    resources: dict[str, Any] = {"num_gpus": 1, "num_cpus": 1} if gpu else {"num_cpus": config.cpus_per_replica}
    if config.accelerator_type and gpu:
        resources["accelerator_type"] = config.accelerator_type
    if config.env:
        resources["runtime_env"] = {"env_vars": dict(config.env)}
    return {"compute": ray.data.ActorPoolStrategy(size=replicas), "batch_size": config.batch_size,
            "batch_format": "pyarrow", **resources}


def hf_actor_kwargs(config: LLMConfig) -> dict[str, Any]:
    """Constructor arguments shared by the transformers actors: model, device, dtype, threads."""
    gpu = config.accelerator == "gpu"
    return {"model": config.model, "trust_remote_code": config.trust_remote_code, "device": "cuda" if gpu else "cpu",
            "dtype": config.dtype, "num_threads": None if gpu else max(1, int(config.cpus_per_replica))}


def generate_hf(ds: Any, config: LLMConfig, task: str, attempt: int, replicas: int | None = None) -> Any:
    """Run one attempt of `ds` through a pool of transformers actors."""
    return ds.map_batches(
        HFGenerator,
        fn_constructor_kwargs={**hf_actor_kwargs(config), "max_model_len": config.max_model_len},
        fn_kwargs={"sampling": sampling_for(config, task, attempt), "attempt": attempt},
        **hf_pool_kwargs(config, replicas or config.concurrency or 1),
    )
