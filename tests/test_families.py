"""The phrasing-family development set of supersession (issue 57): fit and held-out families never mix.

A judge fitted on `fit` conversations is measured on `held` ones (bench/lifecycle_bench.py); that is only a
measure of generalisation if no held-out template, kind or person ever reaches a fit conversation. The truth must
also be what the bench counts: a stale bullet has a later bullet of its slot with another value.
"""

from __future__ import annotations

from memprune.synth.families import HELD_KINDS, KINDS, family_conversation, render


def test_fit_conversations_use_only_fit_families_and_the_truth_holds():
    for split in ("fit", "held"):
        for i in range(60):
            conv = family_conversation(split, 3, i)
            assert conv == family_conversation(split, 3, i)  # deterministic from (split, seed, index)
            first = any(b.text.startswith(("I ", "My ")) for b in conv.bullets)
            assert not (split == "fit" and first)  # the first person is held out
            for k, b in enumerate(conv.bullets):
                if b.kind is not None:
                    assert (split, b.template) in KINDS[b.kind].templates[b.form]
                    assert split == "held" or b.kind not in HELD_KINDS
                later = [x for x in conv.bullets[k + 1:] if x.slot == b.slot and x.session > b.session]
                if b.stale:
                    assert b.slot and any(x.value != b.value for x in later) and not b.distracted
                elif b.slot:
                    assert all(x.value == b.value for x in later)


def test_render_takes_the_person():
    t = "{S} [live|lives] in {v}, {P} home; {Ps} cat is {a_v}."
    assert render(t, "Nora", "third", "Oslo") == "Nora lives in Oslo, their home; Nora's cat is an Oslo."
    assert render(t, "Nora", "first", "Oslo") == "I live in Oslo, my home; My cat is an Oslo."
    assert render(t, None, "none", "Oslo") == "Lives in Oslo, their home; Their cat is an Oslo."


def test_the_real_labelled_pairs_resolve_against_the_shared_data():
    """bench/data/real_updates.json holds only references and labels: each resolves to two texts of one person,
    the first from an earlier session; a reference that does not resolve is one error naming the entry."""
    import json
    import sys

    from conftest import REPO, SHARED

    sys.path.insert(0, str(REPO / "bench"))
    import real_updates

    pairs = real_updates.pairs(SHARED)
    assert len(pairs) == len(json.loads(real_updates.DATA.read_text())) >= 400
    assert {p["label"] for p in pairs} == set(real_updates.LABELS)
    assert all(p["a_text"] and p["b_text"] and p["a_session"] < p["b_session"] for p in pairs)
    assert sum(p["label"] == "update" for p in pairs) >= 100
