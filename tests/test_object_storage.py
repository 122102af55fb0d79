"""Object storage (`memprune.storage`) against a real S3 server on loopback (moto's standalone server): locations,
output sets committed without a rename, and `memprune prune` reading its store and scorer from S3 and writing its
outputs there from the Ray workers."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import free_port, moto_server, upload
from typer.testing import CliRunner

from memprune.errors import MemPruneError
from memprune.io import MARKER, check_committed, SchemaError
from memprune.outputs import OutputSet
from memprune.storage import Location, StorageError, fetch_dir, location


def _cli(*args: str):
    from memprune.cli import app

    return CliRunner().invoke(app, list(args))


def test_locations_resolve_once_and_unknown_ones_are_one_line(bucket: str, tmp_path: Path) -> None:
    local = location(tmp_path / "a")
    assert local.local and local.path == str(tmp_path / "a") and location(f"file://{tmp_path}/a").path == local.path
    remote = location(f"{bucket}/run/x")
    assert not remote.local and remote.path == f"{bucket[5:]}/run/x" and str(remote / "y.json") == f"{bucket}/run/x/y.json"
    (remote / "y.json").write_text('{"a": 1}')
    assert (remote / "y.json").is_file() and remote.is_dir() and remote.files() == {"y.json": 8}
    assert json.loads((remote / "y.json").read_text()) == {"a": 1}
    with pytest.raises(StorageError, match=r"unknown storage scheme 'nosuch' \(known: .*s3"):
        location("nosuch://b/x")
    with pytest.raises(StorageError, match=r"one slash; write s3://"):
        location("s3:/b/x")
    with pytest.raises(StorageError, match=r"bucket 'memprune-no-such-bucket' does not exist"):
        location("s3://memprune-no-such-bucket/x").check_reachable()
    with pytest.raises(StorageError, match=r"no such file"):
        (remote / "absent.json").read_text()


def test_a_remote_artifact_is_fetched_once_per_node_and_again_when_it_changes(bucket: str, tmp_path: Path,
                                                                               monkeypatch) -> None:
    monkeypatch.setenv("MEMPRUNE_CACHE_DIR", str(tmp_path / "cache"))
    art = tmp_path / "art"
    (art / "adapter").mkdir(parents=True)
    (art / "scorer.json").write_text("{}")
    (art / "adapter" / "w.bin").write_bytes(b"\0" * 10)
    uri = upload(art, f"{bucket}/art")
    first = fetch_dir(uri)
    assert (first / "adapter" / "w.bin").read_bytes() == b"\0" * 10 and first.is_relative_to(tmp_path / "cache")
    stamp = (first / "scorer.json").stat().st_mtime_ns
    assert fetch_dir(uri) == first and (first / "scorer.json").stat().st_mtime_ns == stamp  # not fetched again
    location(f"{uri}/scorer.json").write_text('{"changed": true}')
    again = fetch_dir(uri)
    assert again != first and (again / "scorer.json").read_text() == '{"changed": true}'
    assert fetch_dir(tmp_path / "art") == tmp_path / "art"  # a local artifact is used where it is
    with pytest.raises(StorageError, match="no such directory"):
        fetch_dir(f"{bucket}/nothing-here")


def _marker(loc: Location) -> dict:
    return json.loads((loc / MARKER).read_text())


def test_a_remote_output_set_commits_whole_or_not_at_all(bucket: str, monkeypatch) -> None:
    out = location(f"{bucket}/run")
    with OutputSet(out.uri, "demo") as outputs:
        outputs.path("report.json").write_text('{"v": 1}')  # a driver's small file
        table = outputs.target("table")  # what workers write, straight to the staging prefix
        pq.write_table(pa.table({"x": [1, 2, 3]}), (table / "part-0.parquet").path, filesystem=table.fs)
        assert not (out / "report.json").exists()  # nothing is in place before the commit
    info = _marker(out)
    assert info["state"] == "done" and set(info["files"]) == {"report.json", "table"}
    assert info["files"]["report.json"] == 8 and sorted(out.files()) == [MARKER, "report.json", "table/part-0.parquet"]
    check_committed(f"{out}/report.json")
    # a run that fails leaves the committed set as it was, and no staging prefix
    with pytest.raises(RuntimeError), OutputSet(out.uri, "demo") as outputs:
        outputs.path("report.json").write_text('{"v": 2}')
        (outputs.target("table") / "part-0.parquet").write_bytes(b"half")
        raise RuntimeError("killed")
    assert (out / "report.json").read_text() == '{"v": 1}' and sorted(out.files()) == [MARKER, "report.json",
                                                                                       "table/part-0.parquet"]
    # a crash while committing (here: the second copy fails): the marker says so and readers refuse the set
    real_copy = Location.copy_to
    calls = []

    def failing_copy(self, target):
        calls.append(target)
        if len(calls) == 2:
            raise OSError("connection reset")
        real_copy(self, target)

    monkeypatch.setattr(Location, "copy_to", failing_copy)
    with pytest.raises(OSError), OutputSet(out.uri, "demo") as outputs:
        outputs.path("report.json").write_text('{"v": 3}')
        (outputs.target("table") / "part-0.parquet").write_bytes(b"new")
    assert _marker(out)["state"] == "committing"
    with pytest.raises(SchemaError, match="did not finish"):
        check_committed(f"{out}/report.json")
    monkeypatch.setattr(Location, "copy_to", real_copy)
    # a rerun replaces it: staging prefixes the crashed runs left are removed
    with OutputSet(out.uri, "demo") as outputs:
        outputs.path("report.json").write_text('{"v": 4}')
    assert _marker(out)["state"] == "done" and (out / "report.json").read_text() == '{"v": 4}'
    assert not [n for n in out.files() if n.startswith(".staging-")]
    check_committed(f"{out}/report.json")
    # an object changed after the commit is refused by name
    (out / "report.json").write_text('{"v": 44}')
    with pytest.raises(SchemaError, match="changed since the demo run wrote it"):
        check_committed(f"{out}/report.json")


def test_remote_outputs_that_cannot_be_used_are_one_line_and_nothing_is_written(bucket: str, scorer_dir: Path,
                                                                               msc_small: Path) -> None:
    (location(bucket) / "theirs" / "data.csv").write_text("a,b\n")
    base = ["prune", "--scorer", str(scorer_dir), "--input", str(msc_small)]
    cases = {
        "not a memprune output": [*base, "--out", f"{bucket}/theirs"],
        "bucket 'memprune-no-such-bucket' does not exist": [*base, "--out", "s3://memprune-no-such-bucket/x"],
        "unknown storage scheme 'nosuch'": [*base, "--out", "nosuch://b/x"],
        "looks like a URI with one slash": [*base, "--out", "s3:/b/x"],
        "no such object or prefix": ["prune", "--scorer", str(scorer_dir), "--input", f"{bucket}/absent",
                                     "--out", f"{bucket}/o"],
        "scorer artifact s3://": ["prune", "--scorer", f"{bucket}/no-scorer", "--input", str(msc_small),
                                  "--out", f"{bucket}/o"],
    }
    for expected, args in cases.items():
        res = _cli(*args)
        assert res.exit_code != 0, (expected, res.output)
        assert len(res.output.strip().splitlines()) == 1 and expected in " ".join(res.output.split()), res.output
    assert sorted(location(bucket).files()) == ["theirs/data.csv"]


@pytest.mark.slow  # a Ray Data job of 20 s or more
def test_prune_reads_store_and_scorer_from_s3_and_writes_there(ray_local, bucket: str, scorer_dir: Path,
                                                               msc_small: Path, tmp_path: Path) -> None:
    from memprune.prune import MemoryPruner, read_pruned

    store = upload(msc_small / "bullets.parquet", f"{bucket}/store/bullets.parquet")
    scorer = upload(scorer_dir, f"{bucket}/scorer")
    out = f"{bucket}/pruned"
    res = _cli("prune", "--scorer", scorer, "--input", store, "--out", out, "--top-k", "3", "--emit", "split",
               "--set", "progress=false", "--set", "actors=1", "--set", "block_rows=64")
    assert res.exit_code == 0, res.output
    root = location(out)
    summary = json.loads((root / "prune.json").read_text())
    assert summary["scorer"]["path"] == scorer and summary["input"]["files"] == [store]
    assert summary["output"]["store"] == f"{out}/pruned" and summary["emitted"]["kept"]["path"] == f"{out}/kept"
    info = _marker(root)
    assert info["state"] == "done" and set(info["files"]) == {"pruned", "kept", "dropped", "prune.json", "prune.md",
                                                               "review.html"}
    assert f'"{summary["fingerprint"]}"' in (root / "review.html").read_text()  # the page, committed with the rest
    assert not [n for n in root.files() if n.startswith(".staging-")]
    got = read_pruned(out)
    bullets = pq.read_table(msc_small / "bullets.parquet")
    want = MemoryPruner(scorer_dir, top_k=3).prune_table(bullets)
    assert got["bullet_id"].to_pylist() == want["bullet_id"].to_pylist()
    assert got["keep"].to_pylist() == want["keep"].to_pylist() and got["reason"].to_pylist() == want["reason"].to_pylist()
    kept = pq.read_table((root / "kept").path, filesystem=root.fs)
    assert kept.num_rows == sum(got["keep"].to_pylist())
    # the pruned store on S3 is itself an input: read back through the committed marker
    again = _cli("prune", "--scorer", scorer, "--input", f"{out}/pruned", "--out", f"{bucket}/again", "--dry-run",
                 "--top-k", "3", "--set", "progress=false", "--set", "actors=1")
    assert again.exit_code == 0, again.output
    assert json.loads((location(bucket) / "again" / "prune.json").read_text())["input"]["rows"] == bullets.num_rows

    # the dropped bullets' archive on S3 undoes the prune: into a local copy of the kept store, every bullet is back
    # at its input position; into the kept store on S3 itself it is one line that says what to do
    local_kept = tmp_path / "kept"
    local_kept.mkdir()
    pq.write_table(kept, local_kept / "part-00000.parquet")
    res = _cli("restore", "--archive", f"{out}/dropped", "--all", "--into", str(local_kept))
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["restored"] == bullets.num_rows - kept.num_rows
    back = pq.read_table(local_kept)
    assert back["bullet_id"].to_pylist() == bullets["bullet_id"].to_pylist()
    assert back["text"].to_pylist() == bullets["text"].to_pylist()
    res = _cli("restore", "--archive", f"{out}/dropped", "--all")
    assert res.exit_code != 0 and len(res.output.strip().splitlines()) == 1, res.output
    assert f"{out}/kept" in res.output and "--into" in res.output


def test_a_store_refused_mid_commit_is_not_read_as_input(bucket: str, scorer_dir: Path) -> None:
    root = location(bucket) / "half"
    (root / "part-0.parquet").write_bytes(b"PAR1")
    (root / MARKER).write_text(json.dumps({"step": "prune", "state": "committing", "files": ["part-0.parquet"]}))
    res = _cli("prune", "--scorer", str(scorer_dir), "--input", str(root), "--out", f"{bucket}/o")
    assert res.exit_code != 0 and "did not finish" in " ".join(res.output.split()), res.output
    with pytest.raises(MemPruneError):
        check_committed(f"{root}/part-0.parquet")


def test_memory_pruner_loads_a_scorer_from_s3(bucket: str, scorer_dir: Path) -> None:
    from memprune.prune import MemoryPruner

    texts = ["Ann has a cat named Tom.", "Bob works nights at the bakery.", "It rained."]
    remote = MemoryPruner(upload(scorer_dir, f"{bucket}/scorer"), top_k=2)
    local = MemoryPruner(scorer_dir, top_k=2)
    assert remote.score(texts).tolist() == local.score(texts).tolist()
    assert remote.decide(texts)[1].tolist() == local.decide(texts)[1].tolist()


_BAD_CREDENTIALS = """
import sys
from typer.testing import CliRunner
from memprune.cli import app
for args in map(str.split, sys.argv[1:]):
    res = CliRunner().invoke(app, args)
    print(res.exit_code, " ".join(res.output.split()))
