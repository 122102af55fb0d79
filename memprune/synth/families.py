"""A development set for supersession whose phrasings come in families, split into fit and held-out families.

An update is "a later statement about the same attribute of the same person"; people rarely restate a stale fact
in its first words ("lives in Bergen", later "moved to Oslo"). Each *kind* of fact (residence, job, pet, ...)
has templates of three *forms*: `attribute` (a state: "lives in {v}"), `event` (a change: "moved to {v}") and
`distractor` (a related but compatible fact that replaces nothing: "visited {v}", "also has {a_v} now"). Every
template belongs to one *split*: `fit` (what may fit a judge) or `held` (only ever measured). Whole kinds are
held out too (`HELD_KINDS`: their every template is `held`), and so is the first person: a `fit` conversation is
written in the third person (a name, or no subject as in Mem0's memories), a `held` one in the first person or
with a name. A judge fitted on `fit` conversations and measured on `held` ones has never seen the verbs, the
kinds or the person it is measured on.

A conversation (`family_conversation`) is one person over `SESSIONS` sessions a week apart: a few kinds, each
first stated in an early session; some change value once or twice later (an attribute or event phrasing), some
are restated with the same value in other words, some get a distractor later; plus facts of no kind (hobbies)
that never change. Per bullet the truth says whether it is `stale` (a later bullet states a new value of its
slot), the slot, the family of the update that made it stale, and whether a distractor followed it. Everything
is drawn from `random.Random` seeded by (split, seed, index): the same arguments give the same corpus.
"""

from __future__ import annotations

import datetime as _dt
import random
import re
from dataclasses import dataclass, field
from typing import Literal

from memprune.synth.vocabulary import with_article

Split = Literal["fit", "held"]
SESSIONS = 6
NAMES = ("Alex", "Nora", "Sam", "Priya", "Jonas", "Maya", "Leo", "Ines", "Omar", "Zoe", "Kenji", "Lucia", "Tom",
         "Ada", "Ravi", "Elin")


@dataclass(frozen=True)
class Kind:
    """One kind of fact: its values and, per form, its templates as (split, template). In a template `{S}` is the
    subject, `[a|b]` the verb for I / for a third person, `{P}` a possessive (my, their), `{Ps}` one that starts a
    sentence (My, Alex's), `{v}` the value and `{a_v}` it with its article."""

    name: str
    values: tuple[str, ...]
    templates: dict[str, tuple[tuple[Split, str], ...]]


def _t(fit: tuple[str, ...], held: tuple[str, ...]) -> tuple[tuple[Split, str], ...]:
    return tuple(("fit", t) for t in fit) + tuple(("held", t) for t in held)


KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("residence", ("Bergen", "Oslo", "Denver", "Lisbon", "Austin", "Leeds", "Osaka", "Toronto", "Porto",
                       "Chicago", "Dublin", "Seattle", "Lyon", "Tucson"), {
        "attribute": _t(("{S} [live|lives] in {v}.", "{S} [have|has] an apartment in {v}.",
                         "{S} [reside|resides] in {v}.", "{S} [rent|rents] a flat in {v}."),
                        ("{Ps} home is in {v}.", "{S} [am|is] based in {v}.")),
        "event": _t(("{S} moved to {v}.", "{S} [have|has] just relocated to {v}.", "{S} left the old city for {v}.",
                     "{S} moved house and now [live|lives] in {v}."),
                    ("{S} packed up everything and settled in {v}.", "{S} bought a house in {v} and moved there.")),
        "distractor": _t(("{S} visited {v} last month.", "{S} [am|is] planning a trip to {v}.",
                          "{S} [have|has] a sister who lives in {v}.", "{S} went to a concert in {v}.",
                          "{S} [would|would] like to live in {v} one day."),
                         ("{S} spent a weekend in {v} for a wedding.", "{S} [have|has] a cousin who lives in {v}.")),
    }),
    Kind("job", ("nurse", "accountant", "teacher", "chef", "software engineer", "electrician", "pharmacist",
                 "journalist", "architect", "dentist", "paramedic", "librarian"), {
        "attribute": _t(("{S} [work|works] as {a_v}.", "{S} [am|is] {a_v} by profession.", "{S} [am|is] {a_v}.",
                         "{Ps} occupation is {v}."),
                        ("{Ps} job is {a_v}.", "{S} [earn|earns] a living as {a_v}.")),
        "event": _t(("{S} started a new job as {a_v}.", "{S} changed careers and became {a_v}.",
                     "{S} left the old job and now [work|works] as {a_v}.", "{S} retrained as {a_v}."),
                    ("{S} got hired as {a_v}.", "{S} quit the old job to work as {a_v} instead.")),
        "distractor": _t(("{S} [have|has] a friend who is {a_v}.", "{S} [am|is] thinking of training as {a_v} "
                          "someday.", "{Ps} father worked as {a_v}.", "{S} talked to {a_v} about a problem."),
                         ("{S} met {a_v} at a party.", "{S} read a book about life as {a_v}.")),
    }),
    Kind("pet", ("cat", "dog", "parrot", "rabbit", "hamster", "turtle", "ferret", "guinea pig", "corgi", "beagle"), {
        "attribute": _t(("{S} [have|has] {a_v}.", "{S} [own|owns] {a_v} as a pet.", "{S} [keep|keeps] {a_v} at home."),
                        ("{Ps} pet is {a_v}.", "{S} [live|lives] with {a_v}.")),
        "event": _t(("{S} adopted {a_v} after the old pet died.", "{S} rehomed the old pet and got {a_v}.",
                     "{S} lost the old pet and now [have|has] {a_v}."),
                    ("{S} brought home {a_v} now that the old pet has passed away.",
                     "{S} gave the old pet to a friend and took in {a_v}.")),
        "distractor": _t(("{S} also [have|has] {a_v} now.", "{S} pet-sat a neighbour's {v}.",
                          "{S} got a second pet, {a_v}, too.", "{Ps} sister has {a_v}.",
                          "{S} [want|wants] {a_v} one day."),
                         ("{S} [am|is] fostering {a_v} for a week.", "{S} got {a_v} as well, in addition to the "
                          "first pet.")),
    }),
    Kind("vehicle", ("Honda Civic", "Toyota Corolla", "Ford F-150", "Tesla Model 3", "Subaru Outback", "VW Golf",
                     "Mazda 3", "Jeep Wrangler", "Volvo XC60", "Kia Soul"), {
        "attribute": _t(("{S} [drive|drives] {a_v}.", "{S} [own|owns] {a_v}.", "{S} [have|has] {a_v} as a car."),
                        ("{Ps} car is {a_v}.", "{S} [get|gets] around in {a_v}.")),
        "event": _t(("{S} bought {a_v}.", "{S} traded in the old car for {a_v}.", "{S} replaced the car with {a_v}."),
                    ("{S} sold the old car and picked up {a_v}.", "{S} just got a new car, {a_v}.")),
        "distractor": _t(("{S} rented {a_v} for a road trip.", "{S} test-drove {a_v}.",
                          "{Ps} neighbour drives {a_v}.", "{S} [dream|dreams] of owning {a_v}."),
                         ("{S} borrowed a friend's {v} for the weekend.", "{S} [want|wants] {a_v} someday.")),
    }),
    Kind("team", ("Arsenal", "the Lakers", "the Yankees", "Real Madrid", "the Packers", "Liverpool", "the Celtics",
                  "Juventus", "the Cubs", "Ajax"), {
        "attribute": _t(("{S} [support|supports] {v}.", "{Ps} favourite team is {v}.", "{S} [follow|follows] {v}."),
                        ("{S} [am|is] a big fan of {v}.", "{S} [root|roots] for {v}.")),
        "event": _t(("{S} switched allegiance to {v}.", "{S} became a fan of {v} instead.",
                     "{S} [support|supports] {v} now, not the old team."),
                    ("{S} gave up on the old team and now [follow|follows] {v}.",
                     "{S} stopped supporting the old team and started cheering for {v}.")),
        "distractor": _t(("{S} watched a game of {v} with friends.", "{S} [think|thinks] {v} played well this "
                          "season.", "{Ps} dad supports {v}.", "{S} went to see {v} lose at home."),
                         ("{S} bought a ticket to see {v} play.", "{S} [have|has] a brother who supports {v}.")),
    }),
    Kind("relationship", ("Chris", "Jordan", "Taylor", "Morgan", "Daniel", "Hana", "Mateo", "Grace", "Noah",
                          "Freya"), {
        "attribute": _t(("{S} [am|is] dating {v}.", "{Ps} partner is {v}.", "{S} [am|is] married to {v}."),
                        ("{S} [am|is] in a relationship with {v}.", "{S} [am|is] engaged to {v}.")),
        "event": _t(("{S} broke up with the ex and started seeing {v}.", "{S} got together with {v}.",
                     "{S} started dating {v} after the divorce."),
                    ("{S} split up with the ex and [am|is] now with {v}.", "{S} fell for {v} and they became a "
                     "couple.")),
        "distractor": _t(("{S} had lunch with {v}.", "{S} [am|is] friends with {v}.", "{S} helped {v} move house.",
                          "{Ps} brother is dating {v}."),
                         ("{S} went hiking with {v}.", "{S} [work|works] with {v}.")),
    }),
    Kind("possessions", ("iPhone 12", "Pixel 7", "Galaxy S21", "iPhone 15", "OnePlus 9", "Pixel 8", "Galaxy S23"), {
        "attribute": _t(("{S} [use|uses] {a_v}.", "{Ps} phone is {a_v}.", "{S} [own|owns] {a_v}."),
                        ("{S} [carry|carries] {a_v} everywhere.", "{S} [have|has] {a_v} as a phone.")),
        "event": _t(("{S} upgraded to {a_v}.", "{S} replaced the old phone with {a_v}.",
                     "{S} bought {a_v} to replace the old one."),
                    ("{S} switched phones and now [use|uses] {a_v}.", "{S} got {a_v} after the old phone broke.")),
        "distractor": _t(("{S} fixed a friend's {v}.", "{S} read a review of the {v}.",
                          "{Ps} mother uses {a_v}."),
                         ("{S} [am|is] saving up for {a_v}.", "{S} bought {a_v} as a gift for a sister.")),
    }),
    Kind("routine", ("3", "5", "8", "10", "12", "15"), {
        "attribute": _t(("{S} [run|runs] {v} km every morning.", "{S} [jog|jogs] {v} km a day."),
                        ("{Ps} daily run is {v} km.", "{S} [cover|covers] {v} km on each morning run.")),
        "event": _t(("{S} increased the morning run to {v} km.", "{S} cut the daily run down to {v} km."),
                    ("{S} now [run|runs] {v} km each morning instead.", "{S} changed the daily run to {v} km.")),
        "distractor": _t(("{S} ran {v} km in a charity race once.", "{S} walked {v} km on a hike."),
                         ("{S} cycled {v} km to a lake at the weekend.", "{S} swam {v} km in a lake last year.")),
    }),
    # fitted kinds only (no held templates: never measured as held out)
    Kind("employer", ("Google", "a bakery", "the city council", "a law firm", "a hospital", "Ikea", "a startup",
                      "the post office"), {
        "attribute": _t(("{S} [work|works] at {v}.", "{Ps} employer is {v}.", "{S} [am|is] employed by {v}."), ()),
        "event": _t(("{S} joined {v}.", "{S} took a position at {v}.", "{S} switched employers to {v}."), ()),
        "distractor": _t(("{S} applied to {v} but [am|is] staying put.", "{S} delivered a parcel to {v}.",
                          "{Ps} friend works at {v}."), ()),
    }),
    Kind("school", ("biology", "law", "history", "nursing", "computer science", "economics", "music"), {
        "attribute": _t(("{S} [study|studies] {v}.", "{S} [am|is] a {v} student.", "{Ps} major is {v}."), ()),
        "event": _t(("{S} switched majors to {v}.", "{S} changed course and now [study|studies] {v}.",
                     "{S} dropped the old major for {v}."), ()),
        "distractor": _t(("{S} took one elective in {v}.", "{S} went to a talk on {v}.",
                          "{Ps} roommate studies {v}."), ()),
    }),
    Kind("age", ("29", "30", "31", "42", "43", "55", "56", "67"), {
        "attribute": _t(("{S} [am|is] {v} years old.", "{Ps} age is {v}."), ()),
        "event": _t(("{S} just turned {v}.", "{S} celebrated turning {v}."), ()),
        "distractor": _t(("{Ps} father is {v} years old.", "{S} went to a friend's {v}th birthday."), ()),
    }),
    Kind("instrument", ("piano", "violin", "drums", "cello", "saxophone", "ukulele", "trumpet"), {
        "attribute": _t(("{S} [play|plays] the {v}.", "{Ps} instrument is the {v}."), ()),
        "event": _t(("{S} gave up the old instrument and took up the {v}.", "{S} switched to playing the {v}."), ()),
        "distractor": _t(("{S} heard a {v} concert.", "{Ps} child is learning the {v}."), ()),
    }),
    Kind("commute", ("bike", "bus", "train", "car", "scooter", "tram"), {
        "attribute": _t(("{S} [commute|commutes] by {v}.", "{S} [go|goes] to work by {v}."), ()),
        "event": _t(("{S} started commuting by {v}.", "{S} switched to taking the {v} to work."), ()),
        "distractor": _t(("{S} took the {v} to the beach once.", "{Ps} partner commutes by {v}."), ()),
    }),
    Kind("rent", ("900", "1200", "1500", "700", "2100", "1800"), {
        "attribute": _t(("{S} [pay|pays] {v} dollars a month in rent.", "{Ps} rent is {v} dollars."), ()),
        "event": _t(("{Ps} rent went up to {v} dollars.", "{S} renegotiated the rent down to {v} dollars."), ()),
        "distractor": _t(("{S} lent a friend {v} dollars.", "{S} saw a flat advertised for {v} dollars."), ()),
    }),
    # held-out kinds: every template held (never fitted on)
    Kind("health", ("vegetarian", "vegan", "gluten-free", "keto", "low-salt", "pescatarian"), {
        "attribute": _t((), ("{S} [follow|follows] {a_v} diet.", "{S} [eat|eats] {v} food only.",
                             "{S} [am|is] on {a_v} diet.")),
        "event": _t((), ("{S} switched to {a_v} diet.", "{S} went {v} this year.",
                         "{S} gave up the old diet and [eat|eats] {v} now.")),
        "distractor": _t((), ("{S} tried {a_v} recipe.", "{S} cooked {a_v} meal for a friend.",
                              "{S} read an article about {v} eating.")),
    }),
    Kind("plans", ("June 3", "August 12", "May 20", "September 9", "October 1", "July 15", "April 28"), {
        "attribute": _t((), ("{Ps} wedding is on {v}.", "{S} [am|is] getting married on {v}.",
                             "{Ps} wedding date is {v}.")),
        "event": _t((), ("{S} moved the wedding to {v}.", "{S} postponed the wedding to {v}.",
                         "{S} rescheduled the wedding for {v}.")),
        "distractor": _t((), ("{S} went to a friend's wedding on {v}.", "{S} booked a cake tasting for {v}.",
                              "{S} [have|has] a dress fitting on {v}.")),
    }),
)}
HELD_KINDS = ("health", "plans")
FILLERS = ("{S} [enjoy|enjoys] hiking on weekends.", "{S} [play|plays] the guitar.", "{S} [love|loves] Thai food.",
           "{S} [read|reads] a lot of science fiction.", "{S} [have|has] two older brothers.",
           "{S} [volunteer|volunteers] at a food bank.", "{S} [am|is] learning Spanish.",
           "{S} [collect|collects] vinyl records.", "{S} [grow|grows] tomatoes on the balcony.",
           "{S} [prefer|prefers] tea to coffee.", "{S} [go|goes] climbing twice a week.",
           "{S} [paint|paints] watercolours.", "{S} [bake|bakes] bread every Sunday.",
           "{S} [speak|speaks] three languages.", "{S} [is afraid|is afraid] of heights.")


