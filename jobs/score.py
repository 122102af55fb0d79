"""Ray job: add scores to a memory store (no decision).  python jobs/score.py CONFIG.yaml [key=value ...]"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # importable under `ray job submit --working-dir .`

from memprune.runtime import run_job  # noqa: E402
from memprune.stores import ScoreConfig, run_score  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_job("score", ScoreConfig, run_score))
