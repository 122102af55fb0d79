"""Prompt log-probabilities on Ray Data: log p(real turn | reply prompt) for the likelihood judge.

    out = run_loglik(ds, config)   # rows: context, target, target_speaker, memory (list of notes)

Each row becomes the reply prompt (`config.likelihood_prompt`, default `reply_v1`: the dialogue,
then the memory notes, then "write the next utterance of <speaker>") rendered with the model's
chat template, followed by the real target utterance as the assistant's answer. The engine scores
the prompt only: the output is the summed log-probability of the target tokens and their count.
Nothing is generated and nothing is parsed, so the only failures are inputs that cannot be
rendered and prompts longer than the model (error rows, never exceptions).

- `hf`: a transformers forward pass in a Ray Data actor pool (`LoglikScorer`); on CPU every
  sequence is scored alone (exact and independent of batching), on GPU in right-padded batches.
- `vllm`: `ray.data.llm` with `SamplingParams(max_tokens=1, prompt_logprobs=0)` on token ids
  (`tokenized_prompt`); vLLM returns, per prompt position, `{token_id: {logprob, rank,
  decoded_token}}` for the real prompt token (position 0 is None). vLLM does not read its
  prefix cache for requests that ask for prompt log-probabilities (`skip_reading_prefix_cache`):
  this is prefill-bound work.
"""

from __future__ import annotations

import pickle
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from memprune.llm.config import LLMConfig
from memprune.llm.engines import full_replicas, require_vllm, vllm_processor_config, wait_for_replicas
from memprune.llm.kinds import ENGINE_KINDS, plug
from memprune.llm.prompts import PromptError, reply_messages
from memprune.llm.rows import LLMError, chat_tokenizer, map_kwargs, ray_data_llm, short
from memprune.llm.tasks import load_template

INPUTS = ("context", "target", "target_speaker", "memory")
OUTPUT_FIELDS = [pa.field("loglik", pa.float64()), pa.field("n_target", pa.int64()),
                 pa.field("tokens_in", pa.int64()), pa.field("error", pa.string())]
_STATE = pa.schema([pa.field("_mp_pass", pa.binary()), pa.field("_mp_ids", pa.list_(pa.int32())),
                    pa.field("_mp_start", pa.int64()), pa.field("_mp_error", pa.string())])
_SCORED = pa.schema([pa.field("_mp_pass", pa.binary()), pa.field("_mp_loglik", pa.float64()),
                     pa.field("_mp_n_target", pa.int64()), pa.field("_mp_n_in", pa.int64()),
                     pa.field("_mp_error", pa.string())])


def prompt_and_target(row: dict[str, Any], template: Any, tokenizer: Any) -> tuple[list[int], int]:
    """Token ids of (chat-rendered reply prompt + real target) and where the target starts.

    The prompt and the target are tokenized separately and concatenated, so the target's tokens
    are the same with and without a memory note: the two log-probabilities score the same tokens.
    """
    target = row.get("target")
    if not isinstance(target, str) or not target.strip():
        raise PromptError(f"field 'target' must be a non-empty string, got {target!r}")
    messages = reply_messages({"context": row.get("context"), "memory": row.get("memory") or [],
                               "target_speaker": row.get("target_speaker")}, template)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prefix = tokenizer(text, add_special_tokens=False)["input_ids"]
    tail = tokenizer(target, add_special_tokens=False)["input_ids"]
    if not prefix:
        raise PromptError("the rendered prompt has no tokens")
    return list(prefix) + list(tail), len(prefix)


class _Tokenize:
    """Rows -> state rows: pickled passthrough, prompt+target token ids, target start; input errors as rows."""

    def __init__(self, config: LLMConfig) -> None:
        self.config = config

    def __call__(self, batch: pa.Table) -> pa.Table:
        template = load_template(self.config.likelihood_prompt, "loglik")
        tok = chat_tokenizer(self.config.model, self.config.trust_remote_code)
        limit = self.config.max_model_len or getattr(tok, "model_max_length", None)
        out = []
        for row in batch.to_pylist():
            state: dict[str, Any] = {"_mp_pass": pickle.dumps({k: v for k, v in row.items() if k not in INPUTS},
                                                              protocol=5),
                                     "_mp_ids": None, "_mp_start": None, "_mp_error": None}
            try:
                ids, start = prompt_and_target(row, template, tok)
            except (PromptError, KeyError, TypeError) as exc:
                state["_mp_error"] = f"input: {exc}"
            else:
                if limit and len(ids) > int(limit):
                    state["_mp_error"] = f"engine: prompt of {len(ids)} tokens exceeds the model length {limit}"
                else:
                    state.update(_mp_ids=ids, _mp_start=start)
            out.append(state)
        return pa.Table.from_pylist(out, schema=_STATE)


def target_logprob(ids: list[int], start: int, prompt_logprobs: list[Any]) -> float:
    """Sum of log p(ids[p]) over the target positions p >= start, from vLLM's per-position prompt logprobs."""
    total = 0.0
    for p in range(start, len(ids)):
        entry = prompt_logprobs[p]
        if entry is None:
            raise ValueError(f"no prompt logprob at position {p}")
        info = entry.get(ids[p], entry.get(str(ids[p]))) if isinstance(entry, dict) else None
        if info is None:
            raise ValueError(f"prompt logprob of token {ids[p]} at position {p} missing")
        total += float(info["logprob"] if isinstance(info, dict) else info.logprob)
    return total


