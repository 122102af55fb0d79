"""`review.html`: one self-contained page (its style, script and data inside; no network, works from `file://`).

The data is one JSON document in a `<script type="application/json">` element, with `<`, `>`, `&` and the line
separators escaped, so no text of the store can end the element or run as code; the page's script puts every
text on the page with `textContent`. Past `max_bytes` the records go into data files beside the page
(`review-data/part-00000.js`, ...), each a script the page loads from its own folder.
"""

from __future__ import annotations

import json
import re
import time
from importlib import resources
from pathlib import Path
from typing import Any

from memprune.review.data import chunks, payload
from memprune.storage import Location, location

PAGE = "review.html"
PARTS = "review-data"
MAX_BYTES = 20_000_000  # one file past this: the records go into data files beside the page
_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def safe_json(value: Any) -> str:
    """JSON that is safe inside an HTML `<script>` element (nothing in it can close the element)."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    for char, escaped in _ESCAPES.items():
        text = text.replace(char, escaped)
    return text


def _asset(name: str) -> str:
    return resources.files("memprune.review").joinpath(name).read_text(encoding="utf-8")


def _row_bytes(rec: dict[str, list[Any]]) -> Any:
    fixed = 120  # numbers, flags and JSON punctuation of a record
    return lambda i: fixed + len(rec["text"][i]) + len(rec["id"][i]) + len(rec["group"][i])


def write_page(directory: str | Path | Location, rec: dict[str, list[Any]], meta: dict[str, Any],
               max_bytes: int = MAX_BYTES) -> str:
    """Write `directory/review.html` (and, past `max_bytes`, `directory/review-data/`; `directory` a path or a
    storage URI) for the records `rec` of a decision described by `meta`; returns the page's path or URI."""
    directory = location(directory)
    doc = payload(rec, meta)
    doc["present"] = {f: any(v is not None for v in rec[f]) for f in ("effective", "time", "tokens")} | {
        "pinned": meta.get("pins", False)}
    doc["group_names"] = list(dict.fromkeys(rec["group"]))
    cuts = chunks(rec, max_bytes, _row_bytes(rec))
    parts_dir = directory / PARTS
    parts_dir.delete()
    tags = ""
    if len(cuts) == 1:
        doc["records"] = rec
    else:
        for k, (a, b) in enumerate(cuts):
            piece = {f: v[a:b] for f, v in rec.items()}
            (parts_dir / f"part-{k:05d}.js").write_text(
                f"(window.__memprune_parts = window.__memprune_parts || []).push({safe_json(piece)});\n")
        tags = "\n".join(f'<script src="{PARTS}/part-{k:05d}.js"></script>' for k in range(len(cuts)))
    fills = {"TITLE": _html_text(meta["title"]), "CSS": _asset("page.css"), "PARTS": tags, "JS": _asset("page.js"),
             "DATA": safe_json(doc)}  # one pass: nothing filled in is read again for a placeholder
    html = re.sub(r"@@(TITLE|CSS|PARTS|JS|DATA)@@", lambda m: fills[m.group(1)], _asset("page.html"))
    page = directory / PAGE
    page.write_text(html)
    return str(page)


def _html_text(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def written_at() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
