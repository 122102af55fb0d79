"""The synthetic corpus's vocabulary: speakers, persona facts (durable categories with their templates),
one-off remarks, and the small talk around them.

Every durable fact has key entity words that the generator uses to decide recurrence; one-off
remarks' key entities never repeat inside a conversation. `memprune.synth.generator` draws from here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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
NAMES_FOR = {
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


def with_article(word: str) -> str:
    return ("an " if word[0].lower() in "aeiou" else "a ") + word


def capitalize(text: str) -> str:
    return text[0].upper() + text[1:] if text and text[0].islower() else text


ONEOFF_ITEMS: list[tuple[str, str, tuple[tuple[str, str], ...]]] = [
    (name, phrase, cat.templates) for name, cat in ONEOFF.items() for phrase in cat.phrases
]
DURABLE_NAMES = list(DURABLE)
DURABLE_WEIGHTS = [DURABLE[n].weight for n in DURABLE_NAMES]