@dataclass
class FamilyBullet:
    """One bullet and its truth: the slot it fills (None: a filler or a distractor), whether a later bullet of the
    same slot states a new value (`stale`), the family of the update that did (`kind/A form->B form`), whether a
    distractor of its slot followed it, and the bullet's own form, split and template."""

    text: str
    session: int
    kind: str | None
    form: str
    split: Split
    template: str
    slot: str | None = None
    value: str | None = None
    stale: bool = False
    family: str | None = None
    distracted: bool = False


@dataclass
class FamilyConversation:
    conversation_id: str
    speaker: str
    split: Split
    times: list[str]
    bullets: list[FamilyBullet] = field(default_factory=list)


def render(template: str, name: str | None, person: str, value: str) -> str:
    """A template in the first person (`I`), the third (`name`) or with no subject (name None, Mem0's style)."""
    first = person == "first"
    subject = "I" if first else (name or "")
    text = re.sub(r"\[([^|\]]*)\|([^\]]*)\]", lambda m: m.group(1) if first else m.group(2), template)
    text = text.replace("{Ps}", "My" if first else (f"{name}'s" if name else "Their"))
    text = text.replace("{P}", "my" if first else "their").replace("{S}", subject)
    if "{a_v}" in text:
        text = text.replace("{a_v}", with_article(value))
    text = text.replace("{v}", value)
    text = re.sub(r"\s+", " ", text).strip()
    return text[0].upper() + text[1:]


