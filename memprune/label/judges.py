"""The judges by registry: one `JudgeEntry` per judge kind (the `judge_mode` column of pairs.parquet).

Each judge module (`similarity`, `llm_judge` (pairwise), `listwise`, `likelihood`) declares its entry and
registers it here; everything else asks the entry (what the judge needs, how it runs, plans and reports)
instead of comparing kind names. This module imports nothing of `label/`, so `label/config.py` validates
against it. The entries are registered when `memprune.label` is imported (its `__init__` imports the
judge modules), before any setting is validated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from memprune.registry import Registry


@dataclass(frozen=True)
class JudgeEntry:
    """What one judge kind is: how it is selected, what it needs, how it runs, plans and reports."""

    kind: str  # similarity | pairwise | listwise | likelihood: its `judge_mode` value in pairs.parquet
    judge: str  # the `judge` setting that selects it
    description: str
    rank: int  # where it comes in JUDGES (reports, --plan rows): registration order is import order
    judge_mode: str = "pairwise"  # the `judge_mode` setting it needs (the default for judges without modes)
    needs_llm: bool = True  # a model judge: an LLM config, consensus (judge_set), JudgeSpecs, a cost section
    samples: bool = False  # judge_samples > 1 allowed (a sampled judge)
    by_target: bool = False  # groups the pairs by target turn: needs order=target
    context: bool = True  # its pairs carry context turns (and context_turns is in the work fingerprint)
    proxy: bool = False  # a CPU proxy, not a judge of the paper
    lists: bool = False  # its rows carry the judge's list name (`judge` column) instead of its name
    shard_size: int = 4096  # default items per shard (texts for similarity, pairs for the others)
    compute: str = "judging passes (engine start-up included)"  # what label.json's timing calls its compute
    task: str | None = None  # the LLM task whose prompt it sends (JudgeSpec.name, --plan)
    default_prompt: str | None = None  # that prompt without an LLM config (--plan)
    name_prefix: str = "llm"  # JudgeSpec.name: <prefix>:<engine>:<model>:<prompt>
    extras: tuple[str, ...] = ()  # JUDGED columns copied into pairs.parquet
    prefix_cache: bool = True  # --plan: the engine's prefix cache serves shared prompt prefixes
    # judge_all(cfg, plan, inputs) -> Judged: the whole judging of a run (model judges: every JudgeSpec)
    judge_all: Callable[..., Any] | None = None
    # run(cfg, plan, spec, work, stats) -> (JUDGED table, judge object): one JudgeSpec in its work dir
    run: Callable[..., Any] | None = None
    settings: Callable[[Any], dict[str, Any]] | None = None  # (cfg) -> extra settings that change its shards
    # plan(plan, groups, counter, template, llm, cfg) -> (prompts, generated tokens, generated per call): --plan
    plan: Callable[..., Any] | None = None
    plan_summary: Callable[[dict[str, Any]], dict[str, Any]] | None = None  # (plan.json modes) -> extra keys
    executor: Callable[[Any], str] | None = None  # (cfg) -> label.json throughput.executor; None: ray
    report: Callable[..., dict[str, Any]] | None = None  # (cfg, stats, tables) -> label.json[kind]
    render: Callable[[dict[str, Any]], list[str]] | None = None  # (label.json[kind]) -> label.md lines


JUDGES: Registry[JudgeEntry] = Registry("judge kind")


def register(entry: JudgeEntry) -> JudgeEntry:
    """Add a judge kind to `JUDGES` (each judge module registers its own entry), kept in rank order."""
    JUDGES.add(entry.kind, entry)
    ordered = sorted(JUDGES.values(), key=lambda e: (e.rank, e.kind))
    JUDGES.clear()
    JUDGES.update((e.kind, e) for e in ordered)
    return entry


def judge_of(judge: str, judge_mode: str) -> JudgeEntry:
    """The entry selected by the `judge` and `judge_mode` settings; ValueError naming the valid ones."""
    for entry in JUDGES.values():
        if entry.judge == judge and entry.judge_mode == judge_mode:
            return entry
    wants = sorted({e.judge for e in JUDGES.values() if e.judge_mode == judge_mode})
    if wants and any(e.judge == judge for e in JUDGES.values()):
        raise ValueError(f"judge_mode={judge_mode} needs judge={' or judge='.join(wants)} (judge is {judge})")
    raise ValueError(f"judge={judge}, judge_mode={judge_mode}: no such judge; the judges: "
                     + ", ".join(f"{e.kind} (judge={e.judge}, judge_mode={e.judge_mode})" for e in JUDGES.values()))


def plan_modes() -> tuple[str, ...]:
    """The judge kinds `--plan` prices (those that send prompts)."""
    return tuple(kind for kind, entry in JUDGES.items() if entry.plan is not None)
