"""Synthetic multi-session corpora whose bullets carry the ground truth: does this fact recur?

Each conversation has two speakers, each with a persona of durable facts (preferences,
plans, relations, pets, jobs) drawn from the vocabulary below. In every session a
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
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from memprune.io import TableSink, write_json
from memprune.schema import SESSIONS, SYNTH_BULLETS, bullet_id, turn_id

GENERATOR_VERSION = 1

# ---------------------------------------------------------------- vocabulary

SPEAKER_NAMES = (
    "Nora Ethan Priya Marcus Sofia Kenji Amara Lucas Ingrid Diego Hana Tobias Leila Owen Mei Rafael "
    "Zoe Anders Yara Felix Imani Mateo Chloe Arjun Freya Omar Elena Jonah Ayla Theo Nadia Caleb Ines "
    "Ravi Greta Malik Selin Hugo Talia Bruno"
).split()

FEMALE_NAMES = (
    "Maya Grace Olivia Ruth Alice Julia Clara Lydia Rosa Irene Naomi Vera Stella Eva Ada June Nina Lena Iris "
    "Esther Aisha Fatima Lucia Camila Astrid Beatriz Signe Farah Noor Thandiwe Suki Pilar Mirela Wanjiru "
    "Delphine Anneke Mireille Bettina Marisol Odile Solveig Catalina Hyacinth Rosalind Philippa Marguerite "
    "Valentina Yuki Ingeborg"
).split()

MALE_NAMES = (
    "Daniel Samuel Henry Victor Peter Oscar Simon Martin Frank Hector Walter Isaac Gabriel Leon Miles Carl "
    "Paul Roy Adam Kofi Mohammed Sven Pablo Tariq Dmitri Jamal Rohan Kwame Emil Dario Viktor Anton Bashir "
    "Colm Ezra Tomas Rashid Keanu Osman Leopold Finnegan Ibrahim Benedikt Yusuf Magnus Desmond Cyrus Idris "
    "Lorcan"
).split()

PERSON_NAMES = FEMALE_NAMES + MALE_NAMES

PET_NAMES = (
    "Biscuit Waffles Mochi Pickles Noodle Ziggy Pumpkin Sprout Bandit Muffin Rocket Pixel Gizmo Nugget "
    "Clover Domino Marble Pebble Whiskers Scout Duke Coco Bean Juniper Mango Kiwi Basil Maple Ginger "
    "Cinnamon Toffee Yoda Frodo Pippin Nacho Churro Rufus Chester Winston Archie Bubbles Fuzzy Boomer "
    "Shadow Smokey Zorro Loki Sherlock Paprika Wasabi"
).split()

PROFESSIONS = [
    "nurse", "firefighter", "architect", "electrician", "pharmacist", "veterinarian", "librarian",
    "paramedic", "carpenter", "accountant", "pastry chef", "translator", "zookeeper", "graphic designer",
    "air traffic controller", "plumber", "lawyer", "park ranger", "software engineer", "marine biologist",
    "flight attendant", "welder", "journalist", "physical therapist", "bus driver", "chemist", "midwife",
    "locksmith", "sommelier", "tattoo artist", "florist", "mechanic", "optometrist", "tailor",
    "barista", "land surveyor", "social worker", "event planner", "data analyst", "radio host",
    "stage manager", "lighthouse keeper", "pilot", "geologist", "orthodontist", "chimney sweep",
]

# Relations and the first names that fit them (gendered relations take gendered names).
FEMALE_RELATIONS = ["sister", "aunt", "grandmother", "daughter", "niece", "godmother"]
MALE_RELATIONS = ["brother", "uncle", "grandfather", "son", "nephew", "stepdad"]
NEUTRAL_RELATIONS = ["cousin", "best friend", "roommate", "coworker", "neighbor", "mentor"]
RELATIONS = FEMALE_RELATIONS + MALE_RELATIONS + NEUTRAL_RELATIONS
_NAMES_FOR = {
    **{r: FEMALE_NAMES for r in FEMALE_RELATIONS},
    **{r: MALE_NAMES for r in MALE_RELATIONS},
    **{r: PERSON_NAMES for r in NEUTRAL_RELATIONS},
}

SPECIES = [
    "dog", "cat", "parrot", "rabbit", "hamster", "turtle", "iguana", "ferret", "guinea pig", "corgi",
    "golden retriever", "tabby cat", "cockatiel", "bearded dragon", "husky",
]

WHEN = ["next spring", "this summer", "in the fall", "next winter", "for my birthday", "next year"]
YEARS = ["two", "three", "five", "seven", "ten", "twelve"]


@dataclass(frozen=True)
class Category:
    """One kind of durable fact: its kind label, key entities, and the templates that state it.

    `intro` states the fact the first time, `again` restates it in a later session,
    `ask`/`answer` is a later restatement prompted by the partner, `bullet` is the
    memory bullet. Templates use `{x}` (the key entity) and the slots of the fact.
    """

    kind: str
    keys: tuple[str, ...]
    intro: tuple[str, ...]
    again: tuple[str, ...]
    ask: tuple[str, ...]
    answer: tuple[str, ...]
    bullet: tuple[str, ...]
    weight: float = 1.0


def _t(*items: str) -> tuple[str, ...]:
    return tuple(items)


DURABLE: dict[str, Category] = {
    "music": Category(
        "preference",
        _t("jazz", "bluegrass", "heavy metal", "reggae", "classical music", "hip hop", "country music",
           "salsa music", "k-pop", "punk rock", "blues", "opera", "folk music", "techno", "gospel music",
           "indie rock", "bossa nova", "flamenco", "synthwave", "disco", "grunge", "ska", "baroque music",
           "afrobeat", "motown"),
        intro=_t("I listen to {x} pretty much all day.", "Honestly, {x} is my favorite kind of music.",
                 "I've been obsessed with {x} since I was a teenager.",
                 "Nothing relaxes me like putting on some {x}."),
        again=_t("I went to a {x} concert last weekend, it was amazing.",
                 "I made a new {x} playlist for my commute.",
                 "Still listening to {x} nonstop, as you can imagine.",
                 "I found a record store with a whole {x} section."),
        ask=_t("Have you been to any {x} concerts lately?", "Still listening to a lot of {x}?"),
        answer=_t("Of course, {x} is still all I play in the car.",
                  "Yes, I even caught a {x} concert downtown."),
        bullet=_t("{name} loves {x}.", "{name}'s favorite music is {x}.", "{name} listens to {x} a lot."),
    ),
    "food": Category(
        "preference",
        _t("sushi", "Thai curry", "tacos", "dim sum", "Ethiopian food", "barbecue ribs", "pho", "dumplings",
           "Indian food", "falafel", "paella", "pierogi", "Korean barbecue", "ceviche", "pad thai", "gnocchi",
           "tapas", "burritos", "fried chicken", "crepes", "poutine", "shawarma", "risotto", "bibimbap",
           "empanadas"),
        intro=_t("I could eat {x} every single day.", "{x} is my absolute favorite food.",
                 "Whenever I get to choose dinner, it's {x}.", "I'm a little obsessed with {x}."),
        again=_t("I found a new spot that makes amazing {x}.", "I tried making {x} at home again this week.",
                 "We ordered {x} for my birthday, naturally."),
        ask=_t("Found any good {x} places lately?", "Are you still eating {x} every week?"),
        answer=_t("Always, {x} is still my go-to.", "Yes! There's a new {x} place near my apartment."),
        bullet=_t("{name} loves {x}.", "{name}'s favorite food is {x}.", "{name} could eat {x} every day."),
    ),
    "sport": Category(
        "preference",
        _t("tennis", "volleyball", "badminton", "rugby", "ice hockey", "table tennis", "lacrosse", "cricket",
           "water polo", "softball", "pickleball", "netball", "padel", "handball", "ultimate frisbee", "squash",
           "baseball", "basketball", "soccer", "golf"),
        intro=_t("I play {x} every weekend with a local club.",
                 "{x} is my big passion, I practice three times a week.", "I've played {x} since high school."),
        again=_t("We won our {x} match on Saturday!", "I hurt my wrist at {x} practice, but I'm fine.",
                 "My {x} team is going to a tournament."),
        ask=_t("How's {x} going?", "Did your {x} team win this week?"),
        answer=_t("{x} is going great, we won two games in a row.", "Not this time, but I still love {x}."),
        bullet=_t("{name} plays {x} regularly.", "{name}'s favorite sport is {x}.",
                  "{name} is passionate about {x}."),
    ),
    "hobby": Category(
        "preference",
        _t("knitting", "birdwatching", "pottery", "woodworking", "rock climbing", "gardening", "chess",
           "photography", "baking bread", "watercolor painting", "calligraphy", "origami", "scuba diving",
           "salsa dancing", "kayaking", "stargazing", "model trains", "crossword puzzles", "embroidery",
           "beekeeping", "skateboarding", "journaling", "geocaching", "surfing", "hiking", "fly fishing",
           "quilting", "yoga", "juggling"),
        intro=_t("My favorite hobby is {x}.", "I spend most weekends on {x}.",
                 "I got really into {x} a few years ago."),
        again=_t("I spent the whole weekend on {x} again.", "I joined a {x} group that meets on Thursdays.",
                 "I bought some new gear for {x}."),
        ask=_t("Still doing a lot of {x}?", "How's the {x} going?"),
        answer=_t("Yes, {x} keeps me sane.", "It's going well, {x} is still my favorite way to unwind."),
        bullet=_t("{name}'s hobby is {x}.", "{name} enjoys {x}.", "{name} spends free time on {x}."),
    ),
    "media": Category(
        "preference",
        _t("mystery novels", "science fiction", "fantasy novels", "poetry", "graphic novels", "biographies",
           "horror movies", "romantic comedies", "nature documentaries", "anime", "westerns",
           "true crime podcasts", "history books", "cooking competitions", "silent films"),
        intro=_t("I'm a huge fan of {x}.", "I go through {x} like crazy.", "My guilty pleasure is {x}."),
        again=_t("I binged a bunch of {x} this week.", "A friend recommended more {x} to me.",
                 "I joined a club for people who love {x}."),
        ask=_t("Found any good {x} lately?"),
        answer=_t("Tons, I'm still hooked on {x}.", "A few! {x} never gets old for me."),
        bullet=_t("{name} is a fan of {x}.", "{name} enjoys {x}."),
    ),
    "travel": Category(
        "plan",
        _t("Lisbon", "Kyoto", "Reykjavik", "Buenos Aires", "Marrakech", "Istanbul", "Prague", "Vancouver",
           "Cape Town", "Hanoi", "Edinburgh", "Havana", "Santorini", "Budapest", "Seoul", "Oslo", "Lima",
           "Dubrovnik", "Bali", "Patagonia", "Nairobi", "Vienna", "Copenhagen", "Montreal", "New Orleans",
           "Yellowstone", "Banff", "Machu Picchu", "Tasmania", "Mexico City", "Krakow", "Seville",
           "Florence", "Tokyo", "Singapore", "Bangkok", "Cairo", "Athens", "Amsterdam", "Dublin", "Sydney",
           "Zanzibar"),
        intro=_t("I'm saving up to visit {x} {when}.", "My big plan is a trip to {x} {when}.",
                 "I finally decided to travel to {x} {when}."),
        again=_t("I booked the flights to {x}!", "I've been reading guidebooks about {x} every night.",
                 "Still counting down the days until {x}."),
        ask=_t("Any news on the {x} trip?", "When are you leaving for {x} again?"),
        answer=_t("The {x} trip is still on, I just booked a hotel.", "Still {when}, I can't wait to see {x}."),
        bullet=_t("{name} plans to visit {x} {when}.", "{name} is saving up for a trip to {x}."),
        weight=1.5,
    ),
    "language": Category(
        "plan",
        _t("Japanese", "Portuguese", "Italian", "Mandarin", "Swahili", "Arabic", "Korean", "German",
           "sign language", "Greek", "Russian", "Turkish", "Dutch", "Hindi", "Polish", "Icelandic", "Welsh"),
        intro=_t("I've started learning {x} with an app.", "My goal this year is to get fluent in {x}.",
                 "I signed up for {x} classes."),
        again=_t("My {x} teacher says I'm improving fast.", "I managed a whole conversation in {x} yesterday!",
                 "I'm still practicing {x} every morning."),
        ask=_t("How's your {x} coming along?"),
        answer=_t("Slowly! But I'm still studying {x} every day.", "Better, my {x} is finally clicking."),
        bullet=_t("{name} is learning {x}.", "{name} wants to become fluent in {x}."),
    ),
    "instrument": Category(
        "plan",
        _t("cello", "saxophone", "banjo", "ukulele", "violin", "oboe", "harp", "accordion", "trumpet",
           "piano", "clarinet", "mandolin", "flute", "bagpipes", "harmonica"),
        intro=_t("I'm learning to play the {x}.", "I just started {x} lessons.",
                 "My plan for this year is to finally master the {x}."),
        again=_t("I can finally play a full song on the {x}.",
                 "My neighbors are probably tired of my {x} practice.",
                 "My {x} teacher wants me to play at a recital."),
        ask=_t("How are the {x} lessons going?"),
        answer=_t("Great, I practice the {x} every evening now.", "Slow but steady, the {x} is hard!"),
        bullet=_t("{name} is learning to play the {x}.", "{name} takes {x} lessons."),
    ),
    "goal": Category(
        "plan",
        _t("marathon", "bakery", "podcast", "food truck", "log cabin", "pilot license", "master's degree",
           "triathlon", "vegetable farm", "novel", "board game", "sailboat", "camper van", "bookshop",
           "black belt", "YouTube channel", "coffee shop", "tiny house"),
        intro=_t("My big goal is to {phrase}.", "I've decided to {phrase} next year.",
                 "I'm seriously planning to {phrase}."),
        again=_t("I made real progress on the {x} this month.", "Everyone keeps asking me about the {x}.",
                 "The {x} plan is still going strong."),
        ask=_t("How's the {x} plan going?"),
        answer=_t("It's coming along, I'm still determined to {phrase}.", "Good! The {x} is really happening."),
        bullet=_t("{name} plans to {phrase}.", "{name}'s goal is to {phrase}."),
    ),
    "relation": Category(
        "relation",
        tuple(PERSON_NAMES),
        intro=_t("My {rel} {x} works as {a_job}.", "I'm really close to my {rel} {x}, who is {a_job}.",
                 "My {rel} {x} just started a new job as {a_job}."),
        again=_t("I had dinner with my {rel} {x} on Sunday.", "{x}, my {rel}, is coming to stay with me next week.",
                 "My {rel} {x} called me yesterday with big news."),
        ask=_t("How is your {rel} {x} doing?", "Have you seen {x} lately?"),
        answer=_t("{x} is doing well, thanks for asking!", "My {rel} {x} is great, still busy being {a_job}."),
        bullet=_t("{name} has {a_rel} named {x} who is {a_job}.", "{name}'s {rel} {x} works as {a_job}.",
                  "{name} is close to their {rel} {x}."),
        weight=1.5,
    ),
    "pet": Category(
        "pet",
        tuple(PET_NAMES),
        intro=_t("I have {a_species} named {x}.", "My {species} {x} is basically my best friend.",
                 "We adopted {a_species} called {x} last year."),
        again=_t("{x} knocked a plant off the windowsill again.", "I took {x} to the vet, all good.",
                 "{x} has learned a new trick!"),
        ask=_t("How's {x} doing?", "Is {x} still causing trouble?"),
        answer=_t("{x} is great, still the boss of the house.", "Ha, {x} is as wild as ever."),
        bullet=_t("{name} has {a_species} named {x}.", "{name}'s pet {species} is called {x}."),
        weight=0.7,
    ),
    "job": Category(
        "job",
        tuple(PROFESSIONS),
        intro=_t("I've been working as {a_x} for about {years} years.", "I'm {a_x}, and I love what I do.",
                 "I work as {a_x}, it keeps me busy."),
        again=_t("Work has been hectic, being {a_x} is no joke this month.",
                 "I got a raise at my {x} job!", "Long week at work; that's life as {a_x}."),
        ask=_t("How are things at your {x} job?"),
        answer=_t("Busy as ever, but I still love being {a_x}.", "Good, the {x} job is going well."),
        bullet=_t("{name} works as {a_x}.", "{name} is {a_x} by profession."),
        weight=0.7,
    ),
}

# Goal phrases: the sentence a goal is stated with; its key entity words are the dict key.
GOAL_PHRASES: dict[str, str] = {
    "marathon": "run a marathon", "bakery": "open a bakery", "podcast": "start a podcast",
    "food truck": "open a food truck", "log cabin": "build a log cabin", "pilot license": "get a pilot license",
    "master's degree": "finish a master's degree", "triathlon": "finish a triathlon",
    "vegetable farm": "start a small vegetable farm", "novel": "write a novel",
    "board game": "design a board game", "sailboat": "buy a sailboat", "camper van": "convert a camper van",
    "bookshop": "open a bookshop", "black belt": "earn a black belt in karate",
    "YouTube channel": "start a YouTube channel", "coffee shop": "open a coffee shop",
    "tiny house": "build a tiny house",
}


@dataclass(frozen=True)
class OneoffCategory:
    """One kind of one-off remark: entity phrases and (said, bullet) template pairs using `{x}`."""

    phrases: tuple[str, ...]
    templates: tuple[tuple[str, str], ...]


ONEOFF: dict[str, OneoffCategory] = {
    "lunch": OneoffCategory(
        _t("a tuna sandwich", "some lentil soup", "a chicken wrap", "an egg salad", "leftover lasagna",
           "a grilled cheese", "a caesar salad", "a veggie burger", "some tomato soup", "a quinoa bowl",
           "a turkey club", "some minestrone", "a cobb salad", "a meatball sub", "pesto pasta", "a chili dog",
           "some miso soup", "spinach quiche", "a BLT", "a hummus plate", "a tuna melt", "a baked potato",
           "chicken tortilla soup", "beef stew", "a ham sandwich", "a kale salad", "mac and cheese",
           "split pea soup", "a pork bun", "a corn dog", "cup noodles", "a fruit salad", "tofu stir fry",
           "a cheese omelette", "avocado toast", "cold pizza", "a sloppy joe", "a shrimp salad", "onion rings",
           "gazpacho", "egg fried rice", "a banh mi", "a calzone", "a lobster roll", "stuffed peppers",
           "a chicken pot pie", "a bagel with lox", "a bowl of chili", "a reuben", "a veggie wrap"),
        (("I had {x} for lunch today, nothing special.", "{name} had {x} for lunch."),
         ("Lunch today was {x}, pretty decent actually.", "{name} ate {x} for lunch today."),
         ("I grabbed {x} from the cafe downstairs for lunch.", "{name} got {x} from a cafe for lunch."),
         ("I tried {x} at lunch and honestly loved it.", "{name} enjoyed {x} at lunch today.")),
    ),
    "weather": OneoffCategory(
        _t("a hailstorm", "a heat wave", "thick fog", "freezing drizzle", "a double rainbow", "a dust storm",
           "a thunderstorm", "black ice", "a cold snap", "gale force winds", "a blizzard", "sleet",
           "a flash flood warning", "a pollen storm", "smoke haze", "a snow squall", "a muggy night",
           "a sudden downpour", "a frost warning", "a sandstorm"),
        (("We had {x} here this morning.", "There was {x} where {name} lives this morning."),
         ("Ugh, {x} today, I barely left the house.", "{name} stayed in because of {x} today."),
         ("There was {x} this afternoon, so weird for this time of year.", "{name} mentioned {x} today.")),
    ),
    "commute": OneoffCategory(
        _t("a flat tire", "a stalled train", "a detour", "a broken traffic light", "a water main break",
           "a fender bender", "a missed bus", "a lane closure", "a sinkhole", "a jackknifed truck",
           "a cancelled ferry", "a snapped bike chain", "a signal failure", "a road rage incident",
           "a dead car battery", "a herd of goats on the road", "a bridge opening", "a lost wallet"),
        (("I was late to work because of {x}.", "{name} was late to work because of {x}."),
         ("My commute was a mess today, {x} of all things.", "{name}'s commute was disrupted by {x}."),
         ("Traffic was terrible this morning thanks to {x}.", "{name} was delayed by {x} today.")),
    ),
    "sighting": OneoffCategory(
        _t("a heron", "a fox", "a hot air balloon", "a street magician", "a raccoon", "a vintage convertible",
           "a marching band", "a peacock", "a film crew", "a giant inflatable duck", "a runaway shopping cart",
           "a deer", "an owl", "a wedding party", "a flock of geese", "a celebrity lookalike", "a mime",
           "a sand sculpture", "a lost tortoise", "a police horse", "a double-decker bus", "a unicyclist",
           "a skunk", "a fire truck", "a drum circle", "an ice cream truck"),
        (("I saw {x} on my walk this morning.", "{name} saw {x} on a walk."),
         ("Funny thing, there was {x} outside my building today.", "{name} saw {x} outside their building."),
         ("You won't believe it, I spotted {x} in the park.", "{name} spotted {x} in the park today.")),
    ),
    "chore": OneoffCategory(
        _t("the leaky faucet", "the dishwasher", "the garage door", "the squeaky hinge", "the smoke detector",
           "the lawn mower", "the gutters", "the ceiling fan", "the fridge filter", "the curtain rod",
           "the window screen", "the doorbell", "the shower drain", "the toaster", "the wobbly table",
           "the clogged sink", "the porch light", "the washing machine"),
        (("I need to fix {x} later today.", "{name} needs to fix {x} later today."),
         ("Tonight I'm finally dealing with {x}.", "{name} plans to deal with {x} tonight."),
         ("I spent the morning repairing {x}.", "{name} repaired {x} this morning.")),
    ),
    "purchase": OneoffCategory(
        _t("a new umbrella", "a pair of wool socks", "a desk lamp", "a phone charger", "a bag of oranges",
           "a birthday card", "a scented candle", "a lottery ticket", "a jigsaw puzzle", "a travel mug",
           "a stapler", "a doormat", "a spare key", "a bird feeder", "a pack of batteries", "a fern",
           "a shower curtain", "a rain jacket"),
        (("I picked up {x} at the store on the way home.", "{name} bought {x} on the way home."),
         ("I impulse-bought {x} today.", "{name} impulse-bought {x} today."),
         ("I have to remember to buy {x} tonight.", "{name} needs to buy {x} tonight.")),
    ),
    "mishap": OneoffCategory(
        _t("a parking ticket", "a surprise fire drill", "a jury summons", "a flu shot", "a haircut",
           "a sunburn", "a splinter", "a paper cut", "a bee sting", "a surprise refund", "a discount coupon",
           "a compliment from a stranger", "a noise complaint", "a speeding warning", "the hiccups",
           "a wrong number call", "a free dessert", "a cracked phone screen"),
        (("Today I got {x}, of all things.", "{name} got {x} today."),
         ("So this morning I got {x}, what a start to the day.", "{name} got {x} this morning.")),
    ),
}

GREETINGS = _t("Hi {other}! How have you been?", "Hey {other}, good to hear from you.",
               "Hello {other}! It's been a while.", "Hi {other}, how's everything?",
               "Hey {other}! What's new with you?")
REPLY_GREETINGS = _t("Hi {other}! I'm doing well.", "Hey {other}, all good here.", "Hello {other}! Great to chat.",
                     "Hi! Doing fine, thanks {other}.")
ACKS = _t("Oh nice!", "Ha, I see.", "Oh really?", "That's interesting.", "Wow.", "Good to know.", "Oh, cool.",
          "Sounds fun.", "Oh no, really?", "I hear you.", "Makes sense.", "Ha, classic.")
PROMPTS = _t("What about you?", "Anything new on your end?", "How about you?", "Tell me more about your week.",
             "What else is going on?")
TRANSITIONS = _t("Oh, and guess what.", "Anyway.", "Other news!", "So, news from my side.", "Oh, one more thing.")
CLOSINGS = _t("Anyway, I should get going. Talk soon!", "I have to run, but this was fun.",
              "Let's catch up again soon!", "Okay, I need to head out. Bye for now!")
BYES = _t("Bye {other}, take care!", "Talk to you soon, {other}!", "See you, {other}!", "Take care, {other}!")

_ARTICLE_RE = re.compile(r"^(a|an|some|the)\s+", re.IGNORECASE)


def oneoff_key(phrase: str) -> str:
    """The key entity words of a one-off phrase: the phrase without a leading article."""
    return _ARTICLE_RE.sub("", phrase)


def _a(word: str) -> str:
    return ("an " if word[0].lower() in "aeiou" else "a ") + word


def _cap(text: str) -> str:
    return text[0].upper() + text[1:] if text and text[0].islower() else text


_ONEOFF_ITEMS: list[tuple[str, str, tuple[tuple[str, str], ...]]] = [
    (name, phrase, cat.templates) for name, cat in ONEOFF.items() for phrase in cat.phrases
]
_DURABLE_NAMES = list(DURABLE)
_DURABLE_WEIGHTS = [DURABLE[n].weight for n in _DURABLE_NAMES]

# ---------------------------------------------------------------- config and records


@dataclass(frozen=True)
class SynthConfig:
    """What to generate; `seed` fixes every random choice."""

    conversations: int
    sessions: int = 4
    seed: int = 0
    facts_per_speaker: int = 6
    oneoffs_per_session: int = 2
    mention_prob: float = 0.35
    stray_prob: float = 0.0

    def validate(self) -> "SynthConfig":
        """Raise `ValueError` naming the option when the config cannot be generated."""
        if self.conversations < 1:
            raise ValueError(f"conversations must be >= 1, got {self.conversations}")
        if self.sessions < 2:
            raise ValueError(f"sessions must be >= 2 (a fact can only recur in a later session), got {self.sessions}")
        if not 1 <= self.facts_per_speaker <= 20:
            raise ValueError(f"facts_per_speaker must be in 1..20, got {self.facts_per_speaker}")
        if self.oneoffs_per_session < 0:
            raise ValueError(f"oneoffs_per_session must be >= 0, got {self.oneoffs_per_session}")
        if not 0.0 <= self.mention_prob <= 1.0:
            raise ValueError(f"mention_prob must be in [0, 1], got {self.mention_prob}")
        if not 0.0 <= self.stray_prob <= 1.0:
            raise ValueError(f"stray_prob must be in [0, 1], got {self.stray_prob}")
        most = 2 * self.sessions * (self.oneoffs_per_session + 1)
        if most > len(_ONEOFF_ITEMS):
            raise ValueError(
                f"sessions={self.sessions} x oneoffs_per_session={self.oneoffs_per_session} may need {most} distinct "
                f"one-off remarks per conversation, but the vocabulary has {len(_ONEOFF_ITEMS)} "
                "(one-offs must never repeat); lower --sessions or --oneoffs"
            )
        return self


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


# ---------------------------------------------------------------- generation


def conversation_id(index: int) -> str:
    """Id of the synthetic conversation number `index` (0-based), e.g. `synth-000042`."""
    return f"synth-{index:06d}"


def _persona(rng: random.Random, owner: int, name: str, n: int, used: set[str]) -> list[_Fact]:
    """Draw `n` durable facts for one speaker, with key entities unused in this conversation."""
    facts: list[_Fact] = []
    has_job = False
    while len(facts) < n:
        cat_name = rng.choices(_DURABLE_NAMES, _DURABLE_WEIGHTS)[0]
        if cat_name == "job" and has_job:
            continue
        cat = DURABLE[cat_name]
        rel = rng.choice(RELATIONS) if cat_name == "relation" else ""
        key = rng.choice(_NAMES_FOR[rel] if rel else cat.keys)
        if key in used:
            continue
        slots = {"x": key, "name": name}
        if cat_name == "relation":
            job = rng.choice(PROFESSIONS)
            if job in used:
                continue
            used.add(job)
            slots.update(rel=rel, a_rel=_a(rel), a_job=_a(job))
        elif cat_name == "pet":
            species = rng.choice(SPECIES)
            slots.update(species=species, a_species=_a(species))
        elif cat_name == "job":
            has_job = True
            slots.update(a_x=_a(key), years=rng.choice(YEARS))
        elif cat_name == "travel":
            slots["when"] = rng.choice(WHEN)
        elif cat_name == "goal":
            slots["phrase"] = GOAL_PHRASES[key]
        used.add(key)
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
            parts.append(_cap(item[2]))
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
            text = _cap(item[1])
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
    cid: str, index: int, nb: int, names: list[str], item: tuple, evidence: list[str], recurs_of: dict[int, bool]
) -> SynthBullet:
    _mode, _said, _answer, owner, kind, key, btext, ref = item
    return SynthBullet(bullet_id(cid, index, nb), index, names[owner], btext, evidence, recurs_of[ref], kind, key)


def synth_conversation(index: int, config: SynthConfig) -> SynthConversation:
    """Generate conversation number `index` alone; depends only on (config, index)."""
    rng = random.Random(f"memprune-synth/{config.seed}/{index}")
    cid = conversation_id(index)
    names = rng.sample(SPEAKER_NAMES, 2)
    n_sessions = config.sessions
    used: set[str] = set()
    facts = _persona(rng, 0, names[0], config.facts_per_speaker, used) + _persona(
        rng, 1, names[1], config.facts_per_speaker, used
    )
    for fact in facts:
        _schedule(rng, fact, n_sessions, config.mention_prob, config.stray_prob)

    m = config.oneoffs_per_session
    n_oneoffs = [[rng.randint(max(0, m - 1), m + 1) for _ in range(2)] for _ in range(n_sessions)]
    pool = rng.sample(range(len(_ONEOFF_ITEMS)), sum(a + b for a, b in n_oneoffs))

    day = _dt.date(2023, 1, 1).toordinal() + rng.randrange(365)
    sessions: list[SynthSession] = []
    bullets: list[SynthBullet] = []
    ref = 0
    for s in range(n_sessions):
        said: list[list[tuple]] = [[], []]
        recurs_of: dict[int, bool] = {}
        # item: (mode, said text, answer text, owner, kind, key, bullet text, ref); mode "ask" goes to the partner
        for fact in facts:
            if s not in fact.mentions:
                continue
            cat = DURABLE[fact.category]
            slots = fact.slots
            btext = _cap(rng.choice(cat.bullet).format(**slots))
            recurs_of[ref] = fact.mentions[-1] > s
            if s == fact.mentions[0]:
                said[fact.owner].append(("say", rng.choice(cat.intro).format(**slots), "", fact.owner, fact.kind,
                                         fact.key, btext, ref))
            elif rng.random() < 0.35:
                said[1 - fact.owner].append(("ask", rng.choice(cat.ask).format(**slots),
                                             rng.choice(cat.answer).format(**slots), fact.owner, fact.kind,
                                             fact.key, btext, ref))
            else:
                said[fact.owner].append(("say", rng.choice(cat.again).format(**slots), "", fact.owner, fact.kind,
                                         fact.key, btext, ref))
            ref += 1
        for owner in (0, 1):
            for _ in range(n_oneoffs[s][owner]):
                _cat, phrase, templates = _ONEOFF_ITEMS[pool.pop()]
                say, btemplate = rng.choice(templates)
                recurs_of[ref] = False
                said[owner].append(("say", say.format(x=phrase), "", owner, "oneoff", oneoff_key(phrase),
                                    _cap(btemplate.format(x=phrase, name=names[owner])), ref))
                ref += 1
        for queue in said:
            rng.shuffle(queue)
        session = SynthSession(s, _dt.date.fromordinal(day).isoformat())
        session.turns = _session(rng, cid, s, names, said, bullets, recurs_of)
        sessions.append(session)
        day += rng.randint(2, 30)
    return SynthConversation(cid, list(names), sessions, bullets)


# ---------------------------------------------------------------- writing


def _offsets(lengths: list[int]) -> pa.Array:
    out = [0] * (len(lengths) + 1)
    total = 0
    for i, n in enumerate(lengths, 1):
        total += n
        out[i] = total
    return pa.array(out, type=pa.int32())


class _SessionBatch:
    """Column lists for a batch of `sessions` rows (turns flattened with offsets)."""

    def __init__(self) -> None:
        self.cid: list[str] = []
        self.index: list[int] = []
        self.speakers: list[str] = []
        self.time: list[str] = []
        self.n_turns: list[int] = []
        self.turn_id: list[str] = []
        self.turn_speaker: list[str] = []
        self.turn_text: list[str] = []

    def add(self, conv: SynthConversation) -> int:
        """Add every session of `conv`; return the number of turns added."""
        added = 0
        for sess in conv.sessions:
            self.cid.append(conv.conversation_id)
            self.index.append(sess.session_index)
            self.speakers += conv.speakers
            self.time.append(sess.time)
            self.n_turns.append(len(sess.turns))
            for a, b, c in sess.turns:
                self.turn_id.append(a)
                self.turn_speaker.append(b)
                self.turn_text.append(c)
            added += len(sess.turns)
        return added

    def __len__(self) -> int:
        return len(self.cid)

    def table(self) -> pa.Table:
        turns = pa.StructArray.from_arrays(
            [pa.array(self.turn_id, pa.string()), pa.array(self.turn_speaker, pa.string()),
             pa.array(self.turn_text, pa.string())],
            fields=list(SESSIONS.field("turns").type.value_type),
        )
        arrays = [
            pa.array(self.cid, pa.string()),
            pa.array(self.index, pa.int32()),
            pa.ListArray.from_arrays(_offsets([2] * len(self.cid)), pa.array(self.speakers, pa.string()),
                                     type=SESSIONS.field("speakers").type),
            pa.ListArray.from_arrays(_offsets(self.n_turns), turns, type=SESSIONS.field("turns").type),
            pa.array(self.time, pa.string()),
        ]
        return pa.Table.from_arrays(arrays, schema=SESSIONS)


class _BulletBatch:
    """Column lists for a batch of synthetic `bullets` rows (evidence flattened with offsets)."""

    def __init__(self) -> None:
        self.cols: dict[str, list[Any]] = {n: [] for n in SYNTH_BULLETS.names}
        self.n_evidence: list[int] = []
        self.evidence: list[str] = []

    def add(self, conv: SynthConversation) -> None:
        c = self.cols
        for b in conv.bullets:
            c["bullet_id"].append(b.bullet_id)
            c["conversation_id"].append(conv.conversation_id)
            c["session_index"].append(b.session_index)
            c["speaker"].append(b.speaker)
            c["text"].append(b.text)
            c["recurs"].append(b.recurs)
            c["kind"].append(b.kind)
            self.n_evidence.append(len(b.evidence))
            self.evidence += b.evidence

    def __len__(self) -> int:
        return len(self.n_evidence)

    def table(self) -> pa.Table:
        arrays = []
        for f in SYNTH_BULLETS:
            if f.name == "evidence":
                arrays.append(pa.ListArray.from_arrays(_offsets(self.n_evidence), pa.array(self.evidence, pa.string()),
                                                       type=f.type))
            else:
                arrays.append(pa.array(self.cols[f.name], f.type))
        return pa.Table.from_arrays(arrays, schema=SYNTH_BULLETS)


def generate(
    conversations: int,
    sessions: int,
    out: str | Path,
    seed: int = 0,
    *,
    facts_per_speaker: int = 6,
    oneoffs_per_session: int = 2,
    mention_prob: float = 0.35,
    stray_prob: float = 0.0,
    batch_rows: int = 50_000,
    progress: bool = False,
) -> dict[str, Any]:
    """Stream a synthetic corpus to OUT/sessions.parquet, OUT/bullets.parquet and OUT/synth.json.

    Conversations are generated one at a time and flushed as a row group every
    `batch_rows` bullets (every `batch_rows // 10` sessions, which hold all their turns),
    so memory stays bounded whatever the size. Files appear atomically when complete.
    Returns the summary written to synth.json.
    """
    config = SynthConfig(
        conversations, sessions, seed, facts_per_speaker, oneoffs_per_session, mention_prob, stray_prob
    )
    config.validate()
    if batch_rows < 10:
        raise ValueError(f"batch_rows must be >= 10, got {batch_rows}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    counts: dict[str, Any] = {"conversations": 0, "sessions": 0, "turns": 0, "bullets": 0, "recurs": 0}
    by_kind: dict[str, int] = {}
    iterator: Any = range(conversations)
    if progress:
        from tqdm import tqdm

        iterator = tqdm(iterator, desc="synth", unit="conv")
    session_rows = batch_rows // 10
    with TableSink(out / "sessions.parquet", SESSIONS) as s_sink, TableSink(
        out / "bullets.parquet", SYNTH_BULLETS
    ) as b_sink:
        s_batch, b_batch = _SessionBatch(), _BulletBatch()
        for i in iterator:
            conv = synth_conversation(i, config)
            counts["turns"] += s_batch.add(conv)
            b_batch.add(conv)
            for b in conv.bullets:
                counts["recurs"] += b.recurs
                by_kind[b.kind] = by_kind.get(b.kind, 0) + 1
            counts["conversations"] += 1
            counts["sessions"] += len(conv.sessions)
            counts["bullets"] += len(conv.bullets)
            if len(s_batch) >= session_rows:
                s_sink.write_table(s_batch.table())
                s_batch = _SessionBatch()
            if len(b_batch) >= batch_rows:
                b_sink.write_table(b_batch.table())
                b_batch = _BulletBatch()
        if len(s_batch):
            s_sink.write_table(s_batch.table())
        if len(b_batch):
            b_sink.write_table(b_batch.table())
    counts["bullets_by_kind"] = dict(sorted(by_kind.items()))
    summary = {
        "generator": f"memprune.synth v{GENERATOR_VERSION}",
        "seed": seed,
        "config": asdict(config),
        "counts": counts,
        "files": {"sessions": "sessions.parquet", "bullets": "bullets.parquet"},
        "recurs_definition": (
            "true iff the bullet's fact is stated again by the same speaker, with the same key entity words, "
            "in a later session of the same conversation; always false in the final session, for one-offs "
            "and for stray facts"
        ),
    }
    write_json(out / "synth.json", summary)
    return summary
