"""Supersession (issue 26): a later bullet that updates an earlier one of the same subject supersedes it.

Pure properties of the step (hypothesis, with a judge that says yes to every candidate), the built-in `slot`
judge on the README's example, `memprune synth --updates` ground truth, and bad input as one line. The Ray
job's equality with `MemoryPruner` is in tests/test_prune_lifecycle.py.
"""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memprune.decision import Bullets, Found, PruneError, PruneRule, Retention, Supersede, apply, standing
from memprune.decision.supersede import find_superseded
from memprune.decision.updates import UPDATE_JUDGES, UpdateJudgeEntry, register
from memprune.prune import MemoryPruner

YES = register(UpdateJudgeEntry("yes", "every candidate pair is an update (tests)", lambda p, s: np.ones(len(p), bool)))


@st.composite
def scopes(draw):
    """Bullets in two scopes, two subjects, with times (some unknown or equal), sessions, pins and embeddings
    that make every pair a candidate (cosine 1 in a band that admits it)."""
    n = draw(st.integers(2, 14))
    ints = lambda lo, hi: np.array(draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n)))  # noqa: E731
    time = ints(-1, 3).astype(float)
    time[time < 0] = np.nan
    session = ints(-1, 2).astype(float)
    session[session < 0] = np.nan
    # a shared direction and one of its own each: every pair at cosine 0.8, in the default band [0.3, 0.88)
    return {"scope": ints(0, 1), "subject": [("A", "B")[i] for i in ints(0, 1)], "time": time, "session": session,
            "pinned": ints(0, 3) == 0, "emb": np.hstack([np.ones((n, 1)), 0.5 * np.eye(n)]).astype(np.float32)}


@settings(max_examples=80, deadline=None)
@given(s=scopes())
def test_supersession_never_pins_crosses_subjects_or_scopes_or_guesses_time(s):
    n = len(s["scope"])
    bullets = Bullets.of(np.zeros(n), scope=s["scope"], subject=s["subject"], when=s["time"], session=s["session"],
                         texts=["t"] * n, embeddings=s["emb"])
    by, _ = find_superseded(bullets, Supersede(judge="yes"), (0.5, 0.88), None, s["pinned"])
    for a in np.flatnonzero(by >= 0):
        b = by[a]
        assert not s["pinned"][a]                                   # a pinned bullet is never superseded
        assert s["scope"][a] == s["scope"][b] and s["subject"][a] == s["subject"][b]
        ta, tb, sa, sb = s["time"][a], s["time"][b], s["session"][a], s["session"][b]
        if not np.isnan(ta) and not np.isnan(tb):
            assert tb > ta                                          # later by time; equal times never
        else:
            assert not np.isnan(sa) and not np.isnan(sb) and sb > sa  # else later by session
    # and the step finds every such pair: an unpinned bullet with a later one of its subject is superseded
    for a in range(n):
        later = [b for b in range(n) if s["scope"][b] == s["scope"][a] and s["subject"][b] == s["subject"][a]
                 and (tb := s["time"][b], ta := s["time"][a]) and (
                     (tb > ta) if not (np.isnan(ta) or np.isnan(tb))
                     else (s["session"][b] > s["session"][a]))]
        assert (by[a] >= 0) == (bool(later) and not s["pinned"][a])


def test_an_earlier_restatement_of_a_superseded_fact_goes_with_it():
    deg = np.radians([0.0, 18.0, 74.6])  # 0 ~ 1 (cosine 0.95, above the band), 1 -> 2 in the band, 0 -> 2 below it
    emb = np.c_[np.cos(deg), np.sin(deg)].astype(np.float32)
    bullets = Bullets.of(np.zeros(3), scope=np.zeros(3, int), subject=["N"] * 3, when=np.array([0.0, 1.0, 2.0]),
                         session=np.full(3, np.nan), texts=["t"] * 3, embeddings=emb)
    assert find_superseded(bullets, Supersede(judge="yes"), (0.5, 0.9), None, np.zeros(3, bool))[0].tolist() == [2, 2, -1]


def test_the_decision_drops_superseded_before_the_policy_and_min_keep_does_not_bring_them_back():
    rule = PruneRule.of(top_k=None, threshold=0.0, min_keep=1, dedup=False, pin_field="pin",
                        supersede={"judge": "yes", "low": 0.5})
    bullets = [{"text": "a", "speaker": "N", "conversation_id": "c", "session_index": 0},
               {"text": "b", "speaker": "N", "conversation_id": "c", "session_index": 1},
               {"text": "c", "speaker": "M", "conversation_id": "c", "session_index": 0, "pin": True},
               {"text": "d", "speaker": "M", "conversation_id": "c", "session_index": 1}]

    class Embed:  # cosine 0.78 between any two texts: every same-subject pair is a candidate
        def embed(self, texts, batch_size=64):
            own = np.eye(4, dtype=np.float32)[["abcd".index(t) for t in texts]]
            return np.ones((len(texts), 4), dtype=np.float32) + 1.5 * own

        def score_embeddings(self, emb):
            return np.full(len(emb), 0.5)

    _, d = MemoryPruner(Embed(), rule=rule).decisions(bullets, groups=[0, 1, 0, 1])
    assert d.reason.tolist() == ["superseded", None, None, None]  # session 0 emptied of N; M's pin survives
    assert d.superseded_by.tolist() == [1, -1, -1, -1] and d.reason_counts()["superseded"] == 1


