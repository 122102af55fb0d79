"""Listwise judging: one prompt per target turn lists its candidate bullets and gets one score per bullet.

Every pair of one target turn repeats the same instructions, dialogue and target in the pairwise
judge; here they are sent once per list. Rules, precisely:

- A list holds the bullets paired with one target turn (`memprune.label.pairs.target_groups`), in
  an order shuffled per turn with `listwise.seed` (a seeded `random.Random(f"{seed}\\x1f{turn_id}")`),
  which spreads each bullet's position at random and so controls position bias.
- Lists longer than `max_bullets`, or whose prompt would pass the token budget (`max_prompt_tokens`,
  default: the judge's `max_model_len` minus the output budget), are cut into chunks in that order.
- With `orders = 2` every chunk is also scored in the reversed order (3+: more seeded shuffles); a
  pair's score is the mean over the orders that parsed, and `label.json` reports how well the
  orders agree (Spearman) and the mean score by list position.
- The output is enforced with structured output (`memprune.llm.lists.listwise_schema`: exactly the
  listed ids, once each); malformed lists are retried by `run_llm`, and a chunk none of whose
  orders parsed falls back to the pairwise judge for its bullets (`judge_mode = pairwise`).

The pairs table keeps one row per pair (with `judge_mode`), so aggregation, resume and accounting
are those of the pairwise judge.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memprune.label.config import LabelSettings
from memprune.label.cost import HOLE, PromptCounter, holed
from memprune.label.judges import JudgeEntry, register
from memprune.label.judging import judge_all
from memprune.label.llm_judge import LLMJudge, blocks, judge_pair_rows, sampling_override
from memprune.label.pairs import PairPlan, group_bounds, target_groups
from memprune.label.shards import judged_table, run_shards
from memprune.llm.prompts import escape, listwise_messages
from memprune.llm.tasks import load_template
from memprune.markdown import fmt
from memprune.raysession import ensure_ray
from memprune.work import WorkDir

KIND = "listwise"
LIST_OVERHEAD_TOKENS = 8  # generated tokens of a list beyond tokens_per_bullet per bullet ("[", "]", slack)


@dataclass(frozen=True)
class ScoredList:
    """One prompt: the plan positions of a chunk's bullets in display order (ids 1..k), in one order."""

    group: int
    chunk: int
    order: int
    positions: tuple[int, ...]


def shuffled(items: list[int], *key: Any) -> list[int]:
    """`items` in a deterministic order seeded by `key` (the same on every machine and run)."""
    out = list(items)
    random.Random("\x1f".join(str(k) for k in key)).shuffle(out)
    return out


def chunk_group(order: list[int], max_bullets: int, fits: Callable[[list[int]], bool] | None) -> list[list[int]]:
    """Cut one turn's shuffled positions into chunks of at most `max_bullets` whose prompt `fits` the budget.

    A bullet that does not fit even alone still gets a chunk of its own (the engine then reports the
    overlong prompt, and the chunk falls back to the pairwise judge).
    """
    chunks: list[list[int]] = []
    for pos in order:
        if chunks and len(chunks[-1]) < max_bullets and (fits is None or fits(chunks[-1] + [pos])):
            chunks[-1].append(pos)
        else:
            chunks.append([pos])
    return chunks


def display_order(chunk: list[int], order: int, seed: int, turn_id: str, index: int) -> list[int]:
    """Order 0 shows the chunk as shuffled, order 1 reversed (each bullet's position mirrored), 2+ reshuffled."""
    if order == 0:
        return list(chunk)
    if order == 1:
        return list(reversed(chunk))
    return shuffled(chunk, seed, turn_id, index, order)


def build_lists(plan: PairPlan, groups: list[tuple[int, int]], seed: int, max_bullets: int, orders: int,
                fits: Callable[[list[int]], bool] | None = None) -> list[ScoredList]:
    """Every list prompt of the plan, in judging order: group (target turn), chunk, order."""
    turns = plan.pairs.column("turn_id").to_pylist()
    lists = []
    for g, (a, b) in enumerate(groups):
        order0 = shuffled(list(range(a, b)), seed, turns[a])
        for c, chunk in enumerate(chunk_group(order0, max_bullets, fits)):
            for o in range(orders):
                lists.append(ScoredList(g, c, o, tuple(display_order(chunk, o, seed, turns[a], c))))
    return lists


def output_budget(k: int, tokens_per_bullet: int) -> int:
    """max_tokens of a list of `k` bullets."""
    return LIST_OVERHEAD_TOKENS + k * tokens_per_bullet


