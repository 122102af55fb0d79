"""The LLM tasks by registry: one `TaskSpec` per task owns its inputs, prompt, output schema, parse and finish.

`run_llm` (and `llm.local.run_rows`, `llm.tokens`, `llm.chunked`) read everything about a task here, so adding one
is one entry: its prompt columns (`inputs`, of which `required` must be present), the placeholders its template
uses, its template (an `LLMConfig` field, or `template` and `LLMConfig.prompts`) and its default token budget, how a
row becomes chat messages
(`build`, which may leave per-row state for the parser: labels, speakers, a per-row schema), its JSON schema for
structured output, how an answer is parsed (`parse`, strict then lenient) and kept (`result`), and how the kept
result fills the output columns (`finish`). `loglik` scores a given reply instead of generating (`generates`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from memprune.llm.lists import listwise_schema, parse_listwise
from memprune.llm.parsing import (
    JUDGE_SCHEMA,
    QA_JUDGE_SCHEMA,
    SUMMARY_SCHEMA,
    UPDATE_SCHEMA,
    Parsed,
    parse_answer,
    parse_judge,
    parse_qa_judge,
    parse_reply,
    parse_summary,
    parse_update,
)
from memprune.registry import Registry
from memprune.llm.prompts import (
    PromptTemplate,
    answer_messages,
    read_template,
    judge_messages,
    listwise_messages,
    qa_judge_messages,
    reply_messages,
    summarize_messages,
    turn_labels,
    update_messages,
)

PARSE = pa.field("parse", pa.string())  # strict or lenient: how an answer parsed
BULLET_TYPE = pa.struct([
    pa.field("speaker", pa.string()),
    pa.field("text", pa.string()),
    pa.field("evidence", pa.list_(pa.string())),
])
# (row, template, LLM config, state) -> chat messages; may set the state's `_mp_labels`, `_mp_speakers`, `_mp_schema`
Build = Callable[[dict[str, Any], PromptTemplate, Any, dict[str, Any]], list[dict[str, str]]]


@dataclass(frozen=True)
class TaskSpec:
    """One LLM task (see the module docstring)."""

    name: str
    inputs: tuple[str, ...]
    required: tuple[str, ...]
    placeholders: frozenset[str]
    prompt: str | None  # the `LLMConfig` field naming its template (None: `template` unless `LLMConfig.prompts` names one)
    max_tokens: int
    outputs: tuple[pa.Field, ...] = ()
    build: Build | None = None
    parse: Callable[[str | None, dict[str, Any]], Parsed] | None = None
    finish: Callable[[dict[str, Any], Any], None] | None = None
    schema: dict[str, Any] | None = None
    result: Callable[[Parsed], Any] = lambda parsed: parsed.value
    generates: bool = True
    template: str | None = None  # its default template (a name in memprune/prompts or a path) without a config field


TASKS: Registry[TaskSpec] = Registry("LLM task")


def register(spec: TaskSpec) -> TaskSpec:
    """Add a task to `TASKS` (each entry below, or a module of one's own)."""
    return TASKS.add(spec.name, spec)


def task_spec(name: str) -> TaskSpec:
    """The registered task `name`; ValueError naming the known ones otherwise."""
    return TASKS.known(name)


def load_template(name_or_path: str, task: str | None = None) -> PromptTemplate:
    """A prompt template by name or path (`memprune.llm.prompts`); with `task`, checked against the placeholders its
    template must use (a `PromptError` naming the file otherwise)."""
    if task is None:
        return read_template(name_or_path)
    return read_template(name_or_path, task_spec(task).placeholders, f"a {task}")


def prompt_of(config: Any, task: str) -> str:
    """The template `config` (an `LLMConfig`) names for `task`: `config.prompts[task]`, else its own field, else the
    task's default `template`."""
    spec = task_spec(task)
    named = config.prompts.get(task) or (getattr(config, spec.prompt) if spec.prompt else spec.template)
    if not named:
        raise ValueError(f"task {task!r} has no template: set llm.prompts.{task}")
    return str(named)


def _set(column: str, cast: Callable[[Any], Any]) -> Callable[[dict[str, Any], Any], None]:
    """A `finish` that writes the result, cast, into `column` (None without a result)."""
    def finish(item: dict[str, Any], result: Any) -> None:
        item[column] = None if result is None else cast(result)
    return finish


def _judge(row: dict[str, Any], template: PromptTemplate, config: Any, state: dict[str, Any]) -> list[dict[str, str]]:
    return judge_messages(row, template)


def _listwise(row: dict[str, Any], template: PromptTemplate, config: Any, state: dict[str, Any]
              ) -> list[dict[str, str]]:
    messages = listwise_messages(row, template)
    k = len(row["bullets"])
    state["_mp_labels"] = json.dumps(k)
    if config.structured_output:
        state["_mp_schema"] = json.dumps(listwise_schema(k))
    return messages


def _reply(row: dict[str, Any], template: PromptTemplate, config: Any, state: dict[str, Any]) -> list[dict[str, str]]:
    messages = reply_messages(row, template)
    state["_mp_speakers"] = json.dumps({"target": str(row["target_speaker"]), "speakers": sorted(
        {str(t.get("speaker")) for t in row.get("context") or [] if t.get("speaker") is not None})})
    return messages


def _summarize(row: dict[str, Any], template: PromptTemplate, config: Any, state: dict[str, Any]
               ) -> list[dict[str, str]]:
    messages = summarize_messages(row, template, config.max_bullets)
    state["_mp_labels"] = json.dumps(turn_labels(row["turns"]))
    state["_mp_speakers"] = json.dumps(sorted({str(t["speaker"]) for t in row["turns"]}
                                              | {str(s) for s in row.get("speakers") or []}))
    return messages


def _parse_reply(text: str | None, state: dict[str, Any]) -> Parsed:
    who = json.loads(state["_mp_speakers"] or "{}")
    return parse_reply(text, who.get("target"), who.get("speakers"))


def _parse_summary(text: str | None, state: dict[str, Any]) -> Parsed:
    return parse_summary(text, json.loads(state["_mp_labels"] or "{}"), set(json.loads(state["_mp_speakers"] or "[]")))


def _finish_summary(item: dict[str, Any], result: Any) -> None:
    ok = result is not None
    item["bullets"] = result["bullets"] if ok else None
    item["evidence_dropped"] = int(result.get("evidence_dropped", 0)) if ok else None
    item["bullets_dropped"] = int(result.get("bullets_dropped", 0)) if ok else None


register(TaskSpec(
    "judge", inputs=("bullet", "context", "target", "target_speaker"), required=("bullet", "context", "target"),
    placeholders=frozenset({"context", "target_speaker", "target", "bullet"}), prompt="judge_prompt", max_tokens=24,
    outputs=(pa.field("score", pa.float64()),), build=_judge, parse=lambda text, state: parse_judge(text),
    finish=_set("score", float), schema=JUDGE_SCHEMA))
register(TaskSpec(
    "summarize", inputs=("turns",), required=("conversation_id", "session_index", "turns"),
    placeholders=frozenset({"speakers", "time", "turns", "max_bullets"}), prompt="summarize_prompt", max_tokens=512,
    outputs=(pa.field("bullets", pa.list_(BULLET_TYPE)), pa.field("evidence_dropped", pa.int64()),
             pa.field("bullets_dropped", pa.int64()), PARSE),
    build=_summarize, parse=_parse_summary, finish=_finish_summary, schema=SUMMARY_SCHEMA,
    result=lambda parsed: {"bullets": [b.as_dict() for b in parsed.value], **parsed.notes}))
register(TaskSpec(
    "reply", inputs=("context", "memory", "target_speaker"), required=("context", "target_speaker"),
    placeholders=frozenset({"target_speaker", "context", "memory"}), prompt="reply_prompt", max_tokens=96,
    outputs=(pa.field("reply", pa.string()), PARSE), build=_reply, parse=_parse_reply, finish=_set("reply", str)))
register(TaskSpec(
    "answer", inputs=("memory", "question"), required=("question",),
    placeholders=frozenset({"memory", "question"}), prompt="answer_prompt", max_tokens=64,
    outputs=(pa.field("prediction", pa.string()), PARSE), build=lambda row, t, c, s: answer_messages(row, t),
    parse=lambda text, state: parse_answer(text), finish=_set("prediction", str)))
register(TaskSpec(
    "qa_judge", inputs=("question", "gold", "prediction"), required=("question", "gold", "prediction"),
    placeholders=frozenset({"question", "gold", "answer"}), prompt="qa_judge_prompt", max_tokens=24,
    outputs=(pa.field("verdict", pa.string()), PARSE), build=lambda row, t, c, s: qa_judge_messages(row, t),
    parse=lambda text, state: parse_qa_judge(text), finish=_set("verdict", str), schema=QA_JUDGE_SCHEMA))
register(TaskSpec(
    "listwise", inputs=("bullets", "context", "target", "target_speaker"), required=("bullets", "context", "target"),
    placeholders=frozenset({"context", "target_speaker", "target", "bullets"}), prompt="listwise_prompt",
    max_tokens=256, outputs=(pa.field("scores", pa.list_(pa.float64())), PARSE), build=_listwise,
    parse=lambda text, state: parse_listwise(text, int(json.loads(state["_mp_labels"]))),
    finish=_set("scores", lambda v: [float(x) for x in v])))
register(TaskSpec(
    "update", inputs=("earlier", "later"), required=("earlier", "later"),
    placeholders=frozenset({"earlier", "later"}), prompt="update_prompt", max_tokens=16,
    outputs=(pa.field("update", pa.bool_()), PARSE), build=lambda row, t, c, s: update_messages(row, t),
    parse=lambda text, state: parse_update(text), finish=_set("update", bool), schema=UPDATE_SCHEMA))
# The likelihood judge scores the target reply under a reply template: a prompt and placeholders, no generation.
register(TaskSpec(
    "loglik", inputs=("context", "memory", "target_speaker", "target"), required=("context", "target", "target_speaker"),
    placeholders=frozenset({"target_speaker", "context", "memory"}), prompt="likelihood_prompt", max_tokens=0,
    generates=False))
