"""Ray job: pruning a bullets store or an external store (KIND:LOCATION).  python jobs/prune.py CONFIG.yaml [key=value ...]"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # importable under `ray job submit --working-dir .`

from memprune.stores import StorePruneConfig, run  # noqa: E402
from memprune.runtime import run_job  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_job("prune", StorePruneConfig, run))
