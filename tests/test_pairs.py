"""Pair building: speaker filters, context windows, horizons, reasons for no pair, judging order."""

from __future__ import annotations

import random

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memprune import schema
from memprune.label.aggregate import decay_weight
from memprune.label.pairs import (
    NO_NEXT_SESSION,
    NO_SPEAKER,
    NO_TARGET_TURNS,
    PLAN,
    PairOptions,
    build_pairs,
    shard_bounds,
)


def corpus(spec: dict[str, dict[int, list[str]]], bullets: dict[str, dict[int, list[str | None]]]):
    """Tables from {conv: {session: [speaker per turn]}} and {conv: {session: [speaker per bullet]}}."""
    s_rows, b_rows = [], []
    for cid, sessions in spec.items():
        for k, speakers in sessions.items():
            turns = [{"turn_id": schema.turn_id(cid, k, i), "speaker": sp, "text": f"{cid} s{k} t{i} by {sp}"}
                     for i, sp in enumerate(speakers)]
            s_rows.append({"conversation_id": cid, "session_index": k, "speakers": sorted(set(speakers)),
                           "turns": turns, "time": None})
    for cid, sessions in bullets.items():
        for k, speakers in sessions.items():
            for i, sp in enumerate(speakers):
                b_rows.append({"bullet_id": schema.bullet_id(cid, k, i), "conversation_id": cid, "session_index": k,
                               "speaker": sp, "text": f"fact {i} of {cid} s{k}", "evidence": []})
    return (pa.Table.from_pylist(s_rows, schema=schema.SESSIONS), pa.Table.from_pylist(b_rows, schema=schema.BULLETS))


AB = ["A", "B", "A", "B", "A"]


def test_next_session_pairs_and_last_session_unpaired():
    sessions, bullets = corpus({"c": {1: AB, 2: AB[:4], 3: AB[:3]}}, {"c": {1: ["A", "B"], 2: ["A"], 3: ["B"]}})
    plan = build_pairs(sessions, bullets)
    assert plan.pairs.schema.equals(PLAN)
    rows = plan.pairs.to_pylist()
    # 2 bullets x 4 turns of session 2, 1 bullet x 3 turns of session 3
    assert len(rows) == 2 * 4 + 1 * 3
    assert {r["target_session"] - r["bullet_session"] for r in rows} == {1}
    assert {r["horizon"] for r in rows} == {1}
    assert plan.unpaired == [("c:s3:b0", NO_NEXT_SESSION)]
    assert plan.n_bullets == 4
    # every (bullet, turn) at most once
    assert len({(r["bullet_id"], r["turn_id"]) for r in rows}) == len(rows)


@pytest.mark.parametrize("speaker,expected", [("all", 5), ("same", 3), ("other", 2)])
def test_speaker_filter_is_relative_to_the_bullet(speaker, expected):
    sessions, bullets = corpus({"c": {1: AB, 2: AB}}, {"c": {1: ["A"]}})
    plan = build_pairs(sessions, bullets, PairOptions(speaker=speaker))
    rows = plan.pairs.to_pylist()
    assert len(rows) == expected
    if speaker == "same":
        assert {r["target_speaker"] for r in rows} == {"A"}
    if speaker == "other":
        assert {r["target_speaker"] for r in rows} == {"B"}


def test_bullet_without_speaker_and_filter_without_targets():
    sessions, bullets = corpus({"c": {1: AB, 2: ["A", "A"]}}, {"c": {1: [None, "A"]}})
    plan = build_pairs(sessions, bullets, PairOptions(speaker="other"))
    assert dict(plan.unpaired) == {"c:s1:b0": NO_SPEAKER, "c:s1:b1": NO_TARGET_TURNS}
    assert plan.pairs.num_rows == 0
    assert plan.reasons() == {NO_SPEAKER: 1, NO_TARGET_TURNS: 1}
    # with speaker=all the speakerless bullet is paired normally
    plan = build_pairs(sessions, bullets, PairOptions(speaker="all"))
    assert plan.unpaired == [] and plan.pairs.num_rows == 4


@pytest.mark.parametrize("window", [0, 1, 2, 10])
def test_context_window_holds_the_turns_right_before_the_target(window):
    sessions, bullets = corpus({"c": {1: AB, 2: AB}}, {"c": {1: ["A"]}})
    plan = build_pairs(sessions, bullets, PairOptions(context_turns=window))
    turns2 = sessions.to_pylist()[1]["turns"]
    for r in plan.pairs.to_pylist():
        pos = int(r["turn_id"].rsplit("t", 1)[1])
        expected = [{"speaker": t["speaker"], "text": t["text"]} for t in turns2[max(0, pos - window):pos]]
        assert r["context"] == expected
    assert all(r["context"] == [] for r in build_pairs(sessions, bullets, with_context=False).pairs.to_pylist())


