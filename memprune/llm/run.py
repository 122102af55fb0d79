"""`run_llm`: prompts -> engine -> strict/lenient parsing -> bounded retries -> output rows, on Ray Data.

The retry loop is a sequence of Ray Data passes: every pass sends only the rows that are
still pending, parses the outputs, and sets aside the rows that are finished (parsed, or
out of attempts). Pass k uses the sampling of attempt k (retries: higher temperature, a
different seed, optionally more tokens), and a pass is skipped when nothing is pending.
Passthrough columns travel through the engines pickled in one binary column, so no
engine can rename, retype or collide with them.

The pure pieces (`prepare_rows`, `settle_rows`, `finish_rows`) work on plain row dicts
and are tested without Ray.
"""

from __future__ import annotations

import json
import math
import pickle
from collections import Counter
from collections.abc import Iterable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from memprune.llm.config import LLMConfig, Task
from memprune.llm.engines import LLMError, full_replicas, generate
from memprune.llm.prompts import PromptError
from memprune.llm.tasks import load_template, task_spec

# An optional input column of any task: per-row sampling overrides as a JSON object with the keys
# `seed_offset` (added to every attempt's seed: independent samples of one prompt), `temperature`
# (of the first attempt) and `max_tokens` (e.g. sized to a list's length). Dropped from the output.
SAMPLING_COLUMN = "llm_sampling"
COMMON_OUT = ("raw", "error", "attempts", "tokens_in", "tokens_out")

COMMON_FIELDS = [
    pa.field("raw", pa.string()),
    pa.field("error", pa.string()),
    pa.field("attempts", pa.int64()),
    pa.field("tokens_in", pa.int64()),
    pa.field("tokens_out", pa.int64()),
]
STATE_TYPES = {
    "_mp_pass": pa.binary(), "_mp_messages": pa.string(), "_mp_schema": pa.string(), "_mp_labels": pa.string(),
    "_mp_speakers": pa.string(), "_mp_attempts": pa.int64(), "_mp_tok_in": pa.int64(), "_mp_tok_out": pa.int64(),
    "_mp_raw": pa.string(), "_mp_error": pa.string(), "_mp_done": pa.bool_(), "_mp_result": pa.string(),
    "_mp_method": pa.string(), "_mp_sampling": pa.string(),
}


def output_fields(task: Task) -> list[pa.Field]:
    """The columns `run_llm` adds for `task`, with their Arrow types."""
    return list(task_spec(task).outputs) + COMMON_FIELDS


def check_columns(names: Iterable[str], task: Task) -> None:
    """Raise ValueError when required input columns are missing or a column name is reserved."""
    names = list(names)
    missing = [c for c in task_spec(task).required if c not in names]
    if missing:
        raise ValueError(f"run_llm(task={task!r}): input is missing column(s) {missing}; it has {names}")
    reserved = [c for c in names if c.startswith("_mp_")]
    clash = [f.name for f in output_fields(task) if f.name in names]
    if reserved or clash:
        raise ValueError(f"run_llm(task={task!r}): input column(s) {reserved + clash} clash with reserved "
                         f"or output column names")


# ---------------------------------------------------------------- pure row steps


def _dropped(task: Task, keep_inputs: bool) -> set[str]:
    """Input columns that do not come back: the prompt inputs (unless `keep_inputs`) and the sampling overrides."""
    return (set() if keep_inputs else set(task_spec(task).inputs)) | {SAMPLING_COLUMN}


def prepare_rows(rows: list[dict[str, Any]], config: LLMConfig, task: Task, keep_inputs: bool = False
                 ) -> list[dict[str, Any]]:
    """Input rows -> state rows: pickled passthrough, chat messages, schema; bad inputs are finished errors."""
    spec = task_spec(task)
    template = load_template(config.prompt_name(task), task)
    schema = json.dumps(spec.schema) if config.structured_output and spec.schema is not None else None
    drop = _dropped(task, keep_inputs)
    out = []
    for row in rows:
        state: dict[str, Any] = {
            "_mp_pass": pickle.dumps({k: v for k, v in row.items() if k not in drop}, protocol=5),
            "_mp_messages": None, "_mp_schema": schema, "_mp_labels": None, "_mp_speakers": None,
            "_mp_attempts": 0, "_mp_tok_in": None, "_mp_tok_out": None, "_mp_raw": None,
            "_mp_error": None, "_mp_done": False, "_mp_result": None, "_mp_method": None,
            "_mp_sampling": row.get(SAMPLING_COLUMN),
        }
        try:
            state["_mp_messages"] = json.dumps(spec.build(row, template, config, state), ensure_ascii=False)
        except (PromptError, KeyError, TypeError) as exc:
            state["_mp_error"] = f"input: {exc}"
            state["_mp_done"] = True
        out.append(state)
    return out


