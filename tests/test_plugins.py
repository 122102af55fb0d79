"""Adding a variant is one module and its registry entry, with no other change to memprune: a toy pruning policy
and a toy store kind run through `memprune prune` (decide, then `--apply`) and `restore`; a toy judge and a toy
label source through `memprune label` (its label.md lines too); a toy corpus format through `memprune ingest` and
a toy update judge through `memprune prune --supersede`; a toy LLM task through the shared runner."""

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


# ------------------------------------------------------------------ the other families, in this process (issue 53)


@pytest.fixture()
def registries():
    """Every registry a toy below joins, restored after the test (a toy never leaks into another test)."""
    from memprune import adapters
    from memprune.decision.updates import UPDATE_JUDGES
    from memprune.label.judges import JUDGES
    from memprune.label.sources.common import SOURCES
    from memprune.llm.tasks import TASKS

    adapters.formats()  # the built-in formats load on first use: before the snapshot, or restoring would drop them
    held = [JUDGES, SOURCES, UPDATE_JUDGES, TASKS, adapters._REGISTRY]
    saved = [dict(r) for r in held]
    yield
    for registry, before in zip(held, saved):
        registry.clear()
        registry.update(before)


@pytest.fixture(scope="module")
def toy_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small synthetic corpus with fact updates (sessions, bullets)."""
    from memprune.synth import generate

    out = tmp_path_factory.mktemp("toy-corpus")
    generate(out, conversations=3, sessions=3, seed=5, updates=0.6)
    return out


def _cli(*args) -> None:
    from typer.testing import CliRunner

    from memprune.cli import app

    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output


def test_a_toy_judge_and_a_toy_label_source_run_through_memprune_label(registries, toy_corpus: Path,
                                                                       tmp_path: Path) -> None:
    """A judge is one `JudgeEntry` (here: no model, a score from the pair's ids) and a label source one `LabelSource`;
    `memprune label` runs each, with label.json and label.md, and nothing else of memprune changes."""
    import numpy as np

    from memprune.label.judges import JudgeEntry
    from memprune.label.judges import register as register_judge
    from memprune.label.judging import Judged
    from memprune.label.sources.common import LabelSource, SourceResult, SourceRun, label_counts, labels_table
    from memprune.label.sources.common import register as register_source

    def judge_all(cfg, plan, inputs):
        n = plan.pairs.num_rows
        scores = np.array([len(b) % 10 / 10 for b in plan.pairs.column("bullet_id").to_pylist()], dtype=float)
        return Judged(names=["toy"], scores=scores.reshape(1, n), errors=[[None] * n], modes=[["toy"] * n],
                      judge_values=[["toy"] * n], extras=[{}])

    register_judge(JudgeEntry(kind="toy", judge="toy", rank=9, needs_llm=False, context=False,
                              description="a toy: a score from the bullet id's length", judge_all=judge_all))

    def run(cfg, data, bullets, inputs, outputs):
        rows = [{"bullet_id": b, "label": 0.5, "n_pairs": 1, "aggregation": "toy"}
                for b in bullets.column("bullet_id").to_pylist()]
        labels = labels_table(rows, "toy_half")
        return SourceRun(SourceResult(labels, [], {**label_counts(bullets.num_rows, labels, [], ()), "toys": 7}),
                         "every bullet 0.5")

    register_source(LabelSource(name="toy_half", description="a toy: every bullet 0.5", run=run,
                                rows=lambda c: [("toys", c["toys"])]))
    _cli("label", "--data", toy_corpus, "--out", tmp_path / "judged", "--judge", "toy", "--set", "progress=false")
    pairs = pq.read_table(tmp_path / "judged" / "pairs.parquet")
    assert set(pairs.column("judge_mode").to_pylist()) == {"toy"} and pairs.num_rows > 0
    assert pq.read_table(tmp_path / "judged" / "labels.parquet").num_rows > 0
    _cli("label", "--data", toy_corpus, "--out", tmp_path / "sourced", "--source", "toy_half")
    labels = pq.read_table(tmp_path / "sourced" / "labels.parquet")
    assert set(labels.column("source").to_pylist()) == {"toy_half"} and set(labels.column("label").to_pylist()) == {0.5}
    assert "| toys | 7 |" in (tmp_path / "sourced" / "label.md").read_text()


def test_a_toy_corpus_format_and_a_toy_update_judge_run_through_ingest_and_prune(registries, toy_corpus: Path,
                                                                                scorer_dir: Path, tmp_path: Path) -> None:
    """A corpus format is one `Adapter` subclass (`memprune ingest --format`), an update judge one `UpdateJudgeEntry`
    (`memprune prune --supersede`)."""
    import numpy as np

    from memprune.adapters import Adapter, Conversation, register
    from memprune.decision.updates import UpdateJudgeEntry
    from memprune.decision.updates import register as register_judge
    from memprune.schema import bullet_id, turn_id

    @register
    class Lines(Adapter):
        """One conversation per line: `speaker: utterance | speaker: utterance ...`; each utterance is a bullet."""

        name = "toy_lines"

        def read(self, path, ledger, split=None):
            for c, line in enumerate(Path(path).read_text().splitlines()):
                ledger.saw("conversation")
                cid = f"toy{c}"
                turns = []
                for t, part in enumerate(line.split("|")):
                    speaker, text = part.split(":", 1)
                    ledger.saw("turn")
                    turns.append({"turn_id": turn_id(cid, 0, t), "speaker": speaker.strip(), "text": text.strip()})
                ledger.saw("session")
                bullets = [{"bullet_id": bullet_id(cid, 0, t), "conversation_id": cid, "session_index": 0,
                            "speaker": u["speaker"], "text": u["text"], "evidence": [u["turn_id"]]} for t, u in
                           enumerate(turns)]
                for _ in bullets:
                    ledger.saw("bullet")
                    ledger.saw("evidence")
                yield Conversation(cid, sessions=[{"conversation_id": cid, "session_index": 0,
                                                   "speakers": sorted({u["speaker"] for u in turns}), "time": None,
                                                   "turns": turns}], bullets=bullets)

    (tmp_path / "chats.txt").write_text("Ann: I have a cat. | Bo: Nice. | Ann: I moved to Oslo.\nCy: Hi there.\n")
    _cli("ingest", "--format", "toy_lines", "--input", tmp_path / "chats.txt", "--out", tmp_path / "corpus")
    assert pq.read_table(tmp_path / "corpus" / "bullets.parquet").num_rows == 4

    register_judge(UpdateJudgeEntry("toy_later", "a toy: every candidate pair is an update",
                                    lambda pairs, settings: np.ones(len(pairs), dtype=np.int64)))
    _cli("prune", "--scorer", scorer_dir, "--input", toy_corpus, "--out", tmp_path / "pruned", "--threshold", "0",
         "--supersede", "toy_later", "--set", "execution=driver", "--set", "progress=false")
    summary = json.loads((tmp_path / "pruned" / "prune.json").read_text())
    assert summary["lifecycle"]["supersede"]["judge"] == "toy_later"
    assert summary["lifecycle"]["supersede_updates"] == summary["lifecycle"]["supersede_pairs"] > 0
    assert summary["result"]["dropped_by_reason"]["superseded"] > 0


def test_a_toy_llm_task_runs_through_the_shared_runner(registries, tmp_path: Path) -> None:
    """An LLM task is one `TaskSpec` (its inputs, template, schema, parse and finish); the runner every command
    uses (`llm.local.run_rows`: prompts, parsing, retries, error rows) takes it as it is."""
    import pyarrow as pa

    from memprune.llm import LLMConfig
    from memprune.llm.local import run_rows
    from memprune.llm.parsing import Parsed
    from memprune.llm.prompts import escape
    from memprune.llm.tasks import TaskSpec, register

    template = tmp_path / "shout_v1.txt"
    template.write_text("=== system ===\nAnswer in capitals.\n=== user ===\n{{word}}\n")

    def parse(text, state):
        return Parsed(value=text, method="strict") if text and text.isupper() else Parsed(error="not capitals")

    register(TaskSpec("shout", inputs=("word",), required=("word",), placeholders=frozenset({"word"}), prompt=None,
                      template=str(template), max_tokens=8, outputs=(pa.field("shout", pa.string()),),
                      build=lambda row, t, config, state: t.render({"word": escape(row["word"])}), parse=parse,
                      finish=lambda item, result: item.update(shout=result)))
    seen = []

    def generate(rows, task, attempt):  # an engine: the first answer of "b" is not capitals, its retry is
        seen.append(attempt)
        word = lambda r: json.loads(r["_mp_messages"])[-1]["content"]  # noqa: E731
        return [{**r, "_mp_text": word(r).upper() if attempt > 1 or word(r) != "b" else word(r), "_mp_n_in": 3,
                 "_mp_n_out": 1, "_mp_engine_error": None} for r in rows]

    config = LLMConfig(engine="http", model="toy", base_url="http://127.0.0.1:9/v1", max_retries=1)
    out = run_rows([{"word": "a", "n": 1}, {"word": "b", "n": 2}], config, "shout", generate)
    assert [(r["n"], r["shout"], r["error"], r["attempts"]) for r in out] == [(1, "A", None, 1), (2, "B", None, 2)]
    assert seen == [1, 2]
    assert LLMConfig(engine="http", model="toy", base_url="http://x/v1", prompts={"shout": "judge_v1"}).prompt_name(
        "shout") == "judge_v1"