"""


@pytest.mark.slow  # its own S3 server and interpreter
def test_credentials_the_server_refuses_are_one_line_with_the_fix_and_nothing_is_written(scorer_dir: Path,
                                                                                       msc_small: Path,
                                                                                       tmp_path: Path) -> None:
    """A second moto server that checks credentials (INITIAL_NO_AUTH_ACTION_COUNT=0): keys it does not know, for
    an input, a scorer and an output on S3, are each one line naming the URI and where credentials come from."""
    import os
    import subprocess
    import sys

    with moto_server(free_port(), {"INITIAL_NO_AUTH_ACTION_COUNT": "0"}) as endpoint:
        local_out = tmp_path / "out"
        cases = [f"prune --scorer {scorer_dir} --input s3://memprune-creds/bullets.parquet --out {local_out}",
                 f"prune --scorer s3://memprune-creds/scorer --input {msc_small} --out {local_out}",
                 f"prune --scorer {scorer_dir} --input {msc_small} --out s3://memprune-creds/out"]
        env = {**os.environ, "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "nobody-knows-me",
               "AWS_SECRET_ACCESS_KEY": "wrong", "AWS_EC2_METADATA_DISABLED": "true"}
        proc = subprocess.run([sys.executable, "-c", _BAD_CREDENTIALS, *cases], env=env, capture_output=True,
                              text=True, timeout=300)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and len(lines) == len(cases), proc.stdout + proc.stderr[-2000:]
    for line, uri in zip(lines, ["s3://memprune-creds/bullets.parquet", "s3://memprune-creds/scorer",
                                 "s3://memprune-creds/out"]):
        code, _, message = line.partition(" ")
        assert code != "0" and uri in message and "credentials come from the standard environment" in message, line
        assert "Traceback" not in message
    assert not local_out.exists()


def test_evaluate_commits_its_outputs_on_object_storage_as_it_does_locally(bucket: str, tmp_path: Path):
    """`evaluate --out s3://...`: the object-storage output set (marker `done`), the same metrics as a local out."""
    from test_evaluate import synthetic_run

    from memprune.evaluate import evaluate_run

    synthetic_run(tmp_path / "run", seeds=(0,), n_conv=4)
    local = evaluate_run(tmp_path / "run", tmp_path / "out", figures=False)
    remote = evaluate_run(tmp_path / "run", f"{bucket}/report", figures=False)
    assert remote["outputs"]["report"] == f"{bucket}/report/report.md"
    root = location(f"{bucket}/report")
    assert json.loads((root / ".memprune.json").read_text())["state"] == "done"
    assert set(root.files()) == {p.name for p in (tmp_path / "out").iterdir()}
    assert json.loads((root / "metrics.json").read_text())["splits"] == local["splits"]


def test_label_reads_the_corpus_from_s3_commits_there_and_resumes_on_another_node(bucket: str, msc_small: Path,
                                                                                  tmp_path: Path, monkeypatch) -> None:
    """`label --data s3://... --out s3://...`: the output set committed on the bucket (marker `done`), the tables byte
    for byte those of a local run; a rerun on a node with an empty cache reuses every shard from `OUT/.work`."""
    from memprune.label import LabelConfig
    from memprune.label import run as label

    data = upload(msc_small, f"{bucket}/data")
    local = label(LabelConfig(data=msc_small, out=tmp_path / "local", shard_size=48, progress=False))
    monkeypatch.setenv("MEMPRUNE_CACHE_DIR", str(tmp_path / "node-a"))
    out = f"{bucket}/labels"
    res = _cli("label", "--data", data, "--out", out, "--shard-size", "48", "--no-progress")
    assert res.exit_code == 0, res.output
    root = location(out)
    info = _marker(root)
    assert info["state"] == "done" and set(info["files"]) == {p.name for p in (tmp_path / "local").iterdir()
                                                                if not p.name.startswith(".")}
    for name in ("pairs.parquet", "labels.parquet", "unlabelled.jsonl"):
        assert (root / name).read_bytes() == (tmp_path / "local" / name).read_bytes(), name
    monkeypatch.setenv("MEMPRUNE_CACHE_DIR", str(tmp_path / "node-b"))
    again = label(LabelConfig(data=data, out=out, shard_size=48, progress=False))
    assert again["throughput"]["shards_reused"] == local["throughput"]["shards_total"] > 2
    assert again["work_dir"].startswith(f"{out}/.work/")
    assert (root / "labels.parquet").read_bytes() == (tmp_path / "local" / "labels.parquet").read_bytes()


@pytest.mark.slow
def test_train_reads_corpus_and_labels_from_s3_and_commits_the_run_there(ray_local, bucket: str, msc_small: Path,
                                                                         tmp_path: Path, monkeypatch) -> None:
    """`train --data s3://... --labels s3://... --out s3://...`: every artifact, the predictions, run.json and train.md
    committed on the bucket (marker `done`), the same scores as a local run; a rerun on another node reuses them."""
    from memprune.label import LabelConfig
    from memprune.label import run as label
    from memprune.train import TrainConfig
    from memprune.train import run as train

    label(LabelConfig(data=msc_small, out=tmp_path / "labels", shard_size=64, progress=False))
    data, labels = upload(msc_small, f"{bucket}/data"), upload(tmp_path / "labels", f"{bucket}/labels")
    tiny = {"stages": ["vanilla", "stage1"], "seeds": [0], "max_length": 24, "split": {"valid": 1, "test": 1},
            "stage1": {"epochs": 2, "lr": 0.003, "batch_size": 32, "patience": 2},
            "ray": {"num_workers": 0}, "embed": {"actors": 1}}
    train(TrainConfig.model_validate({**tiny, "data": msc_small, "labels": [tmp_path / "labels"],
                                      "out": tmp_path / "local"}))
    monkeypatch.setenv("MEMPRUNE_CACHE_DIR", str(tmp_path / "node-a"))
    out = f"{bucket}/run"
    sets = [f"--set={k}={json.dumps(v)}" for k, v in tiny.items() if k not in ("stages", "seeds")]
    res = _cli("train", "--data", data, "--labels", labels, "--out", out, "--stages", "vanilla,stage1", "--seeds", "0",
               "--no-eval", *sets)
    assert res.exit_code == 0, res.output
    root = location(out)
    assert _marker(root)["state"] == "done"
    files = root.files()
    local = {str(p.relative_to(tmp_path / "local")) for p in (tmp_path / "local").rglob("*") if p.is_file()}
    assert {f for f in files if not f.startswith("ray/")} == {
        f for f in local if not f.startswith(("cache/", "ray/", "."))} | {MARKER}
    run_json = (root / "run.json").read_text()
    assert json.loads(run_json)["out"] == out and str(tmp_path / "node-a") not in run_json
    for stage in ("vanilla", "stage1"):
        got = pq.read_table((root / stage / "seed0" / "predictions.parquet").path, filesystem=root.fs)
        want = pq.read_table(tmp_path / "local" / stage / "seed0" / "predictions.parquet")
        assert got["bullet_id"].to_pylist() == want["bullet_id"].to_pylist()
        assert got["score"].to_pylist() == pytest.approx(want["score"].to_pylist(), abs=1e-5)
    monkeypatch.setenv("MEMPRUNE_CACHE_DIR", str(tmp_path / "node-b"))
    again = train(TrainConfig.model_validate({**tiny, "data": data, "labels": [labels], "out": out}))
    assert [r["reused"] for r in again["runs"]] == [True, True]


def test_synth_and_ingest_write_their_corpus_tables_to_s3_as_they_do_locally(bucket: str, tmp_path: Path) -> None:
    """`synth --out s3://...` and `ingest --out s3://...`: the tables committed on the bucket, byte for byte the local
    ones."""
    source = Path(__file__).resolve().parent / "fixtures" / "locomo_mini.json"
    for args, tables in ((["synth", "-n", "3"], ("sessions.parquet", "bullets.parquet")),
                         (["ingest", "--format", "locomo", "--input", str(source)], ("sessions.parquet", "qa.parquet"))):
        local, out = tmp_path / args[0], f"{bucket}/{args[0]}"
        for where in (str(local), out):
            res = _cli(*args, "--out", where)
            assert res.exit_code == 0, res.output
        root = location(out)
        assert _marker(root)["state"] == "done"
        assert set(root.files()) == {p.name for p in local.iterdir()}
        for name in tables:
            assert (root / name).read_bytes() == (local / name).read_bytes(), name


STORE_LINES = [f"{i:04d},Memory number {i} of {'Alice' if i % 2 else 'Bob'}.,u{i % 6},{2139 + i:05d}\n"
               for i in range(1, 25)]
STORE_CSV = ("id,text,user,zip\n" + "".join(STORE_LINES)).encode()  # ids `0003`, zips `02139`: text, never numbers
STORE_RULE = ["--map", "group=user", "--threshold", "0", "--top-k", "2", "--no-dedup", "--set", "progress=false",
              "--set", "actors=1"]


def test_store_inputs_and_outputs_on_s3_that_cannot_be_used_are_one_line_and_nothing_is_written(
        bucket: str, scorer_dir: Path, tmp_path: Path) -> None:
    (location(bucket) / "theirs" / "data.csv").write_text("a,b\n")
    store = tmp_path / "mem.csv"
    store.write_bytes(STORE_CSV)
    base = ["prune", "--scorer", str(scorer_dir), *STORE_RULE]
    cases = {
        "bucket 'memprune-no-such-bucket' does not exist": [*base, "--input", "table:s3://memprune-no-such-bucket/m.csv",
                                                            "--out", f"{bucket}/o"],
        f"table:{bucket}/absent.csv: no such file or directory": [*base, "--input", f"table:{bucket}/absent.csv",
                                                                  "--out", f"{bucket}/o"],
        "cannot open as a Lance dataset": [*base, "--input", f"lance:{bucket}/absent.lance", "--out", f"{bucket}/o"],
        "not a memprune output": [*base, "--input", f"table:{store}", "--out", f"{bucket}/theirs"],
        "no decision to apply yet": [*base, "--input", f"table:{store}", "--out", f"{bucket}/o", "--apply"],
    }
    for expected, args in cases.items():
        res = _cli(*args)
        assert res.exit_code == 2, (expected, res.output)
        assert len(res.output.strip().splitlines()) == 1 and expected in " ".join(res.output.split()), res.output
    assert sorted(location(bucket).files()) == ["theirs/data.csv"] and store.read_bytes() == STORE_CSV


@pytest.mark.slow  # three Ray Data prune jobs
def test_a_table_store_on_s3_is_decided_split_applied_and_restored_byte_for_byte(ray_local, bucket: str,
                                                                                   scorer_dir: Path,
                                                                                   tmp_path: Path) -> None:
    """`table:s3://.../mem.csv` pruned into `--out s3://...` with `--emit split`, then `--apply`: the object afterwards
    is, byte for byte, what the local apply of the same decision makes of a local copy; the archive on S3 restores
    it (a partial restore, then `--all`) to the original bytes. A Lance dataset on S3 decides as its local copy."""
    import lance
    import pyarrow.csv as pacsv

    from memprune.storage import object_store_options
    from memprune.stores import StoreOptions, open_store
    from memprune.stores.apply import apply_decision

    remote, out = f"{bucket}/store/mem.csv", f"{bucket}/pruned"
    location(remote).write_bytes(STORE_CSV)
    args = ["prune", "--input", f"table:{remote}", "--scorer", str(scorer_dir), "--out", out, *STORE_RULE]
    res = _cli(*args, "--emit", "split")
    assert res.exit_code == 0, res.output
    root = location(out)
    assert _marker(root)["state"] == "done" and location(remote).read_bytes() == STORE_CSV
    assert set(_marker(root)["files"]) == {"decision.parquet", "rejects.jsonl", "prune.json", "prune.md", "kept",
                                           "dropped", "review.html"}
    assert not [n for n in root.files() if n.startswith((".work", ".staging-"))]
    decision = pq.read_table((root / "decision.parquet").path, filesystem=root.fs)
    keep = dict(zip(decision["id"].to_pylist(), decision["keep"].to_pylist()))
    assert sorted(keep) == [f"{i:04d}" for i in range(1, 25)] and 0 < sum(keep.values()) < 24
    summary = json.loads((root / "prune.json").read_text())
    assert summary["emitted"]["kept"] == {"path": f"{out}/kept", "rows": sum(keep.values())}
    kept = pq.read_table((root / "kept").path, filesystem=root.fs)
    assert sorted(kept["bullet_id"].to_pylist()) == sorted(i for i, k in keep.items() if k)

    # the apply check: a record changed since the decision is a refusal, nothing changed
    location(remote).write_bytes(STORE_CSV.replace(b"Memory number 7 ", b"Memory number seven "))
    res = _cli(*args, "--apply")
    assert res.exit_code == 2 and "the store changed since the decision" in " ".join(res.output.split()), res.output
    assert not (root / "archive").exists()
    location(remote).write_bytes(STORE_CSV)
    res = _cli(*args, "--apply")
    assert res.exit_code == 0, res.output
    applied = location(remote).read_bytes()
    local_dir = tmp_path / "local"
    local_dir.mkdir()
    (local_dir / "mem.csv").write_bytes(STORE_CSV)
    pq.write_table(decision, local_dir / "decision.parquet")
    local = open_store("table", str(local_dir / "mem.csv"), {"group": "user"})
    apply_decision(local, local_dir, summary, StoreOptions(apply="delete"))
    assert applied == (local_dir / "mem.csv").read_bytes() == b"id,text,user,zip\n" + "".join(
        ln for ln in STORE_LINES if keep[ln[:4]]).encode()
    assert json.loads((root / "apply.json").read_text())["deleted"] == 24 - sum(keep.values())
    dropped = sorted(i for i, k in keep.items() if not k)
    (tmp_path / "ids").write_text(dropped[-1] + "\n")
    res = _cli("restore", "--archive", f"{out}/archive", "--ids", str(tmp_path / "ids"))
    assert res.exit_code == 0 and json.loads(res.output)["restored"] == 1, res.output
    res = _cli("restore", "--archive", f"{out}/archive", "--all")
    assert res.exit_code == 0 and json.loads(res.output)["restored"] == len(dropped) - 1, res.output
    assert location(remote).read_bytes() == STORE_CSV
    res = _cli("score", "--input", f"table:{remote}", "--scorer", str(scorer_dir), "--out", f"{bucket}/scores",
               "--map", "group=user", "--set", "progress=false", "--set", "actors=1")
    assert res.exit_code == 0, res.output
    assert _marker(location(f"{bucket}/scores"))["state"] == "done"
    scored = location(remote).read_text().splitlines()
    assert scored[0] == "id,text,user,zip,memprune_score" and scored[1].startswith(STORE_LINES[0].strip() + ",0.")

    # a Lance dataset on S3 (read by Lance's own client from the same environment) decides as its local copy
    table = pacsv.read_csv(pa.py_buffer(STORE_CSV), convert_options=pacsv.ConvertOptions(
        column_types={c: pa.string() for c in ("id", "text", "user", "zip")}))
    lance.write_dataset(table, str(tmp_path / "mem.lance"))
    lance.write_dataset(table, f"{bucket}/mem.lance", storage_options=object_store_options(bucket))
    decisions = []
    for where, into in ((str(tmp_path / "mem.lance"), str(tmp_path / "lance-out")), (f"{bucket}/mem.lance",
                                                                                      f"{bucket}/lance-out")):
        res = _cli("prune", "--input", f"lance:{where}", "--scorer", str(scorer_dir), "--out", into, *STORE_RULE)
        assert res.exit_code == 0, res.output
        got = pq.read_table((location(into) / "decision.parquet").path, filesystem=location(into).fs)
        decisions.append(got.select(["id", "keep", "reason"]).sort_by("id").to_pylist())
    assert decisions[0] == decisions[1] == decision.select(["id", "keep", "reason"]).sort_by("id").to_pylist()


def test_a_live_group_apply_on_s3_leaves_a_record_changed_before_its_delete(bucket: str, tmp_path: Path) -> None:
    """Issue 27 on object storage (no lock file there): `apply_group` on `table:s3://.../mem.jsonl`; after its check,
    another writer replaces the object with one dropped record edited. The delete re-reads the object and leaves
    that record (`changed`), deletes the other dropped one; restore gives back the original bytes but the edit."""
    from memprune.archive import restore
    from memprune.stores import open_store
    from memprune.stores.base import CHANGED
    from memprune.stores.group import apply_group, group_table

    remote = f"{bucket}/live/mem.jsonl"
    lines = [json.dumps({"mid": f"m{i}", "memory": f"Memory {i}.", "user": "ann" if i < 4 else "bo"}) + "\n"
             for i in range(6)]
    location(remote).write_bytes("".join(lines).encode())
    store = open_store("table", remote, {"id": "mid", "text": "memory", "group": "user"})
    table = group_table(store, "ann")
    keep = [i not in ("m1", "m2") for i in table.column("bullet_id").to_pylist()]
    decided = (table.append_column("score", pa.array([0.5] * table.num_rows, pa.float64()))
               .append_column("keep", pa.array(keep))
               .append_column("reason", pa.array([None if k else "below_threshold" for k in keep], pa.string()))
               .append_column("duplicate_of", pa.nulls(table.num_rows, pa.string())))
    edited = [ln.replace("Memory 1.", "Memory 1, edited.") for ln in lines]

    def other_writer() -> None:
        location(remote).write_bytes("".join(edited).encode())

    done = apply_group(store, decided, tmp_path / "archive", before_delete=other_writer)
    assert done["deleted"] == 1 and done["skipped"] == [{"id": "m1", "why": CHANGED}]
    assert location(remote).read_bytes() == "".join(ln for ln in edited if '"m2"' not in ln).encode()
    assert restore(tmp_path / "archive")["restored"] == 1
    assert location(remote).read_bytes() == "".join(edited).encode()
