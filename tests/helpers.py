"""What several test modules share (no test module imports another's privates)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pyarrow as pa

from memprune.io import MARKER
from memprune.schema import SESSIONS, turn_id
from memprune.storage import location
from memprune.tune import TuneConfig

LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")
SUMMARY_TOPICS = ["cat", "chess", "weather", "dog"]  # the sessions `summary_sessions` makes, one per topic
os.environ["MEM0_TELEMETRY"] = "False"


def listeners_beyond_loopback(root: int | None = None) -> list[str]:
    """Every listening TCP socket of process `root` (default: this one) and all its descendants that another
    machine could reach (bound to an address other than loopback), as 'ADDRESS:PORT (command)'."""
    top = psutil.Process(root or os.getpid())
    found = []
    for proc in [top, *top.children(recursive=True)]:
        try:
            conns = proc.net_connections(kind="tcp")
            name = " ".join(proc.cmdline())[:100]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        found += [f"{c.laddr.ip}:{c.laddr.port} ({name})" for c in conns
                  if c.status == psutil.CONN_LISTEN and c.laddr.ip not in LOOPBACK]
    return found


USERS = {
    "alice": ["Alice has a cat named Tom.", "Alice has a cat named Tom.", "ok", "Alice works night shifts as a nurse.",
              "lol", "Alice is training for the Berlin marathon in May."],
    "bob": ["Bob is allergic to peanuts.", "hmm", "Bob's daughter starts school in September.",
            "Bob's daughter starts school in September.", "yes"],
    "carol": ["Carol moved to Lisbon last year.", "k", "Carol plays the cello in an orchestra."],
}


def labels_for(bullets: pa.Table, seed: int = 0) -> pa.Table:
    """Pseudo labels like a judge's: durable (recurring) facts high, one-off remarks low, plus noise."""
    rng = np.random.default_rng(seed)
    recurs = np.asarray(bullets.column("recurs").to_pylist(), dtype=float)
    last = np.asarray(bullets.column("session_index").to_pylist()) == max(bullets.column("session_index").to_pylist())
    y = np.clip(0.15 + 0.6 * recurs + rng.normal(0, 0.1, len(recurs)), 0, 1)
    keep = pa.array(~last)  # the last session has no next session: unlabelled
    ids = bullets.column("bullet_id").filter(keep)
    return pa.table(
        {
            "bullet_id": ids,
            "label": pa.array(y[~last]),
            "n_pairs": pa.array(np.ones(len(ids), np.int32)),
            "aggregation": pa.array(["max"] * len(ids)),
        }
    )



def committed(uri: str, step: str) -> dict[str, Any]:
    """The output set's marker at `uri`, checked to be a finished set of `step`."""
    info = json.loads((location(uri) / MARKER).read_text())
    assert info["state"] == "done" and info["step"] == step, info
    return info



def remote_files(uri: str) -> set[str]:
    return {n for n in location(uri).files() if not n.startswith(".")}



def tune_config(data: Path, labels: Path, out: Path, **extra: Any) -> TuneConfig:
    train = {
        "max_length": 24, "split": {"valid": 3, "test": 2}, "head": {"hidden": 16},
        "stage1": {"epochs": 3, "lr": 3e-3, "batch_size": 32, "patience": 3},
        "stage2": {"epochs": 2, "lr": 3e-3, "batch_size": 32, "patience": 2,
                   "lora": {"r": 2, "alpha": 4, "dropout": 0.0}},
        "embed": {"batch_size": 64, "actors": 1}, "ray": {"num_workers": 1, "use_gpu": False},
    }
    base: dict[str, Any] = {
        "data": data, "labels": labels, "out": out, "train": train, "max_concurrent": 2,
        "stage1_space": {"stage1.lr": [3e-3, 1e-2]}, "stage1_trials": 1,
        "stage2_space": {"stage2.lr": [3e-3], "loss.rank_weight": [0.0, 0.5],
                         "stage2.lora.target_modules": [["query", "value"]]}, "stage2_trials": 3,
        # the base settings, then a ranking-loss trial (its own stage 1), then a destructive step size
        "points": [{"loss.rank_weight": 0.5}, {"stage2.lr": 3.0}],
        "scheduler": {"grace_period": 1, "reduction_factor": 2},
    }
    train.update(extra.pop("train", {}))  # a stage's settings given replace that stage's
    base.update(extra)
    return TuneConfig.model_validate(base)



