"""Ray job: search the scorer's training settings.  python jobs/tune.py CONFIG.yaml [key=value ...]"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # importable under `ray job submit --working-dir .`

from memprune.runtime import run_job  # noqa: E402
from memprune.tune import TuneConfig, run  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_job("tune", TuneConfig, run))
