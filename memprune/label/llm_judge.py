"""The LLM judge (the paper's): an LLM reads the bullet, the dialogue context and the real next-session
utterance and says how much the bullet contributes to producing it, as a score in [0, 1].

Judging runs through Ray Data (`memprune.llm.run_llm(ds, config, task="judge")`, any engine) in
deterministic shards of pairs (`memprune.label.shards`), each written atomically under the label
work dir when done, so a killed run loses at most the shard in flight. Malformed outputs are
retried by the LLM layer, then recorded as error pairs (score null, with the message), never as
a default score. With `samples = k > 1` every pair is sent k times in the same pass, sample s
with its own seeds (`seed_offset`) at the judge temperature: k independent judgements for the
consensus (`memprune.label.consensus`) at the cost of one engine start.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from memprune.label.config import LabelSettings
from memprune.label.cost import HOLE, PromptCounter, holed
from memprune.label.judges import JudgeEntry, register
from memprune.label.judging import judge_all
from memprune.label.pairs import PairPlan, shard_bounds
from memprune.label.shards import judged_table, run_shards
from memprune.llm.prompts import escape, judge_messages
from memprune.raysession import ensure_ray
from memprune.work import WorkDir

if TYPE_CHECKING:  # pragma: no cover
    import ray.data

SAMPLE_SEED_STRIDE = 1000  # sample s uses seeds seed + 1000 s + attempt - 1: no two samples share a seed
JUDGE_INPUTS = ["bullet", "context", "target", "target_speaker"]


class LLMJudge:
    """The paper's LLM judge: runs judge prompts through `memprune.llm.run_llm` on Ray Data."""

    kind = "llm"

    def __init__(self, config: Any) -> None:
        self.config = config

    @property
    def name(self) -> str:
        """The value written to the `judge` column: `llm:<engine>:<model>:<prompt>`."""
        return f"llm:{self.config.describe('judge')}"

    def judge(self, ds: "ray.data.Dataset") -> "ray.data.Dataset":
        """Judge rows with `bullet`, `context`, `target`, `target_speaker` (+ passthrough columns).

        Output rows add `score`, `raw`, `error`, `attempts`, `tokens_in`, `tokens_out`; row
        order may change. Malformed outputs are retried by the engine layer, then become
        error rows (score None), never exceptions.
        """
        from memprune.llm import run_llm

        return run_llm(ds, self.config, task="judge")


def check_score(score: Any, error: Any) -> tuple[float | None, str | None]:
    """A judged score in [0, 1] or an error: out-of-range or non-numeric scores become errors."""
    if error:
        return None, str(error)
    if score is None:
        return None, "judge returned no score"
    try:
        value = float(score)
    except (TypeError, ValueError):
        return None, f"score is not a number: {score!r}"
    if math.isnan(value) or not 0.0 <= value <= 1.0:
        return None, f"score out of range [0, 1]: {score!r}"
    return value, None


def sampling_override(sample: int, samples: int, temperature: float, max_tokens: int | None = None) -> str | None:
    """The `llm_sampling` JSON of one row: sample s of k gets its own seeds and the judge temperature."""
    extra: dict[str, Any] = {}
    if samples > 1:
        extra.update(seed_offset=SAMPLE_SEED_STRIDE * sample, temperature=temperature)
    if max_tokens is not None:
        extra["max_tokens"] = max_tokens
    return json.dumps(extra, sort_keys=True) if extra else None


def blocks(table: pa.Table, block_rows: int) -> Any:
    """A Ray dataset of `table` cut into blocks of `block_rows`, in order, so every engine replica gets work."""
    import ray

    return ray.data.from_arrow([table.slice(s, block_rows) for s in range(0, table.num_rows, block_rows)])


