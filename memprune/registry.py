"""One registry type for the families of variants (policies, update judges, judges, LLM tasks and engines): a dict
by name that refuses a second, different entry under a taken name and names the known ones when asked for an
unknown name."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


class Registry(dict[str, T]):
    """`POLICIES = Registry("policy")`; `POLICIES.add(name, entry)`; `POLICIES.known(name)`."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def add(self, name: str, item: T) -> T:
        """Register `item` as `name` (the same item again is a no-op; another one is a ValueError)."""
        if name in self and self[name] is not item:
            raise ValueError(f"{self.what} {name!r} registered twice")
        self[name] = item
        return item

    def known(self, name: str) -> T:
        """The entry `name`; a ValueError naming the known ones otherwise."""
        if name not in self:
            raise ValueError(f"unknown {self.what} {name!r} (known: {', '.join(self)})")
        return self[name]
