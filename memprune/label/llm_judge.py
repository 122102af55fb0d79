"""The LLM judge (the paper's): an LLM reads the bullet, the dialogue context and the real next-session
utterance and says how much the bullet contributes to producing it, as a score in [0, 1].

Judging runs through Ray Data (`memprune.llm.run_llm(ds, config, task="judge")`, any engine) in
deterministic shards of pairs, each written atomically under the label work dir when done, so a
killed run loses at most the shard in flight. Malformed outputs are retried by the LLM layer, then
recorded as error pairs (score null, with the message), never as a default score.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from memprune.io import atomic_path
from memprune.label.config import LabelSettings
from memprune.label.pairs import PairPlan, shard_bounds
from memprune.runtime import ensure_ray
from memprune.work import WorkDir

if TYPE_CHECKING:  # pragma: no cover
    import ray.data

# One finished LLM shard under .work (`pos` indexes the judging order of the plan).
LLM_SHARD = pa.schema(
    [
        pa.field("pos", pa.int64(), nullable=False),
        pa.field("bullet_id", pa.string(), nullable=False),
        pa.field("turn_id", pa.string(), nullable=False),
        pa.field("score", pa.float64()),
        pa.field("error", pa.string()),
        pa.field("attempts", pa.int32()),
        pa.field("tokens_in", pa.int64()),
        pa.field("tokens_out", pa.int64()),
        pa.field("raw", pa.string()),
    ]
)


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


def _check_score(score: Any, error: Any) -> tuple[float | None, str | None]:
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


def _load_llm_shard(path: Path, start: int, stop: int) -> pa.Table | None:
    """A finished LLM shard holding exactly the positions [start, stop), or None."""
    if not path.exists():
        return None
    try:
        t = pq.read_table(path)
    except (pa.ArrowInvalid, OSError):
        return None
    if t.num_rows != stop - start or not t.schema.equals(LLM_SHARD):
        return None
    if t.column("pos").to_pylist() != list(range(start, stop)):
        return None
    return t


def judge_llm(cfg: LabelSettings, plan: PairPlan, work: WorkDir, judge: LLMJudge,
               stats: dict[str, Any]) -> tuple[np.ndarray, list[str | None]]:
    """Judge the pending shards through Ray Data, one `run_llm` pass per shard, each written when done.

    `run_llm` materializes its retry passes, so a shard is the unit of progress: a kill loses
    at most the shard in flight. Large shards amortise the engine start-up (vLLM) per pass.
    """
    import ray
    from tqdm import tqdm

    n = plan.pairs.num_rows
    bounds = shard_bounds(n, cfg.effective_shard_size())
    paths = [work.piece("pairs", i, "parquet") for i in range(len(bounds))]
    pending = [i for i, (a, b) in enumerate(bounds) if _load_llm_shard(paths[i], a, b) is None]
    stats.update(shards_total=len(bounds), shards_reused=len(bounds) - len(pending))
    t0 = time.perf_counter()
    judged = 0
    if pending:
        ensure_ray()
        base = plan.pairs.select(["bullet_id", "turn_id", "bullet", "context", "target", "target_speaker"])
        base = base.append_column("pos", pa.array(np.arange(n, dtype=np.int64)))
        bar = tqdm(total=sum(bounds[i][1] - bounds[i][0] for i in pending), desc="label: judge pairs",
                   unit="pair", disable=not cfg.progress)
        for i in pending:
            a, b = bounds[i]
            # several blocks per shard, in judging order, so every engine replica gets work
            blocks = [base.slice(s, min(cfg.llm_block_rows, b - s)) for s in range(a, b, cfg.llm_block_rows)]
            out = judge.judge(ray.data.from_arrow(blocks))
            got: dict[int, dict[str, Any]] = {}
            for batch in out.iter_batches(batch_size=None, batch_format="pyarrow"):
                for row in batch.select([c for c in LLM_SHARD.names if c in batch.column_names]).to_pylist():
                    score, error = _check_score(row.get("score"), row.get("error"))
                    row.update(score=score, error=error)
                    got[int(row["pos"])] = row
            missing = [p for p in range(a, b) if p not in got]
            if missing or len(got) != b - a:
                raise RuntimeError(f"the LLM judge returned {len(got)} rows for the {b - a} pairs of shard {i} "
                                   f"({len(missing)} missing); finished shards are kept, rerun to retry")
            with atomic_path(paths[i]) as tmp:
                pq.write_table(pa.Table.from_pylist([got[p] for p in range(a, b)], schema=LLM_SHARD), tmp)
            judged += b - a
            bar.update(b - a)
        bar.close()
    stats["judge_s"] = time.perf_counter() - t0
    stats["pairs_judged"] = judged
    tables = []
    for i, (a, b) in enumerate(bounds):
        t = _load_llm_shard(paths[i], a, b)
        if t is None:
            raise RuntimeError(f"{paths[i]}: shard missing or inconsistent after judging")
        tables.append(t)
    if not tables:
        return np.zeros(0), []
    allt = pa.concat_tables(tables)
    stats["tokens_in"] = pc.sum(allt.column("tokens_in")).as_py()
    stats["tokens_out"] = pc.sum(allt.column("tokens_out")).as_py()
    stats["attempts"] = pc.sum(allt.column("attempts")).as_py()
    scores = allt.column("score").to_numpy(zero_copy_only=False).astype(np.float64)
    return scores, allt.column("error").to_pylist()
