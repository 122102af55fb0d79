"""`pytest -m gpu`, with passed / skipped / failed counts."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from .shared import REPO, Sizes, Some, has_cuda, table


def gpu_test_files() -> list[str]:
    """The test files that mark a test `gpu` (`--tiny`: on CPU every one skips, so collecting the whole suite
    for them only costs time; the full check collects everything)."""
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py")
                  if "mark.gpu" in p.read_text(encoding="utf-8"))


class TestsSizes(Sizes):
    """The paths pytest collects, relative to the repository."""

    paths: Some[str] = ["tests"]

    @classmethod
    def tiny(cls, bf16: bool) -> TestsSizes:
        return cls(paths=gpu_test_files())


def run(sizes: TestsSizes, out: Path) -> dict[str, Any]:
    import xml.etree.ElementTree as ET

    from common import child_env

    xml = out / "tests-junit.xml"
    rc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                         f"--junitxml={xml}", *sizes.paths], cwd=REPO, env=child_env()).returncode
    root = ET.parse(xml).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    result = {"collected": n["tests"], "passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"],
              "skipped": n["skipped"], "failed": n["failures"] + n["errors"], "pytest_exit_code": rc,
              "cuda": has_cuda()}
    if rc != 0 or not n["tests"]:
        result["error"] = (f"pytest -m gpu: {result['failed']} of {n['tests']} failed (exit code {rc})" if n["tests"]
                           else f"pytest -m gpu collected no tests (exit code {rc})")
    return result


def headline(r: dict[str, Any]) -> str:
    return f"{r['passed']} passed, {r['skipped']} skipped, {r['failed']} failed"


def markdown(r: dict[str, Any]) -> list[str]:
    return table([r], ["collected", "passed", "skipped", "failed", "cuda"])
