"""Label sources, by registry: `SOURCES` maps a source name to its `LabelSource` entry.

- `judge`: the judges of `memprune.label` (source `judge`);
- `qa`: QA evidence (`memprune.label.sources.qa`); `usage`: a usage log (`memprune.label.sources.usage`);
- `common`: `SOURCES`, `LabelSource`, `SourceResult`, the labels table and its counts.

Each returns a `SourceResult`: the `labels` table (with `source` set on every row), the bullets
left without a label and why, and counts that reconcile.
"""

from __future__ import annotations

from memprune.label.sources import judge, qa, usage  # noqa: F401  (register the sources)
from memprune.label.sources.common import (
    SOURCES,
    LabelSource,
    SourceError,
    SourceResult,
    SourceRun,
    label_counts,
    labels_table,
    register,
)
from memprune.label.sources.qa import (
    NO_LATER_SESSION,
    NO_QA_FOR_CONVERSATION,
    QA_UNLABELLED_REASONS,
    QAOptions,
    qa_labels,
    turn_sessions,
)
from memprune.label.sources.usage import (
    NO_USAGE_EVENTS,
    NO_USAGE_FOR_CONVERSATION,
    USAGE_EXTENSIONS,
    USAGE_UNLABELLED_REASONS,
    UsageEvent,
    UsageOptions,
    UsageTotals,
    parse_time,
    read_usage_log,
    usage_files,
    usage_labels,
)

__all__ = [
    "NO_LATER_SESSION", "NO_QA_FOR_CONVERSATION", "NO_USAGE_EVENTS", "NO_USAGE_FOR_CONVERSATION",
    "QA_UNLABELLED_REASONS", "SOURCES", "USAGE_EXTENSIONS", "USAGE_UNLABELLED_REASONS", "LabelSource", "QAOptions",
    "SourceError", "SourceResult", "SourceRun", "UsageEvent", "UsageOptions", "UsageTotals", "label_counts",
    "labels_table", "parse_time", "qa_labels", "read_usage_log", "register", "turn_sessions", "usage_files",
    "usage_labels",
]
