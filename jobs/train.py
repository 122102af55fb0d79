"""Ray job: scorer training.  python jobs/train.py configs/train-local.yaml [key=value ...]"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # importable under `ray job submit --working-dir .`

from memprune.jobrunner import run_job  # noqa: E402
from memprune.train import TrainConfig, run_training  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_job("train", TrainConfig, run_training))
