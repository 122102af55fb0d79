"""Ray job: session summaries.  python jobs/summarize.py CONFIG.yaml [key=value ...]"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # importable under `ray job submit --working-dir .`

from memprune.runtime import run_job  # noqa: E402
from memprune.summarize import SummarizeConfig, run  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_job("summarize", SummarizeConfig, run))
