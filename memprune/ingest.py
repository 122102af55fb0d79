"""`memprune ingest`: any source format -> the canonical corpus tables, with rejects and counts.

Writes `sessions.parquet`, `bullets.parquet` (and `qa.parquet` for formats with QA),
`rejects.jsonl` and `ingest.json`. Every file is written atomically; conservation
(seen == written + rejected, per item kind) is checked before `ingest.json` is written.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pyarrow.parquet as pq
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from memprune.adapters import IngestError, get_adapter
from memprune.config import ConfigModel
from memprune.io import JsonlSink, read_table, table_sink, write_json
from memprune.outputs import OutputSet, check_out_location
from memprune.rejects import Ledger


class IngestConfig(ConfigModel):
    """Config of the ingest stage (`jobs/ingest.py`)."""

    format: str
    input: str
    out: str
    split: str | None = None


def run(config: IngestConfig) -> dict[str, Any]:
    """Run the ingest stage from its config."""
    return ingest(config.format, config.input, config.out, split=config.split)


class ConservationError(RuntimeError):
    """An adapter lost items without rejecting them: a bug, never a data problem."""


def ingest(format: str, input: str | Path, out: str | Path, split: str | None = None) -> dict[str, Any]:
    """Read `input` with the `format` adapter and write the corpus tables into `out` (a directory or a storage URI,
    committed there as one output set); return the summary."""
    adapter = get_adapter(format)
    input, out = Path(input), check_out_location(out, "ingest")
    if not input.exists():
        raise IngestError(f"{input}: no such file or directory")
    if not (input.is_file() or input.is_dir()):
        raise IngestError(f"{input}: not a regular file or directory (a pipe or device is read once; save it to a "
                          "file first)")
    if input.is_dir() and out.local and Path(out.path).resolve().is_relative_to(input.resolve()):
        raise IngestError(f"{out}: the output directory is inside the input directory {input}; ingest would read "
                          "its own outputs as input")
    started = time.perf_counter()
    keys: dict[str, set] = {"sessions": set(), "bullets": set(), "qa": set()}
    names = ["sessions", "bullets", *(["qa"] if adapter.has_qa else [])]
    with OutputSet(out, "ingest") as outputs, ExitStack() as files:  # committed together, or not at all
        rejects = files.enter_context(JsonlSink(outputs.path("rejects.jsonl")))
        ledger = Ledger(rejects)
        sinks = {name: files.enter_context(table_sink(outputs.path(f"{name}.parquet"), name)) for name in names}
        with Progress(TextColumn("ingest {task.description}"), BarColumn(), TextColumn("{task.completed} conversations"),
                      TimeElapsedColumn(), transient=True,
                      console=Console(stderr=True)) as progress:
            task = progress.add_task(f"{format}:{input.name}", total=None)
            for conv in adapter.read(input, ledger, split=split):
                _check_unique(conv, keys, str(input))
                sinks["sessions"].write_many(conv.sessions)
                sinks["bullets"].write_many(conv.bullets)
                if "qa" in sinks:
                    sinks["qa"].write_many(conv.qa)
                elif conv.qa:
                    raise ConservationError(f"adapter {format!r} produced QA rows but declares has_qa=False")
                for kind, n in conv.counts().items():
                    ledger.wrote(kind, n)
                progress.advance(task)
        imbalance = ledger.imbalance()
        if imbalance:
            raise ConservationError(f"adapter {format!r} lost items without rejecting them: {imbalance}")
        files.close()  # the tables and rejects are complete before the summary that lists them
        written = ledger.written
        summary = {
            "format": format,
            "input": str(input),
            "split": split,
            "counts": {
                "conversations": written["conversation"],
                "sessions": written["session"],
                "turns": written["turn"],
                "bullets": written["bullet"],
                "qa": written["qa"],
                "rejects": rejects.count,
            },
            "ledger": ledger.summary(),
            "tables": sorted(f"{name}.parquet" for name in sinks),
            "seconds": round(time.perf_counter() - started, 3),
        }
        write_json(outputs.path("ingest.json"), summary)
    return summary


def _check_unique(conv, keys: dict[str, set], source: str) -> None:
    """Ids must be unique across the whole corpus; a clash is an adapter bug, so fail loudly."""
    for name, rows, key in (("sessions", conv.sessions, lambda r: (r["conversation_id"], r["session_index"])),
                            ("bullets", conv.bullets, lambda r: r["bullet_id"]),
                            ("qa", conv.qa, lambda r: r["qa_id"])):
        for row in rows:
            k = key(row)
            if k in keys[name]:
                raise ConservationError(f"{source}: duplicate {name} key {k!r} (conversation {conv.conversation_id})")
            keys[name].add(k)


def distribution(values: list[int]) -> dict[str, float]:
    """n, min, mean, median, max and total of a list of counts."""
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "min": min(values),
        "mean": round(statistics.fmean(values), 3),
        "median": statistics.median(values),
        "max": max(values),
        "total": sum(values),
    }


def corpus_stats(data: str | Path) -> dict[str, Any]:
    """Counts and per-session bullet/turn distributions of a corpus directory."""
    data = Path(data)
    if not (data / "sessions.parquet").exists():
        raise IngestError(f"{data}: no sessions.parquet here (is it a `memprune ingest` output directory?)")
    sessions = read_table(data / "sessions.parquet", "sessions")
    bullets = read_table(data / "bullets.parquet", "bullets")
    turns_per_session = pc.list_value_length(sessions.column("turns")).to_pylist()
    keys = list(zip(sessions.column("conversation_id").to_pylist(), sessions.column("session_index").to_pylist()))
    per_session = Counter(zip(bullets.column("conversation_id").to_pylist(), bullets.column("session_index").to_pylist()))
    bullets_per_session = [per_session.get(k, 0) for k in keys]
    by_index: dict[int, list[int]] = {}
    for (_, k), n in zip(keys, bullets_per_session):
        by_index.setdefault(k, []).append(n)
    result: dict[str, Any] = {
        "conversations": len(set(sessions.column("conversation_id").to_pylist())),
        "sessions": sessions.num_rows,
        "turns": sum(turns_per_session),
        "bullets": bullets.num_rows,
        "turns_per_session": distribution(turns_per_session),
        "bullets_per_session": distribution(bullets_per_session),
        "bullets_per_session_index": {str(k): distribution(v) for k, v in sorted(by_index.items())},
    }
    if (data / "qa.parquet").exists():
        result["qa"] = pq.read_metadata(data / "qa.parquet").num_rows
    if (data / "ingest.json").exists():
        result["rejects"] = json.loads((data / "ingest.json").read_text())["counts"]["rejects"]
    return result
