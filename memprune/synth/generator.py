"""The generator of synthetic multi-session conversations whose bullets carry the ground truth: does this fact recur?

Each conversation has two speakers, each with a persona of durable facts (preferences,
plans, relations, pets, jobs) drawn from `memprune.synth.vocabulary`. In every session a
speaker states some durable facts (paraphrased from templates) and makes one-off
remarks (lunch, weather, commute, ...). The bullets of a session are exactly the facts
and remarks stated in it, with the turn ids where they were stated as evidence.

Ground truth (`recurs`): a bullet recurs when its fact is stated again, by the same
speaker with the same key entity words, in a *later* session of the same conversation.
It is computed from the generated schedule, which guarantees: every durable fact is
introduced before the final session and re-stated in the final session (and in some
sessions in between), and every one-off remark's key entity appears exactly once in the
whole conversation. Hence a durable bullet recurs iff it is not in the final session,
and a one-off bullet never recurs. `stray_prob` > 0 (default 0) makes that fraction of
persona facts "strays": stated in one session only, same style as durable facts, so
`recurs` is False for them and text style alone no longer decides it. Everything is drawn from `random.Random` seeded by
(seed, conversation index), so the output is byte-identical for the same arguments and
any conversation can be regenerated alone (`synth_conversation`).
"""

from __future__ import annotations

import datetime as _dt
import random
from dataclasses import dataclass, field
from typing import Any

from memprune.schema import bullet_id, turn_id
from memprune.synth.config import SynthSettings
from memprune.synth.vocabulary import (
    ACKS,
    BYES,
    CLOSINGS,
    DURABLE,
    DURABLE_NAMES,
    DURABLE_WEIGHTS,
    GOAL_PHRASES,
    GREETINGS,
    NAMES_FOR,
    ONEOFF_ITEMS,
    PROFESSIONS,
    PROMPTS,
    RELATIONS,
    REPLY_GREETINGS,
    SPEAKER_NAMES,
    SPECIES,
    TRANSITIONS,
    WHEN,
    YEARS,
    capitalize,
    oneoff_key,
    with_article,
)

GENERATOR_VERSION = 1


@dataclass
class SynthBullet:
    """A bullet with its ground truth and (for tests and analysis) its key entity words."""

    bullet_id: str
    session_index: int
    speaker: str
    text: str
    evidence: list[str]
    recurs: bool
    kind: str
    key: str
    dup_source: str | None = None  # injected duplicates (`duplicates` > 0): the bullet it copies
    dup_kind: str | None = None  # "verbatim" or "paraphrase"
    update_of: str | None = None  # injected updates (`updates` > 0): the bullet of the old value this one replaces
    slot: int | None = None  # durable facts: the persona fact (slot) it states, whatever its value


@dataclass
class SynthSession:
    """One session: its index, date and turns as (turn_id, speaker, text)."""

    session_index: int
    time: str
    turns: list[tuple[str, str, str]] = field(default_factory=list)


@dataclass
class SynthConversation:
    """One generated conversation: speakers, sessions and bullets (bullets in session order)."""

    conversation_id: str
    speakers: list[str]
    sessions: list[SynthSession]
    bullets: list[SynthBullet]


@dataclass
class _Fact:
    owner: int
    category: str
    kind: str
    key: str
    slots: dict[str, str]
    mentions: list[int]
    update: tuple[int, dict[str, str]] | None = None  # (session, slots) from which the fact has a new value


# ---------------------------------------------------------------- generation


def conversation_id(index: int) -> str:
    """Id of the synthetic conversation number `index` (0-based), e.g. `synth-000042`."""
    return f"synth-{index:06d}"


