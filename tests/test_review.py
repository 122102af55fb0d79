"""The review page (issue 55): one self-contained file per decision, opened from file:// in the system's Chromium
(driven by Playwright; skipped, with the reason, where no Chromium is installed).

Checked in the browser: the page's counts are prune.json's; filtering by `superseded` shows exactly those records,
each linking to the record that replaced it; search finds a record by its text; ids selected on the page restore
exactly those records through `memprune restore --ids`; the page makes no network request; text from the store is
shown as text (a record holding `<script>` or `<img onerror>` runs nothing).
"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from helpers import review_document
from memprune.cli import app
from memprune.review import Layout, safe_json, write_review

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
HOSTILE = ['</script><script>window.__pwned = 1</script>', '<img src=x onerror="window.__pwned = 2">']
NOW = "2024-04-01T00:00:00Z"
# A memory table: duplicates, an update (Lima -> Oslo), pins, an old fact that expires, hostile texts.
NOTES = [
    ("n1", "Nora lives in Lima.", "nora", "2024-01-05T00:00:00Z", "false"),
    ("n2", "Nora has a cat named Mochi.", "nora", "2024-01-05T00:00:00Z", ""),
    ("n3", "lol", "nora", "2024-02-01T00:00:00Z", "true"),
    ("n4", "Nora has a cat named Mochi.", "nora", "2024-02-01T00:00:00Z", "false"),
    ("n5", "Nora lives in Oslo.", "nora", "2024-03-10T00:00:00Z", "false"),
    ("n6", "Nora sang in a choir as a child.", "nora", "2023-01-01T00:00:00Z", "false"),
    ("n7", HOSTILE[0], "nora", "2024-03-11T00:00:00Z", "false"),
    ("n8", HOSTILE[1], "nora", "2024-03-12T00:00:00Z", "false"),
    ("o1", "Omar is learning Italian.", "omar", "2024-01-02T00:00:00Z", "false"),
    ("o2", "Omar works as a nurse in Cairo.", "omar", "2024-01-03T00:00:00Z", "false"),
    ("o3", "Omar works as a nurse in Cairo.", "omar", "2024-01-04T00:00:00Z", "false"),
]
MAP = "id=mid,text=memory,group=user,time=created,pin=starred"


def _run(*args) -> str:
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


# ----------------------------------------------------------------- no browser


def test_the_data_cannot_close_its_script_element_and_big_stores_get_data_files(tmp_path: Path) -> None:
    n = 30
    table = pa.table({"id": [f"r{i}" for i in range(n)], "group": ["g"] * 10 + ["h"] * 20,
                      "text": [HOSTILE[i % 2] + " x" * 40 for i in range(n)], "score": [i / n for i in range(n)],
                      "keep": [i % 3 != 0 for i in range(n)], "reason": [None if i % 3 else "over_top_k" for i in range(n)],
                      "duplicate_of": [None] * n})
    summary = {"rule": {"policy": "rule", "threshold": 0.5, "top_k": 3, "description": "d"}, "result": {"label": "x"},
               "input": {"path": "in"}, "fingerprint": "f"}
    page = Path(write_review(tmp_path, table, Layout("id", ("group",)), summary, str(tmp_path)))
    html = page.read_text()
    assert HOSTILE[0] not in html and "<img src=x" not in html  # only escaped inside the JSON
    doc = review_document(html)
    assert doc["records"]["text"] == table.column("text").to_pylist() and doc["counts"]["dropped"] == 10
    assert json.loads(safe_json("</script>")) == "</script>"
    # past the size limit: data files beside the page, cut at group boundaries, holding every record once
    from memprune.review.page import write_page
    from memprune.review.data import records
    from memprune.review import meta_of

    write_page(tmp_path / "big", records(table, Layout("id", ("group",))), meta_of(summary, "o"), max_bytes=1000)
    parts = sorted((tmp_path / "big" / "review-data").glob("part-*.js"))
    assert len(parts) > 1 and 'src="review-data/part-00000.js"' in (tmp_path / "big" / "review.html").read_text()
    ids = [i for p in parts for i in json.loads(p.read_text().split(".push(", 1)[1].rsplit(");", 1)[0])["id"]]
    assert ids == table.column("id").to_pylist()
    # `memprune review --open`: the page and its data files on 127.0.0.1, nothing else of OUT
    import httpx

    from memprune.stores.review import serve_page

    (tmp_path / "big" / "prune.json").write_text("{}")
    server, url = serve_page(str(tmp_path / "big"))
    try:
        assert url.startswith("http://127.0.0.1:") and httpx.get(url).status_code == 200
        base = url.rsplit("/", 1)[0]
        assert httpx.get(f"{base}/review-data/part-00000.js").status_code == 200
        assert [httpx.get(f"{base}/{p}").status_code for p in ("prune.json", "review-data/../prune.json")] == [404, 404]
    finally:
        server.shutdown()


# ----------------------------------------------------------------- in the browser


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("no Chromium on this machine (Debian: apt-get install chromium; .ci/run installs it as root)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (the test extra)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--no-first-run", "--disable-sync"])
        yield b
        b.close()


def _open(browser, page_path: str | Path, downloads: bool = False):
    """The page opened from file://, with the URLs it asked for (every request other than its own file)."""
    context = browser.new_context(viewport={"width": 1280, "height": 800}, accept_downloads=downloads)
    page = context.new_page()
    asked: list[str] = []
    page.on("request", lambda r: asked.append(r.url))
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(Path(page_path).resolve().as_uri())
    page.wait_for_selector("body[data-ready='1']", timeout=30_000)
    assert errors == []
    return page, asked


