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
from memprune.llm.lists import listwise_schema, parse_listwise
from memprune.llm.parsing import (
    SCHEMAS,
    parse_answer,
    parse_judge,
    parse_qa_judge,
    parse_reply,
    parse_summary,
    parse_update,
)
from memprune.llm.prompts import (
    PromptError,
    answer_messages,
    judge_messages,
    listwise_messages,
    load_template,
    qa_judge_messages,
    reply_messages,
    summarize_messages,
    turn_labels,
    update_messages,
)

# An optional input column of any task: per-row sampling overrides as a JSON object with the keys
# `seed_offset` (added to every attempt's seed: independent samples of one prompt), `temperature`
# (of the first attempt) and `max_tokens` (e.g. sized to a list's length). Dropped from the output.
SAMPLING_COLUMN = "llm_sampling"

# Columns a task reads to build its prompt; they are not passed through unless keep_inputs=True.
TASK_INPUTS: dict[str, tuple[str, ...]] = {
    "judge": ("bullet", "context", "target", "target_speaker"),
    "summarize": ("turns",),
    "reply": ("context", "memory", "target_speaker"),
    "answer": ("memory", "question"),
    "qa_judge": ("question", "gold", "prediction"),
    "listwise": ("bullets", "context", "target", "target_speaker"),
    "update": ("earlier", "later"),
}
REQUIRED: dict[str, tuple[str, ...]] = {
    "judge": ("bullet", "context", "target"),
    "summarize": ("conversation_id", "session_index", "turns"),
    "reply": ("context", "target_speaker"),
    "answer": ("question",),
    "qa_judge": ("question", "gold", "prediction"),
    "listwise": ("bullets", "context", "target"),
    "update": ("earlier", "later"),
}
# Tasks whose parsed value is one scalar (a score, a text, a verdict), stored as it is.
SCALAR_TASKS = ("judge", "reply", "answer", "qa_judge", "listwise", "update")  # listwise: a list; update: a bool
COMMON_OUT = ("raw", "error", "attempts", "tokens_in", "tokens_out")

BULLET_TYPE = pa.struct([
    pa.field("speaker", pa.string()),
    pa.field("text", pa.string()),
    pa.field("evidence", pa.list_(pa.string())),
])
OUTPUT_FIELDS: dict[str, list[pa.Field]] = {
    "judge": [pa.field("score", pa.float64())],
    "summarize": [
        pa.field("bullets", pa.list_(BULLET_TYPE)),
        pa.field("evidence_dropped", pa.int64()),
        pa.field("bullets_dropped", pa.int64()),
        pa.field("parse", pa.string()),
    ],
    "reply": [pa.field("reply", pa.string()), pa.field("parse", pa.string())],
    "answer": [pa.field("prediction", pa.string()), pa.field("parse", pa.string())],
    "qa_judge": [pa.field("verdict", pa.string()), pa.field("parse", pa.string())],
    "listwise": [pa.field("scores", pa.list_(pa.float64())), pa.field("parse", pa.string())],
    "update": [pa.field("update", pa.bool_()), pa.field("parse", pa.string())],
}
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
    return OUTPUT_FIELDS[task] + COMMON_FIELDS


def check_columns(names: Iterable[str], task: Task) -> None:
    """Raise ValueError when required input columns are missing or a column name is reserved."""
    names = list(names)
    missing = [c for c in REQUIRED[task] if c not in names]
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
    return (set() if keep_inputs else set(TASK_INPUTS[task])) | {SAMPLING_COLUMN}


