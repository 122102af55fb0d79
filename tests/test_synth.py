"""The synthetic corpus generator: schema, determinism, evidence, ground truth true to the text, CLI."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from memprune import synth
from memprune.io import read_table
from memprune.schema import BULLETS, SYNTH_BULLETS, validate_table
from memprune.synth import vocabulary as vocab

KINDS = {"preference", "plan", "relation", "pet", "job", "oneoff"}


def _word(key: str) -> re.Pattern[str]:
    return re.compile(r"(?<!\w)" + re.escape(key) + r"(?!\w)", re.IGNORECASE)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("synth")
    synth.generate(conversations=40, sessions=4, out=out, seed=7, batch_rows=200)
    return out


def _all_fragments() -> list[str]:
    """Every string the generator can put into a turn or bullet, except the one-off phrases."""
    frags: list[str] = []
    for cat in vocab.DURABLE.values():
        frags += list(cat.keys) + list(cat.intro + cat.again + cat.ask + cat.answer + cat.bullet)
    for cat in vocab.ONEOFF.values():
        frags += [t for pair in cat.templates for t in pair]
    frags += list(vocab.GREETINGS + vocab.REPLY_GREETINGS + vocab.ACKS + vocab.PROMPTS + vocab.TRANSITIONS)
    frags += list(vocab.CLOSINGS + vocab.BYES) + vocab.SPEAKER_NAMES + vocab.PERSON_NAMES
    frags += vocab.PROFESSIONS + vocab.RELATIONS + vocab.SPECIES + vocab.WHEN + vocab.YEARS
    frags += list(vocab.GOAL_PHRASES.values())
    return frags


def test_vocabulary_keeps_one_offs_unique_and_apart_from_durable_facts() -> None:
    oneoff_phrases = [p for cat in vocab.ONEOFF.values() for p in cat.phrases]
    oneoff_keys = [vocab.oneoff_key(p) for p in oneoff_phrases]
    durable_keys = [k for name, cat in vocab.DURABLE.items() if name != "relation" for k in cat.keys]
    durable_keys += vocab.PERSON_NAMES
    every_key = [k.lower() for k in oneoff_keys + durable_keys]
    assert len(every_key) == len(set(every_key)), "a key entity is listed twice"
    assert not set(vocab.SPEAKER_NAMES) & set(vocab.PERSON_NAMES + vocab.PET_NAMES)
    assert set(vocab.GOAL_PHRASES) == set(vocab.DURABLE["goal"].keys)
    assert all(_word(k).search(p) for k, p in vocab.GOAL_PHRASES.items())
    fragments = _all_fragments()
    for key, phrase in zip(oneoff_keys, oneoff_phrases):
        pattern = _word(key)
        clashes = [f for f in fragments if pattern.search(f)]
        clashes += [p for p in oneoff_phrases if p != phrase and pattern.search(p)]
        assert not clashes, f"one-off key {key!r} also occurs in {clashes[:3]}"
    oneoff_text = oneoff_phrases + [t for cat in vocab.ONEOFF.values() for pair in cat.templates for t in pair]
    oneoff_text += list(vocab.GREETINGS + vocab.REPLY_GREETINGS + vocab.ACKS + vocab.PROMPTS + vocab.TRANSITIONS)
    oneoff_text += list(vocab.CLOSINGS + vocab.BYES)
    for key in durable_keys:
        pattern = _word(key)
        clashes = [t for t in oneoff_text if pattern.search(t)]
        assert not clashes, f"durable key {key!r} occurs in one-off/filler text {clashes[:3]}"


def test_tables_match_the_schemas_and_the_summary(corpus: Path) -> None:
    sessions = read_table(corpus / "sessions.parquet", "sessions")
    bullets = pq.read_table(corpus / "bullets.parquet")
    assert bullets.schema.equals(SYNTH_BULLETS)
    validate_table(bullets.select(BULLETS.names), "bullets", source="bullets.parquet")
    assert bullets.column("recurs").null_count == 0
    assert set(bullets.column("kind").to_pylist()) == KINDS
    recurs = bullets.column("recurs").to_pylist()
    assert 0 < sum(recurs) < len(recurs)
    summary = json.loads((corpus / "synth.json").read_text())
    counts = summary["counts"]
    assert counts["conversations"] == 40 and counts["sessions"] == sessions.num_rows == 160
    assert counts["bullets"] == bullets.num_rows and counts["recurs"] == sum(recurs)
    assert counts["turns"] == sum(len(t) for t in sessions.column("turns").to_pylist())
    assert sum(counts["bullets_by_kind"].values()) == bullets.num_rows
    assert summary["seed"] == 7 and summary["config"]["sessions"] == 4
    assert sessions.column("conversation_id")[0].as_py() == "synth-000000"
    assert pq.ParquetFile(corpus / "bullets.parquet").num_row_groups > 1  # flushed in batches


def test_same_seed_same_bytes_other_seed_other_corpus(tmp_path: Path) -> None:
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        synth.generate(conversations=15, sessions=3, out=tmp_path / name, seed=seed)
    for f in ("sessions.parquet", "bullets.parquet", "synth.json"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    for f in ("sessions.parquet", "bullets.parquet"):
        assert (tmp_path / "a" / f).read_bytes() != (tmp_path / "c" / f).read_bytes(), f


def test_evidence_points_to_the_speakers_own_turns_in_that_session(corpus: Path) -> None:
    turns: dict[tuple[str, int], dict[str, tuple[str, str]]] = {}
    for row in pq.read_table(corpus / "sessions.parquet").to_pylist():
        key = (row["conversation_id"], row["session_index"])
        turns[key] = {t["turn_id"]: (t["speaker"], t["text"]) for t in row["turns"]}
        assert len(row["speakers"]) == 2 and {t["speaker"] for t in row["turns"]} == set(row["speakers"])
    for b in pq.read_table(corpus / "bullets.parquet").to_pylist():
        session_turns = turns[(b["conversation_id"], b["session_index"])]
        assert b["evidence"] and all(e in session_turns for e in b["evidence"]), b
        assert session_turns[b["evidence"][-1]][0] == b["speaker"], b  # the owner states it (last evidence turn)


def _check_truth(conv: synth.SynthConversation, checked: dict, strays: bool) -> None:
    """Assert each bullet's `recurs` equals: its key is in a later session's turns by the same speaker."""
    last = len(conv.sessions) - 1
    by_id = {t[0]: t for s in conv.sessions for t in s.turns}
    for b in conv.bullets:
        key = _word(b.key)
        assert key.search(by_id[b.evidence[-1]][2]), (b.key, by_id[b.evidence[-1]])
        assert key.search(b.text), (b.key, b.text)
        later_own = [t[2] for s in conv.sessions[b.session_index + 1 :] for t in s.turns if t[1] == b.speaker]
        assert b.recurs == any(key.search(text) for text in later_own), (b, later_own)
        if b.kind == "oneoff":  # said once: the key is nowhere else in the conversation, any speaker
            everywhere = [t[0] for s in conv.sessions for t in s.turns if key.search(t[2])]
            assert everywhere == b.evidence[-1:], (b.key, everywhere)
            assert not b.recurs
        elif not strays:
            assert b.recurs == (b.session_index < last)
        checked[(b.kind, b.recurs, b.session_index < last)] += 1


def test_recurs_is_true_to_the_generated_text(corpus: Path) -> None:
    config = synth.SynthSettings(conversations=40, sessions=4, seed=7)
    stored = pq.read_table(corpus / "bullets.parquet").to_pylist()
    convs = [synth.synth_conversation(i, config) for i in range(40)]
    regenerated = [b for conv in convs for b in conv.bullets]
    assert len(stored) == len(regenerated)
    for row, b in zip(stored, regenerated):
        assert (row["bullet_id"], row["text"], row["recurs"], row["kind"], row["evidence"]) == (
            b.bullet_id, b.text, b.recurs, b.kind, b.evidence)
    checked: dict = defaultdict(int)
    for conv in convs:
        _check_truth(conv, checked, strays=False)
    assert checked[("oneoff", False, True)] and all(checked[(k, True, True)] for k in KINDS - {"oneoff"})


def test_stray_facts_look_durable_but_do_not_recur() -> None:
    config = synth.SynthSettings(conversations=30, sessions=5, seed=2, stray_prob=0.3)
    checked: dict = defaultdict(int)
    for i in range(30):
        _check_truth(synth.synth_conversation(i, config), checked, strays=True)
    strays = sum(n for (kind, recurs, early), n in checked.items() if kind != "oneoff" and not recurs and early)
    durable = sum(n for (kind, recurs, early), n in checked.items() if kind != "oneoff" and recurs)
    assert strays and durable


def test_bad_options_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="sessions must be >= 2"):
        synth.generate(conversations=2, sessions=1, out=tmp_path)
    with pytest.raises(ValueError, match="one-off remarks"):
        synth.generate(conversations=2, sessions=200, out=tmp_path)
    assert not (tmp_path / "bullets.parquet").exists()


def test_cli_synth_then_stats(tmp_path: Path) -> None:
    from memprune.cli import app

    runner = CliRunner()
    out = tmp_path / "corpus"
    result = runner.invoke(app, ["synth", "--conversations", "6", "--sessions", "3", "--out", str(out), "--seed", "1"])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "synth.json").read_text())
    assert summary["counts"]["conversations"] == 6 and summary["config"]["seed"] == 1
    result = runner.invoke(app, ["stats", str(out)])
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout[result.stdout.index("{") :])
    assert stats["bullets"] == summary["counts"]["bullets"] and stats["sessions"] == 18


def test_duplicates_are_injected_with_ground_truth_and_leave_the_rest_as_it_was(tmp_path):
    from memprune.synth import generate

    generate(tmp_path / "plain", conversations=4, sessions=3, seed=5)
    summary = generate(tmp_path / "dup", conversations=4, sessions=3, seed=5, duplicates=0.3)
    plain = pq.read_table(tmp_path / "plain" / "bullets.parquet")
    dup = pq.read_table(tmp_path / "dup" / "bullets.parquet")
    source, kinds = dup.column("dup_source").to_pylist(), dup.column("dup_kind").to_pylist()
    originals = dup.filter(pa.array([s is None for s in source]))
    assert originals.drop_columns(["dup_source", "dup_kind"]).equals(plain)  # the rest: the same corpus, same order
    by_id = dict(zip(dup.column("bullet_id").to_pylist(), dup.to_pylist()))
    copies = [(r, by_id[r["dup_source"]]) for r in dup.to_pylist() if r["dup_source"] is not None]
    assert len(copies) == summary["counts"]["duplicates_verbatim"] + summary["counts"]["duplicates_paraphrase"] > 10
    assert {k for k in kinds if k} == {"verbatim", "paraphrase"}
    for copy, orig in copies:
        assert (copy["conversation_id"], copy["session_index"], copy["speaker"]) == \
            (orig["conversation_id"], orig["session_index"], orig["speaker"])
        assert (copy["text"] == orig["text"]) == (copy["dup_kind"] == "verbatim")
    assert len(set(dup.column("bullet_id").to_pylist())) == dup.num_rows