def settle_rows(rows: list[dict[str, Any]], task: Task, attempt: int, final: bool) -> list[dict[str, Any]]:
    """Engine output rows -> state rows: count the attempt and tokens, parse, finish or leave pending."""
    spec = task_spec(task)
    out = []
    for row in rows:
        state = {k: row.get(k) for k in STATE_TYPES}
        state["_mp_attempts"] = int(state["_mp_attempts"] or 0) + 1
        for src, dst in (("_mp_n_in", "_mp_tok_in"), ("_mp_n_out", "_mp_tok_out")):
            if row.get(src) is not None:
                state[dst] = int(state[dst] or 0) + int(row[src])
        text = row.get("_mp_text")
        if text is not None:
            state["_mp_raw"] = text
        reason = row.get("_mp_engine_error")
        parsed = None
        if not reason:
            parsed = spec.parse(text, state)
            reason = parsed.error
        if parsed is not None and parsed.ok:
            state.update(_mp_result=json.dumps(spec.result(parsed)), _mp_method=parsed.method, _mp_error=None,
                         _mp_done=True)
        else:
            state["_mp_error"] = f"{reason} [attempt {state['_mp_attempts']}]"
            state["_mp_done"] = final
        out.append(state)
    return out


def finish_rows(rows: list[dict[str, Any]], task: Task) -> list[dict[str, Any]]:
    """State rows -> output rows: passthrough columns back, plus the task's output columns."""
    spec = task_spec(task)
    parse = any(f.name == "parse" for f in spec.outputs)
    out = []
    for row in rows:
        result = json.loads(row["_mp_result"]) if row.get("_mp_result") else None
        ok = result is not None
        item = pickle.loads(row["_mp_pass"])
        spec.finish(item, result)
        if parse:
            item["parse"] = row.get("_mp_method") if ok else None
        error = None if ok else (row.get("_mp_error") or "no result")
        if error and int(row.get("_mp_attempts") or 0) > 0 and not error.startswith("input:"):
            error = f"{error}; gave up after {row['_mp_attempts']} attempt(s)"
        item.update(raw=row.get("_mp_raw"), error=error, attempts=int(row.get("_mp_attempts") or 0),
                    tokens_in=row.get("_mp_tok_in"), tokens_out=row.get("_mp_tok_out"))
        out.append(item)
    return out


# ---------------------------------------------------------------- Ray Data glue


def _state_table(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=pa.schema([pa.field(k, t) for k, t in STATE_TYPES.items()]))


class _Prepare:
    def __init__(self, config: LLMConfig, task: Task, keep_inputs: bool) -> None:
        self.config, self.task, self.keep_inputs = config, task, keep_inputs

    def __call__(self, batch: pa.Table) -> pa.Table:
        return _state_table(prepare_rows(batch.to_pylist(), self.config, self.task, self.keep_inputs))


class _Settle:
    def __init__(self, task: Task, attempt: int, final: bool) -> None:
        self.task, self.attempt, self.final = task, attempt, final

    def __call__(self, batch: pa.Table) -> pa.Table:
        return _state_table(settle_rows(batch.to_pylist(), self.task, self.attempt, self.final))


class _Finish:
    def __init__(self, task: Task, passthrough: pa.Schema | None) -> None:
        self.task, self.passthrough = task, passthrough

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = finish_rows(batch.to_pylist(), self.task)
        fields = output_fields(self.task)
        if self.passthrough is not None:
            schema = pa.schema(list(self.passthrough) + fields)
            try:
                return pa.Table.from_pylist(rows, schema=schema)
            except (pa.ArrowInvalid, pa.ArrowTypeError):
                pass  # a passthrough value that no longer fits its input type: infer those columns
        if not rows:
            return pa.schema(fields).empty_table()
        table = pa.Table.from_pylist(rows)
        for f in fields:
            table = table.set_column(table.schema.get_field_index(f.name), f, table.column(f.name).cast(f.type))
        return table


def _done(batch: pa.Table) -> pa.Table:
    return batch.filter(pc.field("_mp_done"))


def _pending(batch: pa.Table) -> pa.Table:
    return batch.filter(~pc.field("_mp_done"))


def _passthrough_schema(ds: Any, task: Task, keep_inputs: bool) -> tuple[list[str], pa.Schema | None]:
    schema = ds.schema()
    if schema is None:
        raise ValueError(f"run_llm(task={task!r}): the input dataset has no schema (is it empty?)")
    names = list(schema.names)
    base = getattr(schema, "base_schema", None)
    drop = _dropped(task, keep_inputs)
    if isinstance(base, pa.Schema):
        return names, pa.schema([f for f in base if f.name not in drop])
    return names, None


