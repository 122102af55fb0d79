"""Deterministic train/valid/test split by conversation, and k folds of conversations.

A conversation is never in two splits, so nothing the scorer learns about one
speaker's sessions leaks into the sessions it is judged on. The assignment depends
only on the set of conversation ids and the seed, not on the input order: ids are
ordered by a seeded SHA-256 and cut into test, valid and train.

Sizes are fractions (floats, of the number of conversations) or counts (ints);
`train: null` (the default) takes every conversation left after valid and test.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from pydantic import model_validator

from memprune.config import ConfigModel
from memprune.errors import MemPruneError

SPLITS = ("train", "valid", "test")
UNUSED = "unused"


class SplitError(MemPruneError):
    """The split sizes cannot be met by the corpus."""


class SplitConfig(ConfigModel):
    """Split sizes (fraction if float, count if int; `train: null` = the rest) and the split seed."""

    train: float | int | None = None
    valid: float | int = 0.1
    test: float | int = 0.1
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> "SplitConfig":
        for name in SPLITS:
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, float) and not 0.0 <= value <= 1.0:
                raise ValueError(f"split.{name}: fraction {value} outside [0, 1]")
            if isinstance(value, int) and value < 0:
                raise ValueError(f"split.{name}: count {value} is negative")
        return self


def _count(value: float | int, n: int) -> int:
    return int(round(value * n)) if isinstance(value, float) else int(value)


def split_counts(n: int, config: SplitConfig) -> dict[str, int]:
    """How many of `n` conversations go to train, valid and test (and how many stay unused)."""
    n_valid, n_test = _count(config.valid, n), _count(config.test, n)
    if isinstance(config.valid, float) and config.valid > 0 and n_valid == 0 and n >= 3:
        n_valid = 1
    if isinstance(config.test, float) and config.test > 0 and n_test == 0 and n >= 3:
        n_test = 1
    rest = n - n_valid - n_test
    n_train = max(0, rest) if config.train is None else _count(config.train, n)
    if n_train + n_valid + n_test > n:
        raise SplitError(
            f"split sizes need {n_train} train + {n_valid} valid + {n_test} test conversations, the corpus has {n}"
        )
    if n_train < 1 or n_valid < 1:
        raise SplitError(
            f"split sizes leave {n_train} train and {n_valid} valid conversations of {n}; both need at least 1"
        )
    return {"train": n_train, "valid": n_valid, "test": n_test, UNUSED: n - n_train - n_valid - n_test}


def _order_key(seed: int, conversation_id: str) -> str:
    return hashlib.sha256(f"{seed}\x00{conversation_id}".encode("utf-8")).hexdigest()


def split_conversations(conversation_ids: Iterable[str], config: SplitConfig) -> dict[str, str]:
    """Map each distinct conversation id to 'train', 'valid', 'test' (or 'unused'), deterministically."""
    ids = sorted(set(conversation_ids))
    counts = split_counts(len(ids), config)
    ordered = sorted(ids, key=lambda c: (_order_key(config.seed, c), c))
    out: dict[str, str] = {}
    start = 0
    for name in ("test", "valid", "train", UNUSED):
        for cid in ordered[start : start + counts[name]]:
            out[cid] = name
        start += counts[name]
    return out


FOLD_MANIFEST = "fold.json"


def fold_assignment(conversation_ids: Iterable[str], k: int, seed: int) -> dict[str, int]:
    """Conversation -> fold in 0..k-1: ids ordered by a seeded SHA-256 and dealt round-robin (sizes differ by <= 1).

    Depends only on the set of ids, `k` and `seed`, not on the input order.
    """
    ids = sorted(set(conversation_ids))
    if len(ids) < k:
        raise SplitError(f"folds={k} needs at least {k} labelled conversations; the labels cover {len(ids)}")
    ordered = sorted(ids, key=lambda c: (hashlib.sha256(f"fold\x00{seed}\x00{c}".encode("utf-8")).hexdigest(), c))
    return {c: i % k for i, c in enumerate(ordered)}


def fold_split(fold_of: dict[str, int], fold: int, split: SplitConfig) -> dict[str, str]:
    """The splits of one fold: its conversations are the test split, the other folds' conversations are cut
    into train and valid by `split_conversations` (`split.valid`, `split.seed`; `split.test` is not used)."""
    rest = [c for c, f in fold_of.items() if f != fold]
    out = dict(split_conversations(rest, SplitConfig(train=None, valid=split.valid, test=0, seed=split.seed)))
    out.update({c: "test" for c, f in fold_of.items() if f == fold})
    return out