def _persona(rng: random.Random, owner: int, name: str, n: int, used: set[str], unique: bool = False) -> list[_Fact]:
    """Draw `n` durable facts for one speaker, with key entities unused in this conversation; one job, and with
    `unique` one fact per category (a second value of a category is then always an update)."""
    facts: list[_Fact] = []
    taken: set[str] = set()
    while len(facts) < n:
        cat_name = rng.choices(DURABLE_NAMES, DURABLE_WEIGHTS)[0]
        if cat_name in taken and (unique or cat_name == "job"):
            continue
        cat = DURABLE[cat_name]
        rel = rng.choice(RELATIONS) if cat_name == "relation" else ""
        key = rng.choice(NAMES_FOR[rel] if rel else cat.keys)
        if key in used:
            continue
        slots = {"x": key, "name": name}
        if cat_name == "relation":
            job = rng.choice(PROFESSIONS)
            if job in used:
                continue
            used.add(job)
            slots.update(rel=rel, a_rel=with_article(rel), a_job=with_article(job))
        elif cat_name == "pet":
            species = rng.choice(SPECIES)
            slots.update(species=species, a_species=with_article(species))
        elif cat_name == "job":
            slots.update(a_x=with_article(key), years=rng.choice(YEARS))
        elif cat_name == "travel":
            slots["when"] = rng.choice(WHEN)
        elif cat_name == "goal":
            slots["phrase"] = GOAL_PHRASES[key]
        used.add(key)
        taken.add(cat_name)
        facts.append(_Fact(owner, cat_name, cat.kind, key, slots, []))
    return facts


def _schedule(rng: random.Random, fact: _Fact, sessions: int, mention_prob: float, stray_prob: float) -> None:
    """Introduce the fact before the final session, restate it sometimes, and always in the final one.

    With probability `stray_prob` the fact is a stray instead: stated in one session, never again.
    """
    if stray_prob and rng.random() < stray_prob:
        fact.mentions = [rng.randrange(sessions)]
        return
    first = rng.randrange(sessions - 1)
    last = sessions - 1
    fact.mentions = [first] + [t for t in range(first + 1, last) if rng.random() < mention_prob] + [last]


def _session(
    rng: random.Random,
    cid: str,
    index: int,
    names: list[str],
    said: list[list[tuple]],
    out_bullets: list[SynthBullet],
    recurs_of: dict[int, bool],
) -> list[tuple[str, str, str]]:
    """Lay out one session's items as alternating turns and append its bullets (in stated order)."""
    turns: list[tuple[str, str, str]] = []
    cur = rng.randrange(2)
    greeted = [False, False]
    pending: tuple | None = None  # (item, ask turn index) for the speaker about to talk
    nb = 0
    while said[0] or said[1] or pending is not None:
        t = len(turns)
        tid = turn_id(cid, index, t)
        other = names[1 - cur]
        parts: list[str] = []
        if not greeted[cur]:
            parts.append(rng.choice(GREETINGS if t == 0 else REPLY_GREETINGS).format(other=other))
            greeted[cur] = True
        if pending is not None:
            item, ask_t = pending
            parts.append(capitalize(item[2]))
            out_bullets.append(_bullet(cid, index, nb, names, item, [turn_id(cid, index, ask_t), tid], recurs_of))
            nb += 1
            pending = None
        elif t and rng.random() < 0.5:
            parts.append(rng.choice(ACKS))
        queue = said[cur]
        n_items = 2 if (rng.random() < (0.5 if not said[1 - cur] else 0.2)) else 1
        stated = 0
        while queue and stated < n_items:
            item = queue.pop()
            text = capitalize(item[1])
            if stated:
                text = rng.choice(TRANSITIONS) + " " + text
            parts.append(text)
            stated += 1
            if item[0] == "ask":  # a question ends the turn; the partner answers next
                pending = (item, t)
                break
            out_bullets.append(_bullet(cid, index, nb, names, item, [tid], recurs_of))
            nb += 1
        if not stated and pending is None:
            parts.append(rng.choice(PROMPTS))
        turns.append((tid, names[cur], " ".join(parts)))
        cur = 1 - cur
    turns.append((turn_id(cid, index, len(turns)), names[cur], rng.choice(CLOSINGS)))
    turns.append((turn_id(cid, index, len(turns)), names[1 - cur], rng.choice(BYES).format(other=names[cur])))
    return turns


