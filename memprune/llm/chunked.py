"""`run_llm` over a table in resumable chunks: the generation loop of the evaluations (dialogue, qa).

The input table has a unique `row_id` column and the task's prompt columns. It is cut into
chunks of consecutive rows; each chunk is one `run_llm` pass on Ray Data, saved atomically under
`OUT/.work/<fingerprint>/` (`memprune.work.resumable_chunks`). The fingerprint covers the prompt
inputs, the LLM config, the prompt template and the chunk size, so rerunning the same command after a crash or a
kill redoes only the chunks that were not saved, and any change to what the outputs depend on
starts afresh. Results come back in the input's row order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from memprune.llm.config import LLMConfig, Task
from memprune.llm.tasks import load_template
from memprune.llm.run import output_fields, run_llm
from memprune.raysession import ensure_ray
from memprune.storage import Location
from memprune.work import WorkDir, resumable_chunks


def results_schema(task: Task) -> pa.Schema:
    """The columns a chunk returns: `row_id` and the task's output columns (`output_fields`)."""
    return pa.schema([pa.field("row_id", pa.string(), nullable=False), *output_fields(task)])


def work_payload(inputs: pa.Table, llm: LLMConfig, task: Task, chunk_rows: int) -> dict[str, Any]:
    """What the saved chunks depend on: a digest of the prompt inputs, the LLM config, the template's messages
    and the chunk size (chunk files of another size never mix with these)."""
    sink = pa.BufferOutputStream()
    table = inputs.combine_chunks()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    template = load_template(llm.prompt_name(task), task)
    return {"rows": hashlib.sha256(sink.getvalue().to_pybytes()).hexdigest(), "llm": llm.model_dump(mode="json"),
            "template": template.messages, "chunk_rows": chunk_rows}


def _run_chunk(inputs: pa.Table, llm: LLMConfig, task: Task, block_rows: int) -> pa.Table:
    """One chunk through `run_llm` (in blocks of `block_rows`, so several engine replicas share it), in row order."""
    import ray

    schema = results_schema(task)
    blocks = [inputs.slice(s, block_rows) for s in range(0, inputs.num_rows, block_rows)]
    got = []
    for batch in run_llm(ray.data.from_arrow(blocks), llm, task=task).iter_batches(batch_size=None,
                                                                                  batch_format="pyarrow"):
        got.extend({k: r.get(k) for k in schema.names} for r in batch.to_pylist())
    want = inputs.column("row_id").to_pylist()
    if sorted(r["row_id"] for r in got) != sorted(want):
        raise RuntimeError(f"run_llm returned {len(got)} rows for a chunk of {len(want)}; rerun to retry the chunk")
    order = {rid: i for i, rid in enumerate(want)}
    got.sort(key=lambda r: order[r["row_id"]])
    return pa.Table.from_pylist(got, schema=schema)


def run_llm_chunks(rows: pa.Table, columns: Sequence[str], llm: LLMConfig, task: Task, out: str | Path | Location,
                   chunk_rows: int, block_rows: int, desc: str, progress: bool = True
                   ) -> tuple[pa.Table, dict[str, Any]]:
    """`run_llm(task)` over `rows` (its `row_id` + `columns`), resumable; the results table in row order and
    the chunk counts (`chunks`, `reused`, `work`)."""
    inputs = rows.select(["row_id", *columns])
    work = WorkDir(out, work_payload(inputs, llm, task, chunk_rows))
    results, stats = resumable_chunks(inputs, chunk_rows, work, lambda chunk: _run_chunk(chunk, llm, task, block_rows),
                                      results_schema(task), desc, progress, setup=ensure_ray)
    if results.column("row_id").to_pylist() != rows.column("row_id").to_pylist():
        raise RuntimeError(f"{work.path}: the saved chunks do not match the rows; delete it and rerun")
    return results, stats