def summary_sessions() -> pa.Table:
    rows = []
    for c, topic in enumerate(SUMMARY_TOPICS):
        conv = f"conv{c}"
        texts = [f"I adopted a {topic} last week.", "Nice! Tell me more.", f"The {topic} is great."]
        rows.append({
            "conversation_id": conv, "session_index": 0, "speakers": ["A", "B"], "time": None,
            "turns": [{"turn_id": turn_id(conv, 0, i), "speaker": "AB"[i % 2], "text": t} for i, t in enumerate(texts)],
        })
    return pa.Table.from_pylist(rows, schema=SESSIONS)



def summary_reply(body: dict) -> str:
    """cat: valid JSON (one bogus evidence id); chess: garbage, then a Markdown list on retry;
    weather: garbage; dog: JSON that is not a summary."""
    user = body["messages"][-1]["content"]
    if "adopted a cat" in user:
        return json.dumps({"bullets": [
            {"speaker": "A", "text": "A adopted a cat last week.", "evidence": ["T1", "T9"]},
            {"speaker": "A", "text": "A thinks the cat is great.", "evidence": ["T3"]},
        ]})
    if "adopted a dog" in user:
        return "{}"
    if "adopted a chess" in user:
        return "hmm" if body["seed"] == 0 else "- A adopted a chess set [T1]\n- B is curious (T2, T4)"
    return "no idea"



def mem0_config(d: Path, minilm_path: str) -> Path:
    cfg = {"vector_store": {"provider": "qdrant", "config": {"collection_name": "memories", "path": str(d / "qdrant"),
                                                              "embedding_model_dims": 384, "on_disk": True}},
           "embedder": {"provider": "huggingface", "config": {"model": minilm_path}},
           # never called with infer=False; set so that Mem0 builds its LLM client offline
           "llm": {"provider": "openai", "config": {"api_key": "unused", "openai_base_url": "http://127.0.0.1:9/v1"}},
           "history_db_path": str(d / "history.db")}
    path = d / "mem0.json"
    path.write_text(json.dumps(cfg))
    return path


def mem0_memory(config: Path):
    from mem0 import Memory

    return Memory.from_config(json.loads(config.read_text()))


def mem0_close(memory) -> None:
    memory.vector_store.client.close()


def mem0_get_all(config: Path) -> dict[str, set[str]]:
    m = mem0_memory(config)
    try:
        return {u: {r["id"] for r in m.get_all(filters={"user_id": u}, top_k=100)["results"]} for u in USERS}
    finally:
        mem0_close(m)


def mem0_points(config: Path) -> dict[str, tuple[dict, list[float]]]:
    """Every memory as Qdrant holds it: id -> (whole payload: data, hash, created_at, metadata..., vector)."""
    m = mem0_memory(config)
    try:
        vs = m.vector_store
        points, _ = vs.client.scroll(collection_name=vs.collection_name, limit=1000, with_payload=True, with_vectors=True)
        return {str(p.id): (dict(p.payload), [round(x, 6) for x in p.vector]) for p in points}
    finally:
        mem0_close(m)


def review_document(html: str) -> dict[str, Any]:
    """The data document a review page embeds (`<script type="application/json" id="memprune-data">`)."""
    start = html.index('id="memprune-data">') + len('id="memprune-data">')
    return json.loads(html[start:html.index("</script>", start)])
