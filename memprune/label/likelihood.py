"""The likelihood-gain judge: how much a bullet raises the model's probability of the real next-session turn.

For a target turn a with dialogue context c and a bullet b, with the reply prompt of
`memprune.llm.loglik` (the generator's own prompt: dialogue, memory notes, "write the next
utterance of <speaker>"):

    gain(b, a) = mean per-token log p(a | c, memory = [b]) - mean per-token log p(a | c, no memory)

in nats per token of a, from prompt log-probabilities (vLLM `prompt_logprobs`, or a transformers
forward pass for `hf`). It measures usefulness directly instead of asking for an opinion: no
generation and no parsing, so no malformed outputs. The no-memory baseline is scored once per
target turn (shards hold whole turns). The gain is mapped to [0, 1] by a monotone squashing
(`gain_to_score`), applied after judging, so changing it reuses every shard:

- `tanh` (default): score = tanh(max(gain, 0) / scale): a bullet that does not help (gain <= 0)
  scores 0, as an irrelevant bullet does for the LLM judge; `scale` nats/token give tanh(1) = 0.76;
- `sigmoid`: score = 1 / (1 + exp(-gain / scale)): strictly monotone, 0.5 at gain 0 (keeps the
  order of harmful bullets, but moves every label near 0.5).

vLLM does not use its prefix cache for requests that ask for prompt log-probabilities, so this
judge is prefill-bound: plan it by prompt tokens (`memprune label --plan`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import pyarrow as pa

from memprune.label.config import LabelSettings
from memprune.label.cost import HOLE, PromptCounter, holed
from memprune.label.judges import JudgeEntry, register
from memprune.label.judging import judge_all
from memprune.label.llm_judge import blocks
from memprune.label.pairs import PairPlan, group_bounds, target_groups
from memprune.label.shards import judged_table, run_shards
from memprune.label.summary import value_stats
from memprune.llm.prompts import NO_MEMORY, render_note, reply_messages
from memprune.markdown import fmt
from memprune.raysession import ensure_ray
from memprune.work import WorkDir

MAPPINGS = ("tanh", "sigmoid")


def gain_to_score(gain: np.ndarray, mapping: str = "tanh", scale: float = 0.25) -> np.ndarray:
    """Map likelihood gains (nats/token) to [0, 1], monotone non-decreasing; NaN stays NaN."""
    gain = np.asarray(gain, dtype=np.float64)
    if scale <= 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    if mapping == "tanh":
        return np.tanh(np.maximum(gain, 0.0) / scale)
    if mapping == "sigmoid":
        return 1.0 / (1.0 + np.exp(-np.clip(gain / scale, -700, 700)))
    raise ValueError(f"mapping must be one of {', '.join(MAPPINGS)}, got {mapping!r}")


class LikelihoodJudge:
    """Scores pairs by the log-probability gain of the real turn; `name` is the `judge` column value."""

    kind = "likelihood"

    def __init__(self, config: Any, mapping: str = "tanh", scale: float = 0.25) -> None:
        if mapping not in MAPPINGS:
            raise ValueError(f"mapping must be one of {', '.join(MAPPINGS)}, got {mapping!r}")
        self.config = config
        self.mapping = mapping
        self.scale = scale

    @property
    def name(self) -> str:
        """`likelihood:<engine>:<model>:<prompt>:<mapping><scale>`, e.g. `likelihood:vllm:Qwen2.5-7B:reply_v1:tanh0.25`."""
        return f"likelihood:{self.config.describe('loglik')}:{self.mapping}{self.scale:g}"

    def loglik(self, ds: Any) -> Any:
        from memprune.llm.loglik import run_loglik

        return run_loglik(ds, self.config)


def note(bullet: str, speaker: str | None) -> dict[str, Any]:
    """A bullet as the memory note of the reply prompt (with its speaker when known)."""
    return {"text": bullet, "speaker": speaker} if speaker is not None else {"text": bullet}


def _rows(plan: PairPlan, groups: list[tuple[int, int]]) -> pa.Table:
    """One no-memory row per target turn (`pos` = -1 - group index) and one row per pair (`pos` = plan position)."""
    t = plan.pairs
    context, target, speaker = t.column("context"), t.column("target"), t.column("target_speaker")
    bullets, bspk = t.column("bullet").to_pylist(), t.column("bullet_speaker").to_pylist()
    rows = []
    for g, (a, b) in groups:
        shared = {"context": context[a].as_py(), "target": target[a].as_py(), "target_speaker": speaker[a].as_py()}
        rows.append({**shared, "pos": -1 - g, "memory": []})
        rows += [{**shared, "pos": p, "memory": [note(bullets[p], bspk[p])]} for p in range(a, b)]
    return pa.Table.from_pylist(rows)


def score_turns(plan: PairPlan, groups: list[tuple[int, int]], judge: LikelihoodJudge,
                block_rows: int) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Gains of every pair of these target turns (each baseline scored once): `JUDGED` row dicts and counters."""
    counters = {"calls": 0, "tokens_in": 0, "tokens_out": 0, "baselines": len(groups), "engine_passes": 0,
                "replicas_served": 0}
    got: dict[int, dict[str, Any]] = {}
    if groups:
        out = judge.loglik(blocks(_rows(plan, list(enumerate(groups))), block_rows))
        counters["engine_passes"] = 1
        for batch in out.iter_batches(batch_size=None, batch_format="pyarrow"):
            for row in batch.to_pylist():
                got[int(row["pos"])] = row
                counters["calls"] += 1
                counters["tokens_in"] += int(row.get("tokens_in") or 0)
                # vLLM numbers requests from 0 in each engine replica: the 0s count the replicas that served
                counters["replicas_served"] += row.get("engine_request_id") == 0
    if judge.config.kind.scores_by_generating:
        counters["tokens_out"] = counters["calls"]  # max_tokens=1: one generated token per request
    rows = []
    for g, (a, b) in enumerate(groups):
        base = got.get(-1 - g)
        base_error = "baseline missing" if base is None else base.get("error")
        for p in range(a, b):
            row = got.get(p)
            error = "pair missing" if row is None else row.get("error")
            gain = None
            if error is None and base_error is None:
                gain = row["loglik"] / row["n_target"] - base["loglik"] / base["n_target"]
            elif error is None:
                error = f"baseline: {base_error}"
            rows.append({"pos": p, "sample": 0, "gain": gain, "error": error, "judge_mode": "likelihood",
                         "attempts": 1, "tokens_in": None if row is None else row.get("tokens_in"), "tokens_out": None})
    return rows, counters