def _count(page, name: str) -> int:
    return int(page.locator(f"[data-count={name}] .n").inner_text().replace(",", ""))


@pytest.fixture(scope="module")
def notes_run(tmp_path_factory, scorer_dir, ray_local) -> tuple[Path, Path]:
    """The memory table and the --out of its decision (a dry run: nothing applied)."""
    d = tmp_path_factory.mktemp("review")
    notes = d / "notes.csv"
    with notes.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["mid", "memory", "user", "created", "starred"])
        w.writerows(NOTES)
    _run("prune", "--scorer", scorer_dir, "--input", f"table:{notes}", "--map", MAP, "--out", d / "out",
         "--threshold", "0", "--top-k", "4", "--supersede", "slot", "--max-age", "400d", "--now", NOW,
         "--set", "progress=false")
    return notes, d / "out"


@pytest.mark.slow
def test_a_quickstart_decision_shows_prune_jsons_counts_and_asks_for_nothing(browser, scorer_dir, tmp_path) -> None:
    from memprune.synth import generate

    generate(tmp_path / "corpus", conversations=6, sessions=3, seed=2)
    out = tmp_path / "out"
    printed = _run("prune", "--scorer", scorer_dir, "--input", tmp_path / "corpus", "--out", out, "--dry-run",
                   "--set", "execution=driver", "--set", "progress=false")
    assert f"review: {out / 'review.html'}" in " ".join(printed.split())
    summary = json.loads((out / "prune.json").read_text())
    result = summary["result"]
    page, asked = _open(browser, out / "review.html")
    assert _count(page, "records") == result["bullets_total_before"] and _count(page, "kept") == result["bullets_total_after"]
    assert _count(page, "dropped") == result["bullets_total_before"] - result["bullets_total_after"]
    dropped = {r: n for r, n in result["dropped_by_reason"].items() if n}
    shown = {li.get_attribute("data-reason"): int(li.locator(".n").inner_text().replace(",", ""))
             for li in page.locator("#reasons li").all()}
    assert shown == dropped
    assert page.locator("#shown").get_attribute("data-n") == str(result["bullets_total_before"])
    page.select_option("#state", "dropped")
    assert page.locator("#shown").get_attribute("data-n") == str(_count(page, "dropped"))
    assert [u for u in asked if not u.startswith("file://")] == []  # no network, no CDN
    # the page of an existing output, written again
    (out / "review.html").unlink()
    _run("review", out)
    assert (out / "review.html").is_file()


