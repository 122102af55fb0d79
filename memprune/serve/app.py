"""The Ray Serve application: one deployment (a FastAPI ingress) holding the scorer, `MemoryPruner` per rule.

Every request's decision is `MemoryPruner.decisions` / `prune_table` (the batch job's decision), run in a
worker thread. The pruner's scorer is a `BatchedScorer`: its encoder calls go to the replica's `EncoderQueue`,
so the texts of concurrent requests share one encoder pass. User errors are 4xx with one line
(`{"error": ...}`); a request failing never takes the replica down.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import queue
import re
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from ray import serve

from memprune.errors import MemPruneError
from memprune.prune.scoring import OUTPUT_COLUMNS, with_outputs
from memprune.review import PAGE, PARTS
from memprune.serve.config import STORE_NAME, ServeConfig, ServedStore
from memprune.serve.models import (DecideRequest, DecideResponse, ErrorResponse, PruneRequest, PruneResponse,
                                   ScoreRequest, ScoreResponse, Verdict)
from memprune.serve.rules import RuleRefused, request_rule

PRUNERS = 64  # rules whose MemoryPruner a replica keeps
LIMITS = {"max_request_bytes": 1_000_000}  # this process's replica's (a replica is one process)


REVIEW_ID = re.compile(r"\d{8}T\d{6}-[0-9a-f]{32}")  # a review page's address: its time and 128 random bits
REVIEW_PART = re.compile(rf"{PARTS}/part-\d{{5}}\.js")
REVIEW_CSP = ("default-src 'none'; script-src 'unsafe-inline' 'self'; style-src 'unsafe-inline'; img-src data: blob:; "
              "connect-src 'none'; base-uri 'none'; form-action 'none'")


class RequestError(MemPruneError):
    """A request the client can fix; `status` is its HTTP status."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _error(status: int, message: str, **headers: str) -> JSONResponse:
    return JSONResponse({"error": " ".join(message.split())}, status_code=status, headers=headers or None)


