"""Scorers shipped inside the package (issue 54): pruning works out of the box, with no scorer of one's own.

Each shipped scorer is an ordinary artifact directory beside this module (`scorer.json`, `head.safetensors`,
`calibration.json`) plus its `card.json`: name, version, encoder, the labels and data it was trained on and its
headline figures. Adding one is one directory and one entry in `SHIPPED`.

Wherever a scorer is named (`--scorer`, `scorer:` in a config, `MemoryPruner(...)`), a registered name stands for
its directory; nothing given means `DEFAULT_SCORER`. A path (anything else, or `./default` for a local directory of
that name) is used as it is. The encoder of every shipped scorer is the installed MiniLM, so everything loads offline.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, Field

from memprune.errors import MemPruneError

DEFAULT_SCORER = "default"
HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Shipped:
    """A scorer artifact inside the package."""

    name: str
    directory: Path

    def card(self) -> dict[str, Any]:
        """The artifact's card.json (name, version, encoder, labels, data, figures)."""
        card = read_card(self.directory)
        if card is None:
            raise MemPruneError(f"{self.directory}: the shipped scorer {self.name!r} has no card.json")
        return card


SHIPPED: dict[str, Shipped] = {s.name: s for s in [Shipped("default", HERE / "default")]}


def resolve_scorer(ref: str | None) -> str:
    """The artifact a scorer reference names: a shipped scorer's directory for its name (or for nothing: the
    default), else the reference itself (a directory or a URI)."""
    ref = DEFAULT_SCORER if ref is None or not str(ref).strip() else str(ref)
    return str(SHIPPED[ref].directory) if ref in SHIPPED else ref


def read_card(path: str | Path) -> dict[str, Any] | None:
    """The card of an artifact directory when it has one (shipped scorers do; `memprune scorers build` writes one)."""
    card = Path(path) / "card.json"
    if not card.is_file():
        return None
    try:
        return json.loads(card.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise MemPruneError(f"{card}: not a readable scorer card: {exc}") from exc


def card_identity(local: str | Path) -> dict[str, Any]:
    """The name and version an artifact's card gives it (a shipped or built scorer); nulls for a trained run's."""
    card = read_card(local) or {}
    return {"name": card.get("name"), "version": card.get("version")}


def declared_threshold(ref: str | Path) -> float | None:
    """The rule threshold a local artifact's scorer.json declares (`ScorerConfig.threshold`, 0.5 when absent: the
    paper's); for a URI the paper's 0.5 too (a config is validated without fetching anything). The artifact itself is
    checked where it is loaded (`memprune.scorer.check_scorer`)."""
    path = Path(ref) / "scorer.json"
    if not path.is_file():
        return 0.5
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("threshold", 0.5)
    except (OSError, ValueError, AttributeError) as exc:
        raise MemPruneError(f"{path}: not a readable scorer config: {exc}") from exc
    if value is not None and not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
        raise MemPruneError(f"{path}: threshold {value!r}: expected null or a number in [0, 1]")
    return value


ScorerRef = Annotated[str, BeforeValidator(resolve_scorer)]


def scorer_field() -> Any:
    """The `scorer` field of a config: a shipped scorer's name or an artifact directory/URI, `default` when unset."""
    return Field(DEFAULT_SCORER, validate_default=True,
                 description=f"scorer: a shipped one by name ({', '.join(SHIPPED)}) or an artifact directory or URI "
                             "(scorer.json + head.safetensors)")