class ListwiseJudge(LLMJudge):
    """The listwise judge: lists through `run_llm(task="listwise")`, failed chunks through the pairwise judge."""

    kind = "llm"

    @property
    def list_name(self) -> str:
        """The `judge` value of pairs scored in a list: `llm:<engine>:<model>:<listwise prompt>`."""
        return f"llm:{self.config.describe('listwise')}"

    def judge_lists(self, ds: Any) -> Any:
        from memprune.llm import run_llm

        return run_llm(ds, self.config, task="listwise")


def _list_rows(plan: PairPlan, lists: list[ScoredList], samples: int, temperature: float,
               tokens_per_bullet: int) -> pa.Table:
    """The `run_llm(task="listwise")` input of `lists` x samples: bullets in display order + context of the turn."""
    first = [lst.positions[0] for lst in lists]
    ctx = plan.pairs.take(pa.array(first, pa.int64())).select(["context", "target", "target_speaker"]).to_pylist()
    text = plan.pairs.column("bullet").to_pylist()
    rows = []
    for s in range(samples):
        for i, (lst, c) in enumerate(zip(lists, ctx)):
            rows.append({**c, "list_index": i, "sample": s, "bullets": [text[p] for p in lst.positions],
                         "llm_sampling": sampling_override(s, samples, temperature,
                                                           output_budget(len(lst.positions), tokens_per_bullet))})
    return pa.Table.from_pylist(rows)


def score_lists(plan: PairPlan, lists: list[ScoredList], judge: ListwiseJudge, samples: int, temperature: float,
                cfg: LabelSettings) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Judge the lists (all samples in one pass), combine orders per chunk, fall back to pairwise where none parsed."""
    counters = {"calls": 0, "tokens_in": 0, "tokens_out": 0, "lists": len(lists) * samples, "lists_failed": 0,
                "lists_strict": 0, "chunks_fallback": 0, "pairs_fallback": 0}
    results: dict[tuple[int, int], list[float] | None] = {}
    attempts: dict[tuple[int, int], int] = {}
    if lists:
        table = _list_rows(plan, lists, samples, temperature, cfg.listwise.tokens_per_bullet)
        out = judge.judge_lists(blocks(table, cfg.llm_block_rows))
        for batch in out.iter_batches(batch_size=None, batch_format="pyarrow"):
            for row in batch.to_pylist():
                key = (int(row["sample"]), int(row["list_index"]))
                scores = row.get("scores")
                if scores is not None and len(scores) != len(lists[key[1]].positions):
                    scores = None
                results[key] = scores
                attempts[key] = int(row.get("attempts") or 0)
                counters["calls"] += attempts[key]
                counters["tokens_in"] += int(row.get("tokens_in") or 0)
                counters["tokens_out"] += int(row.get("tokens_out") or 0)
                counters["lists_failed"] += scores is None
                counters["lists_strict"] += scores is not None and row.get("parse") == "strict"
    chunks: dict[tuple[int, int, int], list[int]] = {}  # (sample, group, chunk) -> list indices, by order
    for s in range(samples):
        for i, lst in enumerate(lists):
            chunks.setdefault((s, lst.group, lst.chunk), []).append(i)
    rows: list[dict[str, Any]] = []
    fallback: list[tuple[int, int]] = []
    for (s, _, _), members in chunks.items():
        per_order: dict[int, dict[int, float]] = {}
        for i in members:
            scores = results.get((s, i))
            if scores is not None:
                per_order[lists[i].order] = dict(zip(lists[i].positions, scores))
        base = lists[members[0]]  # order 0: the positions of record
        if not per_order:
            counters["chunks_fallback"] += 1
            fallback += [(s, p) for p in sorted(base.positions)]
            continue
        n_orders = max(lists[i].order for i in members) + 1
        for place, p in enumerate(base.positions):
            by_order = [per_order.get(o, {}).get(p) for o in range(n_orders)]
            got = [v for v in by_order if v is not None]
            rows.append({"pos": p, "sample": s, "score": float(np.mean(got)), "error": None, "judge_mode": "listwise",
                         "attempts": max(attempts.get((s, i), 0) for i in members), "list_position": place,
                         "list_size": len(base.positions), "order_scores": by_order if n_orders > 1 else None})
    counters["pairs_fallback"] = len(fallback)
    if fallback:
        pair_rows, pair_counters = judge_pair_rows(plan, fallback, judge, samples, temperature, cfg.llm_block_rows)
        rows += pair_rows
        for k in ("calls", "tokens_in", "tokens_out"):
            counters[k] += pair_counters[k]
    return rows, counters


def judge_listwise(cfg: LabelSettings, plan: PairPlan, work: WorkDir, judge: ListwiseJudge, stats: dict[str, Any],
                   samples: int = 1, fits: Callable[[list[int]], bool] | None = None) -> pa.Table:
    """Listwise judging of the plan in resumable shards of whole target turns; the `JUDGED` rows of every pair.

    `fits(positions)` says whether a list of those plan positions fits the prompt token budget
    (`list_budget`); None: only `listwise.max_bullets` cuts lists.
    """
    opts = cfg.listwise
    groups = target_groups(plan)
    lists = build_lists(plan, groups, opts.seed, opts.max_bullets, opts.orders, fits)
    by_group: dict[int, list[ScoredList]] = {}
    for lst in lists:
        by_group.setdefault(lst.group, []).append(lst)
    starts = {a: g for g, (a, _) in enumerate(groups)}

    def compute(a: int, b: int) -> tuple[pa.Table, dict[str, int]]:
        g0 = starts[a]
        todo = [lst for g in range(g0, len(groups)) if groups[g][0] < b for lst in by_group.get(g, [])]
        rows, counters = score_lists(plan, todo, judge, samples, cfg.judge_temperature, cfg)
        return judged_table(rows), counters

    bounds = group_bounds(groups, cfg.effective_shard_size())
    table, run = run_shards(bounds, samples, work, "lists", compute, "label: judge lists", cfg.progress, ensure_ray)
    stats.update(run)
    stats["lists_planned"] = len(lists)
    return table


def order_agreement(table: pa.Table) -> dict[str, Any]:
    """How well the orders of a list agree: Spearman between the first two orders' scores, mean |difference|."""
    from memprune.label.agreement import spearman

    pairs = [v for v in table.column("order_scores").to_pylist() if v is not None and len(v) > 1
             and v[0] is not None and v[1] is not None]
    if not pairs:
        return {"pairs": 0, "spearman": None, "mean_abs_diff": None}
    a, b = np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])
    return {"pairs": len(pairs), "spearman": spearman(a, b), "mean_abs_diff": float(np.mean(np.abs(a - b)))}