def _bullet(
    cid: str, index: int, nb: int, names: list[str], item: tuple, evidence: list[str], recurs_of: dict[int, Any]
) -> SynthBullet:
    _mode, _said, _answer, owner, kind, key, btext, ref = item
    recurs, slot = recurs_of[ref]
    return SynthBullet(bullet_id(cid, index, nb), index, names[owner], btext, evidence, recurs, kind, key, slot=slot)


def _plan_updates(facts: list[_Fact], share: float, rng: random.Random, used: set[str]) -> None:
    """Give about `share` of the durable facts that are stated at least twice a new value (a fresh key of the same
    category) from one of their later mentions on: same speaker, same slot, later session."""
    for fact in facts:
        if len(fact.mentions) < 2 or rng.random() >= share:
            continue
        pool = NAMES_FOR[fact.slots["rel"]] if fact.category == "relation" else DURABLE[fact.category].keys
        keys = [k for k in pool if k not in used]
        if not keys:
            continue
        key = rng.choice(keys)
        used.add(key)
        slots = {**fact.slots, "x": key}
        if "a_x" in slots:
            slots["a_x"] = with_article(key)
        if "phrase" in slots:
            slots["phrase"] = GOAL_PHRASES[key]
        fact.update = (rng.choice(fact.mentions[1:]), slots)


def synth_conversation(index: int, config: SynthSettings) -> SynthConversation:
    """Generate conversation number `index` alone; depends only on (config, index)."""
    rng = random.Random(f"memprune-synth/{config.seed}/{index}")
    cid = conversation_id(index)
    names = rng.sample(SPEAKER_NAMES, 2)
    n_sessions = config.sessions
    used: set[str] = set()
    unique = config.updates > 0
    facts = _persona(rng, 0, names[0], config.facts_per_speaker, used, unique) + _persona(
        rng, 1, names[1], config.facts_per_speaker, used, unique
    )
    for fact in facts:
        _schedule(rng, fact, n_sessions, config.mention_prob, config.stray_prob)
    if config.updates:  # a separate random stream: the rest of the corpus stays as it was
        _plan_updates(facts, config.updates, random.Random(f"memprune-synth-updates/{config.seed}/{index}"), used)

    m = config.oneoffs_per_session
    n_oneoffs = [[rng.randint(max(0, m - 1), m + 1) for _ in range(2)] for _ in range(n_sessions)]
    pool = rng.sample(range(len(ONEOFF_ITEMS)), sum(a + b for a, b in n_oneoffs))

    day = _dt.date(2023, 1, 1).toordinal() + rng.randrange(365)
    sessions: list[SynthSession] = []
    bullets: list[SynthBullet] = []
    ref = 0
    last_of: dict[int, str] = {}  # fact -> the bullet id of its latest mention (the value an update replaces)
    for s in range(n_sessions):
        said: list[list[tuple]] = [[], []]
        recurs_of: dict[int, tuple[bool, int | None]] = {}  # ref -> (recurs, fact index)
        # item: (mode, said text, answer text, owner, kind, key, bullet text, ref); mode "ask" goes to the partner
        for f, fact in enumerate(facts):
            if s not in fact.mentions:
                continue
            cat = DURABLE[fact.category]
            slots, later = fact.slots, [m for m in fact.mentions if m > s]
            if fact.update is not None:
                at, new = fact.update
                if s >= at:
                    slots = new
                else:  # the old value recurs only while it is still the value
                    later = [m for m in later if m < at]
            btext = capitalize(rng.choice(cat.bullet).format(**slots))
            recurs_of[ref] = (bool(later), f)
            if s == fact.mentions[0]:
                said[fact.owner].append(("say", rng.choice(cat.intro).format(**slots), "", fact.owner, fact.kind,
                                         slots["x"], btext, ref))
            elif rng.random() < 0.35:
                said[1 - fact.owner].append(("ask", rng.choice(cat.ask).format(**slots),
                                             rng.choice(cat.answer).format(**slots), fact.owner, fact.kind,
                                             slots["x"], btext, ref))
            else:
                said[fact.owner].append(("say", rng.choice(cat.again).format(**slots), "", fact.owner, fact.kind,
                                         slots["x"], btext, ref))
            ref += 1
        for owner in (0, 1):
            for _ in range(n_oneoffs[s][owner]):
                _cat, phrase, templates = ONEOFF_ITEMS[pool.pop()]
                say, btemplate = rng.choice(templates)
                recurs_of[ref] = (False, None)
                said[owner].append(("say", say.format(x=phrase), "", owner, "oneoff", oneoff_key(phrase),
                                    capitalize(btemplate.format(x=phrase, name=names[owner])), ref))
                ref += 1
        for queue in said:
            rng.shuffle(queue)
        session = SynthSession(s, _dt.date.fromordinal(day).isoformat())
        start = len(bullets)
        session.turns = _session(rng, cid, s, names, said, bullets, recurs_of)
        for b in bullets[start:]:
            if b.slot is not None:
                upd = facts[b.slot].update
                if upd is not None and upd[0] == s:
                    b.update_of = last_of[b.slot]
                last_of[b.slot] = b.bullet_id
        sessions.append(session)
        day += rng.randint(2, 30)
    if config.duplicates:
        bullets = inject_duplicates(bullets, config.duplicates,
                                    random.Random(f"memprune-synth-duplicates/{config.seed}/{index}"), cid)
    return SynthConversation(cid, list(names), sessions, bullets)


