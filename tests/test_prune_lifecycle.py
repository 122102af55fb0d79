"""Keeping memory current (issue 26): pins, forgetting (retention) and expiry as steps of the one decision.

Pure properties (hypothesis), the worked examples of the README, the usage log, and one Ray job on a corpus
with pins, times and a usage log that decides exactly as `MemoryPruner` does.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memprune.decision import Bullets, Retention, decide, retention_factor
from memprune.prune import MemoryPruner, PruneError, PruneRule, read_pruned, session_times_of
from memprune.times import parse_duration
from memprune.usagelog import UsageLogError, read_usage

DAY = 86400.0
NOW = dt.datetime(2024, 5, 1, tzinfo=dt.timezone.utc)


class FixedScorer:
    """Preset scores by text (no model): the decision's wiring without an encoder."""

    def __init__(self, scores: dict[str, float]) -> None:
        self.scores = scores

    def score(self, texts, batch_size=64):
        return np.array([self.scores[t] for t in texts], dtype=np.float64)


# ------------------------------------------------------------------ durations and the formula


def test_durations_parse_short_and_iso_forms_and_refuse_the_rest():
    assert parse_duration("30d") == parse_duration("P30D") == 30 * DAY
    assert parse_duration("2w") == parse_duration("P2W") == 14 * DAY
    assert parse_duration("12h") == parse_duration("PT12H") == 12 * 3600
    assert parse_duration("90m") == 5400 and parse_duration("1d12h") == 1.5 * DAY
    assert parse_duration("P1DT2H") == 26 * 3600 and parse_duration(3600) == 3600
    for bad in ("3x", "", "30", "P", "PT", "-3d", "P1M", 0, -5, "d"):
        with pytest.raises(ValueError, match="is not a duration"):
            parse_duration(bad)


def test_retention_halves_after_a_half_life_and_each_recall_stretches_it():
    h = 30 * DAY
    r = retention_factor(np.array([0.0, h, 2 * h, h, h, np.nan, -DAY]), np.array([0, 0, 0, 1, 3, 0, 0]), h, 1.0)
    np.testing.assert_allclose(r[:3], [1.0, 0.5, 0.25])
    np.testing.assert_allclose(r[3], 2 ** -0.5)   # S doubled by one recall
    np.testing.assert_allclose(r[4], 2 ** -0.25)  # (1 + 3 recalls)
    assert r[5] == 1.0 and r[6] == 1.0             # unknown age, a time after now: not forgotten


@settings(max_examples=60, deadline=None)
@given(age=st.floats(0, 1e9), more=st.floats(0, 1e9), recalls=st.integers(0, 50), extra=st.integers(0, 50),
       half_life=st.floats(1.0, 1e8), boost=st.floats(0, 10))
def test_retention_is_monotone_in_age_and_in_recalls(age, more, recalls, extra, half_life, boost):
    r = retention_factor(np.array([age, age + more, age]), np.array([recalls, recalls, recalls + extra]),
                         half_life, boost)
    assert 0.0 <= r[1] <= r[0] <= 1.0  # older: never more retained
    assert r[2] >= r[0]                # more recalls: never less retained


# ------------------------------------------------------------------ the decision with pins, expiry, retention


@st.composite
def stores(draw):
    """Groups of bullets with scores, tokens, ages (some unknown), pins and some equal texts."""
    n = draw(st.integers(1, 30))
    codes = np.sort(np.array(draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)), dtype=np.int64))
    codes = np.unique(codes, return_inverse=True)[1].astype(np.int64)
    scores = np.array(draw(st.lists(st.floats(0, 1), min_size=n, max_size=n)))
    tokens = np.array(draw(st.lists(st.integers(1, 12), min_size=n, max_size=n)))
    ages = np.array(draw(st.lists(st.one_of(st.none(), st.floats(0, 400)), min_size=n, max_size=n)), dtype=float)
    pinned = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    texts = [f"fact {t}" for t in draw(st.lists(st.integers(0, n), min_size=n, max_size=n))]
    recalls = np.array(draw(st.lists(st.integers(0, 5), min_size=n, max_size=n)), dtype=float)
    return codes, scores, tokens, ages * DAY, pinned, texts, recalls


POLICIES = st.one_of(
    st.builds(lambda t, k: {"policy": "rule", "threshold": t, "top_k": k},
              st.one_of(st.none(), st.floats(0, 1)), st.one_of(st.none(), st.integers(1, 4))),
    st.builds(lambda b: {"policy": "budget", "budget_tokens": b}, st.integers(0, 40)),
    st.builds(lambda q: {"policy": "fraction", "fraction": q}, st.floats(0.05, 1.0)),
)