def judge_pair_rows(plan: PairPlan, keys: list[tuple[int, int]], judge: LLMJudge, samples: int, temperature: float,
                    block_rows: int) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Pairwise judgements of the plan rows `keys` = [(sample, pos)]: `JUDGED` row dicts and cost counters."""
    if not keys:
        return [], {"calls": 0, "tokens_in": 0, "tokens_out": 0}
    pos = [p for _, p in keys]
    table = plan.pairs.take(pa.array(pos, pa.int64())).select(JUDGE_INPUTS)
    table = table.append_column("pos", pa.array(pos, pa.int64()))
    table = table.append_column("sample", pa.array([s for s, _ in keys], pa.int32()))
    if samples > 1:
        table = table.append_column("llm_sampling", pa.array(
            [sampling_override(s, samples, temperature) for s, _ in keys], pa.string()))
    rows, counters = [], {"calls": 0, "tokens_in": 0, "tokens_out": 0}
    for batch in judge.judge(blocks(table, block_rows)).iter_batches(batch_size=None, batch_format="pyarrow"):
        for row in batch.to_pylist():
            score, error = check_score(row.get("score"), row.get("error"))
            rows.append({"pos": row["pos"], "sample": row["sample"], "score": score, "error": error,
                         "judge_mode": "pairwise", "attempts": row.get("attempts"), "tokens_in": row.get("tokens_in"),
                         "tokens_out": row.get("tokens_out"), "raw": row.get("raw")})
            counters["calls"] += int(row.get("attempts") or 0)
            counters["tokens_in"] += int(row.get("tokens_in") or 0)
            counters["tokens_out"] += int(row.get("tokens_out") or 0)
    return rows, counters


def judge_llm(cfg: LabelSettings, plan: PairPlan, work: WorkDir, judge: LLMJudge, stats: dict[str, Any],
              samples: int = 1) -> pa.Table:
    """Judge the pending shards through Ray Data, one `run_llm` pass per shard, each written when done.

    Returns the `JUDGED` rows of every (sample, pair). `run_llm` materializes its retry passes,
    so a shard is the unit of progress: a kill loses at most the shard in flight. Large shards
    amortise the engine start-up (vLLM) per pass.
    """
    def compute(a: int, b: int) -> tuple[pa.Table, dict[str, int]]:
        keys = [(s, p) for s in range(samples) for p in range(a, b)]
        rows, counters = judge_pair_rows(plan, keys, judge, samples, cfg.judge_temperature, cfg.llm_block_rows)
        return judged_table(rows), counters

    bounds = shard_bounds(plan.pairs.num_rows, cfg.effective_shard_size())
    table, run = run_shards(bounds, samples, work, "pairs", compute, "label: judge pairs", cfg.progress, ensure_ray)
    stats.update(run)
    return table


def scores_and_errors(table: pa.Table) -> tuple[np.ndarray, list[str | None]]:
    """The score column as floats (NaN where null) and the error column of `JUDGED` rows."""
    return table.column("score").to_numpy(zero_copy_only=False).astype(np.float64), table.column("error").to_pylist()


def pairwise_prompts(plan: PairPlan, groups: list[tuple[int, int]], counter: PromptCounter,
                     template: Any) -> Iterable[str]:
    """The pairwise judge prompt of every pair, in judging order (the bullet is the only part that changes)."""
    rows = plan.pairs.select(["context", "target", "target_speaker"])
    bullets = plan.pairs.column("bullet").to_pylist()
    for a, b in groups:
        row = rows.slice(a, 1).to_pylist()[0]
        head, tail = holed(lambda h: counter.render(judge_messages({**row, "bullet": h}, template)), HOLE)
        for p in range(a, b):
            yield head + escape(bullets[p]) + tail


def plan_prompts(plan: PairPlan, groups: list[tuple[int, int]], counter: PromptCounter, template: Any, llm: Any,
                 listwise: Any) -> tuple[Iterable[str], int, int]:
    """`--plan`: every pairwise prompt; each call generates one `{"score":x}` object (+ 1 end token)."""
    return pairwise_prompts(plan, groups, counter, template), 0, int(counter.count(['{"score":0.5}'])[0]) + 1


def _run(cfg: LabelSettings, plan: PairPlan, spec: Any, work: WorkDir, stats: dict[str, Any]) -> tuple[pa.Table, Any]:
    judge = LLMJudge(spec.llm)
    return judge_llm(cfg, plan, work, judge, stats, spec.samples), judge


PAIRWISE = register(JudgeEntry(
    rank=1, kind="pairwise", judge="llm", judge_mode="pairwise", samples=True, task="judge", default_prompt="judge_v1",
    description="the paper's LLM judge: one prompt per (bullet, target turn) pair",
    judge_all=judge_all, run=_run, plan=plan_prompts))
