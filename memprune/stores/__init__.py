"""External memory stores: prune, score and restore the stores people already have.

    memprune prune --input mem0:mem0.yaml --scorer S --out OUT            # decision only
    memprune prune --input mem0:mem0.yaml --scorer S --out OUT --apply    # archive + delete dropped
    memprune.archive.restore("OUT/archive")                                # put them back

- `config`: `StoreOptions` (map, apply, batch), `StorePruneConfig`, `ScoreConfig`, `split_input`, `parse_map`.
- `base`: the `Store` interface and the normal form (id, text, group, time, hash, reject).
- `table`, `lance_store`, `mem0_store`: the three kinds (each registers its archive restorer).
- `export`: the store -> Ray Data (one read task per partition) -> sorted bullets layout + fingerprint.
- `apply`: the changed-store check, the archive, the deletes / flags.
- `stage`: `run(cfg)` (what `memprune prune` and `jobs/prune.py` call: a bullets path goes to
  `memprune.prune.run`, `KIND:LOCATION` to `run_prune`: export -> prune -> decide -> apply), `run_score(cfg)`.
"""

from __future__ import annotations

from memprune.stores import lance_store, mem0_store, table  # noqa: F401  (register the kinds and restorers)
from memprune.stores.base import NORMAL, Store, normalize, open_store
from memprune.stores.config import KINDS, ScoreConfig, StoreError, StoreOptions, StorePruneConfig, parse_map, split_input
from memprune.stores.stage import calibrated_scores, run, run_prune, run_score

__all__ = ["KINDS", "NORMAL", "ScoreConfig", "Store", "StoreError", "StoreOptions", "StorePruneConfig",
           "calibrated_scores", "normalize", "open_store", "parse_map", "run", "run_prune", "run_score", "split_input"]