def _life(ages, pinned, recalls) -> dict:
    return {"pinned": pinned, "since": NOW.timestamp() - ages, "recalls": recalls}


def _decide(scores, codes, rule, tokens=None, texts=None, **life):
    return decide(Bullets.of(scores, codes, tokens=tokens, texts=texts, **life), rule)


@settings(max_examples=80, deadline=None)
@given(store=stores(), policy=POLICIES, min_keep=st.integers(0, 3), floor=st.one_of(st.none(), st.floats(0, 1)),
       dedup=st.booleans(), half_life=st.one_of(st.none(), st.floats(1, 200)), max_age=st.one_of(st.none(),
                                                                                               st.floats(1, 300)))
def test_pins_survive_every_policy_budget_and_min_keep(store, policy, min_keep, floor, dedup, half_life, max_age):
    codes, scores, tokens, ages, pinned, texts, recalls = store
    retention = {"half_life": None if half_life is None else half_life * DAY,
                 "max_age": None if max_age is None else max_age * DAY, "now": NOW if half_life or max_age else None}
    rule = PruneRule.of(**policy, min_keep=min_keep, floor=floor, dedup=dedup, pin_field="pinned",
                        retention=retention)
    d = _decide(scores, codes, rule, tokens, texts if dedup else None, **_life(ages, pinned, recalls))
    assert d.keep[pinned].all() and all(r is None for r in d.reason[pinned])
    assert (d.duplicate_of[pinned] == -1).all()
    # min-keep counts the kept non-pinned bullets: a group keeps min(m, its eligible non-pinned bullets) of them
    expired = d.reason == "expired"
    dup = d.reason == "duplicate"
    for g in np.unique(codes):
        mine = (codes == g) & ~pinned
        eligible = int((mine & ~dup & ~expired).sum())
        assert int((d.keep & mine).sum()) >= min(min_keep, eligible)
    # protected: exactly the pinned bullets the same decision drops when nothing is pinned
    unpinned = _decide(scores, codes, rule.model_copy(update={"pin_field": None}), tokens,
                       texts if dedup else None, **_life(ages, np.zeros(len(scores), bool), recalls))
    if pinned.any():
        assert d.protected is not None
        if not dedup:  # same clusters (none): the pinned ones' fate without the pin is the unpinned decision's
            assert d.protected.tolist() == (pinned & ~unpinned.keep).tolist()
    else:
        assert d.keep.tolist() == unpinned.keep.tolist() and d.reason.tolist() == unpinned.reason.tolist()


@settings(max_examples=60, deadline=None)
@given(store=stores(), policy=POLICIES, min_keep=st.integers(0, 3))
def test_pinned_bullets_stand_outside_the_competition(store, policy, min_keep):
    """Without duplicates, the non-pinned bullets are decided exactly as if the pinned ones were absent."""
    codes, scores, tokens, ages, pinned, texts, recalls = store
    rule = PruneRule.of(**policy, min_keep=min_keep, dedup=False, pin_field="pinned")
    d = _decide(scores, codes, rule, tokens, pinned=pinned)
    rest = ~pinned
    alone = _decide(scores[rest], codes[rest], rule.model_copy(update={"pin_field": None}), tokens[rest])
    assert d.keep[rest].tolist() == alone.keep.tolist()
    assert d.reason[rest].tolist() == alone.reason.tolist()


@settings(max_examples=80, deadline=None)
@given(store=stores(), policy=POLICIES, min_keep=st.integers(0, 3), max_age=st.floats(1, 300),
       half_life=st.one_of(st.none(), st.floats(1, 200)))
def test_max_age_never_drops_a_pinned_or_a_recent_record(store, policy, min_keep, max_age, half_life):
    codes, scores, tokens, ages, pinned, texts, recalls = store
    rule = PruneRule.of(**policy, min_keep=min_keep, dedup=True, pin_field="pinned",
                        retention={"max_age": max_age * DAY, "now": NOW,
                                   "half_life": None if half_life is None else half_life * DAY})
    d = _decide(scores, codes, rule, tokens, texts, **_life(ages, pinned, recalls))
    expired = d.reason == "expired"
    old = NOW.timestamp() - (NOW.timestamp() - ages) > max_age * DAY  # the age as the decision measures it
    assert not (expired & pinned).any()
    assert not (expired & ~old).any()  # younger than max_age (or no time): never expired
    assert not (expired & d.keep).any() and not (d.rescued & old).any()  # min-keep never revives an expired one