def judge_likelihood(cfg: LabelSettings, plan: PairPlan, work: WorkDir, judge: LikelihoodJudge,
                     stats: dict[str, Any]) -> pa.Table:
    """Likelihood gains of the plan's pairs in resumable shards of whole target turns; `JUDGED` rows with `gain`."""
    groups = target_groups(plan)
    starts = {a: g for g, (a, _) in enumerate(groups)}

    def compute(a: int, b: int) -> tuple[pa.Table, dict[str, int]]:
        todo = []
        g = starts[a]
        while g < len(groups) and groups[g][0] < b:
            todo.append(groups[g])
            g += 1
        rows, counters = score_turns(plan, todo, judge, cfg.llm_block_rows)
        return judged_table(rows), counters

    bounds = group_bounds(groups, cfg.effective_shard_size())
    table, run = run_shards(bounds, 1, work, "gains", compute, "label: likelihood", cfg.progress, ensure_ray)
    stats.update(run)
    return table


def with_scores(table: pa.Table, mapping: str, scale: float) -> pa.Table:
    """`JUDGED` rows of the likelihood judge with `score` = gain_to_score(gain) (null where the gain is)."""
    gain = table.column("gain").to_numpy(zero_copy_only=False).astype(np.float64)
    score = gain_to_score(gain, mapping, scale)
    col = pa.array([None if np.isnan(v) else float(v) for v in score], pa.float64())
    return table.set_column(table.schema.get_field_index("score"), "score", col)


def likelihood_prompts(plan: PairPlan, groups: list[tuple[int, int]], counter: PromptCounter,
                       template: Any) -> Iterable[str]:
    """Every sequence the likelihood judge scores: per target turn the no-memory baseline, then one per pair."""
    rows = plan.pairs.select(["context", "target", "target_speaker"])
    bullets, speakers = plan.pairs.column("bullet").to_pylist(), plan.pairs.column("bullet_speaker").to_pylist()
    for a, b in groups:
        row = rows.slice(a, 1).to_pylist()[0]
        head, tail = holed(lambda h: counter.render(reply_messages({**row, "memory": [h]}, template)),
                            f"<note>{HOLE}</note>")
        tail += row["target"]
        yield head + NO_MEMORY + tail
        for p in range(a, b):
            yield head + render_note(note(bullets[p], speakers[p]), 0) + tail


def plan_prompts(plan: PairPlan, groups: list[tuple[int, int]], counter: PromptCounter, template: Any, llm: Any,
                 listwise: Any) -> tuple[Iterable[str], int, int]:
    """`--plan`: every scored sequence; one generated token per request (`max_tokens=1`)."""
    return likelihood_prompts(plan, groups, counter, template), 0, 1


def _run(cfg: LabelSettings, plan: PairPlan, spec: Any, work: WorkDir, stats: dict[str, Any]) -> tuple[pa.Table, Any]:
    judge = LikelihoodJudge(spec.llm, cfg.likelihood.mapping, cfg.likelihood.scale)
    table = judge_likelihood(cfg, plan, work, judge, stats)
    return with_scores(table, cfg.likelihood.mapping, cfg.likelihood.scale), judge


def report(cfg: LabelSettings, stats: dict[str, Any], tables: list[pa.Table]) -> dict[str, Any]:
    """Baselines scored (one per target turn), the gain distribution (all judges) and the squashing used."""
    gains = np.concatenate([t.column("gain").to_numpy(zero_copy_only=False).astype(np.float64) for t in tables]) \
        if tables else np.zeros(0)
    gains = gains[np.isfinite(gains)]
    c = stats.get("counters", {})
    served = c.get("replicas_served", 0) / c["engine_passes"] if c.get("engine_passes") and c.get("replicas_served") \
        else None
    return {"baselines": c.get("baselines", 0), "replicas_served_per_pass": served, "mapping": cfg.likelihood.mapping,
            "scale": cfg.likelihood.scale, "gain_nats_per_token": value_stats(gains),
            "gain_positive_share": float((gains > 0).mean()) if gains.size else None}


def render(lk: dict[str, Any]) -> list[str]:
    """label.md's likelihood section."""
    g = lk["gain_nats_per_token"]
    return ["## Likelihood gain", "", f"Baselines {lk['baselines']}; gain (nats/token) mean {fmt(g['mean'])}, "
            f"min {fmt(g['min'])}, max {fmt(g['max'])}; mapping {lk['mapping']} (scale {lk['scale']}).", ""]


# vLLM reads no prefix cache for requests that ask for prompt log-probabilities: prefix_cache=False
LIKELIHOOD = register(JudgeEntry(
    rank=3, kind="likelihood", judge="likelihood", by_target=True, task="loglik", default_prompt="reply_v1",
    name_prefix="likelihood", extras=("gain",), prefix_cache=False,
    description="log-probability gain of the real turn with the bullet in memory",
    judge_all=judge_all, run=_run, plan=plan_prompts, report=report, render=render))