def prepare_rows(rows: list[dict[str, Any]], config: LLMConfig, task: Task, keep_inputs: bool = False
                 ) -> list[dict[str, Any]]:
    """Input rows -> state rows: pickled passthrough, chat messages, schema; bad inputs are finished errors."""
    template = load_template(config.prompt_name(task), task)
    schema = json.dumps(SCHEMAS[task]) if config.structured_output and task in SCHEMAS else None
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
            if task == "judge":
                messages = judge_messages(row, template)
            elif task == "listwise":
                messages = listwise_messages(row, template)
                k = len(row["bullets"])
                state["_mp_labels"] = json.dumps(k)
                if config.structured_output:
                    state["_mp_schema"] = json.dumps(listwise_schema(k))
            elif task == "reply":
                messages = reply_messages(row, template)
                state["_mp_speakers"] = json.dumps({"target": str(row["target_speaker"]), "speakers": sorted(
                    {str(t.get("speaker")) for t in row.get("context") or [] if t.get("speaker") is not None})})
            elif task == "answer":
                messages = answer_messages(row, template)
            elif task == "qa_judge":
                messages = qa_judge_messages(row, template)
            elif task == "update":
                messages = update_messages(row, template)
            else:
                messages = summarize_messages(row, template, config.max_bullets)
                state["_mp_labels"] = json.dumps(turn_labels(row["turns"]))
                state["_mp_speakers"] = json.dumps(sorted({str(t["speaker"]) for t in row["turns"]}
                                                          | {str(s) for s in row.get("speakers") or []}))
            state["_mp_messages"] = json.dumps(messages, ensure_ascii=False)
        except (PromptError, KeyError, TypeError) as exc:
            state["_mp_error"] = f"input: {exc}"
            state["_mp_done"] = True
        out.append(state)
    return out


def _parse(task: Task, text: str | None, state: dict[str, Any]) -> Any:
    if task == "judge":
        return parse_judge(text)
    if task == "listwise":
        return parse_listwise(text, int(json.loads(state["_mp_labels"])))
    if task == "reply":
        who = json.loads(state["_mp_speakers"] or "{}")
        return parse_reply(text, who.get("target"), who.get("speakers"))
    if task == "answer":
        return parse_answer(text)
    if task == "qa_judge":
        return parse_qa_judge(text)
    if task == "update":
        return parse_update(text)
    labels = json.loads(state["_mp_labels"] or "{}")
    speakers = set(json.loads(state["_mp_speakers"] or "[]"))
    return parse_summary(text, labels, speakers)


def settle_rows(rows: list[dict[str, Any]], task: Task, attempt: int, final: bool) -> list[dict[str, Any]]:
    """Engine output rows -> state rows: count the attempt and tokens, parse, finish or leave pending."""
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
            parsed = _parse(task, text, state)
            reason = parsed.error
        if parsed is not None and parsed.ok:
            if task in SCALAR_TASKS:
                result: Any = parsed.value
            else:
                result = {"bullets": [b.as_dict() for b in parsed.value], **parsed.notes}
            state.update(_mp_result=json.dumps(result), _mp_method=parsed.method, _mp_error=None, _mp_done=True)
        else:
            state["_mp_error"] = f"{reason} [attempt {state['_mp_attempts']}]"
            state["_mp_done"] = final
        out.append(state)
    return out


def finish_rows(rows: list[dict[str, Any]], task: Task) -> list[dict[str, Any]]:
    """State rows -> output rows: passthrough columns back, plus the task's output columns."""
    out = []
    for row in rows:
        result = json.loads(row["_mp_result"]) if row.get("_mp_result") else None
        ok = result is not None
        item = pickle.loads(row["_mp_pass"])
        if task == "judge":
            item["score"] = float(result) if ok else None
        elif task in ("reply", "answer", "qa_judge"):
            item[OUTPUT_FIELDS[task][0].name] = str(result) if ok else None
            item["parse"] = row.get("_mp_method") if ok else None
        elif task == "update":
            item["update"] = bool(result) if ok else None
            item["parse"] = row.get("_mp_method") if ok else None
        elif task == "listwise":
            item["scores"] = [float(v) for v in result] if ok else None
            item["parse"] = row.get("_mp_method") if ok else None
        else:
            item["bullets"] = result["bullets"] if ok else None
            item["evidence_dropped"] = int(result.get("evidence_dropped", 0)) if ok else None
            item["bullets_dropped"] = int(result.get("bullets_dropped", 0)) if ok else None
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
    if task not in TASK_INPUTS:
        raise ValueError(f"unknown task {task!r}; expected one of {', '.join(TASK_INPUTS)}")
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