# Meaning-preserving rewordings of a restated fact, as a summarizer writes them: word swaps and wrappers.
_SWAPS = (("loves", "really loves"), ("enjoys", "likes"), ("favorite", "preferred"), ("is learning", "has been learning"),
          ("plans to", "intends to"), ("this morning", "earlier today"), ("today", "earlier today"), ("a lot", "often"),
          ("works as", "is employed as"), ("wants to", "would like to"), ("regularly", "often"), ("has a", "owns a"),
          ("is a fan of", "is really into"), ("takes", "is taking"), ("spends free time on", "spends spare time on"))
_WRAPS = ("Apparently, {t}", "{t} (mentioned again)", "As noted, {t}", "It seems that {t}", "Once more: {t}")


def paraphrase(text: str, rng: random.Random) -> str:
    """The same fact in other words: a word swap where one applies, and/or a wrapper; never the text itself."""
    out = text
    swaps = [(a, b) for a, b in _SWAPS if f" {a} " in f" {text.rstrip('.')} "]
    if swaps:
        a, b = rng.choice(swaps)
        out = f" {text} ".replace(f" {a} ", f" {b} ", 1).replace(f" {a}.", f" {b}.", 1).strip()
    if out == text or rng.random() < 0.5:
        wrap = rng.choice(_WRAPS)
        body = out if wrap.startswith("{t}") else out[0].lower() + out[1:] if not out[:2].istitle() else out
        out = wrap.format(t=body)
    return out


def inject_duplicates(bullets: list[SynthBullet], share: float, rng: random.Random, cid: str) -> list[SynthBullet]:
    """Add a duplicate of about `share` of the bullets to their own session, with ground truth.

    Half are paraphrases (`paraphrase`: the same fact reworded), the rest verbatim copies. Each copy
    gets a fresh id after the session's own and sits at a random place in its session. A separate
    random stream leaves the rest of the corpus as it was.
    """
    out: list[SynthBullet] = []
    for s in sorted({b.session_index for b in bullets}):
        session = [b for b in bullets if b.session_index == s]
        copies = []
        for b in session:
            if rng.random() >= share:
                continue
            kind = "paraphrase" if rng.random() < 0.5 else "verbatim"
            text = paraphrase(b.text, rng) if kind == "paraphrase" else b.text
            copies.append(SynthBullet(bullet_id(cid, s, len(session) + len(copies)), s, b.speaker, text,
                                      list(b.evidence), b.recurs, b.kind, b.key, b.bullet_id, kind))
        for c in copies:
            session.insert(rng.randint(0, len(session)), c)
        out += session
    return out
