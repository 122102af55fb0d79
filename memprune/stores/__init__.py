"""External memory stores: prune, score and restore the stores people already have.

    memprune prune --input mem0:mem0.yaml --scorer S --out OUT            # decision only
    memprune prune --input mem0:mem0.yaml --scorer S --out OUT --apply    # archive + delete dropped
    memprune.archive.restore("OUT/archive")                                # put them back

- `config`: `StoreOptions` (map, apply, batch), `ScoreConfig`, `split_input`, `parse_map`.
- `base`: the `Store` interface and the normal form (id, text, group, time, hash, reject).
- `table`, `lance_store`, `mem0_store`: the three kinds (each registers its archive restorer).
- `export`: the store -> Ray Data (one read task per partition) -> sorted bullets layout + fingerprint.
- `apply`: the changed-store check, the archive, the deletes / flags.
- `stage`: `run_prune(cfg)` (called by `memprune.prune.run` for KIND:LOCATION inputs), `run_score(cfg)`.
"""

from __future__ import annotations

from memprune.stores import lance_store, mem0_store, table  # noqa: F401  (register the kinds and restorers)
from memprune.stores.base import NORMAL, Store, normalize, open_store
from memprune.stores.config import KINDS, ScoreConfig, StoreError, StoreOptions, parse_map, split_input
from memprune.stores.stage import calibrated_scores, run_prune, run_score

__all__ = ["KINDS", "NORMAL", "ScoreConfig", "Store", "StoreError", "StoreOptions", "calibrated_scores", "normalize",
           "open_store", "parse_map", "run_prune", "run_score", "split_input"]
