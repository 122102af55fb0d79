"""Ray job: pseudo labels.  python jobs/label.py configs/label-similarity.yaml [key=value ...]"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # importable under `ray job submit --working-dir .`

from memprune.jobrunner import run_job  # noqa: E402
from memprune.label import LabelConfig, run_label  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_job("label", LabelConfig, run_label))