class LoglikScorer:
    """A Ray Data actor holding one transformers causal LM: summed log-probabilities of the target tokens."""

    def __init__(self, model: str, trust_remote_code: bool, device: str, dtype: str, num_threads: int | None) -> None:
        import inspect

        import torch

        from memprune.llm.hf_engine import load_causal_lm

        self.torch = torch
        self.device = device
        self.model = load_causal_lm(model, trust_remote_code, device, dtype, num_threads)
        self.keep = "logits_to_keep" in inspect.signature(self.model.forward).parameters

    def _score(self, seqs: list[tuple[list[int], int]]) -> list[float]:
        """log p of each sequence's target tokens; one right-padded forward pass for `seqs`."""
        torch = self.torch
        width = max(len(ids) for ids, _ in seqs)
        input_ids = torch.zeros((len(seqs), width), dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for r, (ids, _) in enumerate(seqs):
            input_ids[r, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[r, :len(ids)] = 1
        first = min(start for _, start in seqs) - 1  # the earliest position whose logits predict a target token
        kwargs = {"logits_to_keep": width - first} if self.keep and len(seqs) == 1 else {}
        with torch.inference_mode():
            logits = self.model(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device),
                                **kwargs).logits.float()
        offset = width - logits.shape[1]  # logits[:, j] belongs to position offset + j
        out = []
        for r, (ids, start) in enumerate(seqs):
            rows = torch.arange(start - 1, len(ids) - 1) - offset
            logp = torch.log_softmax(logits[r, rows], dim=-1)
            target = torch.tensor(ids[start:], dtype=torch.long, device=logp.device)
            out.append(float(logp.gather(1, target[:, None]).sum()))
        return out

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        out = []
        todo = [(i, r["_mp_ids"], int(r["_mp_start"])) for i, r in enumerate(rows) if r["_mp_error"] is None]
        results: dict[int, dict[str, Any]] = {}
        # CPU: one sequence at a time (exact, independent of how Ray Data batches rows); GPU: padded batches
        groups = [todo] if self.device != "cpu" and todo else [[t] for t in todo]
        for group in groups:
            try:
                values = self._score([(ids, start) for _, ids, start in group])
            except Exception as exc:  # e.g. out of memory: these rows only
                for i, _, _ in group:
                    results[i] = {"_mp_error": f"engine: {type(exc).__name__}: {short(exc)}"}
                continue
            for (i, ids, start), value in zip(group, values):
                results[i] = {"_mp_loglik": value, "_mp_n_target": len(ids) - start, "_mp_n_in": len(ids)}
        for i, row in enumerate(rows):
            res = results.get(i, {"_mp_error": row["_mp_error"]})
            out.append({"_mp_pass": row["_mp_pass"], "_mp_loglik": res.get("_mp_loglik"),
                        "_mp_n_target": res.get("_mp_n_target"), "_mp_n_in": res.get("_mp_n_in"),
                        "_mp_error": res.get("_mp_error")})
        return pa.Table.from_pylist(out, schema=_SCORED)


class VLLMLoglikRequest:
    """Preprocess of the vLLM processor: token ids, one generated token, the real prompt tokens' logprobs."""

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        return {"tokenized_prompt": [int(t) for t in row["_mp_ids"]],
                "sampling_params": {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0, "detokenize": False}}


def vllm_loglik_postprocess(row: dict[str, Any]) -> dict[str, Any]:
    """Postprocess of the vLLM processor: the target's summed logprob (or the engine's error) and token counts."""
    out: dict[str, Any] = {"_mp_pass": row["_mp_pass"], "_mp_loglik": None, "_mp_n_target": None,
                           "_mp_n_in": None, "_mp_error": None, "_mp_request_id": row.get("request_id")}
    ids, start = [int(t) for t in row["_mp_ids"]], int(row["_mp_start"])
    error = row.get("__inference_error__")
    if error:
        out["_mp_error"] = f"engine: {short(error)}"
        return out
    try:
        out.update(_mp_loglik=target_logprob(ids, start, row.get("prompt_logprobs") or []),
                   _mp_n_target=len(ids) - start, _mp_n_in=int(row.get("num_input_tokens") or len(ids)))
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        out["_mp_error"] = f"engine: prompt logprobs unusable: {short(exc)}"
    return out


def _scored(batch: pa.Table) -> pa.Table:
    """Engine output -> the `_SCORED` columns (the vLLM path also keeps `_mp_request_id`)."""
    cols = [c for c in _SCORED.names if c in batch.column_names]
    table = batch.select(cols)
    for f in _SCORED:
        if f.name not in table.column_names:
            table = table.append_column(f, pa.nulls(table.num_rows, f.type))
        elif not table.schema.field(f.name).type.equals(f.type):
            table = table.set_column(table.schema.get_field_index(f.name), f, table.column(f.name).cast(f.type))
    extra = ["_mp_request_id"] if "_mp_request_id" in batch.column_names else []
    out = table.select(_SCORED.names)
    for name in extra:
        out = out.append_column(name, batch.column(name).cast(pa.int64()))
    return out


def _errors_only(batch: pa.Table) -> pa.Table:
    """State rows that never reach the engine (input errors, overlong prompts) as scored rows."""
    n = batch.num_rows
    return pa.table({"_mp_pass": batch.column("_mp_pass"), "_mp_loglik": pa.nulls(n, pa.float64()),
                     "_mp_n_target": pa.nulls(n, pa.int64()), "_mp_n_in": pa.nulls(n, pa.int64()),
                     "_mp_error": batch.column("_mp_error")}, schema=_SCORED)


def _finish(batch: pa.Table) -> pa.Table:
    """Scored rows -> passthrough columns + loglik, n_target, tokens_in, error (+ engine_request_id on vLLM)."""
    rows = []
    for row in batch.to_pylist():
        item = pickle.loads(row["_mp_pass"])
        item.update(loglik=row["_mp_loglik"], n_target=row["_mp_n_target"], tokens_in=row["_mp_n_in"],
                    error=row["_mp_error"])
        if "_mp_request_id" in row:
            item["engine_request_id"] = row["_mp_request_id"]
        rows.append(item)
    return pa.Table.from_pylist(rows)


def _vllm(ds: Any, config: LLMConfig, replicas: int) -> Any:
    require_vllm()
    # our own token ids: no chat-template, tokenize or detokenize stages
    processor = ray_data_llm().build_processor(
        vllm_processor_config(config, replicas, stages=False), preprocess=VLLMLoglikRequest(),
        postprocess=vllm_loglik_postprocess, preprocess_map_kwargs=map_kwargs(config) or None,
        postprocess_map_kwargs=map_kwargs(config) or None)
    return processor(ds).map_batches(_scored, batch_format="pyarrow", **map_kwargs(config))


def _hf(ds: Any, config: LLMConfig, replicas: int) -> Any:
    from memprune.llm.hf_engine import hf_actor_kwargs, hf_pool_kwargs

    return ds.map_batches(LoglikScorer, fn_constructor_kwargs=hf_actor_kwargs(config),
                          **hf_pool_kwargs(config, replicas))


plug("vllm", loglik=_vllm)
plug("hf", loglik=_hf)


def _engine(ds: Any, config: LLMConfig, replicas: int) -> Any:
    """Send tokenized state rows through the configured engine; returns `_SCORED` rows."""
    wait_for_replicas(ds, config, replicas)
    return config.kind.loglik(ds, config, replicas)


def run_loglik(ds: Any, config: LLMConfig, replicas: int | None = None) -> Any:
    """Score every row of `ds`: passthrough columns + `loglik` (sum over the target tokens), `n_target`,
    `tokens_in` (prompt + target tokens) and `error` (None, `input: ...` or `engine: ...`).

    Input rows hold `context` (list of {speaker, text}), `target`, `target_speaker` and `memory`
    (a list of notes; empty for the no-memory baseline). Row order may change. Engines: `hf`, `vllm`.
    """
    if not config.kind.log_probs or config.kind.loglik is None:
        able = " or ".join(sorted(n for n, k in ENGINE_KINDS.items() if k.log_probs))
        raise LLMError(f"the likelihood judge needs prompt log-probabilities: engine {able}, not {config.engine!r}")
    load_template(config.likelihood_prompt, "loglik")  # fail fast on a bad template
    names = list(ds.schema().names)
    missing = [c for c in ("context", "target", "target_speaker") if c not in names]
    if missing:
        raise ValueError(f"run_loglik: input is missing column(s) {missing}; it has {names}")
    state = ds.map_batches(_Tokenize(config), batch_format="pyarrow", **map_kwargs(config)).materialize()
    good = state.map_batches(lambda b: b.filter(pc.is_null(b.column("_mp_error"))), batch_format="pyarrow")
    failed = state.map_batches(lambda b: _errors_only(b.filter(pc.is_valid(b.column("_mp_error")))),
                               batch_format="pyarrow")
    # the materialized blocks are read in place (no new tasks) to size the engine pool
    n = sum(b.column("_mp_error").null_count for b in state.iter_batches(batch_size=None, batch_format="pyarrow"))
    parts = [failed]
    if n:
        want = replicas or full_replicas(config)
        parts.append(_engine(good, config, max(1, min(want, -(-n // config.batch_size)))))
    out = parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0]
    return out.map_batches(_finish, batch_format="pyarrow")


def loglik_summary(table: pa.Table) -> dict[str, Any]:
    """Counts of a `run_loglik` output: rows, ok, errors by kind, prompt tokens."""
    errors = [e for e in table.column("error").to_pylist() if e]
    kinds: dict[str, int] = {}
    for e in errors:
        kind = e.split(":", 1)[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    return {"rows": table.num_rows, "ok": table.num_rows - len(errors), "errors": len(errors),
            "errors_by_kind": dict(sorted(kinds.items())), "tokens_in": pc.sum(table.column("tokens_in")).as_py() or 0}
