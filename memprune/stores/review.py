"""`memprune review OUT`: the review page of a `memprune prune` output, written again from the decision there, and
served on 127.0.0.1 with `--open`.

OUT is what a prune left: a bullets store's `pruned/` (or a dry run's `decision/`), or an external store's
`decision.parquet` (after `--apply` with `apply.json`: the page then says what was archived and how to undo it).
"""

from __future__ import annotations

import http.server
import json
import threading
from functools import partial
from typing import Any

from memprune.errors import MemPruneError
from memprune.io import check_committed
from memprune.prune.config import PruneConfig
from memprune.prune.decided import decided, shown_session_times, write_run_review
from memprune.prune.job import DECISION_DIR
from memprune.prune.store import STORE_DIR, list_store_files, parquet_file
from memprune.review import PAGE, PARTS
from memprune.storage import location
from memprune.stores.config import StoreError
from memprune.stores.stage import write_store_review


def review_output(out: str) -> str:
    """Write OUT/review.html from the decision in OUT; returns the page's path (or URI)."""
    import pyarrow.parquet as pq

    loc = location(out, "OUT")
    if not (loc / "prune.json").is_file():
        raise StoreError(f"{out}: no prune.json: not the output of a `memprune prune` run")
    check_committed(loc / "prune.json")
    summary = json.loads((loc / "prune.json").read_text())
    if "store" in summary:  # an external store's decision
        if (loc / "apply.json").is_file():
            summary["apply"] = json.loads((loc / "apply.json").read_text())
        table = pq.read_table((loc / "decision.parquet").path, filesystem=loc.fs)
        return write_store_review(loc, table, summary, out)
    config = PruneConfig.model_validate(summary["config"])
    where = loc / (DECISION_DIR if summary.get("dry_run") else STORE_DIR)
    files = [where / name for name in sorted(where.files()) if name.endswith(".parquet") and "/" not in name]
    if not files:
        raise StoreError(f"{where}: no decision here (its files were moved or deleted)")
    names = parquet_file(files[0]).schema_arrow.names
    try:
        sessions = shown_session_times(list_store_files(config.input))
    except (MemPruneError, OSError):  # the input may be gone since; the page then shows no session times
        sessions = None
    write_run_review(loc, decided(files, names, config), summary, config, sessions, out)
    return str(loc / PAGE)


class _Page(http.server.SimpleHTTPRequestHandler):
    """Serves the page and its data files, nothing else of OUT."""

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        path = self.path.split("?", 1)[0]
        if path == "/":
            self.send_response(302)
            self.send_header("Location", f"/{PAGE}")
            self.end_headers()
        elif path == f"/{PAGE}" or (path.startswith(f"/{PARTS}/") and path.endswith(".js") and ".." not in path):
            super().do_GET()
        else:
            self.send_error(404, "only the review page is served here")

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet: the command prints the address
        pass


def serve_page(out: str, port: int = 0) -> tuple[http.server.ThreadingHTTPServer, str]:
    """An HTTP server on 127.0.0.1:`port` (0: a free one) for OUT's review page, serving in a thread; (server, URL)."""
    loc = location(out, "OUT")
    if not loc.local:
        raise StoreError(f"{out}: --open serves a local OUT; for a URI, copy review.html (and {PARTS}/) from it")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), partial(_Page, directory=loc.path))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/{PAGE}"
