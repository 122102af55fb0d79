"""The scorer's stages as facts (no torch): the one place that names vanilla, stage 1 and stage 2.

A `StageFacts` says what a stage is: its directory name (`RUN/<name>/seed<k>/`, the optimiser section of
`TrainSettings`), its report label, the earlier stage of the same seed it starts from (`init_from`), whether it
is the untrained baseline every trained stage is compared with, and whether it trains the encoder (LoRA).
`STAGES` holds them in method order (`register` adds one). It sits on the floor, so every package asks it (evaluate/ below train/ too);
`memprune.train.stages.STAGE_SPECS` adds the torch side (model classes, input columns, optimiser sections).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class StageFacts:
    """What one stage is, apart from how it trains."""

    name: str
    label: str  # its name in reports ("Stage 1")
    init_from: str | None = None  # the stage whose artifact of the same seed it starts from
    baseline: bool = False  # the untrained reference every trained stage is compared with
    trains_encoder: bool = False  # LoRA adapters on the encoder (its ScorerConfig carries the LoRA settings)

    @property
    def trained(self) -> bool:
        return not self.baseline


VANILLA = StageFacts("vanilla", "Vanilla", baseline=True)
STAGE1 = StageFacts("stage1", "Stage 1")
STAGE2 = StageFacts("stage2", "Stage 2", init_from=STAGE1.name, trains_encoder=True)

STAGES: tuple[StageFacts, ...] = (VANILLA, STAGE1, STAGE2)  # method order
BY_NAME: dict[str, StageFacts] = {s.name: s for s in STAGES}


def register(facts: StageFacts) -> StageFacts:
    """Add a stage after the registered ones (method order is registration order). It starts from a registered stage
    (`init_from`) or from scratch, and is trained: there is one baseline. `memprune.train.stages.register_spec` calls
    this with its spec's facts."""
    global STAGES
    if facts.name in BY_NAME:
        if BY_NAME[facts.name] is facts:
            return facts
        raise ValueError(f"stage {facts.name!r} registered twice")
    if facts.baseline:
        raise ValueError(f"stage {facts.name!r}: there is one baseline ({baseline().name})")
    if facts.init_from is not None:
        get(facts.init_from)
    BY_NAME[facts.name] = facts
    STAGES = tuple(BY_NAME.values())
    return facts


def stage_names() -> tuple[str, ...]:
    """Every stage name in method order."""
    return tuple(BY_NAME)


def get(name: str) -> StageFacts:
    """The facts of stage `name`; an unknown one names the registered ones."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown stage {name!r}; known: {', '.join(BY_NAME)}") from None


def check(names: Iterable[str], trained_only: bool = False) -> list[str]:
    """`names` validated against the registry (in the order given); `trained_only`: no baseline among them."""
    out = []
    for n in names:
        s = get(n)
        if trained_only and not s.trained:
            raise ValueError(f"{n!r} is not a trained stage; trained: {', '.join(t.name for t in trained_chain())}")
        out.append(s.name)
    return out


def in_order(names: Iterable[str]) -> list[str]:
    """The registered stages among `names`, once each, in method order."""
    wanted = set(names)
    return [n for n in BY_NAME if n in wanted]


def baseline() -> StageFacts:
    """The untrained reference stage (vanilla)."""
    return next(s for s in STAGES if s.baseline)


def label(name: str) -> str:
    """The report label of a stage name ("Stage 1"); an unregistered name is its own label."""
    s = BY_NAME.get(name)
    return s.label if s else name


def sort_key(name: str) -> tuple[int, str]:
    """Registered stages first, in method order; any other name after them, alphabetically."""
    names = stage_names()
    return (names.index(name), "") if name in names else (len(names), name)


def trains_encoder(name: str | None) -> bool:
    """Whether stage `name` trains the encoder (False for None or an unregistered name)."""
    s = BY_NAME.get(name) if name is not None else None
    return bool(s and s.trains_encoder)


def trained_chain() -> list[StageFacts]:
    """The trained stages in start order: the one that starts from scratch, then each that starts from the one
    before (`init_from`): stage 1, stage 2."""
    chain = [s for s in STAGES if s.trained and s.init_from is None]
    while True:
        nxt = [s for s in STAGES if s.init_from == chain[-1].name]
        if not nxt:
            return chain
        chain.append(nxt[0])


def starts() -> tuple[tuple[str, str], ...]:
    """(stage, the stage it starts from) for every stage with an `init_from`: the stage-vs-start comparisons."""
    return tuple((s.name, s.init_from) for s in STAGES if s.init_from is not None)


def verdict_pair() -> tuple[str, str]:
    """(the last trained stage, the stage it starts from): what the "is it worth it" verdict weighs."""
    last = trained_chain()[-1]
    if last.init_from is None:
        raise ValueError(f"{last.name} starts from no other stage: no verdict to compute")
    return last.name, last.init_from
