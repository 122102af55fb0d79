"""`ServiceClient`: the service over HTTP, shaped like `MemoryPruner` where a store pruner needs it."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from memprune.errors import MemPruneError


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
        """`table` (bullet_id, text[, time, the `pin_field` column]; one group) with score, keep, reason and
        duplicate_of from `/v1/decide`; its times and pins go with the bullets."""
        n = table.num_rows
        times = table.column("time").to_pylist() if "time" in table.column_names else [None] * n
        pins = table.column(pin_field).to_pylist() if pin_field else [None] * n
        bullets = [{"id": i, "text": t, "time": at, "pinned": p}
                   for i, t, at, p in zip(table.column("bullet_id").to_pylist(), table.column("text").to_pylist(),
                                          times, pins)]
        rule = self.rule
        if pin_field:
            if rule is None:
                raise ServiceError(f"{self.http.base_url}: a store with pins needs the client's rule "
                                   "(ServiceClient(url, rule={...})): the server's rule cannot be given a pin field")
            rule = {**rule, "pin_field": "pinned"}
        rows = self._post("/v1/decide", {"bullets": bullets, "rule": rule})["decisions"]
        return (table.append_column("score", pa.array([r["score"] for r in rows], pa.float64()))
                .append_column("keep", pa.array([r["keep"] for r in rows], pa.bool_()))
                .append_column("reason", pa.array([r["reason"] for r in rows], pa.string()))
                .append_column("duplicate_of", pa.array([r["duplicate_of"] for r in rows], pa.string())))

    def close(self) -> None:
        self.http.close()