def test_the_superseding_bullet_ranks_with_at_least_the_score_of_what_it_supersedes():
    rule = PruneRule.of(top_k=1, threshold=0.0, min_keep=0, dedup=False)
    bullets = Bullets.of(np.array([0.9, 0.2, 0.5, 0.1]), np.array([0, 1, 1, 2]))  # sessions: [0], [1, 2], [3]
    stand = standing(bullets, Retention())

    def found(superseded_by=None):
        return Found(stand, superseded_by=None if superseded_by is None else np.array(superseded_by))

    plain = apply(bullets, rule, found())
    assert plain.keep.tolist() == [True, False, True, True]
    d = apply(bullets, rule, found([1, -1, -1, -1]))  # 1 updates 0: ranks with 0.9
    assert d.keep.tolist() == [False, True, False, True] and d.reason.tolist() == ["superseded", None, "over_top_k",
                                                                                   None]
    chain = apply(bullets, PruneRule.of(threshold=0.3, min_keep=0, dedup=False),
                  found([1, 3, -1, -1]))  # 0 -> 1 -> 3: 3 inherits 0.9 over its 0.1
    assert chain.keep.tolist() == [False, False, True, True]


def test_slot_judge_weights_are_safetensors_and_another_width_is_one_line():
    from memprune.decision.updates import Pairs, slot

    w = slot.weights()
    assert slot.WEIGHTS.suffix == ".safetensors" and w["mean"].shape == (384 * slot.N_VEC + slot.N_TEXT,)
    assert 0 < w["threshold"][0] < 1
    pairs = Pairs(["Nora lives in Lima."], ["Nora lives in Oslo."], np.array([0.7]),
                  lambda texts: np.ones((len(texts), 8), dtype=np.float32))
    with pytest.raises(ValueError, match="fitted on 384-dimensional embeddings; this scorer's encoder gives 8"):
        slot.judge(pairs)


def test_slot_judge_readme_example(scorer_dir):
    memory = [{"text": "Nora lives in Lima.", "speaker": "Nora", "conversation_id": "u1", "time": "2024-01-05"},
              {"text": "Nora has a cat named Mochi.", "speaker": "Nora", "conversation_id": "u1", "time": "2024-01-05"},
              {"text": "Nora lives in Oslo.", "speaker": "Nora", "conversation_id": "u1", "time": "2024-03-10"}]
    pruner = MemoryPruner(scorer_dir, threshold=0.0, top_k=None, supersede={"judge": "slot"})
    _, d = pruner.decisions(memory)
    assert d.reason.tolist() == ["superseded", None, None] and d.superseded_by.tolist() == [2, -1, -1]
    same_time = [dict(b, time="2024-01-05") for b in memory]
    assert not (pruner.decisions(same_time)[1].superseded_by >= 0).any()  # equal times are never guessed


def test_bad_settings_are_one_clear_line():
    with pytest.raises(PruneError, match="unknown update judge 'nope'"):
        PruneRule.of(supersede={"judge": "nope"})
    with pytest.raises(PruneError, match=r"band is empty: low 0.8 >= high 0.6"):
        PruneRule.of(supersede={"judge": "slot", "low": 0.8, "high": 0.6})
    with pytest.raises(PruneError, match="must be non-empty and lie below the duplicate threshold 0.88"):
        PruneRule.of(supersede={"judge": "slot", "low": 0.5, "high": 0.95})
    assert "slot" in UPDATE_JUDGES and PruneRule.of(supersede={"judge": "slot"}).unit_keys == ("conversation_id",)


def test_cli_bad_band_is_one_line(tmp_path):
    from typer.testing import CliRunner

    from memprune.cli import app

    result = CliRunner().invoke(app, ["prune", "--scorer", str(tmp_path), "--input", str(tmp_path), "--out",
                                      str(tmp_path / "o"), "--supersede", "slot", "--supersede-band", "x:y"])
    assert result.exit_code != 0 and "--supersede-band: 'x:y' is not LOW:HIGH" in result.output
    assert not (tmp_path / "o").exists()


def test_synth_updates_ground_truth(tmp_path):
    from memprune.synth import generate

    summary = generate(tmp_path, conversations=6, sessions=4, updates=0.5, seed=2)
    table = pq.read_table(tmp_path / "bullets.parquet").to_pylist()
    by_id = {b["bullet_id"]: b for b in table}
    updates = [b for b in table if b["update_of"] is not None]
    assert summary["counts"]["updates"] == len(updates) > 0
    for b in updates:
        old = by_id[b["update_of"]]
        assert old["speaker"] == b["speaker"] and old["conversation_id"] == b["conversation_id"]
        assert old["session_index"] < b["session_index"] and old["text"] != b["text"]
    sessions = pq.read_table(tmp_path / "sessions.parquet")
    assert None not in sessions.column("time").to_pylist()
    generate(tmp_path / "plain", conversations=6, sessions=4, seed=2)  # no updates: the corpus as before
    assert "update_of" not in pq.read_table(tmp_path / "plain" / "bullets.parquet").column_names


def test_a_missing_subject_column_is_one_line_before_any_work(scorer_dir, tmp_path):
    from typer.testing import CliRunner

    from memprune.cli import app
    from memprune.synth import generate

    generate(tmp_path / "c", conversations=1, sessions=2, seed=1)
    out = tmp_path / "o"
    result = CliRunner().invoke(app, ["prune", "--scorer", str(scorer_dir), "--input", str(tmp_path / "c"), "--out",
                                      str(out), "--supersede", "slot", "--supersede-subject", "author"])
    assert result.exit_code == 2 and "no column 'author' for the supersession subject" in result.output
    assert not out.exists() or not any(out.iterdir())