def test_duplicates_prefer_a_pinned_then_a_live_copy():
    scores = np.array([0.9, 0.5, 0.8, 0.3])
    codes = np.zeros(4, dtype=np.int64)
    texts = ["Ann is allergic to nuts.", "ann is allergic to nuts", "Ann is allergic to nuts!", "Bo likes tea."]
    rule = PruneRule.of(threshold=None, top_k=None, pin_field="p", retention={"max_age": "30d", "now": NOW})
    d = _decide(scores, codes, rule, texts=texts, pinned=np.array([False, True, False, False]),
                since=NOW.timestamp() - np.array([40, 1, 2, 1]) * DAY)
    assert d.keep.tolist() == [False, True, False, True]
    assert d.reason.tolist() == ["duplicate", None, "duplicate", None]
    assert d.duplicate_of.tolist() == [1, -1, 1, -1]  # the pinned copy represents the cluster
    d = _decide(scores, codes, rule.model_copy(update={"pin_field": None}), texts=texts,
                since=NOW.timestamp() - np.array([40, 1, 2, 1]) * DAY)
    assert d.reason.tolist() == ["duplicate", "duplicate", None, None]  # the best live copy, not the expired 0.9
    assert d.duplicate_of.tolist() == [2, 2, -1, -1]


# ------------------------------------------------------------------ the README's worked examples (MemoryPruner)


SCORES = {"Ann is allergic to peanuts.": 0.35, "Ann is training for a marathon.": 0.70,
          "Ann had pasta for lunch.": 0.30, "Ann moved to Oslo.": 0.60, "Ann's old phone number is 555-0100.": 0.80}


def _memory() -> list[dict]:
    return [
        {"bullet_id": "b0", "text": "Ann is allergic to peanuts.", "pinned": True, "time": "2023-01-10"},
        {"bullet_id": "b1", "text": "Ann is training for a marathon.", "time": "2024-04-20"},
        {"bullet_id": "b2", "text": "Ann had pasta for lunch.", "time": "2024-04-28"},
        {"bullet_id": "b3", "text": "Ann moved to Oslo.", "session_time": "2024-03-01"},
        {"bullet_id": "b4", "text": "Ann's old phone number is 555-0100.", "time": "2023-06-01"},
    ]


def test_readme_example_pins():
    pruner = MemoryPruner(FixedScorer(SCORES), threshold=0.5, top_k=2, pin_field="pinned", min_keep=1)
    _, d = pruner.decisions(_memory())
    assert d.keep.tolist() == [True, True, False, False, True]  # pinned + top 2 of the others (0.80, 0.70)
    assert d.reason.tolist() == [None, None, "below_threshold", "over_top_k", None]
    assert d.pin_counts() == {"pinned": 1, "kept_by_pin": 1}  # 0.35 < 0.5: the pin saved it


def test_readme_example_forgetting_and_expiry():
    mem = _memory()
    forget = MemoryPruner(FixedScorer(SCORES), threshold=0.25, top_k=2, pin_field="pinned",
                          retention={"half_life": "30d", "now": "2024-05-01"})
    _, d = forget.decisions(mem)
    # ages 477 (pinned: kept anyway) / 11 / 3 / 61 / 335 days: the old phone number (0.80) fades to 0.0003
    np.testing.assert_allclose(d.retention, 0.5 ** (np.array([477, 11, 3, 61, 335]) / 30))
    assert d.keep.tolist() == [True, True, True, False, False]
    assert d.reason.tolist() == [None, None, None, "below_threshold", "below_threshold"]
    expire = MemoryPruner(FixedScorer(SCORES), threshold=None, top_k=None, pin_field="pinned",
                          retention={"max_age": "90d", "now": "2024-05-01"})
    _, d = expire.decisions(mem)
    assert d.reason.tolist() == [None, None, None, None, "expired"]  # 335 days; the pinned one is older still
    assert d.reason_counts()["expired"] == 1 and d.effective is None  # no half-life: scores as they are


