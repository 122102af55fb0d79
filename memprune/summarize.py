"""`memprune summarize`: sessions -> memory bullets with evidence, by an LLM on Ray Data.

Reads `DATA/sessions.parquet`, runs the session summarizer (`memprune.llm.run_llm`,
task "summarize") and writes into `OUT/`:

- `bullets.parquet`   the `bullets` table (ids `<conversation>:s<session>:b<i>`), evidence = turn ids;
- `sessions.parquet`  a copy of the input sessions, so `OUT` is a complete corpus for `memprune label`;
- `summaries.parquet` one row per session: bullets, raw text, error, attempts, tokens, dropped counts;
- `rejects.jsonl`     sessions whose summary failed (with the raw model text);
- `summarize.json` + `summarize.md`  counts and settings.

Evidence ids the model cites that do not exist in the session are dropped from the bullet
and counted. Sessions are processed in chunks; each finished chunk is written atomically
under `OUT/.work/<fingerprint>/`, so a rerun with the same inputs and config resumes.
Corpora that already have bullets (MSC, LoCoMo) can skip this step.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import Field

from memprune.errors import MemPruneError
from memprune.ingest import distribution
from memprune.io import JsonlSink, atomic_path, read_table, write_summary, write_table
from memprune.outputs import OutputSet, check_out_location
from memprune.llm import LLMConfig, outcome_summary, run_llm
from memprune.llm.config import LLMSection
from memprune.llm.run import COMMON_FIELDS
from memprune.llm.tasks import BULLET_TYPE
from memprune.rejects import Ledger
from memprune.raysession import ensure_ray
from memprune.schema import BULLETS, bullet_id
from memprune.storage import canonical, directory, location
from memprune.work import WorkDir, file_digest, resumable_chunks

SUMMARIES = pa.schema([
    pa.field("conversation_id", pa.string(), nullable=False),
    pa.field("session_index", pa.int32(), nullable=False),
    pa.field("n_bullets", pa.int64()),
    pa.field("bullets", pa.list_(BULLET_TYPE)),
    pa.field("evidence_dropped", pa.int64()),
    pa.field("bullets_dropped", pa.int64()),
    pa.field("parse", pa.string()),
    *COMMON_FIELDS,
])


class SummarizeError(MemPruneError):
    """The summarize inputs are unusable (missing table, bad config); the message names them."""


class SummarizeConfig(LLMSection):
    """Config of the summarize stage (`jobs/summarize.py`, `memprune summarize`)."""

    data: str = Field(..., description="Directory or URI with sessions.parquet (a `memprune ingest` output).")
    out: str = Field(..., description="Output directory or storage URI (s3://...).")
    chunk_sessions: int = Field(2048, ge=1, description="Sessions per resumable chunk (one run_llm pass each).")
    block_rows: int = Field(16, ge=1, description="Sessions per Ray Data block (spreads work over replicas).")
    limit: int | None = Field(None, ge=1, description="Only the first N sessions (a trial run).")



def run(config: SummarizeConfig) -> dict[str, Any]:
    """Run the summarize stage from its config (the `jobs/summarize.py` entry)."""
    return summarize(config.data, config.out, config.llm_settings(), chunk_sessions=config.chunk_sessions,
                     block_rows=config.block_rows, limit=config.limit)


def bullet_rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """`bullets` table rows of one summarized session (none for an error row)."""
    conv, idx = summary["conversation_id"], int(summary["session_index"])
    return [
        {"bullet_id": bullet_id(conv, idx, i), "conversation_id": conv, "session_index": idx,
         "speaker": b.get("speaker"), "text": b["text"], "evidence": list(b.get("evidence") or [])}
        for i, b in enumerate(summary.get("bullets") or [])
    ]


def _summarize_chunk(table: pa.Table, llm: LLMConfig, block_rows: int) -> pa.Table:
    """One chunk of sessions through run_llm; returns its `summaries` rows."""
    import ray

    blocks = [table.slice(s, block_rows) for s in range(0, table.num_rows, block_rows)]
    out = run_llm(ray.data.from_arrow(blocks), llm, task="summarize")
    rows = []
    for batch in out.iter_batches(batch_size=None, batch_format="pyarrow"):
        for r in batch.to_pylist():
            bullets = r.get("bullets")
            rows.append({
                "conversation_id": r["conversation_id"], "session_index": int(r["session_index"]),
                "n_bullets": None if bullets is None else len(bullets), "bullets": bullets,
                **{k: r.get(k) for k in ("evidence_dropped", "bullets_dropped", "parse", "raw", "error",
                                         "attempts", "tokens_in", "tokens_out")},
            })
    got = {(r["conversation_id"], r["session_index"]) for r in rows}
    want = set(zip(table.column("conversation_id").to_pylist(), table.column("session_index").to_pylist()))
    if got != want or len(rows) != table.num_rows:
        raise RuntimeError(f"run_llm returned {len(rows)} rows for a chunk of {table.num_rows} sessions "
                           f"({len(want - got)} missing); rerun to retry the chunk")
    rows.sort(key=lambda r: (r["conversation_id"], r["session_index"]))
    return pa.Table.from_pylist(rows, schema=SUMMARIES)


def summarize(data: str | Path, out: str | Path, llm: LLMConfig, chunk_sessions: int = 2048, block_rows: int = 16,
              limit: int | None = None, progress: bool = True) -> dict[str, Any]:
    """Summarize every session of `DATA/sessions.parquet` into bullets; write the tables to `out`; return the summary."""

    data, out = directory(data, "--data"), check_out_location(out, "summarize")
    sessions_path = data / "sessions.parquet"
    if not sessions_path.exists():
        raise SummarizeError(f"{data}: no sessions.parquet here (is it a `memprune ingest` output directory?)")
    if canonical(out) == canonical(str(data)):
        raise SummarizeError(f"{out}: the output directory must differ from the data directory")
    llm.check_model()
    started = time.perf_counter()
    sessions = read_table(sessions_path, "sessions")
    if limit is not None:
        sessions = sessions.slice(0, limit)
    work = WorkDir(out, {"sessions": file_digest(sessions_path), "llm": llm.model_dump(mode="json"),
                         "chunk_sessions": chunk_sessions, "limit": limit})
    summaries, chunk_stats = resumable_chunks(sessions, chunk_sessions, work,
                                              lambda chunk: _summarize_chunk(chunk, llm, block_rows), SUMMARIES,
                                              "summarize: chunks", progress, setup=ensure_ray)

    with OutputSet(out, "summarize") as outputs:
        bullets: list[dict[str, Any]] = []
        with JsonlSink(outputs.path("rejects.jsonl")) as ledger_sink:
            ledger = Ledger(ledger_sink)
            for row in summaries.to_pylist():
                ledger.saw("session")
                if row["error"]:
                    ledger.reject(source=str(sessions_path), record=f"{row['conversation_id']}:s{row['session_index']}",
                                  field="summary", kind="session", reason=row["error"], value=row["raw"])
                else:
                    ledger.wrote("session")
                    bullets.extend(bullet_rows(row))
            write_table(pa.Table.from_pylist(bullets, schema=BULLETS), outputs.path("bullets.parquet"), "bullets")
            write_table(summaries, outputs.path("summaries.parquet"))
            if limit is None:  # the input's own bytes (server-side when both are on one object store)
                location(sessions_path).copy_to(outputs.target("sessions.parquet"))
            else:
                with atomic_path(outputs.path("sessions.parquet")) as tmp:
                    pq.write_table(sessions, tmp)

        outcome = outcome_summary(summaries)
        per_session = [n for n in summaries.column("n_bullets").to_pylist() if n is not None]
        evidence = [len(b["evidence"]) for b in bullets]
        summary = {
            "data": str(data),
            "out": str(out),
            "llm": llm.describe("summarize"),
            "counts": {
                "sessions": summaries.num_rows,
                "sessions_ok": outcome["ok"],
                "sessions_error": outcome["errors"],
                "bullets": len(bullets),
                "bullets_without_evidence": sum(1 for n in evidence if n == 0),
                "bullets_dropped": sum(n or 0 for n in summaries.column("bullets_dropped").to_pylist()),
                "evidence_kept": sum(evidence),
                "evidence_dropped": sum(n or 0 for n in summaries.column("evidence_dropped").to_pylist()),
                "rejects": ledger_sink.count,
            },
            "llm_outcome": outcome,
            "bullets_per_session": distribution(per_session),
            "chunks": {"total": chunk_stats["chunks"], "reused": chunk_stats["reused"], "work": chunk_stats["work"]},
            "settings": {"llm": llm.model_dump(mode="json"), "chunk_sessions": chunk_sessions,
                         "block_rows": block_rows, "limit": limit},
            "seconds": round(time.perf_counter() - started, 3),
        }
        write_summary(outputs.staging, "summarize", summary, render_report(summary))
    return summary


def render_report(summary: dict[str, Any]) -> str:
    """The Markdown report of a summarize run."""
    c, o = summary["counts"], summary["llm_outcome"]
    lines = [
        "# memprune summarize", "",
        f"- data: `{summary['data']}`", f"- out: `{summary['out']}`", f"- LLM: `{summary['llm']}`",
        f"- time: {summary['seconds']} s", "",
        "| count | value |", "|---|---|",
        *(f"| {k} | {v} |" for k, v in c.items()),
        "", "## LLM outcome", "",
        "| item | value |", "|---|---|",
        f"| rows | {o['rows']} |", f"| ok | {o['ok']} |", f"| errors | {o['errors']} |",
        f"| errors by kind | {json.dumps(o['errors_by_kind'])} |",
        f"| retried rows | {o['retried_rows']} |", f"| attempts histogram | {json.dumps(o['attempts'])} |",
        f"| parse (strict/lenient) | {json.dumps(o.get('parse', {}))} |",
        f"| tokens in / out | {o['tokens_in']} / {o['tokens_out']} |",
        "", "## Bullets per session", "",
        json.dumps(summary["bullets_per_session"]), "",
    ]
    return "\n".join(lines)
