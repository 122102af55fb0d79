"""The decision a run wrote, read back on the driver: a dry run's preview sample and every run's review page.

A run writes its decided rows (the store with its decision columns; a dry run `decision/`, the decision's columns
alone, `job.decision_block`). `decided` reads the columns the page needs from those files, `write_run_review`
writes `review.html` beside prune.md (`memprune.review`), with each record's time (its own, else its session's)
and token count in the run's unit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from memprune.errors import MemPruneError
from memprune.prune.config import PruneConfig
from memprune.prune.inputs import SESSION_TIME, TIME, corpus_session_times, first_known
from memprune.prune.job import DECISION_COLUMNS
from memprune.prune.store import read_parquet
from memprune.tokens import token_counter

REVIEW_TIME = "memprune_review_time"


def decided(files: list[Any], names: list[str], config: PruneConfig) -> pa.Table:
    """The written decision's rows (`files`, of columns `names`): the group keys, pins and times the run carries
    (`config.decision_carry`) and the decision's own columns."""
    columns = [c for c in dict.fromkeys([*config.decision_carry, *DECISION_COLUMNS]) if c in names]
    tables = [read_parquet(f, columns=columns) for f in files]
    return pa.concat_tables(tables) if tables else pa.table({c: [] for c in columns})


def shown_session_times(paths: list[Any]) -> dict[tuple[Any, Any], float] | None:
    """The corpus's session times for the page only (`corpus_session_times`), None where there are none or they
    are not times (a LoCoMo corpus's '1:56 pm on 8 May, 2023'): the page shows ages, it never fails a run."""
    try:
        return corpus_session_times(paths)
    except (MemPruneError, OSError):
        return None


def review_times(table: pa.Table, sessions: Mapping[tuple[Any, Any], float] | None) -> pa.Table:
    """`table` with `REVIEW_TIME`: each record's own time (epoch seconds), else its session's (the column, else
    `sessions`: the corpus's, by (conversation_id, session_index)); None where none is known, and the table unchanged
    where no record has one."""
    n = table.num_rows
    given = [table.column(c).to_numpy(zero_copy_only=False).astype(np.float64)
             for c in (TIME, SESSION_TIME) if c in table.column_names
             and (pa.types.is_integer(table.column(c).type) or pa.types.is_floating(table.column(c).type))]
    if sessions and {"conversation_id", "session_index"} <= set(table.column_names):
        keys = zip(table.column("conversation_id").to_pylist(), table.column("session_index").to_pylist())
        given.append(np.fromiter((sessions.get(k, np.nan) for k in keys), dtype=np.float64, count=n))
    times = first_known(*given)
    if times is None or np.isnan(times).all():
        return table
    return table.append_column(REVIEW_TIME, pa.array(times, pa.float64(), mask=np.isnan(times)))


def write_run_review(directory: Any, table: pa.Table, summary: dict[str, Any], config: PruneConfig,
                     sessions: Mapping[tuple[Any, Any], float] | None, out: str) -> None:
    """`directory/review.html` of this run's decision (`table`: `decided`'s rows; `sessions`: the session times)."""
    from memprune.review import Layout, write_review

    table = review_times(table, sessions)
    layout = Layout("bullet_id", tuple(config.rule.keys), pin=config.rule.pin_field,
                    time=REVIEW_TIME if REVIEW_TIME in table.column_names else None)
    count, _ = token_counter(config.tokenizer, summary["scorer"]["encoder"])
    write_review(directory, table, layout, summary, out, count)