def test_memory_pruner_usage_log_recalls_and_last_access(tmp_path):
    log = tmp_path / "usage.jsonl"
    log.write_text("\n".join(json.dumps(e) for e in [
        {"bullet_id": "b4", "used": True, "time": "2024-04-30T12:00:00Z"},
        {"bullet_id": "b4", "used": True, "time": "2024-04-10"},
        {"bullet_id": "b2", "used": False, "time": "2024-04-30"},   # in context, not used: no recall
        {"bullet_id": "b1", "weight": 0.4},                          # a recall without a time
    ]) + "\n")
    usage = read_usage(log, {"b1", "b2", "b4"})
    assert usage.recalls == {"b4": 2, "b1": 1}
    assert usage.last_access == {"b4": dt.datetime(2024, 4, 30, 12, tzinfo=dt.timezone.utc).timestamp()}
    pruner = MemoryPruner(FixedScorer(SCORES), threshold=None, top_k=None, usage_log=log,
                          retention={"half_life": "30d", "now": "2024-05-01"})
    _, d = pruner.decisions(_memory())
    # b4: last access 12 hours ago, 2 recalls: S = 30d/ln2 * 3
    np.testing.assert_allclose(d.retention[4], math.exp(-0.5 / (30 / math.log(2) * 3)))
    np.testing.assert_allclose(d.retention[1], 0.5 ** (11 / 60))  # b1: its own time, one recall
    # the README's example: recalled twice, yesterday, the old phone number stays
    pruner = MemoryPruner(FixedScorer(SCORES), threshold=0.25, top_k=2, pin_field="pinned", usage_log=log,
                          retention={"half_life": "30d", "now": "2024-05-01"})
    _, d = pruner.decisions(_memory())
    assert d.reason.tolist() == [None, None, "over_top_k", "below_threshold", None]
    np.testing.assert_allclose(d.effective[[1, 2, 3, 4]], [0.616, 0.280, 0.147, 0.797], atol=6e-4)
    with pytest.raises(UsageLogError, match=r"usage\.jsonl: line 1: unknown bullet_id 'b4'"):
        read_usage(log, {"b1", "b2"})


def test_settings_are_validated_once():
    with pytest.raises(PruneError, match="'3x' is not a duration; use e.g. 30d, 12h, P2W"):
        PruneRule.of(retention={"half_life": "3x"})
    with pytest.raises(PruneError, match="recall_boost only slows forgetting"):
        PruneRule.of(retention={"recall_boost": 2})
    with pytest.raises(PruneError, match="now only matters"):
        PruneRule.of(retention={"now": "2024-05-01"})
    with pytest.raises(PruneError, match="not a time"):
        PruneRule.of(retention={"max_age": "1d", "now": "soon"})
    r = Retention(half_life="P2W", max_age="90d", now="2024-05-01T00:00:00Z")
    assert r.model_dump(mode="json") == {"half_life": 14 * DAY, "recall_boost": 1.0, "max_age": 90 * DAY,
                                         "now": "2024-05-01T00:00:00+00:00"}
    assert PruneRule.model_validate(PruneRule.of(retention=r.model_dump()).model_dump()).retention == r
    with pytest.raises(PruneError, match=r"pin field 'pinned'.*bullets\[1\].*not true/false"):
        MemoryPruner(FixedScorer(SCORES), pin_field="pinned").decisions(
            [{"text": "Ann moved to Oslo."}, {"text": "Ann had pasta for lunch.", "pinned": "yes"}])
    with pytest.raises(PruneError, match=r"column 'time': 'last week' \(record 'x'\) is not a time"):
        MemoryPruner(FixedScorer(SCORES), retention={"max_age": "1d"}).decisions(
            [{"bullet_id": "x", "text": "Ann moved to Oslo.", "time": "last week"}])


def test_a_decision_without_pins_or_times_has_no_standing():
    scores = np.array([0.9, 0.2, 0.7])
    d = _decide(scores, np.zeros(3, dtype=np.int64), PruneRule.of(top_k=1, dedup=False))
    assert d.keep.tolist() == [True, False, False] and not d.pinned.any() and d.effective is None


# ------------------------------------------------------------------ the Ray job decides as MemoryPruner does


