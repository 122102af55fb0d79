"""The label step's own error (a module of its own, so that config, judges and sources all raise it)."""

from __future__ import annotations

from memprune.errors import MemPruneError


class LabelError(MemPruneError):
    """The labeling stage cannot run with these inputs or settings (the message says why)."""
