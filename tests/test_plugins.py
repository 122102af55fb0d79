"""Adding a variant is one module and its registry entry (issue 24): a toy pruning policy and a toy store kind,
registered from a module of their own, run through `memprune prune` (decide, then `--apply`) and `restore`
with no other change to memprune."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow.parquet as pq
import pytest

PLUGIN = textwrap.dedent('''
    """A toy policy (keep every `step`-th bullet of a group's ranking) and a toy store (one JSON file of records)."""
    import json
    from pathlib import Path
    from typing import ClassVar

    import pyarrow as pa

    from memprune.decision import Policy, register_policy
    from memprune.stores.base import Store, register


    @register_policy
    class Alternate(Policy):
        name: ClassVar[str] = "alternate"
        reasons: ClassVar[tuple[str, ...]] = ("off_step",)
        step: int = 2

        def keep(self, ranking, reason):
            keep = ranking.active & (ranking.rank % self.step == 0)
            reason[ranking.active & ~keep] = "off_step"
            return keep

        @property
        def key(self):
            return f"alternate{self.step}"

        @property
        def label(self):
            return f"every {self.step}th"

        def describe(self, unit):
            return f"alternate: every {self.step}th bullet of each {unit}'s ranking"


    @register
    class JsonFileStore(Store):
        kind = "toyjson"
        parallel = False

        def _records(self):
            return json.loads(Path(self.location).read_text())

        def _write(self, records):
            Path(self.location).write_text(json.dumps(records, indent=1))

        def raw_partitions(self):
            return [lambda: iter([pa.RecordBatch.from_pylist(self._records())])]

        def fetch(self, ids):
            want = set(ids)
            return pa.Table.from_pylist([r for r in self._records() if r["id"] in want])

        def delete(self, ids):
            want = set(ids)
            records = self._records()
            self._write([r for r in records if r["id"] not in want])
            return sum(r["id"] in want for r in records)

        def set_fields(self, values):
            by_id = {r.pop("id"): r for r in values.to_pylist()}
            self._write([{**r, **by_id.get(r["id"], {})} for r in self._records()])
            return len(by_id)

        def insert(self, records, archived=None):
            rows = records.drop_columns([c for c in records.column_names if c.startswith("memprune_")]).to_pylist()
            self._write(sorted(self._records() + rows, key=lambda r: r["id"]))
            return len(rows)
''')
MEMORIES = [{"id": f"m{i:02d}", "text": text, "group": user, "time": f"2024-01-{i + 1:02d}"}
            for i, (user, text) in enumerate([("ann", "Ann has a dog."), ("ann", "Ann likes tea."), ("ann", "ok"),
                                              ("ann", "Ann runs marathons."), ("bo", "Bo plays chess."),
                                              ("bo", "Bo moved to Oslo."), ("bo", "lol")])]


def _memprune(tmp_path: Path, ray_address: str, *args: str) -> subprocess.CompletedProcess:
    """The CLI in a process that imports the plugin module first, on the session's Ray; run in the plugin's
    directory, which Ray puts on the path of the job's workers, so that they can import it too."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path]), "RAY_ADDRESS": ray_address}
    script = "import toy_plugins, sys\nfrom memprune.cli import app\napp(sys.argv[1:])\n"
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)


@pytest.mark.slow
def test_a_toy_policy_and_a_toy_store_run_through_prune_apply_and_restore(scorer_dir: Path, tmp_path: Path,
                                                                          ray_address: str) -> None:
    (tmp_path / "toy_plugins.py").write_text(PLUGIN)
    store = tmp_path / "memories.json"
    store.write_text(json.dumps(MEMORIES, indent=1))
    original = json.loads(store.read_text())
    args = ["prune", "--input", f"toyjson:{store}", "--scorer", str(scorer_dir), "--out", str(tmp_path / "o"),
            "--policy", "alternate", "--min-keep", "0", "--set", "rule.step=2", "--set", "progress=false",
            "--set", "actors=1"]
    proc = _memprune(tmp_path, ray_address, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "o" / "prune.json").read_text())
    assert summary["rule"]["name"] == "alternate2" and "every 2th bullet" in summary["rule"]["description"]
    decision = pq.read_table(tmp_path / "o" / "decision.parquet").to_pylist()
    for user, n in (("ann", 4), ("bo", 3)):  # ranks 0, 2 kept: ceil(n / 2) per user
        rows = [r for r in decision if r["group"] == user]
        assert len(rows) == n and sum(r["keep"] for r in rows) == (n + 1) // 2
        assert {r["reason"] for r in rows if not r["keep"]} == {"off_step"}
    assert json.loads(store.read_text()) == original  # decided, not changed
    proc = _memprune(tmp_path, ray_address, *args, "--apply")
    assert proc.returncode == 0, proc.stderr[-3000:]
    kept = {r["id"] for r in decision if r["keep"]}
    assert {r["id"] for r in json.loads(store.read_text())} == kept
    proc = _memprune(tmp_path, ray_address, "restore", "--archive", str(tmp_path / "o" / "archive"), "--all")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(store.read_text()) == original