def _validation_message(exc: RequestValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
    return f"{where}: {first.get('msg', 'invalid').removeprefix('Value error, ')}"


api = FastAPI(title="memprune", description="Score memory bullets and prune memory stores with a memprune scorer: "
              "the decision of `memprune prune` and `MemoryPruner`, live.",
              responses={400: {"model": ErrorResponse}, 422: {"model": ErrorResponse}})


@api.exception_handler(RequestValidationError)
async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    return _error(422, _validation_message(exc))


@api.exception_handler(MemPruneError)
async def _user_error(request: Request, exc: MemPruneError) -> JSONResponse:
    return _error(getattr(exc, "status", 400), str(exc))


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's and FastAPI's own errors (404, 405, a body that does not parse) in the one error form."""
    return _error(exc.status_code, str(exc.detail), **(exc.headers or {}))


@api.exception_handler(Exception)
async def _bug(request: Request, exc: Exception) -> JSONResponse:
    return _error(500, f"internal error ({type(exc).__name__}); the server's log has the traceback")


class BodyLimit:
    """ASGI middleware: a body over `max_request_bytes` is refused (413) before it is parsed: by its Content-Length
    before a byte is read, and a body without one (chunked) as soon as what has arrived passes the limit."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = LIMITS["max_request_bytes"]
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            return await _error(413, f"request body of {length.decode(errors='replace')[:20]} bytes, "
                                     f"at most {limit}")(scope, receive, send)
        seen = 0

        async def bounded() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:  # FastAPI passes an HTTPException from its body read on as it is
                raise StarletteHTTPException(413, f"request body over {limit} bytes")
            return message

        await self.app(scope, bounded, send)


api.add_middleware(BodyLimit)  # before `serve.ingress` below: it freezes a copy of the app


class EncoderQueue:
    """One encoder thread for a replica's requests: it takes every request that queued while it encoded the last
    batch (at most `max_requests`; a request that finds the queue empty waits `wait_s` for company), encodes their
    texts in one length-sorted call and hands each request its rows. A call that fails is retried one request at a
    time, so a request that breaks the encoder fails alone.

    Batches form when the encoder is free, so under load they are as big as the queue. (`serve.batch` forms its
    next batch on a time window while the last one is still encoding: at 32 clients its batches held 1.6
    requests, and the encoder ran at 15 texts a call.)
    """

    def __init__(self, embed: Any, max_requests: int, wait_s: float) -> None:
        self._embed, self.max_requests, self.wait_s = embed, max_requests, wait_s
        self._queue: queue.SimpleQueue[tuple[list[str], Future[np.ndarray]]] = queue.SimpleQueue()
        self.stats: dict[str, float] = {"batches": 0, "requests": 0, "texts": 0, "encode_s": 0.0}
        threading.Thread(target=self._run, name="memprune-encode", daemon=True).start()

    def __call__(self, texts: list[str]) -> np.ndarray:
        done: Future[np.ndarray] = Future()
        self._queue.put((list(texts), done))
        return done.result()

    def _take(self) -> list[tuple[list[str], Future[np.ndarray]]]:
        batch = [self._queue.get()]
        if self.wait_s and self._queue.empty():
            time.sleep(self.wait_s)
        while len(batch) < self.max_requests and not self._queue.empty():
            batch.append(self._queue.get_nowait())
        return batch

    def _run(self) -> None:
        while True:
            batch = self._take()
            try:
                rows = self._encode([texts for texts, _ in batch])
            except BaseException as exc:  # noqa: BLE001  (the thread goes on)
                if len(batch) == 1:
                    batch[0][1].set_exception(exc)
                    continue
                for texts, done in batch:  # one request's bad text must not fail the others: each alone
                    try:
                        done.set_result(self._encode([texts])[0])
                    except BaseException as one:  # noqa: BLE001
                        done.set_exception(one)
                continue
            for (_, done), emb in zip(batch, rows):
                done.set_result(emb)

    def _encode(self, requests: list[list[str]]) -> list[np.ndarray]:
        """Each request's embeddings, from one length-sorted encoder call over all their texts."""
        flat = [t for texts in requests for t in texts]
        order = np.argsort([len(t) for t in flat], kind="stable")  # length order across requests: less padding
        started = time.perf_counter()
        got = self._embed([flat[i] for i in order])
        emb = np.empty_like(got)
        emb[order] = got
        for key, n in (("batches", 1), ("requests", len(requests)), ("texts", len(flat)),
                       ("encode_s", time.perf_counter() - started)):
            self.stats[key] += n
        bounds = np.cumsum([len(texts) for texts in requests])[:-1]
        return np.split(emb, bounds)


class BatchedScorer:
    """The replica's scorer with `embed` (and `score`) going through its `EncoderQueue`."""

    def __init__(self, scorer: Any, embed: Any) -> None:
        self._scorer, self._embed = scorer, embed

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scorer, name)

    def embed(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        return self._embed(list(texts))

    def score(self, texts: list[str], batch_size: int = 64, calibrated: bool = False) -> np.ndarray:
        return self._scorer.score_embeddings(self._embed(list(texts)), calibrated=calibrated)


def scorer_identity(path: str, scorer: Any) -> dict[str, Any]:
    """What /healthz says about the scorer: artifact, fingerprint (its files' digests), calibration, precision."""
    from memprune.scorer import artifact_fingerprint
    from memprune.scorers import card_identity

    local, cal = scorer.source or path, scorer.calibration
    return {"path": path, **card_identity(local), "fingerprint": artifact_fingerprint(local),
            "encoder": scorer.config.encoder, "stage": scorer.config.stage, "seed": scorer.config.seed,
            "precision": scorer.precision, "device": str(scorer.device),
            "calibration": None if cal is None else {"method": cal.method,
                                                     "relevance_threshold": cal.relevance_threshold}}


def verdicts_of(decided: Any) -> list[Verdict]:
    """A decided bullets table (`MemoryPruner.prune_table`'s columns) as the response's verdicts."""
    fields = [f for f in Verdict.model_fields if f != "id" and f in decided.column_names]
    cols = {"id": decided.column("bullet_id").to_pylist()} | {f: decided.column(f).to_pylist() for f in fields}
    return [Verdict(**{f: v[i] for f, v in cols.items()}) for i in range(decided.num_rows)]


def _replica_grpc_on_node_address() -> None:
    """Ray Serve starts each replica's inter-deployment gRPC server on every interface (`[::]:0`, whatever the node's
    address; Ray 2.60). On a node that listens on loopback only (every Ray memprune starts, `raysession.init_local_ray`)
    that server binds to the node's address too, so no port of the service is reachable from another machine."""
    import ipaddress

    import ray
    from ray.serve._private import replica

    node = ray.util.get_node_ip_address()
    if not ipaddress.ip_address(node).is_loopback or getattr(replica.add_port_to_grpc_server, "memprune", False):
        return
    add = replica.add_port_to_grpc_server

    def on_node(server: Any, address: str) -> int:
        return add(server, address.replace("[::]", node, 1) if address.startswith("[::]:") else address)

    on_node.memprune = True  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = on_node


@serve.deployment
@serve.ingress(api)
class MemPruneService:
    """One replica: the scorer loaded once, a `MemoryPruner` per rule, the configured stores by name."""

    def __init__(self, config: dict[str, Any]) -> None:
        import torch

        from memprune.runtime import torch_device
        from memprune.scorer import Scorer

        _replica_grpc_on_node_address()
        self.cfg = ServeConfig.model_validate(config)
        LIMITS["max_request_bytes"] = self.cfg.max_request_bytes
        torch.set_num_threads(max(1, int(np.ceil(self.cfg.num_cpus))))
        self.scorer = Scorer.load(self.cfg.scorer, device=torch_device(self.cfg.device), precision=self.cfg.precision)
        self.identity = scorer_identity(self.cfg.scorer, self.scorer)
        self.encoder = EncoderQueue(lambda texts: self.scorer.embed(texts, batch_size=self.cfg.batch_size),
                                    self.cfg.batch_max_size, self.cfg.batch_wait_s)
        self.batched = BatchedScorer(self.scorer, self.encoder)
        self.pruners: OrderedDict[str, Any] = OrderedDict()
        self.judges = self.cfg.allowed_judges()
        self.work = ThreadPoolExecutor(max_workers=self.cfg.max_ongoing_requests, thread_name_prefix="memprune-decide")
        self.store_locks: dict[str, asyncio.Lock] = {name: asyncio.Lock() for name in self.cfg.stores}

    async def _in_thread(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.work, fn, *args)

    # ------------------------------------------------------------- requests

    def _pruner(self, rule: dict[str, Any] | None) -> Any:
        from memprune.prune import MemoryPruner

        try:
            parsed = request_rule(rule, self.cfg.rule, self.judges)
        except RuleRefused as exc:
            raise RequestError(str(exc)) from None
        key = parsed.model_dump_json()
        if key not in self.pruners:
            self.pruners[key] = MemoryPruner(self.batched, rule=parsed, batch_size=self.cfg.batch_size,
                                             tokenizer=self.cfg.tokenizer, score=self.cfg.score)
            while len(self.pruners) > PRUNERS:
                self.pruners.popitem(last=False)
        self.pruners.move_to_end(key)
        return self.pruners[key]

    def _check_texts(self, texts: list[str], what: str) -> None:
        if len(texts) > self.cfg.max_bullets:
            raise RequestError(f"{what}: {len(texts)} given, at most {self.cfg.max_bullets} per request", 413)
        long = next((i for i, t in enumerate(texts) if len(t) > self.cfg.max_text_chars), None)
        if long is not None:
            raise RequestError(f"{what}[{long}]: {len(texts[long])} characters, at most {self.cfg.max_text_chars}", 413)

    @api.get("/healthz")
    async def healthz(self) -> dict[str, Any]:
        return {"status": "ok", "scorer": self.identity, "stores": sorted(self.cfg.stores),
                "rule": self.cfg.rule.describe(), "encoder": dict(self.encoder.stats)}

    @api.post("/v1/score", response_model=ScoreResponse)
    async def score(self, req: ScoreRequest) -> ScoreResponse:
        self._check_texts(req.texts, "texts")
        raw = await self._in_thread(self.batched.score, req.texts)
        cal = None if self.scorer.calibration is None else self.scorer.calibrate(raw).tolist()
        return ScoreResponse(raw=np.asarray(raw).tolist(), calibrated=cal)

    @api.post("/v1/decide", response_model=DecideResponse)
    async def decide(self, req: DecideRequest) -> DecideResponse:
        self._check_texts([b.text for b in req.bullets], "bullets")
        pruner = self._pruner(req.rule)
        scores, d = await self._in_thread(pruner.decisions, [b.mapping() for b in req.bullets])
        ids = [b.id if b.id is not None else str(i) for i, b in enumerate(req.bullets)]
        decided = with_outputs(pa.table({"bullet_id": pa.array(ids, pa.string())}), scores, d)
        return DecideResponse(rule=pruner.rule.describe(), score="calibrated" if pruner.calibrated else "raw",
                              columns=[c for c in OUTPUT_COLUMNS if c in decided.column_names],
                              decisions=verdicts_of(decided))

    @api.post("/v1/prune", response_model=PruneResponse)
    async def prune(self, req: PruneRequest, request: Request) -> PruneResponse:
        if req.apply:
            self._authorize(request)
        served = self._store(req.store)
        pruner = self._pruner(req.rule)
        async with self.store_locks[req.store]:
            return await self._in_thread(self._prune_group, req, served, pruner)

    @api.get("/v1/review/{store}/{page}/{path:path}", include_in_schema=False)
    async def review(self, store: str, page: str, path: str) -> FileResponse:
        """A review page /v1/prune wrote (and its data files): only under the unguessable address it answered."""
        file = Path(self.cfg.review_dir) / store / page / path
        if not (STORE_NAME.match(store) and REVIEW_ID.fullmatch(page) and (path == PAGE or REVIEW_PART.fullmatch(path))
                and file.is_file()):
            raise RequestError("no such review page (pages are kept for the newest review_keep prunes of a store)", 404)
        return FileResponse(file, media_type="text/html" if path == PAGE else "text/javascript",
                            headers={"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff",
                                     "Content-Security-Policy": REVIEW_CSP})

    def _review(self, name: str, store: Any, decided: pa.Table, pruner: Any, applied: dict[str, Any] | None) -> str:
        """Write this prune's review page under review_dir (the newest review_keep of the store kept); its address."""
        import shutil

        from memprune.stores.group import review_group

        root = Path(self.cfg.review_dir) / name
        page = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex}"
        review_group(root / page, decided, store, pruner, applied)
        for old in sorted(p for p in root.iterdir() if REVIEW_ID.fullmatch(p.name))[:-self.cfg.review_keep]:
            shutil.rmtree(old, ignore_errors=True)
        return f"/v1/review/{name}/{page}/{PAGE}"

    def _authorize(self, request: Request) -> None:
        token = os.environ.get(self.cfg.token_env)
        if not token:
            raise RequestError(f"apply is disabled: the server has no token ({self.cfg.token_env} is unset)", 403)
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise RequestError("apply needs 'Authorization: Bearer <token>' with the server's token", 401)

    def _store(self, name: str) -> ServedStore:
        if not STORE_NAME.match(name):
            raise RequestError(f"store {name[:80]!r}: give the name of a configured store, not a path or a location "
                               f"(configured: {', '.join(sorted(self.cfg.stores)) or 'none'})")
        if name not in self.cfg.stores:
            raise RequestError(f"store {name!r} is not configured (configured: "
                               f"{', '.join(sorted(self.cfg.stores)) or 'none'})", 404)
        return self.cfg.stores[name]

    def _prune_group(self, req: PruneRequest, served: ServedStore, pruner: Any) -> PruneResponse:
        from memprune.stores.group import apply_group, decide_group

        store = served.open()
        try:
            decided = decide_group(store, req.group, pruner)
            done: dict[str, Any] = {}
            if req.apply:
                stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
                group = re.sub(r"[^A-Za-z0-9_-]", "_", req.group)[:40]
                target = Path(self.cfg.archive_dir) / req.store / f"{stamp}-{group}-{uuid.uuid4().hex[:8]}"
                done = apply_group(store, decided, target)
            review = self._review(req.store, store, decided, pruner, done if req.apply else None) if req.review else None
        finally:
            store.close()
        keep = sum(decided.column("keep").to_pylist()) if decided.num_rows else 0
        return PruneResponse(store=req.store, group=req.group, applied=req.apply, kept=keep,
                             dropped=decided.num_rows - keep, archive=done.get("archive"),
                             skipped=done.get("skipped", []), decisions=verdicts_of(decided), review=review)


def build_app(cfg: ServeConfig) -> Any:
    """The bound application of this config (what `serve.run` takes)."""
    return MemPruneService.options(**cfg.deployment_options()).bind(cfg.model_dump(mode="json"))


def build(args: dict[str, Any]) -> Any:
    """The application builder of `serve run` / `serve deploy` (import path `memprune.serve.app:build`): `args` are
    ServeConfig's fields, or `config: FILE` plus overrides."""
    from memprune.config import load_config

    args = dict(args)
    path = args.pop("config", None)
    return build_app(load_config(path, [], ServeConfig, values=args))