@pytest.fixture(scope="module")
def lifecycle_corpus(tmp_path_factory) -> Path:
    """A synthetic corpus with fact updates whose bullets carry a `pinned` column (every 4th), with session times,
    and a usage log."""
    from memprune.synth import generate

    out = tmp_path_factory.mktemp("lifecycle")
    generate(conversations=4, sessions=3, out=out, seed=3, updates=0.6)
    bullets = pq.read_table(out / "bullets.parquet")
    pinned = pa.array([i % 4 == 1 for i in range(bullets.num_rows)], pa.bool_())
    pq.write_table(bullets.append_column("pinned", pinned), out / "bullets.parquet")
    (out / ".memprune.json").unlink(missing_ok=True)
    ids = bullets.column("bullet_id").to_pylist()
    events = [{"bullet_id": b, "used": True, "time": "2024-01-15T00:00:00Z"} for b in ids[::5]]
    events += [{"bullet_id": b, "used": True} for b in ids[::7]]
    (out / "usage.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return out


def test_ray_job_and_memory_pruner_decide_identically_with_pins_forgetting_expiry_and_supersession(
        ray_local, scorer_dir, lifecycle_corpus, tmp_path):
    from typer.testing import CliRunner

    from memprune.cli import app

    corpus = lifecycle_corpus
    out = tmp_path / "out"
    result = CliRunner().invoke(app, [
        "prune", "--scorer", str(scorer_dir), "--input", str(corpus), "--out", str(out), "--threshold", "0.2",
        "--top-k", "2", "--pin-field", "pinned", "--half-life", "14d", "--recall-boost", "2", "--max-age", "P5W",
        "--now", "2024-01-20T00:00:00Z", "--usage-log", str(corpus / "usage.jsonl"), "--supersede", "slot",
        "--set", "block_rows=16", "--set", "progress=false", "--set", "actors=2"])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "prune.json").read_text())
    got = read_pruned(out)
    assert got.column_names[-7:] == ["score", "effective_score", "retention", "keep", "reason", "duplicate_of",
                                     "superseded_by"]
    sessions = pq.read_table(corpus / "sessions.parquet")
    rule = PruneRule.of(threshold=0.2, top_k=2, pin_field="pinned",
                        retention={"half_life": "14d", "recall_boost": 2, "max_age": "P5W",
                                   "now": "2024-01-20T00:00:00Z"},
                        supersede={"judge": "slot"})
    expected = MemoryPruner(scorer_dir, rule=rule, usage_log=corpus / "usage.jsonl",
                            session_times=session_times_of(sessions)).prune_table(
        pq.read_table(corpus / "bullets.parquet"))
    cols = ["bullet_id", "keep", "reason", "duplicate_of", "superseded_by"]
    assert got.select(cols).to_pylist() == expected.select(cols).to_pylist()
    superseded = [r for r in got.to_pylist() if r["reason"] == "superseded"]
    assert superseded and not any(r["pinned"] for r in superseded)
    np.testing.assert_allclose(got["effective_score"].to_numpy(), expected["effective_score"].to_numpy(), atol=1e-5)
    np.testing.assert_allclose(got["retention"].to_numpy(), expected["retention"].to_numpy(), rtol=1e-12)
    reasons = got["reason"].to_pylist()
    pinned = got["pinned"].to_pylist()
    assert all(k for k, p in zip(got["keep"].to_pylist(), pinned) if p)  # every pin survives
    r = summary["result"]
    assert r["dropped_by_reason"]["expired"] == reasons.count("expired") > 0
    assert r["dropped_by_reason"]["superseded"] == len(superseded)
    assert r["pinned"] == sum(pinned) and 0 < r["kept_by_pin"] <= sum(pinned)
    life = summary["lifecycle"]
    assert life["now"] == "2024-01-20T00:00:00+00:00" and life["now_given"] and life["half_life"] == "2w"
    assert life["max_age"] == "5w" and life["session_times"] == 12 and life["recalled_bullets"] > 0
    assert summary["rule"]["retention"]["now"] == "2024-01-20T00:00:00+00:00"
    md = (out / "prune.md").read_text()
    assert "Pins: column `pinned`" in md and "expiry after 5w" in md and "| expired |" in md
    assert "Supersession: judge `slot` within each conversation, same `speaker`" in md and "| superseded |" in md


def test_dry_run_preview_shows_the_effective_score(tmp_path):
    from memprune.prune.job import preview_block
    from memprune.prune.stage import write_preview

    table = pa.table({"conversation_id": ["c", "c"], "session_index": pa.array([0, 0], pa.int32()),
                      "bullet_id": ["c:s0:b0", "c:s0:b1"], "text": ["a", "b"], "score": [0.8, 0.4],
                      "effective_score": [0.4, 0.39], "retention": [0.5, 0.975], "keep": [True, False],
                      "reason": [None, "over_top_k"], "duplicate_of": pa.nulls(2, pa.string())})
    keys = ["conversation_id", "session_index"]
    write_preview(tmp_path / "preview.jsonl", preview_block(table, keys, 1.0), keys)
    lines = [json.loads(ln) for ln in (tmp_path / "preview.jsonl").read_text().splitlines()]
    assert [(ln["score"], ln["effective_score"], ln["reason"]) for ln in lines] == [(0.8, 0.4, None),
                                                                                    (0.4, 0.39, "over_top_k")]
    write_preview(tmp_path / "plain.jsonl", preview_block(table.drop_columns(["effective_score", "retention"]),
                                                          keys, 1.0), keys)
    assert "effective_score" not in (tmp_path / "plain.jsonl").read_text()