def test_horizon_reaches_later_sessions_and_skips_missing_ones():
    # session 3 is missing: a bullet of session 2 gets session 4 at h=2 only, never session 3 "as" h=1
    sessions, bullets = corpus({"c": {1: AB[:2], 2: AB[:3], 4: AB[:4]}}, {"c": {1: ["A"], 2: ["B"], 4: ["A"]}})
    plan = build_pairs(sessions, bullets, PairOptions(horizon=3))
    rows = plan.pairs.to_pylist()
    by_bullet: dict[str, set[tuple[int, int]]] = {}
    for r in rows:
        by_bullet.setdefault(r["bullet_id"], set()).add((r["target_session"], r["horizon"]))
    assert by_bullet["c:s1:b0"] == {(2, 1), (4, 3)}
    assert by_bullet["c:s2:b0"] == {(4, 2)}
    assert sum(1 for r in rows if r["bullet_id"] == "c:s1:b0") == 3 + 4
    assert plan.unpaired == [("c:s4:b0", NO_NEXT_SESSION)]
    # horizon 1: the bullet of session 2 has no next session (3 is missing)
    plan1 = build_pairs(sessions, bullets, PairOptions(horizon=1))
    assert dict(plan1.unpaired) == {"c:s2:b0": NO_NEXT_SESSION, "c:s4:b0": NO_NEXT_SESSION}
    assert decay_weight(0.5, 1) == 1.0 and decay_weight(0.5, 3) == 0.25  # decay belongs to aggregation


def _runs_are_contiguous(keys: list) -> bool:
    seen, prev = set(), object()
    for k in keys:
        if k != prev:
            if k in seen:
                return False
            seen.add(k)
            prev = k
    return True


def test_target_order_puts_prompts_sharing_a_prefix_together():
    sessions, bullets = corpus({"c": {1: AB, 2: AB, 3: AB}, "d": {1: AB, 2: AB}},
                               {"c": {1: ["A", "B", "A"], 2: ["B", "A"]}, "d": {1: ["A", "B"]}})
    plan = build_pairs(sessions, bullets, PairOptions(horizon=2, order="target"))
    rows = plan.pairs.to_pylist()
    # the judge prompt is system + context + target + bullet: same target => same prefix up to the bullet
    prefixes = [(r["conversation_id"], r["turn_id"], tuple((c["speaker"], c["text"]) for c in r["context"]),
                 r["target"]) for r in rows]
    assert _runs_are_contiguous(prefixes)
    # a target's run holds every bullet paired with it, and runs follow the dialogue order
    assert _runs_are_contiguous([r["target_session"] for r in rows if r["conversation_id"] == "c"])
    plan_b = build_pairs(sessions, bullets, PairOptions(horizon=2, order="bullet"))
    assert _runs_are_contiguous([r["bullet_id"] for r in plan_b.pairs.to_pylist()])
    assert sorted(map(str, plan_b.pairs.to_pylist())) == sorted(map(str, rows))


def test_order_does_not_depend_on_session_row_order():
    sessions, bullets = corpus({"c": {1: AB, 2: AB, 3: AB}, "d": {1: AB, 2: AB}},
                               {"c": {1: ["A", "B"], 2: ["B"]}, "d": {1: ["A"]}})
    idx = list(range(sessions.num_rows))
    random.Random(3).shuffle(idx)
    a = build_pairs(sessions, bullets).pairs
    b = build_pairs(sessions.take(idx), bullets).pairs
    assert a.equals(b)


def test_options_are_validated():
    with pytest.raises(ValueError, match="horizon"):
        PairOptions(horizon=0)
    with pytest.raises(ValueError, match="decay"):
        decay_weight(0.0, 1)
    with pytest.raises(ValueError, match="speaker"):
        PairOptions(speaker="both")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="context_turns"):
        PairOptions(context_turns=-1)


def test_shard_bounds_cover_every_item_once():
    assert shard_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert shard_bounds(0, 4) == []
    with pytest.raises(ValueError):
        shard_bounds(3, 0)


@settings(max_examples=40, deadline=None)
@given(
    n_sessions=st.integers(1, 4),
    turns=st.lists(st.lists(st.sampled_from("AB"), min_size=1, max_size=5), min_size=4, max_size=4),
    n_bullets=st.lists(st.lists(st.sampled_from("AB"), max_size=3), min_size=4, max_size=4),
    horizon=st.integers(1, 3),
    speaker=st.sampled_from(["all", "same", "other"]),
)
def test_pair_count_matches_the_definition(n_sessions, turns, n_bullets, horizon, speaker):
    spec = {"c": {k + 1: turns[k] for k in range(n_sessions)}}
    bspec = {"c": {k + 1: n_bullets[k] for k in range(n_sessions)}}
    sessions, bullets = corpus(spec, bspec)
    plan = build_pairs(sessions, bullets, PairOptions(horizon=horizon, speaker=speaker))
    expected = 0
    for k in range(1, n_sessions + 1):
        for b in bspec["c"][k]:
            for h in range(1, horizon + 1):
                for sp in spec["c"].get(k + h, []):
                    expected += speaker == "all" or (sp == b) == (speaker == "same")
    assert plan.pairs.num_rows == expected
    paired = set(plan.pairs.column("bullet_id").to_pylist())
    # every bullet is either paired or listed with a reason, never both, never neither
    assert paired.isdisjoint({b for b, _ in plan.unpaired})
    assert len(paired) + len(plan.unpaired) == plan.n_bullets == bullets.num_rows
