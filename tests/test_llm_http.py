"""The `http` engine end to end: ray.data.llm's HTTP processor against a local OpenAI-compatible server.

The server (tests/tiny_llm.py) runs on 127.0.0.1 in this process, serves the tiny random
LLM with transformers, and stops by itself. A scripted variant answers fixed texts so the
retry and error paths can be asserted exactly.
"""

from __future__ import annotations

import json

import pytest
from tiny_llm import TinyOpenAIServer, check_judge_output, judge_dataset, judge_rows

from memprune.llm import JUDGE_SCHEMA, LLMConfig, run_llm

pytestmark = pytest.mark.slow


def _config(server: TinyOpenAIServer, **kw) -> LLMConfig:
    base = dict(engine="http", model="tiny", base_url=server.base_url, qps=50, http_retries=1, batch_size=4,
                stage_num_cpus=0.25)
    base.update(kw)
    return LLMConfig(**base)


def test_http_judge_real_model_malformed_and_server_errors(ray_local, tiny_llm, monkeypatch):
    monkeypatch.setenv("MEMPRUNE_TEST_API_KEY", "sk-test-123")
    rows = judge_rows(4)
    with TinyOpenAIServer(tiny_llm, max_len=1024, idle_timeout=120) as server:
        config = _config(server, api_key_env="MEMPRUNE_TEST_API_KEY", max_retries=1, sampling={"max_tokens": 3})
        out = run_llm(judge_dataset(rows), config, task="judge").take_all()
        requests = [r["body"] for r in server.requests]
        headers = [r["headers"] for r in server.requests]
    by_id = check_judge_output(rows, out, max_attempts=2)
    long = by_id["c:s0:long"]
    assert long["attempts"] == 2 and long["error"].startswith("server:") and "exceeds the context length" in long["error"]
    assert by_id["c:s0:empty"]["attempts"] == 0
    garbage = [r for r in out if r["error"] and "unparseable" in r["error"]]
    assert garbage and all(r["attempts"] == 2 and r["raw"] is not None for r in garbage)
    assert all(r["tokens_in"] > 0 for r in garbage)

    # what went over the wire: schema'd response_format, auth header, retry sampling
    n_sent = sum(r["attempts"] for r in out)
    assert len(requests) == n_sent
    assert all(h.get("Authorization") == "Bearer sk-test-123" for h in headers)
    assert all(b["response_format"]["json_schema"]["schema"] == JUDGE_SCHEMA for b in requests)
    first = [b for b in requests if b["seed"] == 0]
    retries = [b for b in requests if b["seed"] == 1]
    assert len(first) == 5 and all(b["temperature"] == 0.0 and b["max_tokens"] == 3 for b in first)  # not `empty`
    assert len(retries) == n_sent - 5 and all(b["temperature"] == 0.7 for b in retries)
    # untrusted text travels as data inside the user message only
    assert all("How is your dog doing?" in b["messages"][1]["content"] for b in first if "dog number" in
               b["messages"][1]["content"])


def _scripted(body: dict) -> str:
    """good -> valid JSON; flaky -> garbage on the first attempt only; lenient -> prose; bad -> never a score."""
    user = body["messages"][-1]["content"]
    if "KIND good" in user:
        return '{"score": 0.75}'
    if "KIND flaky" in user:
        return "I cannot decide" if body["seed"] == 0 else '{"score": 1}'
    if "KIND lenient" in user:
        return "The score is 0.3 because the dog is mentioned."
    return "nope, 7 out of 10"


def test_http_judge_scripted_retries_and_error_rows(ray_local, tiny_llm):
    kinds = ["good", "flaky", "lenient", "bad", "good", "flaky"]
    rows = [{"bullet_id": f"b{i}", "turn_id": f"t{i}", "pos": i, "bullet": f"KIND {k}", "context": [],
             "target": "hello", "target_speaker": "A", "kind": k} for i, k in enumerate(kinds)]
    with TinyOpenAIServer(tiny_llm, responder=_scripted, idle_timeout=120) as server:
        config = _config(server, max_retries=1, response_format="json_object")
        out = run_llm(judge_dataset(rows, block_rows=2), config, task="judge").take_all()
        sent = [r["body"] for r in server.requests]
    by_id = {r["bullet_id"]: r for r in out}
    assert len(out) == 6 and {r["kind"] for r in out} == set(kinds)  # passthrough column kept
    for r in out:
        if r["kind"] == "good":
            assert (r["score"], r["attempts"], r["error"]) == (0.75, 1, None)
        elif r["kind"] == "flaky":
            assert (r["score"], r["attempts"], r["error"], r["raw"]) == (1.0, 2, None, '{"score": 1}')
        elif r["kind"] == "lenient":
            assert (r["score"], r["attempts"]) == (0.3, 1)
        else:
            assert r["score"] is None and r["attempts"] == 2 and r["raw"] == "nope, 7 out of 10"
            assert "first number '7' is not in [0, 1]" in r["error"]
    flaky_in, good_in = by_id["b1"]["tokens_in"], by_id["b0"]["tokens_in"]
    assert flaky_in % 2 == 0 and abs(flaky_in / 2 - good_in) <= 3  # summed over both attempts of one prompt
    assert len(sent) == 6 + 3 and all(b["response_format"] == {"type": "json_object"} for b in sent)
    assert json.loads(json.dumps(sent[0]["messages"]))[0]["role"] == "system"


def test_http_retries_429_and_5xx_then_gives_up_with_one_clear_error(ray_local, tiny_llm):
    """Ray's HTTP stage retries 429/502/503/504 with backoff; a server that never recovers is one LLMError."""
    from memprune.llm import LLMError

    seen: dict[str, int] = {}

    def flaky(body: dict) -> str | int:
        user = body["messages"][-1]["content"]
        seen[user] = seen.get(user, 0) + 1
        if "always" in user:
            return 503
        return (429, 503)[seen[user] - 1] if seen[user] <= 2 else '{"score": 0.5}'

    rows = [{"bullet_id": f"b{i}", "turn_id": f"t{i}", "pos": i, "bullet": f"bullet {i}", "context": [],
             "target": "hello", "target_speaker": "A"} for i in range(3)]
    with TinyOpenAIServer(tiny_llm, responder=flaky, idle_timeout=120) as server:
        config = _config(server, http_retries=2, http_retry_wait_s=0.05, max_retries=0, qps=4)
        out = run_llm(judge_dataset(rows, block_rows=3), config, task="judge").take_all()
        times = sorted(r["time"] for r in server.requests)
    assert sorted(r["score"] for r in out) == [0.5, 0.5, 0.5] and all(r["error"] is None for r in out)
    assert sorted(seen.values()) == [3, 3, 3]  # 429, then 503, then the answer: two retries each
    gaps = [b - a for a, b in zip(times, times[1:])]  # qps=4 spaces every send, retries included
    assert len(times) == 9 and min(gaps) >= 1 / 4 - 0.02, gaps

    stuck = [{**rows[0], "bullet": "always failing"}]
    with TinyOpenAIServer(tiny_llm, responder=flaky, idle_timeout=120) as server:
        config = _config(server, http_retries=1, http_retry_wait_s=0.05, max_retries=0)
        with pytest.raises(LLMError, match="kept failing .* after 1 retries"):
            run_llm(judge_dataset(stuck), config, task="judge").take_all()