def position_bias(table: pa.Table, max_positions: int = 10) -> dict[str, Any]:
    """Mean listwise score by position in the list (0 = first shown): a flat profile means no position bias."""
    lw = table.filter(pc.equal(table.column("judge_mode"), "listwise"))
    if not lw.num_rows:
        return {}
    pos = lw.column("list_position").to_numpy(zero_copy_only=False)
    score = lw.column("score").to_numpy(zero_copy_only=False).astype(np.float64)
    out = {}
    for p in range(min(int(pos.max()) + 1, max_positions)):
        sel = pos == p
        out[str(p)] = {"n": int(sel.sum()), "mean_score": float(score[sel].mean()) if sel.any() else None}
    return out


def listwise_prompts(plan: PairPlan, lists: list[ScoredList], groups: list[tuple[int, int]], counter: PromptCounter,
                     template: Any) -> Iterable[str]:
    """The listwise judge prompt of every list, in judging order."""
    rows = plan.pairs.select(["context", "target", "target_speaker"])
    bullets = plan.pairs.column("bullet").to_pylist()
    cache: dict[int, tuple[str, str]] = {}
    for lst in lists:
        if lst.group not in cache:
            cache.clear()
            row = rows.slice(groups[lst.group][0], 1).to_pylist()[0]
            cache[lst.group] = holed(lambda h: counter.render(listwise_messages({**row, "bullets": [h]}, template)),
                                      f'<bullet id="1">{HOLE}</bullet>')
        head, tail = cache[lst.group]
        block = "\n".join(f'<bullet id="{i}">{escape(bullets[p])}</bullet>' for i, p in enumerate(lst.positions, 1))
        yield head + block + tail


def list_budget(plan: PairPlan, groups: list[tuple[int, int]], counter: PromptCounter, template: Any,
                max_prompt_tokens: int | None, max_model_len: int | None,
                tokens_per_bullet: int) -> Callable[[list[int]], bool] | None:
    """`fits(positions)`: does the list prompt of these bullets (+ its output budget) fit the model? None: no limit."""
    if max_prompt_tokens is None and max_model_len is None:
        return None
    group_of = np.zeros(plan.pairs.num_rows, dtype=np.int64)
    for g, (a, b) in enumerate(groups):
        group_of[a:b] = g
    rows = plan.pairs.select(["context", "target", "target_speaker"])
    bullets = plan.pairs.column("bullet").to_pylist()
    fixed: dict[int, int] = {}

    def fits(positions: list[int]) -> bool:
        g = int(group_of[positions[0]])
        if g not in fixed:
            row = rows.slice(groups[g][0], 1).to_pylist()[0]
            text = counter.render(listwise_messages({**row, "bullets": [HOLE]}, template))
            fixed[g] = int(counter.count([text.replace(f'<bullet id="1">{HOLE}</bullet>', "")])[0])
        lines = [f'<bullet id="{len(positions):02d}">{escape(bullets[p])}</bullet>\n' for p in positions]
        prompt = fixed[g] + int(counter.count(["".join(lines)])[0])
        out = output_budget(len(positions), tokens_per_bullet)
        return ((max_prompt_tokens is None or prompt <= max_prompt_tokens)
                and (max_model_len is None or prompt + out <= max_model_len))

    return fits


