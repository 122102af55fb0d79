"""Pair building for the judge: bullets of session t x real utterances of sessions t+1..t+H.

This is step 2 of the method (DESIGN.md): every bullet b_i of session t is paired with
every utterance a of the next session (optionally of the next H sessions, optionally only
the utterances of one speaker), together with the dialogue context before a. Pure Python
and Arrow: no Ray, no model; `memprune.label` judges the pairs.

Rules, precisely:

- "h sessions ahead" means the session whose `session_index` is exactly t + h in the same
  conversation (1 <= h <= horizon); a missing session is skipped, never replaced by a later one.
- speaker filter, relative to the bullet's speaker: `all` keeps every turn, `same` only the
  turns spoken by the bullet's speaker, `other` only the turns of the other speakers. A bullet
  without a speaker cannot be filtered by `same`/`other` and gets no pairs (reason `no_speaker`).
- context: the `context_turns` turns right before the target in its own session (all
  speakers, oldest first); 0 means none.
- a pair h sessions ahead carries `horizon = h`; aggregation weighs its score by
  `decay ** (h - 1)` (see `memprune.label.aggregate`).
- bullets that get no pair are returned with a reason: `no_next_session` (none of the
  sessions t+1..t+H exists), `no_speaker`, `no_target_turns` (the filter left no turn).

Order: pairs come grouped so that pairs whose judge prompts share a prefix are adjacent
(prefix cache reuse, see `PairOptions.order`); the order is a pure function of the inputs.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Literal

import pyarrow as pa

Speaker = Literal["all", "same", "other"]
Order = Literal["target", "bullet"]

SPEAKER_FILTERS: tuple[str, ...] = ("all", "same", "other")
ORDERS: tuple[str, ...] = ("target", "bullet")

# Why a bullet got no pair at all.
NO_NEXT_SESSION = "no_next_session"
NO_SPEAKER = "no_speaker"
NO_TARGET_TURNS = "no_target_turns"

CONTEXT_TURN = pa.struct([pa.field("speaker", pa.string()), pa.field("text", pa.string())])

# One row per (bullet, target turn) pair, in judging order.
PLAN = pa.schema(
    [
        pa.field("bullet_id", pa.string(), nullable=False),
        pa.field("turn_id", pa.string(), nullable=False),
        pa.field("conversation_id", pa.string(), nullable=False),
        pa.field("bullet_session", pa.int32(), nullable=False),
        pa.field("target_session", pa.int32(), nullable=False),
        pa.field("horizon", pa.int32(), nullable=False),
        pa.field("bullet", pa.string(), nullable=False),
        pa.field("bullet_speaker", pa.string(), nullable=True),
        pa.field("target", pa.string(), nullable=False),
        pa.field("target_speaker", pa.string(), nullable=False),
        pa.field("context", pa.list_(CONTEXT_TURN), nullable=False),
    ]
)


@dataclass(frozen=True)
class PairOptions:
    """How pairs are built: speaker filter, context window, horizon, judging order.

    `order="target"` (default) puts all bullets for one target turn next to each other:
    the judge prompt (memprune/prompts/judge_v1.txt) is system text, then the dialogue
    context, then the target, and the bullet last, so those pairs share everything but
    the bullet and a prefix-caching engine computes the long part once. Consecutive
    targets of one session follow each other, so the system prompt and the dialogue
    also stay hot. `order="bullet"` puts all target turns of one bullet together, for a
    template that starts with the bullet.
    """

    speaker: Speaker = "all"
    context_turns: int = 4
    horizon: int = 1
    order: Order = "target"

    def __post_init__(self) -> None:
        if self.speaker not in SPEAKER_FILTERS:
            raise ValueError(f"speaker must be one of {', '.join(SPEAKER_FILTERS)}, got {self.speaker!r}")
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {self.order!r}")
        if not isinstance(self.horizon, int) or self.horizon < 1:
            raise ValueError(f"horizon must be an integer >= 1, got {self.horizon!r}")
        if not isinstance(self.context_turns, int) or self.context_turns < 0:
            raise ValueError(f"context_turns must be an integer >= 0, got {self.context_turns!r}")


@dataclass
class PairPlan:
    """The pairs to judge (a `PLAN` table in judging order) and the bullets that got none."""

    pairs: pa.Table
    unpaired: list[tuple[str, str]] = field(default_factory=list)  # (bullet_id, reason), by bullet_id
    n_bullets: int = 0

    def reasons(self) -> dict[str, int]:
        """How many bullets got no pair, per reason."""
        out: dict[str, int] = {}
        for _, reason in self.unpaired:
            out[reason] = out.get(reason, 0) + 1
        return dict(sorted(out.items()))


def _keep(turn_speaker: str, bullet_speaker: str | None, speaker: str) -> bool:
    if speaker == "all":
        return True
    if speaker == "same":
        return turn_speaker == bullet_speaker
    return turn_speaker != bullet_speaker


def build_pairs(
    sessions: pa.Table,
    bullets: pa.Table,
    options: PairOptions | None = None,
    with_context: bool = True,
) -> PairPlan:
    """Pair every bullet of session t with the (filtered) turns of sessions t+1..t+H, in judging order.

    `sessions` and `bullets` follow `memprune.schema.SESSIONS` / `BULLETS`. With
    `with_context=False` the `context` lists stay empty (the similarity judge ignores them,
    and building them for millions of pairs costs time).
    """
    opts = options or PairOptions()
    # conversation -> session_index -> list of (turn_id, speaker, text)
    turns_of: dict[str, dict[int, list[tuple[str, str, str]]]] = defaultdict(dict)
    for row in sessions.select(["conversation_id", "session_index", "turns"]).to_pylist():
        turns_of[row["conversation_id"]][row["session_index"]] = [
            (t["turn_id"], t["speaker"], t["text"]) for t in row["turns"]
        ]
    # conversation -> session_index -> bullets in table order
    bullets_of: dict[str, dict[int, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    b_rows = bullets.select(["bullet_id", "conversation_id", "session_index", "speaker", "text"]).to_pylist()
    for b in b_rows:
        bullets_of[b["conversation_id"]][b["session_index"]].append(b)

    # Each pair: (sort key, row). Keys make the order independent of dict iteration.
    keyed: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    unpaired: list[tuple[str, str]] = []
    for cid in sorted(bullets_of):
        conv_turns = turns_of.get(cid, {})
        for t in sorted(bullets_of[cid]):
            ahead = [(h, t + h) for h in range(1, opts.horizon + 1) if (t + h) in conv_turns]
            for b_pos, b in enumerate(bullets_of[cid][t]):
                if not ahead:
                    unpaired.append((b["bullet_id"], NO_NEXT_SESSION))
                    continue
                if opts.speaker != "all" and b["speaker"] is None:
                    unpaired.append((b["bullet_id"], NO_SPEAKER))
                    continue
                n_before = len(keyed)
                for h, s in ahead:
                    turns = conv_turns[s]
                    for pos, (tid, spk, text) in enumerate(turns):
                        if not _keep(spk, b["speaker"], opts.speaker):
                            continue
                        if with_context and opts.context_turns:
                            ctx = [{"speaker": cs, "text": ct} for _, cs, ct in turns[max(0, pos - opts.context_turns):pos]]
                        else:
                            ctx = []
                        if opts.order == "target":
                            key = (cid, s, pos, t, b_pos)
                        else:
                            key = (cid, t, b_pos, s, pos)
                        keyed.append((key, {
                            "bullet_id": b["bullet_id"],
                            "turn_id": tid,
                            "conversation_id": cid,
                            "bullet_session": t,
                            "target_session": s,
                            "horizon": h,
                            "bullet": b["text"],
                            "bullet_speaker": b["speaker"],
                            "target": text,
                            "target_speaker": spk,
                            "context": ctx,
                        }))
                if len(keyed) == n_before:
                    unpaired.append((b["bullet_id"], NO_TARGET_TURNS))
    keyed.sort(key=lambda kr: kr[0])
    table = pa.Table.from_pylist([row for _, row in keyed], schema=PLAN)
    unpaired.sort()
    return PairPlan(pairs=table, unpaired=unpaired, n_bullets=len(b_rows))


def shard_bounds(n_items: int, shard_size: int) -> list[tuple[int, int]]:
    """The `[start, stop)` ranges that cut `n_items` ordered items into shards of `shard_size`."""
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    return [(start, min(start + shard_size, n_items)) for start in range(0, n_items, shard_size)]


def target_groups(plan: PairPlan) -> list[tuple[int, int]]:
    """The `[start, stop)` runs of plan rows that share one target turn (listwise lists, likelihood baselines).

    Needs the `target` order, where the pairs of one target turn are adjacent; a turn that comes back
    later in the plan is a ValueError.
    """
    turns = plan.pairs.column("turn_id").to_pylist()
    groups: list[tuple[int, int]] = []
    seen: set[str] = set()
    start = 0
    for i in range(1, len(turns) + 1):
        if i == len(turns) or turns[i] != turns[start]:
            if turns[start] in seen:
                raise ValueError(f"the pairs of turn {turns[start]!r} are not adjacent: build the plan with order=target")
            seen.add(turns[start])
            groups.append((start, i))
            start = i
    return groups


def group_bounds(groups: list[tuple[int, int]], shard_size: int) -> list[tuple[int, int]]:
    """Shards of whole groups: consecutive groups are joined until a shard holds at least `shard_size` pairs."""
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    bounds: list[tuple[int, int]] = []
    for a, b in groups:
        if bounds and bounds[-1][1] - bounds[-1][0] < shard_size:
            bounds[-1] = (bounds[-1][0], b)
        else:
            bounds.append((a, b))
    return bounds
