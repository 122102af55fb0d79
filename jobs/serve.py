"""Ray job: the memprune service on the cluster.  python jobs/serve.py CONFIG.yaml [key=value ...]

For a long-lived deployment prefer `serve deploy deploy/serve.yaml` (the import path `memprune.serve.app:build`).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # importable under `ray job submit --working-dir .`

from memprune.runtime import run_job  # noqa: E402
from memprune.serve import ServeConfig, run  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_job("serve", ServeConfig, run))