def run_llm(ds: Any, config: LLMConfig, task: Task, keep_inputs: bool = False) -> Any:
    """Run `task` over every row of `ds` with the configured engine; never raises for bad model output.

    judge: rows with `bullet`, `context` (list of {speaker, text}), `target`, `target_speaker`
    -> passthrough columns + `score` (in [0, 1] or None), `raw`, `error`, `attempts`,
    `tokens_in`, `tokens_out` (summed over attempts).
    summarize: sessions rows -> passthrough columns (all but `turns`) + `bullets`
    (list of {speaker, text, evidence: turn ids}), `evidence_dropped`, `bullets_dropped`,
    `parse` (strict/lenient) and the same common columns.
    reply: rows with `context` (list of {speaker, text}), `memory` (list of notes: strings or
    {text, speaker, session_index}), `target_speaker` -> passthrough columns + `reply` (the
    generated utterance, or None), `parse` and the common columns; free text, no JSON schema.
    answer: rows with `question` and `memory` (notes, as for reply) -> passthrough + `prediction`
    (a short answer, or None), `parse` and the common columns; free text.
    qa_judge: rows with `question`, `gold`, `prediction` -> passthrough + `verdict` (CORRECT or
    WRONG, or None), `parse` and the common columns; JSON schema `QA_JUDGE_SCHEMA`.
    listwise: rows with `bullets` (list of k strings, shown as ids 1..k), `context`, `target`,
    `target_speaker` -> passthrough columns + `scores` (k numbers in [0, 1] in bullet order, or
    None), `parse` and the common columns; structured output pins exactly the ids 1..k.
    Any task: an optional `llm_sampling` column (JSON: seed_offset, temperature, max_tokens)
    overrides the sampling of that row (`memprune.llm.rows.row_sampling`).
    Row order may change. The prompt input columns are dropped unless `keep_inputs`.
    """
    if not task_spec(task).generates:
        raise ValueError(f"task {task!r} scores given text (memprune.llm.loglik), it generates nothing")
    load_template(config.prompt_name(task), task)  # fail fast on a bad template
    config.check_model()  # and on a model that is not there, before an engine starts
    names, passthrough = _passthrough_schema(ds, task, keep_inputs)
    check_columns(names, task)
    prepared = ds.map_batches(_Prepare(config, task, keep_inputs), batch_format="pyarrow").materialize()
    finished = [prepared.map_batches(_done, batch_format="pyarrow")]
    pending = prepared.map_batches(_pending, batch_format="pyarrow").materialize()
    full = None
    for attempt in range(1, config.max_retries + 2):
        n = pending.count()
        if n == 0:
            break
        if full is None:
            full = full_replicas(config)
        replicas = max(1, min(full, math.ceil(n / config.batch_size)))
        final = attempt == config.max_retries + 1
        try:
            settled = generate(pending, config, task, attempt, replicas).map_batches(
                _Settle(task, attempt, final), batch_format="pyarrow").materialize()
        except Exception as exc:
            if "Reached maximum retries" in str(exc):  # ray.data.llm's HTTP stage gave up on a request
                raise LLMError(f"{config.base_url}: the server kept failing (429/5xx/timeouts) after "
                               f"{config.http_retries} retries with backoff; raise http_retries or lower qps, then "
                               "rerun (finished work is kept)") from exc
            raise
        finished.append(settled.map_batches(_done, batch_format="pyarrow"))
        pending = settled.map_batches(_pending, batch_format="pyarrow").materialize()
    out = finished[0].union(*finished[1:]) if len(finished) > 1 else finished[0]
    return out.map_batches(_Finish(task, passthrough), batch_format="pyarrow")


# ---------------------------------------------------------------- reporting


def outcome_summary(table: pa.Table) -> dict[str, Any]:
    """Counts of a `run_llm` output: rows, ok, errors (by kind), attempts, retried rows, tokens."""
    rows = table.num_rows
    errors = [e for e in table.column("error").to_pylist() if e]
    attempts = table.column("attempts").to_pylist()
    kinds = Counter(e.split(":", 1)[0] if e.split(":", 1)[0] in ("input", "engine", "server") else "unparseable"
                    for e in errors)
    out = {
        "rows": rows,
        "ok": rows - len(errors),
        "errors": len(errors),
        "errors_by_kind": dict(sorted(kinds.items())),
        "retried_rows": sum(1 for a in attempts if a and a > 1),
        "attempts": dict(sorted(Counter(int(a or 0) for a in attempts).items())),
        "tokens_in": pc.sum(table.column("tokens_in")).as_py() or 0,
        "tokens_out": pc.sum(table.column("tokens_out")).as_py() or 0,
    }
    if "parse" in table.column_names:
        out["parse"] = dict(sorted(Counter(p for p in table.column("parse").to_pylist() if p).items()))
    return out
