"""Live pruning (issue 27): the real Ray Serve app on a free loopback port (one for the module). /v1/decide is
MemoryPruner's decision for every policy; /v1/prune applies on a real Mem0 store and restore gives the rest back;
200 concurrent requests all answered right; bad requests are one-line 4xx that change nothing; the Mem0
integration keeps a user within the cap over 100 adds, in-process and through the service."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import free_port
from helpers import USERS, mem0_close, mem0_config, mem0_get_all, mem0_memory, mem0_points, review_document

from memprune.archive import read_archive, restore
from memprune.prune import MemoryPruner, PruneRule

pytestmark = pytest.mark.slow
TOKEN = "test-token-27"
os.environ["MEMPRUNE_SERVE_TOKEN"] = TOKEN  # before any Ray starts: the replicas inherit it, as on a server
BULLETS = ["Alice has a cat named Tom.", "Alice has a cat named Tom.", "ok", "Alice works night shifts as a nurse.",
           "lol", "Alice is training for the Berlin marathon in May.", "Bob is allergic to peanuts.",
           "Bob's daughter starts school in September.", "Carol moved to Lisbon last year.", "k"]
RULES = [{"threshold": 0.5, "top_k": 3}, {"policy": "budget", "budget_tokens": 25},
         {"policy": "fraction", "fraction": 0.4}]
# a table store whose id/text/group/time/pin need a map (issue 27): Nora's move, an old fact, a pinned "lol"
NOTES = [("n1", "Nora lives in Lima.", "nora", "2024-01-05T00:00:00Z", "false"),
         ("n2", "Nora has a cat named Mochi.", "nora", "2024-01-05T00:00:00Z", ""),
         ("n3", "lol", "nora", "2024-02-01T00:00:00Z", "true"),
         ("n4", "ok", "nora", "2024-02-01T00:00:00Z", "false"),
         ("n5", "Nora lives in Oslo.", "nora", "2024-03-10T00:00:00Z", "false"),
         ("n6", "Nora sang in a choir as a child.", "nora", "2023-01-01T00:00:00Z", "false"),
         ("o1", "Omar is learning Italian.", "omar", "2024-01-02T00:00:00Z", "false")]
NOTES_MAP = {"id": "mid", "text": "memory", "group": "user", "time": "created", "pin": "starred"}


@pytest.fixture(scope="module")
def service(ray_local, scorer_dir, minilm_path, tmp_path_factory):
    """The service (1 replica) with one configured Mem0 store; yields (url, Mem0 config path, archive dir)."""
    from ray import serve

    from memprune.serve import ServeConfig, run

    d = tmp_path_factory.mktemp("serve")
    config = mem0_config(d, minilm_path)
    m = mem0_memory(config)
    for user, texts in USERS.items():
        for text in texts:
            m.add([{"role": "user", "content": text}], user_id=user, infer=False)
    mem0_close(m)
    notes = d / "notes.csv"
    notes.write_text("mid,memory,user,created,starred\n" + "".join(",".join(r) + "\n" for r in NOTES))
    cfg = ServeConfig(scorer=str(scorer_dir), port=free_port(),
                      stores={"mem": f"mem0:{config}", "notes": {"location": f"table:{notes}", "map": NOTES_MAP}},
                      archive_dir=str(d / "archive"), review_dir=str(d / "reviews"), num_cpus=0.5, block=False)
    summary = run(cfg)
    yield summary["url"], config, d / "archive"
    serve.shutdown()


def _post(url: str, route: str, body, **kw) -> httpx.Response:
    return httpx.post(url + route, json=body, timeout=60, **kw)


def _expected(scorer_dir: Path, rule: dict, texts: list[str]) -> list[dict]:
    scores, d = MemoryPruner(str(scorer_dir), rule=PruneRule.of(**rule)).decisions(texts)
    return [{"keep": bool(d.keep[i]), "reason": d.reason[i], "score": float(scores[i]),
             "duplicate_of": None if d.duplicate_of[i] < 0 else str(d.duplicate_of[i])} for i in range(len(texts))]


def _same(got: list[dict], want: list[dict]) -> None:
    assert [(g["keep"], g["reason"], g["duplicate_of"]) for g in got] == \
        [(w["keep"], w["reason"], w["duplicate_of"]) for w in want]
    np.testing.assert_allclose([g["score"] for g in got], [w["score"] for w in want], rtol=0, atol=1e-6)


def test_decide_is_memory_pruners_decision_for_every_policy(service, scorer_dir) -> None:
    url, _, _ = service
    for rule in RULES:
        reply = _post(url, "/v1/decide", {"bullets": [{"text": t} for t in BULLETS], "rule": rule})
        assert reply.status_code == 200, reply.text
        _same(reply.json()["decisions"], _expected(scorer_dir, rule, BULLETS))
    nora = [("Nora lives in Lima.", "2024-01-05"), ("Nora has a cat named Mochi.", "2024-01-05"),
            ("Nora lives in Oslo.", "2024-03-10")]  # supersession: the README's example, as MemoryPruner decides it
    reply = _post(url, "/v1/decide", {"bullets": [{"text": t, "time": at, "metadata": {"speaker": "Nora"}}
                                                  for t, at in nora],
                                      "rule": {"threshold": 0.0, "top_k": None, "supersede": {"judge": "slot"}}})
    assert reply.status_code == 200, reply.text
    assert [(v["reason"], v["superseded_by"]) for v in reply.json()["decisions"]] == \
        [("superseded", "2"), (None, None), (None, None)]
    from memprune.scorer import Scorer

    scored = _post(url, "/v1/score", {"texts": BULLETS[:3]}).json()
    np.testing.assert_allclose(scored["raw"], Scorer.load(scorer_dir).score(BULLETS[:3]), atol=1e-6)
    health = httpx.get(url + "/healthz").json()
    assert health["status"] == "ok" and len(health["scorer"]["fingerprint"]) == 16 and health["stores"] == ["mem", "notes"]
    assert httpx.get(url + "/docs").status_code == 200 and "/v1/prune" in httpx.get(url + "/openapi.json").json()["paths"]


def test_200_concurrent_requests_are_all_answered_right(service, scorer_dir) -> None:
    url, _, _ = service
    sessions = [BULLETS[i:] + BULLETS[:i] for i in range(10)]  # ten different 10-bullet sessions
    rule = RULES[0]
    want = [_expected(scorer_dir, rule, s) for s in sessions]

    def call(i: int) -> tuple[int, list[dict]]:
        reply = _post(url, "/v1/decide", {"bullets": [{"text": t} for t in sessions[i % 10]], "rule": rule})
        assert reply.status_code == 200, reply.text
        return i, reply.json()["decisions"]

    before = httpx.get(url + "/healthz").json()["encoder"]
    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(call, range(200)))
    assert len(answers) == 200
    for i, got in answers:
        _same(got, want[i % 10])
    after = httpx.get(url + "/healthz").json()["encoder"]
    requests, calls = after["requests"] - before["requests"], after["batches"] - before["batches"]
    assert requests == 200 and calls <= 100, (requests, calls)  # concurrent requests shared encoder calls


def test_bad_requests_are_one_line_4xx_and_change_nothing(service) -> None:
    url, config, archive = service
    before = mem0_points(config)
    bad = {
        "malformed JSON": (400, 422, {"content": b'{"bullets": [', "headers": {"content-type": "application/json"}}),
        "1 MB text": (413, None, {"json": {"bullets": [{"text": "x" * 1_000_000}]}}),
        "empty list": (422, None, {"json": {"bullets": []}}),
        "unknown policy": (400, None, {"json": {"bullets": [{"text": "a"}], "rule": {"policy": "nope"}}}),
    }
    for what, (status, alt, kw) in bad.items():
        reply = httpx.post(url + "/v1/decide", timeout=60, **kw)
        assert reply.status_code in (status, alt), (what, reply.status_code, reply.text)
        message = reply.json()["error"]
        assert message and "\n" not in message, (what, message)
    assert "unknown policy 'nope'" in httpx.post(url + "/v1/decide", **bad["unknown policy"][2]).json()["error"]
    prunes = {
        "unknown store": (404, {"store": "other", "group": "alice"}, {}, "store 'other' is not configured"),
        "a path": (400, {"store": "/etc/passwd", "group": "alice"}, {}, "not a path"),
        "a location": (400, {"store": f"mem0:{config}", "group": "alice"}, {}, "not a path"),
        "apply without token": (401, {"store": "mem", "group": "alice", "apply": True}, {}, "Bearer"),
        "apply, wrong token": (401, {"store": "mem", "group": "alice", "apply": True},
                               {"Authorization": "Bearer nope"}, "Bearer"),
    }
    for what, (status, body, headers, words) in prunes.items():
        reply = _post(url, "/v1/prune", body, headers=headers)
        assert reply.status_code == status, (what, reply.status_code, reply.text)
        assert words in reply.json()["error"] and "\n" not in reply.json()["error"], what
    assert mem0_points(config) == before and not archive.exists()
    assert httpx.get(url + "/healthz").json()["status"] == "ok"


def test_prune_applies_on_mem0_and_restore_gives_the_rest_back(service, scorer_dir) -> None:
    url, config, _ = service
    rule = {"threshold": None, "top_k": 2}
    before = mem0_get_all(config)
    dry = _post(url, "/v1/prune", {"store": "mem", "group": "alice", "rule": rule, "review": True})
    assert dry.status_code == 200 and not dry.json()["applied"] and dry.json()["archive"] is None
    assert mem0_get_all(config) == before  # a dry run changes nothing
    # ... and, asked for, its review page: every record of the group, the verdicts the response gave
    page = httpx.get(url + dry.json()["review"], timeout=30)
    assert page.status_code == 200 and "connect-src 'none'" in page.headers["content-security-policy"]
    shown = review_document(page.text)["records"]
    assert dict(zip(shown["id"], shown["keep"])) == {d["id"]: d["keep"] for d in dry.json()["decisions"]}
    assert set(shown["id"]) == before["alice"] and dry.json()["decisions"]
    for wrong in ("/v1/review/mem/20240101T000000-" + "0" * 32 + "/review.html",
                  dry.json()["review"].replace("review.html", "../../../archive"), "/v1/review/mem/x/review.html"):
        assert httpx.get(url + wrong, timeout=30).status_code == 404
    reply = _post(url, "/v1/prune", {"store": "mem", "group": "alice", "rule": rule, "apply": True},
                  headers={"Authorization": f"Bearer {TOKEN}"})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    kept = {d["id"] for d in body["decisions"] if d["keep"]}
    dropped = {d["id"] for d in body["decisions"] if not d["keep"]}
    assert body["kept"] == 2 and kept | dropped == before["alice"] and dropped
    after = mem0_get_all(config)
    assert after["alice"] == kept and {u: after[u] for u in after if u != "alice"} == \
        {u: before[u] for u in before if u != "alice"}
    archived = read_archive(body["archive"]).records
    assert set(archived.column("id").to_pylist()) == dropped
    assert restore(body["archive"])["restored"] == len(dropped)
    assert mem0_get_all(config) == before


def test_prune_of_a_mapped_table_store_is_memprune_prunes_decision(service, scorer_dir) -> None:
    """A configured store's map gives /v1/prune the times and pins `memprune prune --map` gives: the same decision as
    MemoryPruner on the same mapped records (supersession and forgetting by time; the pinned "lol" kept)."""
    import pyarrow as pa

    from memprune.serve import ServeConfig
    from memprune.serve.stage import check_stores
    from memprune.stores import StoreError

    url, _, archive = service
    now = "2024-04-01T00:00:00Z"
    rule = {"threshold": 0.5, "top_k": 3, "supersede": {"judge": "slot"}, "retention": {"half_life": "60d",
                                                                                         "max_age": "400d", "now": now}}
    reply = _post(url, "/v1/prune", {"store": "notes", "group": "nora", "rule": rule})
    assert reply.status_code == 200, reply.text
    got = {d["id"]: (d["keep"], d["reason"], d["superseded_by"]) for d in reply.json()["decisions"]}
    records = sorted(({"bullet_id": i, "text": t, "conversation_id": u, "time": at, "pinned": p == "true", "speaker": ""}
                      for i, t, u, at, p in NOTES if u == "nora"), key=lambda r: (r["time"], r["bullet_id"]))
    want = {}
    for pin in ("pinned", None):
        expected = MemoryPruner(str(scorer_dir), rule=PruneRule.of(**rule, pin_field=pin, group_by="conversation")).prune_table(
            pa.Table.from_pylist(records))
        want[pin] = {r["bullet_id"]: (r["keep"], r["reason"], r["superseded_by"]) for r in expected.to_pylist()}
    assert got == want["pinned"]
    assert got["n1"] == (False, "superseded", "n5") and got["n6"][1] == "expired"
    # the HTTP client decides a table as MemoryPruner does, every column of it (retention's and supersession's too)
    from memprune.serve.client import ServiceClient

    table = pa.Table.from_pylist(records)
    local = MemoryPruner(str(scorer_dir), rule=PruneRule.of(**rule)).prune_table(table, "conversation", "pinned")
    served = ServiceClient(url, rule=rule).prune_table(table, pin_field="pinned")
    assert served.column_names == local.column_names and "superseded_by" in local.column_names
    for column in local.column_names:
        if pa.types.is_floating(local.schema.field(column).type):
            np.testing.assert_allclose(served.column(column).to_numpy(), local.column(column).to_numpy(), atol=1e-6)
        else:
            assert served.column(column).equals(local.column(column)), column
    assert got["n3"][0] and not want[None]["n3"][0]  # the pin keeps what the policy drops
    # a map naming a column the store lacks, or an unknown field: one line at startup
    with pytest.raises(StoreError, match="^stores.notes: .*column 'pinned' \\(mapped to pin\\) missing"):
        check_stores(ServeConfig(scorer=str(scorer_dir), stores={"notes": {
            "location": f"table:{archive.parent / 'notes.csv'}", "map": {**NOTES_MAP, "pin": "pinned"}}}))
    with pytest.raises(ValueError, match="unknown map field 'colour'"):
        ServeConfig(scorer=str(scorer_dir), stores={"x": {"location": "table:x.csv", "map": {"colour": "red"}}})


def test_mem0_integration_keeps_each_user_within_the_cap(service, scorer_dir, minilm_path, tmp_path) -> None:
    from memprune.integrations.mem0 import PrunedMemory
    from memprune.serve.client import ServiceClient

    url, _, _ = service
    config = mem0_config(tmp_path, minilm_path)
    memory = PrunedMemory.from_config(config, MemoryPruner(str(scorer_dir), threshold=None, top_k=5),
                                      tmp_path / "archive")
    added: set[str] = set()
    try:
        for i in range(100):  # a scripted growth: new facts, repeats and chatter
            text = [f"Alice's fact number {i} is about topic {i % 7}.", "Alice has a cat named Tom.", "ok"][i % 3]
            added |= {r["id"] for r in memory.add([{"role": "user", "content": text}], user_id="alice",
                                                   infer=False)["results"]}
            assert len(memory.get_all(filters={"user_id": "alice"}, top_k=1000)["results"]) <= 5
        kept = {r["id"] for r in memory.get_all(filters={"user_id": "alice"}, top_k=1000)["results"]}
        archived = {i for a in memory.archives() for i in read_archive(a).records.column("id").to_pylist()}
        assert len(added) == 100 and archived == added - kept and len(kept) == 5
        page = memory.review("alice", tmp_path / "review")  # the decision on a page, nothing changed
        assert set(review_document(Path(page).read_text())["records"]["id"]) == kept
        assert {r["id"] for r in memory.get_all(filters={"user_id": "alice"}, top_k=1000)["results"]} == kept
        assert memory.restore()["restored"] == 95
        assert len(memory.get_all(filters={"user_id": "alice"}, top_k=1000)["results"]) == 100
        # a metadata key as the pin (issue 27): the pinned "lol" outlives better memories
        pins = PrunedMemory(memory.memory, config, MemoryPruner(str(scorer_dir), threshold=None, top_k=2),
                            tmp_path / "archive-pins", pin="pinned")
        pins.add([{"role": "user", "content": "lol"}], user_id="cy", infer=False, metadata={"pinned": True})
        for i in range(4):
            pins.add([{"role": "user", "content": f"Cy collects stamps from country {i}."}], user_id="cy", infer=False)
        left = [r["memory"] for r in memory.get_all(filters={"user_id": "cy"}, top_k=100)["results"]]
        assert "lol" in left and len(left) == 2
        # the same through the service: /v1/decide decides, the wrapper archives and deletes
        memory.pruner = ServiceClient(url, rule={"threshold": None, "top_k": 3, "dedup": False})
        for i in range(6):
            memory.add([{"role": "user", "content": f"Bob plays chess on day {i}."}], user_id="bob", infer=False)
        assert len(memory.get_all(filters={"user_id": "bob"}, top_k=1000)["results"]) == 3
        assert json.loads((memory.archives()[-1] / "archive.json").read_text())["store"]["kind"] == "mem0"
    finally:
        mem0_close(memory.memory)


class _Listener:
    """An HTTP listener on 127.0.0.1 that records every request it gets (what a hostile client would point the
    server at)."""

    def __init__(self) -> None:
        import http.server
        import threading

        self.seen: list[tuple[str, str]] = []
        seen = self.seen

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                seen.append((self.path, self.headers.get("Authorization", "")))
                self.send_response(500)
                self.end_headers()

            do_GET = do_POST  # noqa: N815

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_a_rule_naming_a_server_resource_is_refused_and_reaches_nothing(service) -> None:
    """Issue 56, item 1: a request's rule cannot make the server call a URL (with its own token), read a file or pick
    an engine: 400 naming the field, and the listener it names hears nothing."""
    url, config, _ = service
    listener = _Listener()
    llm = {"engine": "http", "model": "m", "base_url": listener.url + "/v1", "api_key_env": "MEMPRUNE_SERVE_TOKEN"}
    hostile = {
        "rule.supersede.llm": {"threshold": 0.0, "supersede": {"judge": "llm", "llm": llm}},
        "rule.supersede.llm_config": {"supersede": {"judge": "llm", "llm_config": "/etc/passwd"}},
        "rule.supersede.judge": {"supersede": {"judge": "llm"}},
        "rule.usage_log": {"usage_log": "/etc/passwd"},
    }
    bullets = [{"text": "Nora lives in Lima.", "time": "2024-01-01", "metadata": {"speaker": "Nora"}},
               {"text": "Nora lives in Oslo.", "time": "2024-03-01", "metadata": {"speaker": "Nora"}}]
    for field, rule in hostile.items():
        for route, body in (("/v1/decide", {"bullets": bullets, "rule": rule}),
                            ("/v1/prune", {"store": "mem", "group": "alice", "rule": rule})):
            reply = _post(url, route, body)
            assert reply.status_code == 400, (field, route, reply.text)
            message = reply.json()["error"]
            assert message.startswith(field + ":") and "passwd" not in message and "top level" not in message, message
    assert listener.seen == []
    listener.server.shutdown()


def test_hostile_bodies_are_refused_before_parsing_and_fail_alone(service) -> None:
    """Issue 56, items 5 and 6: a body over max_request_bytes is 413 from its Content-Length or as it streams in; a
    text that is not valid Unicode is 422 for its own request while 30 good requests beside it all succeed; every
    error body is {"error": one line}."""
    url, _, _ = service
    big = json.dumps({"texts": ["word " * 1000] * 360}).encode()  # 1.8 MB, every text within the per-text limit
    assert len(big) > 1_800_000
    reply = httpx.post(url + "/v1/score", content=big, headers={"content-type": "application/json"}, timeout=60)
    assert reply.status_code == 413 and reply.json() == {"error": f"request body of {len(big)} bytes, at most 1000000"}

    def chunked():  # no Content-Length: refused once 1 MB has arrived, not after 3 MB are parsed
        yield b'{"texts": ['
        for _ in range(3000):
            yield json.dumps("x" * 1000).encode() + b","
        yield b'"x"]}'

    reply = httpx.post(url + "/v1/score", content=chunked(), headers={"content-type": "application/json"}, timeout=60)
    assert reply.status_code == 413 and reply.json() == {"error": "request body over 1000000 bytes"}
    for body, status in ((b'{"texts": ["\xff\xfe"]}', 400), (b'{"texts": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400)):
        reply = httpx.post(url + "/v1/score", content=body, headers={"content-type": "application/json"}, timeout=60)
        assert reply.status_code == status and list(reply.json()) == ["error"], reply.text
    for route, status in (("/nope", 404), ("/v1/score", 405)):
        reply = httpx.get(url + route, timeout=60)
        assert reply.status_code == status and list(reply.json()) == ["error"], reply.text

    def good(i: int) -> httpx.Response:
        return _post(url, "/v1/decide", {"bullets": [{"text": f"Alice's fact number {i}."}, {"text": "ok"}]})

    def bad() -> httpx.Response:
        return httpx.post(url + "/v1/decide", content=b'{"bullets": [{"text": "ok"}, {"text": "\\udc00"}]}',
                          headers={"content-type": "application/json"}, timeout=60)

    with ThreadPoolExecutor(32) as pool:
        goods = [pool.submit(good, i) for i in range(15)]
        hostile = pool.submit(bad)
        goods += [pool.submit(good, i) for i in range(15, 30)]
        assert [g.result().status_code for g in goods] == [200] * 30
        reply = hostile.result()
    assert reply.status_code == 422
    assert reply.json() == {"error": "bullets.1.text: not valid Unicode text: a lone surrogate U+DC00 at character 0"}


def test_memprune_serve_listens_on_loopback_only_and_stops_in_order_on_sigterm() -> None:
    """Issue 56, item 2 and the SIGTERM message: `memprune serve` starts its own Ray, none of whose processes listens
    beyond 127.0.0.1; SIGTERM to its process group (a service manager's stop) shuts Serve and Ray down, exit 0.
    Issue 54: it needs no --scorer (the shipped `default`, named with its version in /healthz)."""
    import signal
    import subprocess
    import sys
    import time

    from helpers import listeners_beyond_loopback

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen([str(Path(sys.executable).with_name("memprune")), "serve",
                             "--port", str(port), "--set", "num_cpus=0.5"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, env=env)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=30)
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
                if health.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        assert listeners_beyond_loopback(proc.pid) == []
        scorer = health.json()["scorer"]
        assert (scorer["name"], scorer["version"]) == ("default", "1") and len(scorer["fingerprint"]) == 16
        os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-2000:]
    assert "memprune serve: stopped" in out and "Traceback" not in err
