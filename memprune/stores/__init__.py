"""External memory stores: prune, score and restore the stores people already have.

    memprune prune --input mem0:mem0.yaml --scorer S --out OUT            # decision only
    memprune prune --input mem0:mem0.yaml --scorer S --out OUT --apply    # archive + delete dropped
    memprune.archive.restore("OUT/archive")                                # put them back

- `config`: `StoreOptions` (map, apply, batch), `StorePruneConfig`, `ScoreConfig`, `parse_map`.
- `base`: the `Store` interface, the normal form (id, text, group, time, hash, reject), the registry of
  kinds (`@register`: `open_store`, `split_input`, and the one restorer `restore_into`).
- `table` (+ `records`: record-exact CSV/JSONL), `lance_store`, `mem0_store`: the three built-in kinds.
- `export`: the store -> normal form (held in memory up to 200k usable rows, else spilled to Parquet and Ray Data
  read tasks, one per partition left) -> sorted bullets layout + fingerprint.
- `apply`: the changed-store check, the archive, the deletes / flags.
- `stage`: `run(cfg)` (what `memprune prune` and `jobs/prune.py` call: a bullets path goes to
  `memprune.prune.run`, `KIND:LOCATION` to `run_prune`: export -> prune -> decide -> apply), `run_score(cfg)`.
"""

from __future__ import annotations

from memprune.stores import lance_store, mem0_store, table  # noqa: F401  (register the kinds and restorers)
from memprune.stores.base import NORMAL, Store, kinds, normalize, open_store, register, split_input
from memprune.stores.config import ScoreConfig, StoreError, StoreOptions, StorePruneConfig, parse_map
from memprune.stores.stage import calibrated_scores, run, run_prune, run_score

__all__ = ["NORMAL", "ScoreConfig", "Store", "StoreError", "StoreOptions", "StorePruneConfig", "calibrated_scores",
           "kinds", "normalize", "open_store", "parse_map", "register", "run", "run_prune", "run_score", "split_input"]
