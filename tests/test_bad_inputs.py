"""Every command over bad inputs: exit 2, exactly one stderr line naming the problem, no traceback,
and the output directory exactly as it was (created by nothing, changed by nothing).

The cases are the classes of a hostile new user's inputs: missing, empty, wrong-type and unreadable
files; a table that is a directory; half-written outputs; values that mean nothing (NaN, out of
range); unknown keys and options; broken scorer artifacts; resources the cluster does not have.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from memprune.cli import app

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, minilm_path: str) -> dict[str, Path]:
    """Valid inputs to break: a corpus, labels, a scorer artifact, a run with predictions, an LLM config."""
    from memprune.label import LabelConfig
    from memprune.label import run as label
    from memprune.scorer import Scorer, ScorerConfig
    from memprune.synth import generate

    root = tmp_path_factory.mktemp("world")
    generate(root / "corpus", conversations=3, sessions=2, seed=1)
    label(LabelConfig(data=root / "corpus", out=root / "labels", judge="similarity", progress=False))
    Scorer.build(ScorerConfig(encoder=minilm_path, head={"hidden": 0}), seed=0).save(root / "scorer")
    run = root / "run" / "vanilla" / "seed0"
    run.mkdir(parents=True)
    pq.write_table(pa.table({"bullet_id": ["a:s0:b0", "a:s0:b1"], "conversation_id": ["a", "a"],
                             "session_index": pa.array([0, 0], pa.int32()), "split": ["test", "test"],
                             "label": [0.2, 0.8], "score": [0.3, 0.6]}), run / "predictions.parquet")
    from memprune.archive import DECISION_COLUMNS, write_archive

    records = pa.table({"bullet_id": ["a:s0:b0"], **{c: [None] for c in DECISION_COLUMNS}})
    write_archive(root / "archive", records, id_column="bullet_id", store={"kind": "carrier-pigeon"}, fingerprint="x")
    (root / "ids.txt").write_text("a:s0:b0\nnot-archived\n")
    shutil.copytree(root / "archive", root / "archive-truncated")  # a manifest cut short, a records file gone
    manifest = root / "archive-truncated" / "archive.json"
    manifest.write_text(manifest.read_text()[:40])
    shutil.copytree(root / "archive", root / "archive-no-records")
    (root / "archive-no-records" / "archive.parquet").unlink()
    (root / "foreign").mkdir()  # a directory memprune did not write, with a user's file named like an output
    (root / "foreign" / "decision.parquet").write_bytes(b"a user's own file")
    (root / "llm.yaml").write_text("engine: hf\nmodel: /nonexistent-model\naccelerator: cpu\n")
    (root / "a-file").write_text("not a directory")
    (root / "empty-dir").mkdir()
    os.mkfifo(root / "a-pipe")  # what `--input <(zcat ...)` hands over; never opened (no writer)
    return {"root": root}


def _table_variants(root: Path) -> dict[str, Path]:
    """Corpus dirs whose bullets/sessions tables are broken in one way each."""
    src = root / "corpus"
    out: dict[str, Path] = {}

    def variant(name: str, edit: Callable[[Path], None]) -> None:
        d = root / "variants" / name
        if not d.exists():
            shutil.copytree(src, d)
            (d / ".memprune.json").unlink()  # edited by hand: the user's own data, not a synth output any more
            edit(d)
        out[name] = d

    variant("empty-bullets", lambda d: (d / "bullets.parquet").write_bytes(b""))
    variant("text-bullets", lambda d: (d / "bullets.parquet").write_text("bullet_id,text\nx,y\n"))
    variant("no-text", lambda d: pq.write_table(pq.read_table(d / "bullets.parquet").drop_columns(["text"]),
                                                d / "bullets.parquet"))
    variant("string-index", lambda d: pq.write_table(
        pq.read_table(d / "bullets.parquet").set_column(2, "session_index",
                                                        pa.array(["x"] * pq.read_metadata(d / "bullets.parquet").num_rows)),
        d / "bullets.parquet"))
    variant("dup-ids", lambda d: pq.write_table(pa.concat_tables([pq.read_table(d / "bullets.parquet")] * 2),
                                                d / "bullets.parquet"))

    def as_dir(d: Path) -> None:
        (d / "sessions.parquet").unlink()
        (d / "sessions.parquet").mkdir()

    variant("sessions-dir", as_dir)

    def half_written(d: Path) -> None:
        (d / ".memprune.json").write_text(json.dumps({"step": "synth", "state": "committing", "files": []}))

    variant("half-written", half_written)

    def changed(d: Path) -> None:  # a synth output whose bullets another tool rewrote
        shutil.copy(src / ".memprune.json", d / ".memprune.json")
        pq.write_table(pq.read_table(d / "bullets.parquet").slice(0, 5), d / "bullets.parquet")

    variant("changed", changed)

    def null_evidence(d: Path) -> None:
        t = pq.read_table(d / "bullets.parquet")
        ev = t.column("evidence").to_pylist()
        ev[0] = [None]
        t = t.set_column(5, pa.field("evidence", pa.list_(pa.string())), pa.array(ev, pa.list_(pa.string())))
        pq.write_table(t, d / "bullets.parquet")

    variant("null-evidence", null_evidence)
    return out


def _scorer_variants(root: Path) -> dict[str, Path]:
    src = root / "scorer"
    out: dict[str, Path] = {}

    def variant(name: str, edit: Callable[[Path], None]) -> None:
        d = root / "scorers" / name
        if not d.exists():
            shutil.copytree(src, d)
            edit(d)
        out[name] = d

    variant("corrupt-head", lambda d: (d / "head.safetensors").write_bytes(b"\x00garbage" * 10))
    variant("no-head", lambda d: (d / "head.safetensors").unlink())
    variant("bad-json", lambda d: (d / "scorer.json").write_text("{not json"))
    variant("missing-encoder", lambda d: (d / "scorer.json").write_text(json.dumps(
        {**json.loads((src / "scorer.json").read_text()), "encoder": "/nonexistent/encoder"})))
    return out


def cases(w: dict[str, Path]) -> list[tuple[str, list[str], str, str | None]]:
    """(id, argv, expected text in the error line, output dir that must stay unchanged)."""
    r = w["root"]
    t, s = _table_variants(r), _scorer_variants(r)
    corpus, labels, scorer, run, llm, afile = (str(r / n) for n in ("corpus", "labels", "scorer", "run", "llm.yaml",
                                                                     "a-file"))
    o = str(r / "out")
    prune = ["prune", "--scorer", scorer, "--input", corpus, "--out", o]
    train = ["train", "--data", corpus, "--labels", labels, "--out", o, "--set", "ray.num_workers=0"]
    label = ["label", "--data", corpus, "--out", o]
    evaluate = ["evaluate", "--run", run, "--out", o]
    dialogue = ["dialogue-eval", "--data", corpus, "--pruned", corpus, "--out", o, "--llm-config", llm]
    tune = ["tune", "--data", corpus, "--labels", labels, "--out", o]
    plan = [*label, "--plan"]
    archive = str(r / "archive")
    score = ["score", "--scorer", scorer, "--input", f"{corpus}/bullets.parquet", "--out", o]
    qa = ["qa-eval", "--data", corpus, "--pruned", corpus, "--out", o, "--llm-config", llm]
    return [
        # ingest
        ("ingest-format", ["ingest", "-f", "nope", "-i", corpus, "-o", o], "unknown format", o),
        ("ingest-missing", ["ingest", "-f", "jsonl", "-i", str(r / "missing"), "-o", o], "no such file", o),
        ("ingest-devnull", ["ingest", "-f", "jsonl", "-i", "/dev/null", "-o", o], "/dev/null", o),
        ("ingest-pipe", ["ingest", "-f", "jsonl", "-i", str(r / "a-pipe"), "-o", o], "a-pipe", o),
        ("ingest-out-file", ["ingest", "-f", "jsonl", "-i", corpus, "-o", afile], "a-file", None),
        ("ingest-out-inside", ["ingest", "-f", "jsonl", "-i", corpus, "-o", str(r / "corpus" / "again")],
         "inside", str(r / "corpus")),
        ("ingest-msc-layout", ["ingest", "-f", "msc", "-i", corpus, "-o", o], "session_", o),
        ("ingest-no-jsonl", ["ingest", "-f", "jsonl", "-i", str(r / "empty-dir"), "-o", o], "no .jsonl", o),
        ("ingest-no-args", ["ingest"], "format", None),
        # stats
        ("stats-missing", ["stats", str(r / "missing")], "missing", None),
        ("stats-not-corpus", ["stats", labels], "sessions.parquet", None),
        ("stats-empty", ["stats", str(t["empty-bullets"])], "bullets.parquet", None),
        ("stats-not-parquet", ["stats", str(t["text-bullets"])], "Parquet", None),
        ("stats-no-column", ["stats", str(t["no-text"])], "'text'", None),
        ("stats-wrong-type", ["stats", str(t["string-index"])], "session_index", None),
        ("stats-dup-ids", ["stats", str(t["dup-ids"])], "duplicate", None),
        ("stats-dir-table", ["stats", str(t["sessions-dir"])], "not a file", None),
        ("stats-half-written", ["stats", str(t["half-written"])], "did not finish", None),
        ("stats-changed", ["stats", str(t["changed"])], "changed since", None),
        # synth
        ("synth-sessions", ["synth", "-n", "2", "-s", "1", "-o", o], "sessions must be >= 2", o),
        ("synth-conversations", ["synth", "-n", "0", "-o", o], "conversations", o),
        ("synth-out-file", ["synth", "-n", "2", "-o", afile], "a-file", None),
        ("synth-prob", ["synth", "-n", "2", "--mention-prob", "2", "-o", o], "mention_prob", o),
        ("synth-prob-nan", ["synth", "-n", "2", "--mention-prob", "nan", "-o", o], "mention_prob", o),
        ("synth-unknown-key", ["synth", "-n", "2", "-o", o, "--set", "colour=red"], "colour", o),
        # summarize
        ("summarize-no-sessions", ["summarize", "--data", labels, "--out", o, "--llm-config", llm], "sessions.parquet", o),
        ("summarize-llm-missing", ["summarize", "--data", corpus, "--out", o, "--llm-config", str(r / "x.yaml")],
         "x.yaml", o),
        ("summarize-llm-not-mapping", ["summarize", "--data", corpus, "--out", o, "--llm-config", afile], "a-file", o),
        ("summarize-out-is-data", ["summarize", "--data", corpus, "--out", corpus, "--llm-config", llm], "differ",
         corpus),
        ("summarize-no-llm", ["summarize", "--data", corpus, "--out", o], "llm_config", o),
        ("summarize-no-model", ["summarize", "--data", corpus, "--out", o, "--llm-config", llm], "/nonexistent-model", o),
        ("label-no-model", [*label, "--judge", "llm", "--llm-config", llm], "/nonexistent-model", o),
        # label
        ("label-missing-data", ["label", "--data", str(r / "missing"), "--out", o], "missing", o),
        ("label-dir-table", ["label", "--data", str(t["sessions-dir"]), "--out", o], "not a file", o),
        ("label-half-written", ["label", "--data", str(t["half-written"]), "--out", o], "did not finish", o),
        ("label-speaker", [*label, "--speaker", "both"], "speaker", o),
        ("label-decay", [*label, "--decay", "2"], "decay", o),
        ("label-decay-nan", [*label, "--decay", "nan"], "decay", o),
        ("label-horizon", [*label, "--horizon", "0"], "horizon", o),
        ("label-llm-no-config", [*label, "--judge", "llm"], "llm_config", o),
        ("label-usage-no-log", [*label, "--source", "usage"], "usage", o),
        ("label-usage-missing-log", [*label, "--source", "usage", "--usage-log", str(r / "nolog.jsonl")], "nolog", o),
        ("label-qa-no-table", [*label, "--source", "qa"], "qa.parquet", o),
        ("label-unknown-key", [*label, "--set", "judge_temprature=1"], "judge_temprature", o),
        ("label-out-file", ["label", "--data", corpus, "--out", afile], "a-file", None),
        ("label-out-is-data", ["label", "--data", corpus, "--out", corpus], "must differ", corpus),
        # label --plan
        ("plan-missing-data", ["label", "--data", str(r / "missing"), "--out", o, "--plan"], "missing", o),
        ("plan-throughput", [*plan, "--throughput", "-5"], "cost.throughput", o),
        ("plan-throughput-nan", [*plan, "--decode-throughput", "nan"], "cost.decode_throughput", o),
        ("plan-tokenizer", [*plan, "--plan-tokenizer", str(r / "tok.json")], "tok.json", o),
        ("plan-tokenizer-not-one", [*plan, "--plan-tokenizer", afile], "cost.tokenizer", o),
        ("plan-llm-missing", [*plan, "--judge", "llm", "--llm-config", str(r / "x.yaml")], "x.yaml", o),
        ("plan-out-file", ["label", "--data", corpus, "--out", afile, "--plan"], "a-file", None),
        ("plan-out-is-data", ["label", "--data", corpus, "--out", corpus, "--plan"], "must differ", corpus),
        ("measure-without-plan", [*label, "--measure", "20"], "give it with --plan", o),
        ("measure-zero", [*plan, "--measure", "0"], "cost.measure", o),
        # train
        ("train-missing-data", ["train", "--data", str(r / "missing"), "--labels", labels, "--out", o], "missing", o),
        ("train-missing-labels", ["train", "--data", corpus, "--labels", str(r / "nolabels"), "--out", o],
         "nolabels", o),
        ("train-seeds", [*train, "--seeds", "a,b"], "--seeds", o),
        ("train-stages", [*train, "--stages", "stage3"], "stages", o),
        ("train-weight-source", [*train, "--label-weight", "gold=2"], "unknown source", o),
        ("train-weight-form", [*train, "--label-weight", "qa"], "SOURCE=WEIGHT", o),
        ("train-lr", [*train, "--set", "stage1.lr=-1"], "stage1.lr", o),
        ("train-lr-inf", [*train, "--set", "stage1.lr=inf"], "stage1.lr", o),
        ("train-folds", [*train, "--folds", "1"], "folds", o),
        ("train-encoder", [*train, "--encoder", "/nonexistent/encoder"], "/nonexistent/encoder", o),
        ("train-labels-table", ["train", "--data", corpus, "--labels", str(t["text-bullets"]), "--out", o],
         "labels.parquet", o),
        ("train-cpus", ["train", "--data", corpus, "--labels", labels, "--out", o, "--set", "ray.cpus_per_worker=64"],
         "ray.cpus_per_worker", o),
        ("train-cpus-stage1", ["train", "--data", corpus, "--labels", labels, "--out", o, "--set", "ray.num_workers=0",
                               "--set", "ray.stage1_workers=1", "--set", "ray.cpus_per_worker=64"],
         "ray.cpus_per_worker", o),
        # tune
        ("tune-missing-data", ["tune", "--data", str(r / "missing"), "--labels", labels, "--out", o], "missing", o),
        ("tune-missing-labels", ["tune", "--data", corpus, "--labels", str(r / "nolabels"), "--out", o], "nolabels", o),
        ("tune-trials", [*tune, "--stage1-trials", "-1"], "stage1_trials", o),
        ("tune-fraction", [*tune, "--train-fraction", "0"], "train_fraction", o),
        ("tune-local-mode", [*tune, "--set", "train.ray.num_workers=0"], "num_workers", o),
        ("tune-space-key", [*tune, "--set", "stage2_space={stage2.optimizer: [sgd]}"], "stage2.optimizer", o),
        ("tune-space-value", [*tune, "--set", "stage2_space={stage2.lora.r: [0, 4]}"], "stage2.lora.r", o),
        ("tune-point-key", [*tune, "--set", "points=[{stage1.lr: 0.1}]"], "points[0]", o),
        ("tune-encoder", [*tune, "--set", "train.encoder=/nonexistent/encoder"], "/nonexistent/encoder", o),
        ("tune-unknown-key", [*tune, "--set", "stage3_trials=2"], "stage3_trials", o),
        ("tune-out-file", ["tune", "--data", corpus, "--labels", labels, "--out", afile], "a-file", None),
        # evaluate
        ("eval-missing-run", ["evaluate", "--run", str(r / "missing"), "--out", o], "not found", o),
        ("eval-no-predictions", ["evaluate", "--run", labels, "--out", o], "predictions", o),
        ("eval-threshold-nan", [*evaluate, "--threshold", "nan"], "rule.threshold", o),
        ("eval-threshold-2", [*evaluate, "--threshold", "2"], "rule.threshold", o),
        ("eval-relevance-nan", [*evaluate, "--relevance-threshold", "nan"], "relevance_threshold", o),
        ("eval-top-k", [*evaluate, "--top-k", "-1"], "--top-k", o),
        ("eval-tokenizer", [*evaluate, "--data", corpus, "--tokenizer", str(r / "tok.json")], "tok.json", o),
        ("eval-splits", [*evaluate, "--set", "splits=[train]"], "splits", o),
        # prune
        ("prune-missing-scorer", ["prune", "--scorer", str(r / "missing"), "--input", corpus, "--out", o],
         "scorer.json", o),
        ("prune-bad-json", ["prune", "--scorer", str(s["bad-json"]), "--input", corpus, "--out", o], "scorer.json", o),
        ("prune-corrupt-head", ["prune", "--scorer", str(s["corrupt-head"]), "--input", corpus, "--out", o],
         "head.safetensors", o),
        ("prune-no-head", ["prune", "--scorer", str(s["no-head"]), "--input", corpus, "--out", o],
         "head.safetensors", o),
        ("prune-missing-encoder", ["prune", "--scorer", str(s["missing-encoder"]), "--input", corpus, "--out", o],
         "/nonexistent/encoder", o),
        ("prune-missing-input", ["prune", "--scorer", scorer, "--input", str(r / "missing"), "--out", o], "missing", o),
        ("prune-wrong-type", ["prune", "--scorer", scorer, "--input", str(t["string-index"]), "--out", o],
         "session_index", o),
        ("prune-not-parquet", ["prune", "--scorer", scorer, "--input", str(t["text-bullets"]), "--out", o],
         "Parquet", o),
        ("prune-null-evidence", ["prune", "--scorer", scorer, "--input", str(t["null-evidence"]), "--out", o],
         "evidence", o),
        ("prune-dup-ids", ["prune", "--scorer", scorer, "--input", str(t["dup-ids"]), "--out", o], "duplicate", o),
        ("prune-half-written", ["prune", "--scorer", scorer, "--input", str(t["half-written"]), "--out", o],
         "did not finish", o),
        ("prune-threshold", [*prune, "--threshold", "2"], "rule.threshold", o),
        ("prune-group-by", [*prune, "--group-by", "turn"], "group_by", o),
        ("prune-tokenizer", [*prune, "--set", f"tokenizer={r / 'tok.json'}"], "tok.json", o),
        ("prune-out-file", ["prune", "--scorer", scorer, "--input", corpus, "--out", afile], "a-file", None),
        # restore (the output is the store the records go back into: here --into, or the archive itself)
        ("restore-missing", ["restore", "--archive", str(r / "missing"), "--all", "--into", o], "archive.json", o),
        ("restore-not-archive", ["restore", "--archive", labels, "--all"], "not an archive", labels),
        ("restore-neither", ["restore", "--archive", archive, "--into", o], "exactly one", o),
        ("restore-no-archive", ["restore"], "give --archive DIR", o),
        ("restore-both", ["restore", "--archive", archive, "--all", "--ids", str(r / "ids.txt"), "--into", o],
         "exactly one", o),
        ("restore-ids-missing", ["restore", "--archive", archive, "--ids", str(r / "noids.txt"), "--into", o],
         "noids.txt", o),
        ("restore-id-absent", ["restore", "--archive", archive, "--ids", str(r / "ids.txt"), "--into", o],
         "'not-archived'", archive),
        ("restore-kind", ["restore", "--archive", archive, "--all", "--into", o], "carrier-pigeon", archive),
        ("restore-truncated-manifest", ["restore", "--archive", str(r / "archive-truncated"), "--all", "--into", o],
         "not a readable archive manifest", str(r / "archive-truncated")),
        ("restore-records-gone", ["restore", "--archive", str(r / "archive-no-records"), "--all", "--into", o],
         "archive.parquet: missing", str(r / "archive-no-records")),
        ("prune-out-foreign", ["prune", "--scorer", scorer, "--input", corpus, "--out", str(r / "foreign")],
         "not a memprune output", str(r / "foreign")),
        ("prune-store-out-foreign", ["prune", "--scorer", scorer, "--input", f"table:{corpus}/bullets.parquet", "--map",
                                     "id=bullet_id,group=conversation_id", "--out", str(r / "foreign")],
         "not a memprune output", str(r / "foreign")),
        ("prune-usage-log-missing", ["prune", "--scorer", scorer, "--input", f"table:{corpus}/bullets.parquet", "--map",
                                     "id=bullet_id,group=conversation_id", "--out", o, "--half-life", "30d",
                                     "--usage-log", str(r / "no-usage.jsonl")], "usage log not found", o),
        # score
        ("score-missing-scorer", ["score", "--scorer", str(r / "missing"), "--input", f"{corpus}/bullets.parquet",
                                  "--out", o], "scorer.json", o),
        ("score-corrupt-head", ["score", "--scorer", str(s["corrupt-head"]), "--input", f"{corpus}/bullets.parquet",
                                "--out", o], "head.safetensors", o),
        ("score-missing-input", ["score", "--scorer", scorer, "--input", str(r / "missing.parquet"), "--out", o],
         "missing.parquet", o),
        ("score-kind", ["score", "--scorer", scorer, "--input", "carrier-pigeon:coop", "--out", o], "carrier-pigeon", o),
        ("score-map-field", [*score, "--map", "idd=bullet_id"], "idd", o),
        ("score-map-column", ["score", "--scorer", scorer, "--input", f"table:{corpus}/bullets.parquet", "--out", o,
                              "--map", "id=nocol"], "'nocol'", o),
        ("score-batch", [*score, "--set", "batch_size=0"], "batch_size", o),
        ("score-out-file", ["score", "--scorer", scorer, "--input", f"{corpus}/bullets.parquet", "--out", afile],
         "a-file", None),
        # qa-eval
        ("qa-no-questions", qa, "no qa.parquet", o),
        ("qa-conditions", [*qa, "--conditions", "none,bogus"], "conditions", o),
        ("qa-retrieval-k", [*qa, "--retrieval-k", "many"], "--retrieval-k", o),
        ("qa-no-llm", ["qa-eval", "--data", corpus, "--pruned", corpus, "--out", o], "llm_config", o),
        ("qa-unknown-key", [*qa, "--set", "categries=[1]"], "categries", o),
        # dialogue-eval
        ("dialogue-no-data", ["dialogue-eval", "--data", labels, "--pruned", corpus, "--out", o, "--llm-config", llm],
         "sessions.parquet", o),
        ("dialogue-llm-missing", ["dialogue-eval", "--data", corpus, "--pruned", corpus, "--out", o, "--llm-config",
                                  str(r / "x.yaml")], "x.yaml", o),
        ("dialogue-no-model", dialogue, "/nonexistent-model", o),
        ("dialogue-conditions", [*dialogue, "--conditions", "none,bogus"], "conditions", o),
        ("dialogue-retrieval-k", [*dialogue, "--retrieval-k", "abc"], "--retrieval-k", o),
        ("dialogue-turns", [*dialogue, "--turns", "0"], "turns", o),
        ("dialogue-no-pruned", ["dialogue-eval", "--data", corpus, "--out", o, "--llm-config", llm], "pruned", o),
        # quickstart
        ("quickstart-data", ["quickstart", "--out", o, "--data", "parquet:/x"], "FORMAT:PATH", o),
        ("quickstart-missing", ["quickstart", "--out", o, "--data", f"msc:{r / 'missing'}"], "missing", o),
    ]


def _snapshot(path: str | None) -> object:
    if path is None:
        return None
    p = Path(path)
    if not p.exists():
        return "absent"
    return sorted((str(f.relative_to(p)), f.stat().st_size, f.stat().st_mtime_ns) for f in p.rglob("*"))


def gpu_cases(w: dict[str, Path]) -> list[tuple[str, list[str], str, str | None]]:
    """Cases that are bad only where the Ray cluster has no GPU: on a GPU host `use_gpu=true` is a valid request."""
    r = w["root"]
    corpus, labels, scorer, o = str(r / "corpus"), str(r / "labels"), str(r / "scorer"), str(r / "out")
    return [
        ("train-gpu", ["train", "--data", corpus, "--labels", labels, "--out", o, "--set", "ray.use_gpu=true"],
         "ray.use_gpu", o),
        ("prune-gpu", ["prune", "--scorer", scorer, "--input", corpus, "--out", o, "--set", "use_gpu=true"],
         "use_gpu", o),
    ]


def _failures(all_cases: list[tuple[str, list[str], str, str | None]]) -> list[str]:
    """Each case that did not exit 2 with one stderr line holding its text and its output dir untouched."""
    runner = CliRunner()
    failures = []
    for case_id, argv, expected, out in all_cases:
        before = _snapshot(out)
        result = runner.invoke(app, argv)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        problems = []
        if result.exit_code != 2:
            problems.append(f"exit {result.exit_code}")
        if len(lines) != 1 or "Traceback" in result.stderr:
            problems.append(f"{len(lines)} stderr lines")
        elif expected not in lines[0]:
            problems.append(f"{expected!r} not in the error")
        if _snapshot(out) != before:
            problems.append("the output directory changed")
        if problems:
            failures.append(f"{case_id}: {', '.join(problems)}: {result.stderr.strip()[:300]!r}"
                            f"{repr(result.exception) if result.exception and result.exit_code != 2 else ''}")
    return failures


def test_every_command_gives_one_clear_line(world: dict[str, Path]) -> None:
    all_cases = cases(world)
    assert len(all_cases) >= 100
    commands = {argv[0] for _, argv, _, _ in all_cases}
    assert {"tune", "restore", "score", "qa-eval"} <= commands
    assert any(argv[0] == "label" and "--plan" in argv for _, argv, _, _ in all_cases)
    failures = _failures(all_cases)
    assert not failures, f"{len(failures)} of {len(all_cases)} cases:\n" + "\n".join(failures)


@pytest.mark.slow  # starts a local Ray cluster (the GPU requests are checked against it)
def test_gpu_requests_without_a_gpu_give_one_clear_line(world: dict[str, Path]) -> None:
    """`use_gpu=true` where the Ray cluster these commands use (this process's) has no GPU: one line, exit 2.

    On a host whose Ray cluster has a GPU the same request is valid and would train and prune for real,
    so the test skips there rather than start that work.
    """
    import ray

    from memprune.raysession import ensure_ray

    ensure_ray()  # the commands' own cluster: they call ensure_ray() too, and reuse one already started
    gpus = float(ray.cluster_resources().get("GPU", 0))
    if gpus:
        pytest.skip(f"the Ray cluster has {gpus:g} GPU(s): use_gpu=true is valid here and would start real "
                    "training and pruning")
    failures = _failures(gpu_cases(world))
    assert not failures, "\n".join(failures)


@pytest.fixture(scope="module")
def life_world(tmp_path_factory: pytest.TempPathFactory, scorer_dir: Path) -> dict[str, Path]:
    """A corpus, one with a `time` column that holds a non-time, one whose sessions' times are not times, a usage
    log naming a bullet the store does not hold; and the scorer."""
    from memprune.synth import generate

    root = tmp_path_factory.mktemp("life-world")
    generate(root / "corpus", conversations=2, sessions=2, seed=1)
    bullets = pq.read_table(root / "corpus" / "bullets.parquet")
    ids = bullets.column("bullet_id").to_pylist()
    for name in ("bad-time", "bad-session-time"):
        shutil.copytree(root / "corpus", root / name)
        (root / name / ".memprune.json").unlink()
    times = ["2024-05-01"] * len(ids)
    times[3] = "yesterday"
    pq.write_table(bullets.append_column("time", pa.array(times)), root / "bad-time" / "bullets.parquet")
    sessions = pq.read_table(root / "corpus" / "sessions.parquet")
    pq.write_table(sessions.set_column(sessions.schema.get_field_index("time"), "time",
                                       pa.array(["2024-05-01", "next tuesday", *["2024-05-02"] * (sessions.num_rows - 2)])),
                   root / "bad-session-time" / "sessions.parquet")
    (root / "usage.jsonl").write_text(json.dumps({"bullet_id": ids[0], "used": True}) + "\n"
                                      + json.dumps({"bullet_id": "nobody:s0:b9", "used": True}) + "\n")
    return {"root": root, "scorer": scorer_dir, "id3": Path(ids[3])}


def life_cases(w: dict[str, Path]) -> list[tuple[str, list[str], str, str | None]]:
    """Pins, forgetting and expiry (issue 26): a bad duration, a missing pin field, unknown usage-log ids, bad times."""
    r = w["root"]
    o = str(r / "out")
    prune = ["prune", "--scorer", str(w["scorer"]), "--input", str(r / "corpus"), "--out", o]
    return [
        ("prune-half-life", [*prune, "--half-life", "3x"],
         "--half-life: '3x' is not a duration; use e.g. 30d, 12h, P2W", o),
        ("prune-max-age", [*prune, "--max-age", "ninety days"], "--max-age: 'ninety days' is not a duration", o),
        ("prune-half-life-set", [*prune, "--set", "rule.retention.half_life=3x"],
         "rule.retention.half_life: Value error, '3x' is not a duration", o),
        ("prune-now", [*prune, "--max-age", "90d", "--now", "soon"], "--now: 'soon' is not a time", o),
        ("prune-recall-boost-alone", [*prune, "--recall-boost", "2"], "set half_life too", o),
        ("prune-usage-without-retention", [*prune, "--usage-log", str(r / "usage.jsonl")], "--half-life", o),
        ("prune-pin-field", [*prune, "--pin-field", "pinned"], "--pin-field pinned: the store has no column 'pinned'", o),
        ("prune-pin-field-type", [*prune, "--pin-field", "speaker"], "column 'speaker' has type string, expected bool", o),
        ("prune-usage-unknown-id", [*prune, "--half-life", "30d", "--usage-log", str(r / "usage.jsonl")],
         f"{r / 'usage.jsonl'}: line 2: unknown bullet_id 'nobody:s0:b9'", o),
        ("prune-usage-missing", [*prune, "--half-life", "30d", "--usage-log", str(r / "nope.jsonl")],
         "usage log not found", o),
        ("prune-bad-time", [*prune[:4], str(r / "bad-time"), *prune[5:], "--max-age", "90d"],
         f"column 'time': 'yesterday' (record '{w['id3']}') is not a time", o),
        ("prune-bad-session-time", [*prune[:4], str(r / "bad-session-time"), *prune[5:], "--half-life", "2w"],
         "sessions.parquet: column 'sessions.time': 'next tuesday'", o),
    ]


def test_keeping_memory_current_gives_one_clear_line(life_world: dict[str, Path]) -> None:
    failures = _failures(life_cases(life_world))
    assert not failures, "\n".join(failures)
