"""The memory a condition draws from (pure: no Ray, no model): a corpus's bullets per conversation and session,
the pool of a point in a conversation, the stable hash rank of sampling, and the top-k of a retrieval baseline.

Both evaluations build their conditions from these: `all` is the pool, `pruned` the pool's kept bullets,
`retrieval` the pool's `top_k` by similarity. Bullets are always listed chronologically (session, then
position), so the set of bullets is the only variable between conditions.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

BySession = Mapping[str, Mapping[int, list["Bullet"]]]


@dataclass(frozen=True)
class Bullet:
    """A memory bullet of the corpus, with its position in its session (for chronological order)."""

    bullet_id: str
    conversation_id: str
    session_index: int
    position: int
    speaker: str | None
    text: str

    def note(self) -> dict[str, Any]:
        """The bullet as a memory note of the reply prompt."""
        return {"bullet_id": self.bullet_id, "session_index": self.session_index, "speaker": self.speaker,
                "text": self.text}


def rank_key(seed: int, item_id: str) -> bytes:
    """The sampling rank of an item (a turn, a question): a hash of (seed, id), the same in every process and run,
    so a selection does not depend on the order of the corpus files and a larger sample is a superset."""
    return hashlib.blake2b(f"{seed}|{item_id}".encode(), digest_size=16).digest()


def bullets_by_session(bullets: pa.Table) -> dict[str, dict[int, list[Bullet]]]:
    """conversation -> session -> its bullets in table order (empty-text bullets are skipped)."""
    out: dict[str, dict[int, list[Bullet]]] = defaultdict(lambda: defaultdict(list))
    cols = {c: bullets.column(c).to_pylist() for c in ("bullet_id", "conversation_id", "session_index", "speaker", "text")}
    for i in range(bullets.num_rows):
        text = cols["text"][i]
        if not isinstance(text, str) or not text.strip():
            continue
        conv, sess = cols["conversation_id"][i], int(cols["session_index"][i])
        group = out[conv][sess]
        group.append(Bullet(cols["bullet_id"][i], conv, sess, len(group), cols["speaker"][i], text))
    return out


def memory_pool(by_session: BySession, conversation_id: str, session_index: int) -> list[Bullet]:
    """Every bullet of the sessions before `session_index` of the conversation, chronologically."""
    sessions = by_session.get(conversation_id, {})
    return [b for s in sorted(sessions) if s < session_index for b in sessions[s]]


def top_k(similarities: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest similarities, ties to the earlier index, returned in ascending index order."""
    k = max(0, min(int(k), len(similarities)))
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.lexsort((np.arange(len(similarities)), -np.asarray(similarities, dtype=np.float64)))
    return np.sort(order[:k])
