"""Questions, memory scopes, memory conditions and answer rows of qa-eval (pure: no Ray, no model).

A question of the `qa` table is answered once per memory condition, with the same prompt apart
from the memory notes:

- `none`       no memory;
- `all`        every bullet of the conversation in the question's scope (below);
- `pruned`     the bullets of `all` that a pruning run kept (`keep` of the pruned store);
- `retrieval`  the bullets of `all` most similar to the question (cosine of L2-normalised
               encoder embeddings): a fixed `retrieval_k`, `"pruned"` = as many bullets as
               `pruned` has for the question, or `"pruned_tokens"` = the most similar bullets
               that fit in the memory tokens of `pruned` for the question (equal token budget);
- `dialogue`   the raw turns of the sessions in scope, the most recent ones that fit in
               `dialogue_tokens` memory tokens (the upper reference: what a summary loses).

**Scope: which sessions precede the question.** `last_session` (the default): the question is
asked after the last session of its conversation, so every session is in scope; this is how
LoCoMo and LongMemEval ask their questions. `evidence`: the question is asked right after its
latest evidence session, so the sessions up to and including that one are in scope (a question
without evidence falls back to every session).

Notes carry the session index and date (`time`) of their session and the speaker, in
chronological order (session, then position), so the set of notes is the only variable.
Memory tokens are what the notes cost in the prompt: the token counts (`count`) of the notes as
the prompt renders them (`<note session time speaker>text</note>`, `memprune.llm.prompts.render_note`),
summed. The dialogue budget and the equal-token retrieval budget are measured in them, so a budget
bounds the prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pyarrow as pa

from memprune.errors import MemPruneError
from memprune.llm.prompts import render_note
from memprune.memory.conditions import Bullet, memory_pool, rank_key, top_k

CONDITIONS: tuple[str, ...] = ("none", "all", "pruned", "retrieval", "dialogue")
Scope = Literal["last_session", "evidence"]
RetrievalK = int | Literal["pruned", "pruned_tokens"]
Count = Callable[[Sequence[str]], Sequence[int]]
Embed = Callable[[Sequence[str]], np.ndarray]

NOTE = pa.struct([
    pa.field("id", pa.string()),
    pa.field("session_index", pa.int32()),
    pa.field("time", pa.string()),
    pa.field("speaker", pa.string()),
    pa.field("text", pa.string()),
])

# One row per (question, memory condition): the answer prompt's input plus what scoring needs.
ROWS = pa.schema([
    pa.field("row_id", pa.string(), nullable=False),
    pa.field("qa_id", pa.string(), nullable=False),
    pa.field("conversation_id", pa.string(), nullable=False),
    pa.field("category", pa.int32()),
    pa.field("question", pa.string(), nullable=False),
    pa.field("gold", pa.string()),
    pa.field("answerable", pa.bool_(), nullable=False),
    pa.field("condition", pa.string(), nullable=False),
    pa.field("memory", pa.list_(NOTE), nullable=False),
    pa.field("memory_ids", pa.list_(pa.string()), nullable=False),
    pa.field("n_memory", pa.int32(), nullable=False),
    pa.field("memory_tokens", pa.int64(), nullable=False),
    pa.field("pool_size", pa.int32(), nullable=False),
    pa.field("truncated", pa.int32(), nullable=False),
    pa.field("scope_session", pa.int32()),
])


class QAError(MemPruneError):
    """The qa-eval inputs or settings are unusable; the message names the file, record or key."""


@dataclass(frozen=True)
class Question:
    """One row of the `qa` table; `gold` None = unanswerable (LoCoMo's adversarial questions)."""

    qa_id: str
    conversation_id: str
    question: str
    gold: str | None
    evidence: tuple[str, ...]
    category: int | None

    @property
    def answerable(self) -> bool:
        return self.gold is not None


@dataclass(frozen=True)
class Turn:
    """A dialogue turn as a memory note of the `dialogue` condition."""

    turn_id: str
    session_index: int
    time: str | None
    speaker: str
    text: str


@dataclass(frozen=True)
class Corpus:
    """What the conditions draw from: bullets and turns per conversation and session, session dates."""

    by_session: Mapping[str, Mapping[int, list[Bullet]]]
    turns: Mapping[str, list[Turn]]
    times: Mapping[tuple[str, int], str | None]
    turn_session: Mapping[str, int]

    @classmethod
    def build(cls, sessions: pa.Table, by_session: Mapping[str, Mapping[int, list[Bullet]]]) -> "Corpus":
        """Index the `sessions` table (turns chronologically, dates, turn id -> session) next to the bullets."""
        turns: dict[str, list[Turn]] = {}
        times: dict[tuple[str, int], str | None] = {}
        turn_session: dict[str, int] = {}
        rows = sessions.select(["conversation_id", "session_index", "turns", "time"]).to_pylist()
        for row in sorted(rows, key=lambda r: (r["conversation_id"], int(r["session_index"]))):
            conv, idx = row["conversation_id"], int(row["session_index"])
            times[(conv, idx)] = row["time"]
            for t in row["turns"] or []:
                turn_session[t["turn_id"]] = idx
                if str(t.get("text") or "").strip():
                    turns.setdefault(conv, []).append(Turn(t["turn_id"], idx, row["time"], str(t["speaker"]),
                                                           " ".join(str(t["text"]).split())))
        return cls(by_session, turns, times, turn_session)

    def sessions_of(self, conversation_id: str) -> list[int]:
        """Session indices of a conversation (with turns or bullets), ascending."""
        found = {s for (c, s) in self.times if c == conversation_id} | set(self.by_session.get(conversation_id, {}))
        return sorted(found)


def load_questions(qa: pa.Table) -> list[Question]:
    """The `qa` table as `Question`s, in table order."""
    cols = {c: qa.column(c).to_pylist() for c in ("qa_id", "conversation_id", "question", "answer", "evidence",
                                                  "category")}
    return [Question(cols["qa_id"][i], cols["conversation_id"][i], " ".join(str(cols["question"][i]).split()),
                     None if cols["answer"][i] is None else str(cols["answer"][i]), tuple(cols["evidence"][i] or ()),
                     cols["category"][i]) for i in range(qa.num_rows)]


def select_questions(questions: Sequence[Question], limit: int | None, seed: int,
                     categories: Sequence[int] | None = None) -> tuple[list[Question], dict[str, int]]:
    """The questions evaluated, in table order, and how many each filter left out.

    `categories` keeps only those categories; `limit` then takes the first `limit` by a hash of
    (seed, qa_id), so the choice is stable and a larger limit is a superset of a smaller one.
    """
    excluded = {"category": 0, "limit": 0}
    pool = list(questions)
    if categories is not None:
        wanted = set(categories)
        pool = [q for q in questions if q.category in wanted]
        excluded["category"] = len(questions) - len(pool)
    if limit is not None and limit < len(pool):
        chosen = {q.qa_id for q in sorted(pool, key=lambda q: rank_key(seed, q.qa_id))[:limit]}
        excluded["limit"] = len(pool) - limit
        pool = [q for q in pool if q.qa_id in chosen]
    return pool, excluded


def scope_end(question: Question, corpus: Corpus, scope: Scope) -> int | None:
    """The last session in the question's scope (None when its conversation has no session)."""
    sessions = corpus.sessions_of(question.conversation_id)
    if not sessions:
        return None
    if scope == "evidence":
        cited = [corpus.turn_session[t] for t in question.evidence if t in corpus.turn_session]
        if cited:
            return max(cited)
    return sessions[-1]


def bullet_note(bullet: Bullet, times: Mapping[tuple[str, int], str | None]) -> dict[str, Any]:
    """A bullet as a memory note (id, session, session date, speaker, text)."""
    return {"id": bullet.bullet_id, "session_index": bullet.session_index,
            "time": times.get((bullet.conversation_id, bullet.session_index)), "speaker": bullet.speaker,
            "text": bullet.text}


def turn_note(turn: Turn) -> dict[str, Any]:
    """A dialogue turn as a memory note."""
    return {"id": turn.turn_id, "session_index": turn.session_index, "time": turn.time, "speaker": turn.speaker,
            "text": turn.text}


def recent_within(costs: Sequence[int], budget: int | None) -> int:
    """How many items from the end fit in `budget` tokens (a contiguous most recent window; None = all)."""
    if budget is None:
        return len(costs)
    total, n = 0, 0
    for cost in reversed(costs):
        if total + cost > budget:
            break
        total += cost
        n += 1
    return n


def fill_budget(similarities: np.ndarray, costs: Sequence[int], budget: int) -> np.ndarray:
    """Indices of the most similar items that fit in `budget` tokens (greedy down the ranking, skipping
    items that no longer fit; ties to the earlier index), in ascending index order."""
    order = np.lexsort((np.arange(len(similarities)), -np.asarray(similarities, dtype=np.float64)))
    taken, total = [], 0
    for i in order:
        if total + costs[i] <= budget:
            taken.append(int(i))
            total += costs[i]
    return np.array(sorted(taken), dtype=np.int64)


def check_conditions(conditions: Sequence[str], keep: Mapping[str, bool] | None, embed: Embed | None,
                     retrieval_k: RetrievalK) -> None:
    """Raise `QAError` for unknown/repeated conditions or a condition whose inputs are missing."""
    unknown = [c for c in conditions if c not in CONDITIONS]
    if unknown or not conditions or len(set(conditions)) != len(conditions):
        raise QAError(f"conditions must be distinct values among {list(CONDITIONS)}, got {list(conditions)}")
    if needs_keep(conditions, retrieval_k) and keep is None:
        raise QAError("the pruned condition (or retrieval_k: pruned / pruned_tokens) needs the pruned store's keep flags")
    if "retrieval" in conditions and embed is None:
        raise QAError("the retrieval condition needs an encoder (embed)")
    if isinstance(retrieval_k, bool) or (not isinstance(retrieval_k, int) and retrieval_k not in ("pruned",
                                                                                                   "pruned_tokens")):
        raise QAError(f"retrieval_k must be an integer >= 1, 'pruned' or 'pruned_tokens', got {retrieval_k!r}")
    if isinstance(retrieval_k, int) and retrieval_k < 1:
        raise QAError(f"retrieval_k must be an integer >= 1, 'pruned' or 'pruned_tokens', got {retrieval_k!r}")


def needs_keep(conditions: Sequence[str], retrieval_k: RetrievalK) -> bool:
    """Whether the conditions need the pruned store: `pruned`, or retrieval sized by the pruned memory."""
    return "pruned" in conditions or ("retrieval" in conditions and retrieval_k in ("pruned", "pruned_tokens"))


def build_rows(questions: Sequence[Question], corpus: Corpus, conditions: Sequence[str], count: Count,
               keep: Mapping[str, bool] | None = None, embed: Embed | None = None,
               retrieval_k: RetrievalK = "pruned", dialogue_tokens: int | None = None,
               scope: Scope = "last_session") -> pa.Table:
    """The `ROWS` table: one row per question x condition, the conditions of a question adjacent.

    `count(texts) -> token counts` measures the rendered notes; `keep` maps bullet id -> kept (a bullet
    missing from it counts as not kept: the caller decides whether that is an error); `embed(texts)
    -> L2-normalised vectors` serves retrieval, each distinct text embedded once.
    """
    check_conditions(conditions, keep, embed, retrieval_k)
    ends = [scope_end(q, corpus, scope) for q in questions]
    pools = [[] if end is None else memory_pool(corpus.by_session, q.conversation_id, end + 1)
             for q, end in zip(questions, ends)]
    turns = [[t for t in corpus.turns.get(q.conversation_id, []) if end is not None and t.session_index <= end]
             for q, end in zip(questions, ends)]
    notes = {b.bullet_id: bullet_note(b, corpus.times) for pool in pools for b in pool}
    if "dialogue" in conditions:
        notes.update({t.turn_id: turn_note(t) for window in turns for t in window})
    ids = sorted(notes)
    cost = dict(zip(ids, (int(n) for n in count([render_note(notes[i], 0) for i in ids])))) if ids else {}
    vectors: dict[str, np.ndarray] = {}
    if "retrieval" in conditions:
        wanted = sorted({b.text for pool in pools for b in pool} | {q.question for q in questions})
        emb = np.asarray(embed(wanted), dtype=np.float32) if wanted else np.zeros((0, 1), dtype=np.float32)
        if emb.shape[0] != len(wanted):
            raise QAError(f"the encoder returned {emb.shape[0]} vectors for {len(wanted)} texts")
        vectors = dict(zip(wanted, emb))

    rows: list[dict[str, Any]] = []
    for q, end, pool, window in zip(questions, ends, pools, turns):
        kept = [b for b in pool if keep.get(b.bullet_id, False)] if keep is not None else []
        for condition in conditions:
            truncated, size = 0, len(pool)
            if condition == "dialogue":
                n = recent_within([cost[t.turn_id] for t in window], dialogue_tokens)
                memory = [notes[t.turn_id] for t in window[len(window) - n:]]
                truncated, size = len(window) - n, len(window)
            else:
                memory = [notes[b.bullet_id] for b in _bullets(condition, q, pool, kept, vectors, cost, retrieval_k)]
            rows.append({
                "row_id": f"{q.qa_id}|{condition}", "qa_id": q.qa_id, "conversation_id": q.conversation_id,
                "category": q.category, "question": q.question, "gold": q.gold, "answerable": q.answerable,
                "condition": condition, "memory": memory, "memory_ids": [n["id"] for n in memory],
                "n_memory": len(memory), "memory_tokens": sum(cost[n["id"]] for n in memory),
                "pool_size": size, "truncated": truncated, "scope_session": end,
            })
    return pa.Table.from_pylist(rows, schema=ROWS)


def _bullets(condition: str, q: Question, pool: list[Bullet], kept: list[Bullet], vectors: Mapping[str, np.ndarray],
             cost: Mapping[str, int], retrieval_k: RetrievalK) -> list[Bullet]:
    """The bullets of one bullet-memory condition, chronologically (`cost`: bullet id -> memory tokens)."""
    if condition == "none" or not pool:
        return []
    if condition == "all":
        return list(pool)
    if condition == "pruned":
        return kept
    sims = np.array([float(vectors[b.text] @ vectors[q.question]) for b in pool])
    if retrieval_k == "pruned_tokens":
        budget = sum(cost[b.bullet_id] for b in kept)
        return [pool[i] for i in fill_budget(sims, [cost[b.bullet_id] for b in pool], budget)]
    k = len(kept) if retrieval_k == "pruned" else int(retrieval_k)
    return [pool[i] for i in top_k(sims, k)]
