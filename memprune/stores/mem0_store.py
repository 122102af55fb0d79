"""The `mem0` store: a Mem0 memory store opened through Mem0's own library from the user's config file.

`Memory.from_config(<the YAML/JSON file>)` opens whatever vector backend the config names. Reading
scrolls the Qdrant collection directly in pages (the default backend; a memory-flat stream) and
falls back to the vector store's `list` for other backends. Records are grouped by `user_id`
(`--map group=agent_id` or `run_id` for the others); their text is the payload's `data`.
Deletes go through `Memory.delete` (Mem0 records them in its history); the live path's (`delete_unchanged`) reads
each memory again right before deleting it and leaves one whose text or group changed (Mem0 deletes by id only,
with no condition, so this is as late as the check can be); archived records keep the
whole payload and the dense vector, and restore re-inserts them with their own ids.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from memprune.stores.base import CHANGED, REMOVED, Partition, Store, register, text_hash
from memprune.stores.config import StoreError

PAYLOAD, VECTOR = "payload", "vector"
PAGE = 1024
RAW_KEYS = ("data", "user_id", "agent_id", "run_id", "created_at")


def load_config(path: str) -> dict[str, Any]:
    """The user's Mem0 config file (YAML or JSON) as the dict `Memory.from_config` takes."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise StoreError(f"mem0:{path}: no such Mem0 config file")
    try:
        cfg = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise StoreError(f"mem0:{path}: not a YAML/JSON Mem0 config: {' '.join(str(exc).split())}") from None
    if not isinstance(cfg, dict):
        raise StoreError(f"mem0:{path}: a Mem0 config must be a mapping, got {type(cfg).__name__}")
    return cfg


def open_memory(path: str) -> Any:
    """`mem0.Memory.from_config` of the config file, telemetry off; any failure is one `StoreError` line."""
    os.environ.setdefault("MEM0_TELEMETRY", "False")
    cfg = load_config(path)
    try:
        from mem0 import Memory
    except ImportError as exc:  # pragma: no cover - the stores extra installs it
        raise StoreError(f"mem0:{path}: the mem0 store needs `pip install memprune[stores]` ({exc})") from None
    try:
        return Memory.from_config(cfg)
    except Exception as exc:  # pydantic, client, lock and credential errors from every backend
        first = " ".join(str(exc).split())[:300]
        raise StoreError(f"mem0:{path}: cannot open the Mem0 store: {type(exc).__name__}: {first}") from None


def _dense(vector: Any) -> list[float] | None:
    if isinstance(vector, dict):
        vector = vector.get("")
    return None if vector is None else [float(x) for x in vector]


