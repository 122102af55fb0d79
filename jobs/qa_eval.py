"""Ray job: QA evaluation (answer accuracy against memory tokens).  python jobs/qa_eval.py CONFIG.yaml [key=value ...]"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # importable under `ray job submit --working-dir .`

from memprune.qa import QAEvalConfig, run  # noqa: E402
from memprune.runtime import run_job  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_job("qa_eval", QAEvalConfig, run))
