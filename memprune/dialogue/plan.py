"""Target turns, memory conditions and generation rows of the dialogue evaluation (pure: no Ray, no model).

DESIGN step 6. For every evaluated turn of a later session the generator gets the dialogue
of that session before the turn plus one memory condition, and writes the turn:

- `none`       no memory;
- `all`        every bullet of the earlier sessions of the same conversation;
- `pruned`     the bullets of `all` that a pruning run kept (`keep` column of the pruned store);
- `retrieval`  the top-k bullets of `all` by cosine similarity between the bullet and the
               recent dialogue (an LD-Agent-style retrieval baseline); `retrieval_k="pruned"`
               gives each target as many bullets as `pruned` has (an equal-budget baseline).

Every condition of a target gets the identical dialogue context, speaker and prompt
template; only the memory notes differ, and they are always listed in chronological order
(session, then position in the session), so the set of bullets is the only variable.

Sampling is deterministic and stable: each candidate turn is ranked by a hash of
(seed, turn id) and the first `turns` are taken, so a turn's selection does not depend on
the order of the corpus files, and a larger `turns` is a superset of a smaller one.

The bullets, their pools, the hash rank and the retrieval top-k are `memprune.memory.conditions`,
which qa-eval builds its conditions from too; what is dialogue's own is the target turn.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pyarrow as pa

from memprune.errors import MemPruneError
from memprune.memory.conditions import Bullet, memory_pool, rank_key, top_k

CONDITIONS: tuple[str, ...] = ("none", "all", "pruned", "retrieval")
Condition = Literal["none", "all", "pruned", "retrieval"]

CONTEXT_TURN = pa.struct([pa.field("speaker", pa.string()), pa.field("text", pa.string())])
NOTE = pa.struct([
    pa.field("bullet_id", pa.string()),
    pa.field("session_index", pa.int32()),
    pa.field("speaker", pa.string()),
    pa.field("text", pa.string()),
])

# One row per (target turn, memory condition): the generation input plus what the report needs.
ROWS = pa.schema([
    pa.field("row_id", pa.string(), nullable=False),
    pa.field("turn_id", pa.string(), nullable=False),
    pa.field("conversation_id", pa.string(), nullable=False),
    pa.field("session_index", pa.int32(), nullable=False),
    pa.field("turn_index", pa.int32(), nullable=False),
    pa.field("condition", pa.string(), nullable=False),
    pa.field("target_speaker", pa.string(), nullable=False),
    pa.field("reference", pa.string(), nullable=False),
    pa.field("context", pa.list_(CONTEXT_TURN), nullable=False),
    pa.field("memory", pa.list_(NOTE), nullable=False),
    pa.field("n_memory", pa.int32(), nullable=False),
    pa.field("memory_ids", pa.list_(pa.string()), nullable=False),
    pa.field("pool_size", pa.int32(), nullable=False),
])


class DialogueError(MemPruneError):
    """The dialogue evaluation inputs or settings are unusable; the message names the file, record or key."""


@dataclass(frozen=True)
class Target:
    """One evaluated turn: where it is, who says it, the real text and the dialogue before it."""

    turn_id: str
    conversation_id: str
    session_index: int
    turn_index: int
    speaker: str
    reference: str
    context: tuple[tuple[str, str], ...]  # (speaker, text) of the turns before it in its session


@dataclass
class SampleSettings:
    """Which turns are evaluated: how many, the seed, and the eligibility rules."""

    turns: int = 200
    seed: int = 0
    min_context_turns: int = 1
    context_turns: int | None = None
    max_per_session: int | None = None
    require_memory: bool = True


@dataclass
class Candidates:
    """The outcome of sampling: the chosen targets and how many turns each rule excluded."""

    targets: list[Target]
    eligible: int
    excluded: dict[str, int] = field(default_factory=dict)


def sample_targets(sessions: pa.Table, by_session: Mapping[str, Mapping[int, list[Bullet]]],
                   settings: SampleSettings) -> Candidates:
    """Candidate turns of every session that has an earlier session, ranked by `rank_key`; the first `turns`.

    A turn is eligible when at least `min_context_turns` turns precede it in its session, its
    text is not empty and (with `require_memory`) the earlier sessions have at least one bullet.
    """
    if settings.turns < 1:
        raise DialogueError(f"turns must be >= 1, got {settings.turns}")
    first: dict[str, int] = {}
    convs = sessions.column("conversation_id").to_pylist()
    idxs = [int(i) for i in sessions.column("session_index").to_pylist()]
    for conv, idx in zip(convs, idxs):
        first[conv] = min(first.get(conv, idx), idx)
    excluded = {"first_session": 0, "too_little_context": 0, "empty_text": 0, "no_memory": 0}
    eligible: list[tuple[bytes, int, int]] = []  # (rank, session row, turn index)
    turns_col = sessions.column("turns")
    for row, (conv, idx) in enumerate(zip(convs, idxs)):
        turns = turns_col[row].as_py() or []
        if idx == first[conv]:
            excluded["first_session"] += len(turns)
            continue
        has_memory = bool(memory_pool(by_session, conv, idx))
        for pos, turn in enumerate(turns):
            if pos < settings.min_context_turns:
                excluded["too_little_context"] += 1
            elif not str(turn.get("text") or "").strip():
                excluded["empty_text"] += 1
            elif settings.require_memory and not has_memory:
                excluded["no_memory"] += 1
            else:
                eligible.append((rank_key(settings.seed, turn["turn_id"]), row, pos))
    eligible.sort()
    chosen: list[tuple[int, int]] = []
    per_session: dict[int, int] = defaultdict(int)
    for _, row, pos in eligible:
        if len(chosen) >= settings.turns:
            break
        if settings.max_per_session is not None and per_session[row] >= settings.max_per_session:
            continue
        per_session[row] += 1
        chosen.append((row, pos))
    chosen.sort(key=lambda rp: (convs[rp[0]], idxs[rp[0]], rp[1]))
    targets = []
    for row, pos in chosen:
        turns = turns_col[row].as_py()
        start = 0 if settings.context_turns is None else max(0, pos - settings.context_turns)
        turn = turns[pos]
        targets.append(Target(
            turn_id=turn["turn_id"], conversation_id=convs[row], session_index=idxs[row], turn_index=pos,
            speaker=str(turn["speaker"]), reference=" ".join(str(turn["text"]).split()),
            context=tuple((str(t["speaker"]), str(t["text"])) for t in turns[start:pos]),
        ))
    return Candidates(targets=targets, eligible=len(eligible), excluded=excluded)


def retrieval_query(target: Target, turns: int) -> str:
    """The text a retrieval baseline embeds: the last `turns` context turns (`speaker: text` lines)."""
    recent = target.context[-turns:] if turns > 0 else ()
    return "\n".join(f"{speaker}: {text}" for speaker, text in recent)


Embed = Callable[[Sequence[str]], np.ndarray]


def build_rows(targets: Sequence[Target], by_session: Mapping[str, Mapping[int, list[Bullet]]],
               conditions: Sequence[str], keep: Mapping[str, bool] | None = None,
               embed: Embed | None = None, retrieval_k: int | Literal["pruned"] = 5,
               retrieval_turns: int = 4) -> pa.Table:
    """The `ROWS` table: one row per target x condition, the conditions of a target adjacent.

    `keep` maps bullet id -> kept (needed for `pruned`, and for `retrieval_k="pruned"`);
    a bullet missing from `keep` counts as not kept (the caller decides whether that is an error).
    `embed(texts) -> L2-normalised vectors` is needed for `retrieval`; every distinct text is
    embedded once. Adjacent rows share the prompt prefix (dialogue first), for prefix caching.
    """
    unknown = [c for c in conditions if c not in CONDITIONS]
    if unknown or not conditions:
        raise DialogueError(f"conditions must be a non-empty subset of {list(CONDITIONS)}, got {list(conditions)}")
    if len(set(conditions)) != len(conditions):
        raise DialogueError(f"conditions must not repeat, got {list(conditions)}")
    needs_keep = "pruned" in conditions or ("retrieval" in conditions and retrieval_k == "pruned")
    if needs_keep and keep is None:
        raise DialogueError("the pruned condition (or retrieval_k: pruned) needs the pruned store's keep flags")
    if "retrieval" in conditions and embed is None:
        raise DialogueError("the retrieval condition needs an encoder (embed)")
    if retrieval_k != "pruned" and (isinstance(retrieval_k, bool) or not isinstance(retrieval_k, int) or retrieval_k < 1):
        raise DialogueError(f"retrieval_k must be an integer >= 1 or 'pruned', got {retrieval_k!r}")

    pools = [memory_pool(by_session, t.conversation_id, t.session_index) for t in targets]
    vectors: dict[str, np.ndarray] = {}
    if "retrieval" in conditions:
        queries = [retrieval_query(t, retrieval_turns) for t in targets]
        texts = sorted({b.text for pool in pools for b in pool} | {q for q in queries if q})
        if texts:
            emb = np.asarray(embed(texts), dtype=np.float32)
            if emb.shape[0] != len(texts):
                raise DialogueError(f"the encoder returned {emb.shape[0]} vectors for {len(texts)} texts")
            vectors = {t: emb[i] for i, t in enumerate(texts)}

    rows: list[dict[str, Any]] = []
    for target, pool in zip(targets, pools):
        kept = [b for b in pool if keep.get(b.bullet_id, False)] if keep is not None else []
        for condition in conditions:
            if condition == "none":
                memory: list[Bullet] = []
            elif condition == "all":
                memory = list(pool)
            elif condition == "pruned":
                memory = kept
            else:
                k = len(kept) if retrieval_k == "pruned" else int(retrieval_k)
                query = retrieval_query(target, retrieval_turns)
                if not pool or k == 0:
                    memory = []
                elif not query:  # no dialogue yet: the k most recent bullets
                    memory = pool[-k:]
                else:
                    sims = np.array([float(vectors[b.text] @ vectors[query]) for b in pool])
                    memory = [pool[i] for i in top_k(sims, k)]
            rows.append({
                "row_id": f"{target.turn_id}|{condition}", "turn_id": target.turn_id,
                "conversation_id": target.conversation_id, "session_index": target.session_index,
                "turn_index": target.turn_index, "condition": condition, "target_speaker": target.speaker,
                "reference": target.reference,
                "context": [{"speaker": s, "text": t} for s, t in target.context],
                "memory": [b.note() for b in memory], "n_memory": len(memory),
                "memory_ids": [b.bullet_id for b in memory], "pool_size": len(pool),
            })
    return pa.Table.from_pylist(rows, schema=ROWS)