def generated_per_list(counter: PromptCounter, k: int) -> int:
    """The planned output tokens of one list of k bullets: the schema's array, compact JSON (+ 1 end token)."""
    array = json.dumps([{"id": i, "score": 5} for i in range(1, k + 1)], separators=(",", ":"))
    return int(counter.count([array])[0]) + 1


def plan_prompts(plan: PairPlan, groups: list[tuple[int, int]], counter: PromptCounter, template: Any, llm: Any,
                 listwise: Any) -> tuple[Iterable[str], int, int]:
    """`--plan`: the lists of the run (cut to the token budget) and every list prompt; the arrays they generate."""
    fits = list_budget(plan, groups, counter, template, listwise.max_prompt_tokens,
                       getattr(llm, "max_model_len", None), listwise.tokens_per_bullet)
    lists = build_lists(plan, groups, listwise.seed, listwise.max_bullets, listwise.orders, fits)
    generated = sum(generated_per_list(counter, len(lst.positions)) for lst in lists)
    return listwise_prompts(plan, lists, groups, counter, template), generated, 0


def plan_summary(modes: dict[str, Any]) -> dict[str, Any]:
    """plan.json: how many times fewer prompt tokens per pair listwise needs than pairwise."""
    pw, lw = modes.get("pairwise"), modes[KIND]
    saving = pw["prompt_tokens_per_pair"] / lw["prompt_tokens_per_pair"] \
        if pw and pw["prompt_tokens_per_pair"] and lw["prompt_tokens_per_pair"] else None
    return {"listwise_saving": saving}


def _run(cfg: LabelSettings, plan: PairPlan, spec: Any, work: WorkDir, stats: dict[str, Any]) -> tuple[pa.Table, Any]:
    judge = ListwiseJudge(spec.llm)
    fits = None
    if cfg.listwise.max_prompt_tokens is not None or spec.llm.max_model_len is not None:
        counter = PromptCounter(spec.llm.model, cfg.cost.tokenizer, spec.llm.trust_remote_code)
        fits = list_budget(plan, target_groups(plan), counter, load_template(spec.llm.listwise_prompt, "listwise"),
                           cfg.listwise.max_prompt_tokens, spec.llm.max_model_len, cfg.listwise.tokens_per_bullet)
    return judge_listwise(cfg, plan, work, judge, stats, spec.samples, fits), judge


def report(cfg: LabelSettings, stats: dict[str, Any], tables: list[pa.Table]) -> dict[str, Any]:
    """Lists sent and failed, chunks that fell back to pairwise, order agreement and position bias."""
    c = stats.get("counters", {})
    table = pa.concat_tables(tables) if tables else None
    return {
        "lists_planned": stats.get("lists_planned"),
        "lists_sent": c.get("lists", 0),
        "lists_failed": c.get("lists_failed", 0),
        "lists_parsed_strictly": c.get("lists_strict", 0),
        "chunks_fallback": c.get("chunks_fallback", 0),
        "pairs_fallback": c.get("pairs_fallback", 0),
        "order_agreement": order_agreement(table) if table is not None else None,
        "position_bias": position_bias(table) if table is not None else None,
    }




def render(lw: dict[str, Any]) -> list[str]:
    """label.md's listwise section."""
    oa = lw.get("order_agreement") or {}
    return ["## Listwise", "", f"Lists sent {lw['lists_sent']}, failed after retries {lw['lists_failed']}; "
            f"chunks that fell back to pairwise {lw['chunks_fallback']} ({lw['pairs_fallback']} pairs). "
            f"Order agreement (Spearman, {oa.get('pairs', 0)} pairs): {fmt(oa.get('spearman'))}.", ""]


LISTWISE = register(JudgeEntry(
    rank=2, kind=KIND, judge="llm", judge_mode=KIND, samples=True, by_target=True, lists=True, task="listwise",
    default_prompt="judge_listwise_v1", description="one LLM prompt per target turn listing its bullets",
    extras=("list_position", "list_size"), judge_all=judge_all, run=_run,
    settings=lambda cfg: {"listwise": cfg.listwise.model_dump(mode="json"), "cost_tokenizer": cfg.cost.tokenizer},
    plan=plan_prompts, plan_summary=plan_summary, report=report, render=render))