@pytest.mark.slow
def test_a_stores_page_links_updates_finds_text_runs_nothing_and_its_ids_restore(browser, notes_run, scorer_dir) -> None:
    notes, out = notes_run
    summary = json.loads((out / "prune.json").read_text())
    page, asked = _open(browser, out / "review.html")
    assert _count(page, "records") == len(NOTES) and _count(page, "kept") == summary["decision"]["kept"]
    assert page.evaluate("window.__pwned") is None  # the hostile texts ran nothing ...
    page.fill("#q", "onerror")
    page.locator("#shown[data-n='1']").wait_for()
    assert page.locator("tr.rec .txt").inner_text() == HOSTILE[1]  # ... and are shown as text
    # search by text
    page.fill("#q", "choir")
    page.locator("tr.rec[data-id='n6']").wait_for()
    assert page.locator("#shown").get_attribute("data-n") == "1"
    assert page.locator("tr.rec[data-id='n6'] td.tm").inner_text() == "2023-01-01"  # the store's time, read as one
    # exactly the superseded records, each linked to what superseded it; the link leads there
    decision = {r["id"]: r for r in pq.read_table(out / "decision.parquet").to_pylist()}
    superseded = {i: r["superseded_by"] for i, r in decision.items() if r["reason"] == "superseded"}
    assert superseded == {"n1": "n5"}
    page.fill("#q", "")
    page.locator(f"#shown[data-n='{len(NOTES)}']").wait_for()
    page.select_option("#reason", "superseded")
    page.locator(f"#shown[data-n='{len(superseded)}']").wait_for()
    rows = page.locator("tr.rec").all()
    assert {r.get_attribute("data-id"): r.locator("a.replaced-by").get_attribute("data-target") for r in rows} == superseded
    assert rows[0].locator("a.replaced-by").inner_text() == "Nora lives in Oslo."  # shown by its text
    rows[0].locator("a.replaced-by").click()
    assert page.locator("tr.rec.focus").get_attribute("data-id") == "n5"
    assert page.locator("tr.rec.focus a.replaces").get_attribute("data-target") == "n1"  # and back
    assert [u for u in asked if not u.startswith("file://")] == []

    # apply, then pick two of the dropped records on the page and restore exactly those
    _run("prune", "--scorer", scorer_dir, "--input", f"table:{notes}", "--map", MAP, "--out", out,
         "--threshold", "0", "--top-k", "4", "--supersede", "slot", "--max-age", "400d", "--now", NOW, "--apply",
         "--set", "progress=false")
    dropped = sorted(i for i, r in decision.items() if not r["keep"])
    assert len(dropped) >= 3
    left = {row["mid"] for row in csv.DictReader(notes.open())}
    assert left == set(decision) - set(dropped)
    page, _ = _open(browser, out / "review.html", downloads=True)
    archive = json.loads((out / "apply.json").read_text())["archive"]
    assert page.locator("#restore-cmd").inner_text() == f"memprune restore --archive {archive} --all"
    page.select_option("#state", "dropped")
    for rid in dropped[:2]:
        page.locator(f"tr.rec[data-id='{rid}'] input[type=checkbox]").check()
    with page.expect_download() as got:
        page.click("#export")
    ids = Path(got.value.path()).read_text().split()
    assert ids == dropped[:2]
    ids_file = out / "ids.txt"
    ids_file.write_text("\n".join(ids) + "\n")
    _run("restore", "--archive", archive, "--ids", ids_file)
    assert {row["mid"] for row in csv.DictReader(notes.open())} == left | set(dropped[:2])


@pytest.mark.slow
def test_ids_exported_from_the_page_are_kept_by_the_next_decision(scorer_dir, ray_local, tmp_path) -> None:
    """The page is where a decision is corrected: ids it exports, given to --keep-ids, are kept whatever the
    decision says (as pins), the rest decided as before; an id the store lacks is one line, nothing decided."""
    notes = tmp_path / "notes.csv"
    with notes.open("w", newline="") as f:
        csv.writer(f).writerows([["mid", "memory", "user", "created", "starred"], *NOTES])
    args = ["prune", "--scorer", scorer_dir, "--input", f"table:{notes}", "--map", MAP, "--threshold", "0",
            "--top-k", "4", "--supersede", "slot", "--max-age", "400d", "--now", NOW, "--set", "progress=false"]
    _run(*args, "--out", tmp_path / "first")
    first = {r["id"]: r for r in pq.read_table(tmp_path / "first" / "decision.parquet").to_pylist()}
    dropped = sorted(i for i, r in first.items() if not r["keep"])
    assert {"n1", "n6"} <= set(dropped)  # superseded, expired
    ids = tmp_path / "memprune-ids.txt"
    ids.write_text("# kept after review\nn1\nn6\n")
    printed = _run(*args, "--out", tmp_path / "second", "--keep-ids", ids)
    second = {r["id"]: r for r in pq.read_table(tmp_path / "second" / "decision.parquet").to_pylist()}
    assert second["n1"]["keep"] and second["n6"]["keep"]
    assert {i for i, r in second.items() if not r["keep"]} == set(dropped) - {"n1", "n6"}
    summary = json.loads((tmp_path / "second" / "prune.json").read_text())
    assert summary["lifecycle"]["keep_ids"] == {"file": str(ids), "ids": 2} and "Kept ids" in printed + (
        tmp_path / "second" / "prune.md").read_text()
    assert summary["fingerprint"] != json.loads((tmp_path / "first" / "prune.json").read_text())["fingerprint"]
    ids.write_text("n1\nnot-a-record\n")
    result = CliRunner().invoke(app, [str(a) for a in (*args, "--out", tmp_path / "third", "--keep-ids", ids)])
    assert result.exit_code != 0 and "not-a-record" in result.output and "not in the store" in result.output
    assert not (tmp_path / "third" / "prune.json").exists()
