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
from test_stores import USERS, _close, _get_all, _memory, _mem0_config, _points

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
    config = _mem0_config(d, minilm_path)
    m = _memory(config)
    for user, texts in USERS.items():
        for text in texts:
            m.add([{"role": "user", "content": text}], user_id=user, infer=False)
    _close(m)
    notes = d / "notes.csv"
    notes.write_text("mid,memory,user,created,starred\n" + "".join(",".join(r) + "\n" for r in NOTES))
    cfg = ServeConfig(scorer=str(scorer_dir), port=free_port(),
                      stores={"mem": f"mem0:{config}", "notes": {"location": f"table:{notes}", "map": NOTES_MAP}},
                      archive_dir=str(d / "archive"), num_cpus=0.5, block=False)
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
    before = _points(config)
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
    assert _points(config) == before and not archive.exists()
    assert httpx.get(url + "/healthz").json()["status"] == "ok"


def test_prune_applies_on_mem0_and_restore_gives_the_rest_back(service, scorer_dir) -> None:
    url, config, _ = service
    rule = {"threshold": None, "top_k": 2}
    before = _get_all(config)
    dry = _post(url, "/v1/prune", {"store": "mem", "group": "alice", "rule": rule})
    assert dry.status_code == 200 and not dry.json()["applied"] and dry.json()["archive"] is None
    assert _get_all(config) == before  # a dry run changes nothing
    reply = _post(url, "/v1/prune", {"store": "mem", "group": "alice", "rule": rule, "apply": True},
                  headers={"Authorization": f"Bearer {TOKEN}"})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    kept = {d["id"] for d in body["decisions"] if d["keep"]}
    dropped = {d["id"] for d in body["decisions"] if not d["keep"]}
    assert body["kept"] == 2 and kept | dropped == before["alice"] and dropped
    after = _get_all(config)
    assert after["alice"] == kept and {u: after[u] for u in after if u != "alice"} == \
        {u: before[u] for u in before if u != "alice"}
    archived = read_archive(body["archive"]).records
    assert set(archived.column("id").to_pylist()) == dropped
    assert restore(body["archive"])["restored"] == len(dropped)
    assert _get_all(config) == before


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
    config = _mem0_config(tmp_path, minilm_path)
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
        _close(memory.memory)
