"""The one base class of the errors a user can fix: bad input, a wrong path, an invalid setting.

Every stage raises a subclass (`TrainError`, `PruneError`, ...) whose message names the file,
record, field or key. The CLI and the job runner print such an error as one line and exit 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class MemPruneError(ValueError):
    """A problem the user can fix; the message names the file, record, field or config key."""