def family_conversation(split: Split, seed: int, index: int, kinds: int = 4) -> FamilyConversation:
    """One person's bullets over `SESSIONS` sessions (see the module docstring), all of one split's families."""
    rng = random.Random(f"memprune-families/{split}/{seed}/{index}")
    name = rng.choice(NAMES)
    person = rng.choice(("third", "none") if split == "fit" else ("first", "third"))
    who = None if person == "none" else name
    start = _dt.datetime(2024, 1, 1) + _dt.timedelta(days=rng.randrange(300))
    conv = FamilyConversation(f"{split}-{seed}-{index:05d}", name, split,
                              [(start + _dt.timedelta(days=7 * s)).isoformat() for s in range(SESSIONS)])

    def templates(kind: Kind, form: str) -> list[str]:
        return [t for s, t in kind.templates[form] if s == split]

    def say(template: str, kind: str | None, form: str, value: str, session: int,
            slot: str | None = None) -> FamilyBullet:
        return FamilyBullet(render(template, who, person, value), session, kind, form, split, template, slot,
                            value if slot else None)

    pool = [k for k in KINDS.values() if templates(k, "attribute") and templates(k, "event")]
    for kind in rng.sample(pool, min(kinds, len(pool))):
        values = rng.sample(kind.values, 3)
        slot = f"{conv.conversation_id}/{kind.name}"
        first_form = "attribute" if rng.random() < 0.8 else "event"
        s = rng.randrange(0, 2)
        said = [say(rng.choice(templates(kind, first_form)), kind.name, first_form, values[0], s, slot)]
        fate = rng.random()
        changes = 0 if fate < 0.4 else (1 if fate < 0.85 else 2)
        value = values[0]
        for c in range(changes):
            last = SESSIONS - (changes - c - 1)  # the sessions this change may take, leaving room for the next
            s = rng.randrange(s + 1, last)
            if rng.random() < 0.3 and s + 1 < last:  # the old value said again first, in other words
                said.append(say(rng.choice(templates(kind, "attribute")), kind.name, "attribute", value, s, slot))
                s += 1
            form = "event" if rng.random() < 0.6 else "attribute"
            value = values[c + 1]
            new = say(rng.choice(templates(kind, form)), kind.name, form, value, s, slot)
            for b in said:
                if b.value != value and not b.stale:
                    b.stale, b.family = True, f"{kind.name}/{b.form}->{form}"
            said.append(new)
        if changes == 0 and rng.random() < 0.5:  # the same value restated later in other words
            template = rng.choice(templates(kind, "attribute"))
            said.append(say(template, kind.name, "attribute", value, rng.randrange(s + 1, SESSIONS), slot))
        if rng.random() < 0.5 and said[-1].session < SESSIONS - 1:  # a compatible related fact, later
            other = rng.choice([v for v in kind.values if v not in values])
            for b in said:
                if not b.stale:
                    b.distracted = True
            template = rng.choice(templates(kind, "distractor"))
            said.append(say(template, kind.name, "distractor", other, rng.randrange(said[-1].session + 1, SESSIONS)))
        conv.bullets += said
    for t in rng.sample(FILLERS, 3):
        conv.bullets.append(say(t, None, "filler", "", rng.randrange(SESSIONS)))
    conv.bullets.sort(key=lambda b: b.session)
    return conv
