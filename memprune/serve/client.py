"""`ServiceClient`: the service over HTTP, shaped like `MemoryPruner` where a store pruner needs it."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from memprune.errors import MemPruneError


# the types of the decision's columns (`/v1/decide`'s `columns`)
COLUMN_TYPES = {"score": pa.float64(), "effective_score": pa.float64(), "retention": pa.float64(),
                "keep": pa.bool_(), "reason": pa.string(), "duplicate_of": pa.string(), "superseded_by": pa.string()}


def _plain(kind: pa.DataType) -> bool:
    """A column type whose values are JSON as they are."""
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_integer(kind) or \
        pa.types.is_floating(kind) or pa.types.is_boolean(kind)


class ServiceError(MemPruneError):
    """The service refused a request (its one-line message) or could not be reached."""


class ServiceClient:
    """`ServiceClient("http://127.0.0.1:8000", rule={"top_k": 5})`: `decide`, `prune`, and `prune_table` (a bullets
    table decided by `/v1/decide`, the columns `MemoryPruner.prune_table` adds)."""

    def __init__(self, url: str, rule: dict[str, Any] | None = None, token: str | None = None,
                 timeout: float = 60.0) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.rule = rule
        self.http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout)

    def _post(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        import httpx

        try:
            reply = self.http.post(route, json=body)
        except httpx.HTTPError as exc:
            raise ServiceError(f"{self.http.base_url}{route}: {type(exc).__name__}: {exc}") from None
        if reply.status_code >= 400:
            try:
                message = reply.json().get("error") or reply.text
            except ValueError:
                message = reply.text
            raise ServiceError(f"{self.http.base_url}{route}: {reply.status_code}: {message}")
        return dict(reply.json())

    def decide(self, bullets: list[dict[str, Any]]) -> dict[str, Any]:
        """`/v1/decide` of one group's bullets ({id, text, ...}) under this client's rule (null: the server's)."""
        return self._post("/v1/decide", {"bullets": bullets, "rule": self.rule})

    def prune(self, store: str, group: str, apply: bool = False) -> dict[str, Any]:
        """`/v1/prune`: a configured store's group decided (and with `apply`, archived and deleted) by the service."""
        return self._post("/v1/prune", {"store": store, "group": group, "rule": self.rule, "apply": apply})

    def prune_table(self, table: pa.Table, group_by: str | None = None, pin_field: str | None = None) -> pa.Table:
        """`table` (bullet_id, text[, time, the `pin_field` column, other columns]; one group) with the columns
        `MemoryPruner.prune_table` adds, from `/v1/decide`; its times, pins and other columns of strings, numbers
        and booleans (the bullets' metadata: a supersession subject such as speaker) go with the bullets."""
        n = table.num_rows
        times = table.column("time").to_pylist() if "time" in table.column_names else [None] * n
        pins = table.column(pin_field).to_pylist() if pin_field else [None] * n
        # the other columns of plain values (a supersession subject such as speaker) go as the bullets' metadata
        extra = [c for c in table.column_names if c not in ("bullet_id", "text", "time", pin_field)
                 and _plain(table.schema.field(c).type)]
        metadata = table.select(extra).to_pylist() if extra else [None] * n
        bullets = [{"id": i, "text": t, "time": at, "pinned": p, "metadata": m}
                   for i, t, at, p, m in zip(table.column("bullet_id").to_pylist(), table.column("text").to_pylist(),
                                             times, pins, metadata)]
        rule = self.rule
        if pin_field:
            if rule is None:
                raise ServiceError(f"{self.http.base_url}: a store with pins needs the client's rule "
                                   "(ServiceClient(url, rule={...})): the server's rule cannot be given a pin field")
            rule = {**rule, "pin_field": "pinned"}
        reply = self._post("/v1/decide", {"bullets": bullets, "rule": rule})
        for column in reply["columns"]:
            table = table.append_column(column, pa.array([r[column] for r in reply["decisions"]], COLUMN_TYPES[column]))
        return table

    def close(self) -> None:
        self.http.close()
