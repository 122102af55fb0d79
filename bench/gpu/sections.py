"""The registry of the GPU check, the one place that maps a name to its code: the sections, in the order they
run and report, and every child kind (the sections and their helpers)."""
from __future__ import annotations

from typing import Any

from . import judge, prune, tests, train
from .shared import Child, Section

SECTIONS: dict[str, Section[Any]] = {s.name: s for s in (
    Section("judge", judge.JudgeSizes, judge.run, judge.__doc__ or "", judge.headline, judge.markdown,
            judge.unavailable, judge.GOALS),
    Section("prune", prune.PruneSizes, prune.run, prune.__doc__ or "", prune.headline, prune.markdown,
            goals=prune.GOALS),
    Section("train", train.TrainSizes, train.run, train.__doc__ or "", train.headline, train.markdown,
            helpers=(train.SEED,)),
    Section("tests", tests.TestsSizes, tests.run, tests.__doc__ or "", tests.headline, tests.markdown),
)}
CHILDREN: dict[str, Child[Any]] = {c.name: c for s in SECTIONS.values() for c in (s, *s.helpers)}
