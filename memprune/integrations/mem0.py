"""Keep a Mem0 store within budget as it grows: `PrunedMemory` wraps a Mem0 `Memory`.

    memory = PrunedMemory.from_config("mem0.yaml", MemoryPruner("runs/train/stage2/seed0", top_k=20,
                                                                 threshold=None), archive_dir="mem0-archive")
    memory.add([{"role": "user", "content": "..."}], user_id="alice")   # then alice is pruned to 20
    memory.review("alice", "review-alice")   # what pruning alice does, on a page (review-alice/review.html); changes nothing
    memory.restore()                                                     # every archived memory back

After each `add` for a user (or agent/run: `group`), that user's memories are decided by the pruner: an
in-process `MemoryPruner` (any policy: cap, token budget, fraction) or a `ServiceClient` (`memprune serve`'s
`/v1/decide`); the dropped ones are archived whole (`memprune.archive`: one archive per prune under
`archive_dir`, restorable with `memprune restore`) and then deleted (`memprune.stores.group`). Everything else
is the wrapped `Memory`'s (`search`, `get_all`, ...).
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

from memprune.archive import read_archive
from memprune.stores.base import restore_to
from memprune.stores.group import TablePruner, apply_group, decide_group, review_group
from memprune.stores.mem0_store import Mem0Store, open_memory


class PrunedMemory:
    """A Mem0 `Memory` whose every `add` is followed by pruning that group's memories (archived, restorable).

    `config` is the Mem0 config file the memory was opened from: the archives name it, so `memprune restore
    ARCHIVE` finds the store from a fresh interpreter. `time` and `pin` are the metadata keys of a memory's time
    and pin (as `memprune prune --map time=KEY,pin=KEY`): a memory whose `pin` is true is never dropped.
    """

    def __init__(self, memory: Any, config: str | Path, pruner: TablePruner, archive_dir: str | Path,
                 group: str = "user_id", time: str = "created_at", pin: str | None = None) -> None:
        self.memory = memory
        self.pruner = pruner
        self.archive_dir = Path(archive_dir)
        self.store = Mem0Store(str(config), {"group": group, "time": time, **({"pin": pin} if pin else {})},
                               memory=memory)
        self.group = group
        self.pruned: list[dict[str, Any]] = []  # what each prune did: group, kept, deleted, archive

    @classmethod
    def from_config(cls, config: str | Path, pruner: TablePruner, archive_dir: str | Path,
                    group: str = "user_id", time: str = "created_at", pin: str | None = None) -> "PrunedMemory":
        """Open the Mem0 store of `config` (as `memprune prune --input mem0:CONFIG` does) and wrap it."""
        return cls(open_memory(str(config)), config, pruner, archive_dir, group, time, pin)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.memory, name)

    def add(self, messages: Any, **kwargs: Any) -> Any:
        """`Memory.add`, then `prune` of the group the add was for."""
        result = self.memory.add(messages, **kwargs)
        group = kwargs.get(self.group)
        if group is not None:
            self.prune(str(group))
        return result

    def prune(self, group: str) -> dict[str, Any]:
        """Decide `group`'s memories; archive and delete the dropped ones. Returns group, kept, deleted, archive and
        skipped (dropped memories changed or removed by someone else meanwhile: left alone)."""
        decided = decide_group(self.store, group, self.pruner)
        target = self.archive_dir / f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:8]}"
        done = apply_group(self.store, decided, target)
        kept = sum(decided.column("keep").to_pylist()) if decided.num_rows else 0
        record = {"group": group, "kept": kept, **done}
        if done["archive"]:
            self.pruned.append(record)
        return record

    def review(self, group: str, directory: str | Path) -> str:
        """Decide `group`'s memories as `prune` would and write the decision's review page (`directory/review.html`:
        every memory, kept or why it goes, what replaced it) without changing anything; returns the page's path."""
        return review_group(directory, decide_group(self.store, group, self.pruner), self.store, self.pruner)

    def archives(self) -> list[Path]:
        """Every archive this wrapper's prunes wrote under `archive_dir`, oldest first."""
        return sorted(p.parent for p in self.archive_dir.glob("*/archive.json"))

    def restore(self, archive: str | Path | None = None) -> dict[str, int]:
        """Put back the memories of one archive, or of every archive under `archive_dir`; (restored, already_present)."""
        total = {"restored": 0, "already_present": 0}
        for path in [Path(archive)] if archive is not None else self.archives():
            done = restore_to(self.store, read_archive(path))
            total = {k: total[k] + done[k] for k in total}
        return total