@register
class Mem0Store(Store):
    """A Mem0 memory store (`mem0:CONFIG.yaml`); read on the driver (a local Qdrant path allows one client)."""

    kind = "mem0"
    defaults = {"id": "id", "text": "data", "group": "user_id", "time": "created_at"}
    parallel = False
    schemaless = True  # `--map pin=KEY` names a metadata key: the export checks that some memory has it

    def __init__(self, location: str, mapping: dict[str, str] | None = None, memory: Any = None) -> None:
        """`memory`: a Mem0 `Memory` already open on the config file `location` (used, never closed, here)."""
        super().__init__(location, mapping)
        if self.fields["id"] != "id":
            raise StoreError(f"mem0:{location}: --map id={self.fields['id']}: a Mem0 memory's id is its own id")
        self.owned = memory is None
        self.memory = open_memory(location) if memory is None else memory
        self.vs = self.memory.vector_store
        self.qdrant = self.memory.config.vector_store.provider == "qdrant" and hasattr(self.vs, "client")

    def _rows(self, points: Sequence[Any]) -> pa.RecordBatch:
        keys = list(dict.fromkeys([*RAW_KEYS, *[v for k, v in self.fields.items() if k != "id"]]))
        cols: dict[str, list[Any]] = {"id": [str(p.id) for p in points]}
        for k in keys:
            cols[k] = [None if (p.payload or {}).get(k) is None else str(p.payload[k]) for p in points]
        return pa.RecordBatch.from_pydict({k: pa.array(v, pa.string()) for k, v in cols.items()})

    def _scroll(self, group: str | None = None) -> Iterator[list[Any]]:
        """Every memory in pages, or (`group`) only those whose group key is `group` (a filter the backend runs)."""
        key = self.fields["group"]
        if self.qdrant:
            from qdrant_client import models

            where = None if group is None else models.Filter(must=[models.FieldCondition(
                key=key, match=models.MatchValue(value=group))])
            offset = None
            while True:
                points, offset = self.vs.client.scroll(collection_name=self.vs.collection_name, limit=PAGE, offset=offset,
                                                       with_payload=True, with_vectors=False, scroll_filter=where)
                if points:
                    yield points
                if offset is None:
                    return
        else:  # any other backend: Mem0's own list (one call)
            listed = self.vs.list(filters=None if group is None else {key: group}, top_k=10**9)
            rows = listed[0] if isinstance(listed, (list, tuple)) and listed and isinstance(listed[0], list) else listed
            yield list(rows or [])

    def raw_partitions(self) -> list[Partition]:
        return [lambda: (self._rows(points) for points in self._scroll())]

    def raw_group(self, group: str) -> list[Partition]:
        return [lambda: (self._rows(points) for points in self._scroll(group))]

    def fetch(self, ids: Sequence[str]) -> pa.Table:
        rows: dict[str, list[Any]] = {"id": [], PAYLOAD: [], VECTOR: []}
        ids = [str(i) for i in ids]
        for i in range(0, len(ids), PAGE):
            part = ids[i:i + PAGE]
            if self.qdrant:
                points = self.vs.client.retrieve(collection_name=self.vs.collection_name, ids=part,
                                                 with_payload=True, with_vectors=True)
            else:
                points = [p for p in (self.vs.get(vector_id=x) for x in part) if p is not None]
            for p in points:
                rows["id"].append(str(p.id))
                rows[PAYLOAD].append(json.dumps(p.payload or {}, ensure_ascii=False, sort_keys=True))
                rows[VECTOR].append(_dense(getattr(p, "vector", None)))
        table = pa.table({"id": pa.array(rows["id"], pa.string()), PAYLOAD: pa.array(rows[PAYLOAD], pa.string()),
                          VECTOR: pa.array(rows[VECTOR], pa.list_(pa.float32()))})
        payloads = [json.loads(p) for p in rows[PAYLOAD]]
        for k in RAW_KEYS:  # readable columns beside the whole payload
            table = table.append_column(k, pa.array([None if p.get(k) is None else str(p[k]) for p in payloads], pa.string()))
        return table

    def delete(self, ids: Sequence[str]) -> int:
        for i in ids:
            self.memory.delete(str(i))
        return len(ids)

    def delete_unchanged(self, group: str, expected: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        """Each memory of `expected` read again just before its `Memory.delete`: deleted only while still in `group`
        with the decided text (a memory gone meanwhile, also inside Mem0's own delete, is REMOVED)."""
        key, text = self.fields["group"], self.fields["text"]
        deleted: list[str] = []
        left: dict[str, str] = {}
        for mid, want in expected.items():
            point = self.vs.get(vector_id=mid)
            payload = None if point is None else (point.payload or {})
            if payload is None or ("" if payload.get(key) is None else str(payload[key])) != group:
                left[mid] = REMOVED
                continue
            body = payload.get(text)
            if body is None or text_hash(str(body)) != want:
                left[mid] = CHANGED
                continue
            try:
                self.memory.delete(mid)
            except ValueError:  # Mem0: "Memory with id ... not found"
                left[mid] = REMOVED
                continue
            deleted.append(mid)
        return deleted, left

    def set_fields(self, values: pa.Table) -> int:
        rows = values.to_pylist()
        for row in rows:
            mid = str(row.pop("id"))
            current = self.vs.get(vector_id=mid)
            if current is None:
                continue
            self.vs.update(vector_id=mid, payload={**(current.payload or {}), **row})
        return len(rows)

    def insert(self, records: pa.Table, archived: pa.Table | None = None) -> int:
        for row in records.to_pylist():
            payload = json.loads(row[PAYLOAD])
            vector = row.get(VECTOR)
            if vector is None:  # a backend that does not return vectors: embed the text again, as Mem0 does
                vector = self.memory.embedding_model.embed(payload.get("data", ""), "add")
            self.vs.insert(vectors=[list(vector)], payloads=[payload], ids=[str(row["id"])])
        return records.num_rows

    def close(self) -> None:
        if not self.owned:
            return
        try:
            self.memory.close()
        except Exception:  # closing is best effort (an already closed client)
            pass
        client = getattr(self.vs, "client", None)
        if client is not None and hasattr(client, "close"):
            client.close()
