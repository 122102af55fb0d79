"""A two-node Ray cluster on one machine whose worker node has its own disk, with a real S3 server on loopback.

The head runs as usual; the worker node runs `ray start --address` under `unshare -m`, with a fresh tmpfs
mounted over pytest's base temporary directory: it cannot see any of the test's files (they all live there),
as a second machine cannot, and that tmpfs is its only disk (its Ray session dir and memprune's cache go
there). The software's install stays visible, as a machine image would. The prune job then runs from a driver on the head: with local
paths it stops before any work with the one line that names the path and the node; with every input and output
on S3 it runs on both nodes and commits its outputs in the bucket. The pipeline with `out=s3://`, submitted to the
head's job server with `ray job submit`, trains stage 2 on the worker node (its Ray label), which cannot see the driver's disk, and commits every step in the bucket.
`jobs/tune.py` the same way runs its trials' Ray Train workers there and commits the search in the bucket.
The cluster runs with Ray's token auth on: memprune's drivers find the token in RAY_AUTH_TOKEN (RAY_AUTH_MODE unset),
`ray job submit` and its jobs run with RAY_AUTH_MODE=token as the README says.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import upload
from test_ray_job import TINY_TRAIN, free_ports, jobs_client, submit

from memprune.storage import location

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
WORKER_LABEL = "memprune-test-node=worker"  # the worker node's Ray label: a label_selector puts work there
TOKEN = secrets.token_hex(16)  # the cluster runs with Ray's token auth on (its default for new clusters since 2.59)
AUTH = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": TOKEN}


def driver_env(**extra: str) -> dict[str, str]:
    """A memprune driver's environment: the token in a standard place (RAY_AUTH_TOKEN) and RAY_AUTH_MODE unset, so
    memprune itself finds the token and turns token auth on for the connection."""
    return {**{k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}, "RAY_AUTH_TOKEN": TOKEN, **extra}


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=3)  # `ray start --block` stops its processes one by one: kill what is left
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)


def _node_args(ports: list[int], workers: tuple[int, int]) -> list[str]:
    node_mgr, obj_mgr, agent_http, agent_grpc, metrics, env_agent = ports
    return ["--block", "--node-ip-address=127.0.0.1", "--num-cpus=1", "--disable-usage-stats",
            f"--node-manager-port={node_mgr}", f"--object-manager-port={obj_mgr}",
            f"--dashboard-agent-listen-port={agent_http}", f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={env_agent}",
            f"--min-worker-port={workers[0]}", f"--max-worker-port={workers[1]}"]


def _nodes_up(address: str, nodes: int, head: subprocess.Popen, worker: subprocess.Popen, deadline: float) -> bool:
    """Whether `nodes` nodes are alive before `deadline`: one driver connects and polls `ray.nodes()` (a fresh
    interpreter per probe costs seconds on a loaded machine); a failed connection (the head not up yet) is retried."""
    script = ("import sys, time, ray; ray.init(address=%r, log_to_driver=False)\n"
              "while sum(1 for n in ray.nodes() if n['Alive']) < %d:\n"
              "    if time.monotonic() > %r: sys.exit(1)\n"
              "    time.sleep(0.5)" % (address, nodes, deadline))  # CLOCK_MONOTONIC: one clock for all processes
    while time.monotonic() < deadline:
        probe = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, env={**os.environ, **AUTH})
        while probe.poll() is None and head.poll() is None and worker.poll() is None and time.monotonic() < deadline + 30:
            time.sleep(0.5)
        if probe.poll() is None:  # a node process died, or the connection hangs: stop waiting
            probe.kill()
            probe.wait()
            return False
        if probe.returncode == 0:
            return True
        time.sleep(1)
    return False


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory, s3_server: str):
    """(GCS address, the worker node's process, its private dir, the job server's address): a head (with the
    dashboard's job server, for `ray job submit`) and a worker node with a private disk."""
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"mount namespaces are not permitted here: {probe.stderr.decode().strip()[:200]}")
    logs = tmp_path_factory.mktemp("cluster")
    private = tmp_path_factory.getbasetemp()  # every test file is below it; the worker node sees a fresh tmpfs here
    gcs, dashboard, *ports = free_ports(15)
    env = {**os.environ, **AUTH, "RAY_USAGE_STATS_ENABLED": "0", "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("RAY_ADDRESS", None)
    head_log, worker_log = open(logs / "head.log", "w"), open(logs / "worker.log", "w")
    head = subprocess.Popen([str(BIN / "ray"), "start", "--head", f"--port={gcs}", "--include-dashboard=true",
                             "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
                             f"--ray-client-server-port={ports[12]}", *_node_args(ports[:6], (20000, 20999))],
                            stdout=head_log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    address, worker = f"127.0.0.1:{gcs}", None
    try:
        deadline = time.monotonic() + 180
        # the worker node joins once the head is registered (`ray start --address` earlier fails on a loaded machine:
        # "No node info found for head node in GCS")
        if _nodes_up(address, 1, head, head, deadline):
            # its own mount namespace, a fresh tmpfs over the tests' files (its session dir and only disk)
            inner = " ".join([f"exec {BIN / 'ray'} start --address={address}", f"--temp-dir={private / 'ray'}",
                              f"--labels={WORKER_LABEL}", *_node_args(ports[6:12], (21000, 21999))])
            worker = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c",
                                       f"mount -t tmpfs -o size=4g tmpfs {private} && {inner}"],
                                      stdout=worker_log, stderr=subprocess.STDOUT, start_new_session=True,
                                      env={**env, "MEMPRUNE_CACHE_DIR": str(private / "cache")})
        if worker is None or not _nodes_up(address, 2, head, worker, deadline):
            pytest.fail(f"the two-node cluster did not come up: {(logs / 'head.log').read_text()[-1500:]} "
                        f"{(logs / 'worker.log').read_text()[-1500:]}")
        yield address, worker, private, f"http://127.0.0.1:{dashboard}"
    finally:
        if worker is not None:
            _stop(worker)
        _stop(head)
        head_log.close()
        worker_log.close()
        from ray._common.utils import get_ray_address_file

        current = Path(get_ray_address_file(None))
        if current.exists() and current.read_text().strip().endswith(f":{gcs}"):
            current.unlink()


def _prune(address: str, *args: str) -> subprocess.CompletedProcess:
    """`memprune prune` from a driver on the head, connected to the cluster.

    Ray Data starts a pool's actors asynchronously and a small job may end before the second has started (on a
    loaded machine); waiting for the whole pool before the first block makes "a scoring actor on each node"
    a fact the tests can assert.
    """
    return subprocess.run([str(BIN / "memprune"), "prune", *args, "--set", f"ray_address={address}",
                           "--set", "progress=false"], capture_output=True, text=True, timeout=600,
                          env=driver_env(COLUMNS="1000", RAY_DATA_DEFAULT_WAIT_FOR_MIN_ACTORS_S="300"))


def _private_files(worker: subprocess.Popen, private: Path) -> list[str]:
    """What the worker node wrote on its own disk (seen through its mount namespace), Ray's session dir aside."""
    root = Path(f"/proc/{worker.pid}/root{private}")
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()
                  and p.relative_to(root).parts[0] != "ray")


def test_local_paths_the_worker_node_cannot_see_are_one_line_before_any_work(two_nodes, scorer_dir: Path,
                                                                              msc_small: Path, tmp_path: Path):
    import urllib.error
    import urllib.request

    address, _, _, jobs = two_nodes
    with pytest.raises(urllib.error.HTTPError, match="401"):  # token auth is on: the job server refuses a stranger
        urllib.request.urlopen(f"{jobs}/api/jobs/", timeout=30)
    proc = _prune(address, "--scorer", str(scorer_dir), "--input", str(msc_small), "--out", str(tmp_path / "o"))
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() + proc.stdout.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"--input {msc_small}: not visible from node " in lines[0] and "1 of 2 nodes" in lines[0]
    assert "give a URI (s3://" in lines[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()


def test_prune_on_s3_killed_mid_write_leaves_nothing_a_reader_accepts_and_the_rerun_runs_on_both_nodes(
        two_nodes, bucket: str, scorer_dir: Path, msc_small: Path):
    """Every path on S3: a driver SIGKILLed mid-write leaves nothing a reader accepts; the rerun runs on both nodes,
    commits in the bucket, decides as MemoryPruner does, and the worker node wrote only its scorer cache."""
    from memprune.io import check_committed
    from memprune.prune import MemoryPruner, read_pruned

    address, worker, private, _ = two_nodes
    store = upload(msc_small / "bullets.parquet", f"{bucket}/store/bullets.parquet")
    scorer = upload(scorer_dir, f"{bucket}/scorer")
    out = f"{bucket}/pruned"
    args = ["--scorer", scorer, "--input", store, "--out", out, "--top-k", "3", "--set", "actors=2",
            "--set", "block_rows=8", "--set", f"ray_address={address}", "--set", "progress=false"]
    proc = subprocess.Popen([str(BIN / "memprune"), "prune", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=driver_env())
    root = location(out)
    deadline = time.monotonic() + 300
    while not any(n.startswith(".staging-") and n.endswith(".parquet") for n in root.files()):
        assert proc.poll() is None, "the job ended before any worker wrote"
        assert time.monotonic() < deadline, "no worker output appeared in the staging prefix"
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)  # mid-write: workers have put part files under the staging prefix
    proc.wait(timeout=30)
    marker = root / ".memprune.json"  # a small job may already be committing when the kill lands: never "done"
    if marker.exists():
        assert json.loads(marker.read_text())["state"] == "committing"
    else:
        assert not (root / "pruned").exists()  # nothing committed
    try:
        read_pruned(out)
    except Exception as exc:  # no reader accepts the half-written set
        assert "no pruned store here" in str(exc) or "did not finish" in str(exc), exc
    else:
        raise AssertionError("a reader accepted a half-written output set")
    again = _prune(address, *args[:-4])
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert not [n for n in root.files() if n.startswith(".staging-")]  # the killed run's staging is gone
    check_committed(f"{out}/prune.json")
    assert json.loads((root / ".memprune.json").read_text())["state"] == "done"
    assert json.loads((root / "prune.json").read_text())["resources"]["nodes"] == 2  # a scoring actor on each node
    got = read_pruned(out)  # the decisions of the one uninterrupted process
    want = MemoryPruner(scorer_dir, top_k=3).prune_table(pq.read_table(msc_small / "bullets.parquet"))
    for col in ("bullet_id", "keep", "reason", "duplicate_of"):
        assert got[col].to_pylist() == want[col].to_pylist(), col
    assert got["score"].to_pylist() == pytest.approx(want["score"].to_pylist(), abs=1e-5)
    # the worker node wrote nothing on its own disk but Ray's session files and its cached copy of the scorer
    written = _private_files(worker, private)
    assert all(Path(f).is_relative_to("cache/artifacts") for f in written), written
    assert any(f.endswith("head.safetensors") for f in written)  # the worker fetched the artifact itself


def test_train_with_a_local_out_the_worker_node_cannot_see_is_one_line_before_training(two_nodes, tmp_path: Path):
    """The failure users met (a stage-2 Ray Train worker on another node could not read the stage-1 head) is now
    refused up front, naming the path and the node."""
    from helpers import labels_for

    from memprune.io import write_table
    from memprune.synth import generate

    address, *_ = two_nodes
    generate(conversations=6, sessions=3, out=tmp_path / "data", seed=1)
    write_table(labels_for(pq.read_table(tmp_path / "data" / "bullets.parquet")), tmp_path / "labels" /
                "labels.parquet", "labels")
    proc = subprocess.run([str(BIN / "memprune"), "train", "--data", str(tmp_path / "data"), "--labels",
                           str(tmp_path / "labels"), "--out", str(tmp_path / "run"), "--seeds", "0", "--no-eval",
                           "--set", f"ray.address={address}"],
                          capture_output=True, text=True, timeout=600,
                          env=driver_env(COLUMNS="1000"))
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() + proc.stdout.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"--out {tmp_path / 'run'}: not visible from node " in lines[0] and "Traceback" not in proc.stderr
    assert not list((tmp_path / "run").rglob("*.safetensors"))  # nothing was trained


def test_local_paths_on_a_filesystem_every_node_mounts_pass_the_check(two_nodes, scorer_dir: Path, msc_small: Path):
    """/dev/shm is one filesystem for both nodes here, as NFS would be on a real cluster."""
    import shutil
    import tempfile

    address, *_ = two_nodes
    shared = Path(tempfile.mkdtemp(prefix="memprune-shared-", dir="/dev/shm"))
    try:
        shutil.copytree(scorer_dir, shared / "scorer")
        shutil.copy(msc_small / "bullets.parquet", shared / "bullets.parquet")
        proc = _prune(address, "--scorer", str(shared / "scorer"), "--input", str(shared / "bullets.parquet"),
                      "--out", str(shared / "out"), "--top-k", "3", "--set", "actors=2", "--set", "block_rows=32")
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        summary = json.loads((shared / "out" / "prune.json").read_text())
        assert summary["resources"]["nodes"] == 2 and summary["output"]["rows"] == summary["input"]["rows"]
        assert not list(shared.rglob(".memprune-probe-*"))  # the probe files are removed
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_pipeline_on_s3_trains_stage2_on_the_node_without_the_drivers_disk(two_nodes, bucket: str, tmp_path: Path):
    """The README's cluster command through `ray job submit` with out=s3://: the stage-2 Ray Train worker runs on the
    worker node (a label selector puts it there), which cannot see the driver's disk; every step reads from the bucket
    and commits there, and the summary names the URI. The job's driver runs on the head, its temp dir on the head's
    own disk."""
    _, worker, private, jobs = two_nodes
    out = f"{bucket}/run"
    key, value = WORKER_LABEL.split("=")
    job_id = f"memprune-two-nodes-{tmp_path.name}"
    submit(jobs, {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}, job_id,
           "jobs/pipeline.py", "configs/pipeline-local.yaml", f"out={out}", "corpus.conversations=6", "corpus.sessions=3", "evaluate.figures=false", "prune.progress=false", *TINY_TRAIN,
           "train.stages=[vanilla,stage1,stage2]", "train.stage2={epochs: 1, batch_size: 32, patience: 1}",
           "train.ray.num_workers=1", f"train.ray.label_selector={{{key}: {value}}}",
           entry=("env", f"TMPDIR={tmp_path}", "python"), token=TOKEN)  # the driver's temp dir: the head's disk
    log = jobs_client(jobs, TOKEN).get_job_logs(job_id)
    lines = log.splitlines()
    summary = json.loads("\n".join(lines[max(i for i, ln in enumerate(lines) if ln == "{"):]))  # the job's summary
    assert summary["report"] == f"{out}/report/report.md" and "memprune-staging-" not in json.dumps(summary)
    assert (location(out) / "report" / "report.md").exists()
    for step in ("data", "label", "train", "report", "prune"):
        assert summary["steps"][{"report": "evaluate"}.get(step, step)]["dir"] == f"{out}/{step}"
    for step in ("data", "label", "train", "report", "prune"):  # each committed by its step's output set
        assert json.loads((location(out) / step / ".memprune.json").read_text())["state"] == "done", step
    trained = json.loads((location(out) / "train" / "stage2" / "seed0" / "train.json").read_text())
    assert trained["ray"]["storage"] == f"{out}/train/ray" and trained["epochs_run"] == 1
    logs = list(Path(f"/proc/{worker.pid}/root{private}/ray").glob("session_*/logs/worker-*.out"))  # the node's
    assert any(b":actor_name:RayTrainWorker" in f.read_bytes() for f in logs), len(logs)  # Ray names each actor there


def test_a_table_store_on_s3_is_pruned_split_applied_and_restored_through_ray_job_submit(two_nodes, bucket: str,
                                                                                          scorer_dir: Path):
    """A `table:s3://` directory store of two CSV files through `ray job submit`: jobs/prune.py decides with
    `emit=split` into an S3 out, then applies (each file rewritten as a whole object: only the dropped records
    leave), and `memprune restore --archive s3://.../archive --all`, submitted as a job too, gives back every
    object byte for byte."""
    from test_object_storage import STORE_LINES

    jobs = two_nodes[3]
    header = "id,text,user,zip\n"
    files = {"a.csv": header + "".join(STORE_LINES[:12]), "b.csv": header + "".join(STORE_LINES[12:])}
    for name, text in files.items():
        (location(bucket) / "store" / name).write_text(text)
    out = f"{bucket}/store-pruned"
    env = dict(os.environ)
    args = ["jobs/prune.py", "configs/prune-local.yaml", f"scorer={upload(scorer_dir, f'{bucket}/scorer')}",
            f"input=table:{bucket}/store", f"out={out}", "store.map={group: user}", "rule.group_by=conversation",
            "rule.threshold=0", "rule.top_k=2", "emit=split", "progress=false"]
    submit(jobs, env, "memprune-store-decide", *args, token=TOKEN)
    root = location(out)
    assert json.loads((root / ".memprune.json").read_text())["state"] == "done"
    assert (root / "kept").is_dir() and (root / "dropped" / "archive.json").is_file()
    decision = pq.read_table((root / "decision.parquet").path, filesystem=root.fs)
    keep = dict(zip(decision["id"].to_pylist(), decision["keep"].to_pylist()))
    submit(jobs, env, "memprune-store-apply", *args, "store.apply=delete", token=TOKEN)
    for name, text in files.items():
        lines = text.splitlines(keepends=True)
        assert (location(bucket) / "store" / name).read_text() == lines[0] + "".join(
            ln for ln in lines[1:] if keep[ln[:4]])
    submit(jobs, env, "memprune-store-restore", "restore", "--archive", f"{out}/archive", "--all",
           entry=(str(BIN / "memprune"),), token=TOKEN)
    assert {n: (location(bucket) / "store" / n).read_text() for n in files} == files


def test_tune_on_s3_runs_its_trials_workers_on_the_node_without_the_drivers_disk_and_a_rerun_reuses(
        two_nodes, ray_local, bucket: str, tmp_path: Path):
    """`jobs/tune.py` through `ray job submit` with out=s3://: the driver searches in its node's working copy (on
    the head's own disk), every trial's Ray Train worker runs on the worker node (its label) and checkpoints into the
    bucket, and the search is committed there with the files and results of the same search run locally. A second
    job whose driver has another working copy (another node's, as far as it knows) reuses the committed trials."""
    import yaml
    from helpers import committed, labels_for, remote_files, tune_config

    from memprune.io import write_table
    from memprune.synth import generate
    from memprune.tune import run as tune

    worker, private, jobs = two_nodes[1:]
    generate(conversations=12, sessions=3, out=tmp_path / "data", seed=3)
    write_table(labels_for(pq.read_table(tmp_path / "data" / "bullets.parquet")),
                tmp_path / "labels" / "labels.parquet", "labels")
    # the stage-2 search alone, one epoch per stage: what the URI adds is the same for both stages' trials
    small = {"stage1_trials": 0, "stage2_trials": 1, "points": [], "max_concurrent": 1, "train": {
        "stage1": {"epochs": 1, "lr": 3e-3, "batch_size": 32, "patience": 1},
        "stage2": {"epochs": 1, "lr": 3e-3, "batch_size": 32, "patience": 1, "lora": {"r": 2, "alpha": 4, "dropout": 0.0}}}}
    local = tune(tune_config(tmp_path / "data", tmp_path / "labels", tmp_path / "local", **small))  # in this process

    data, labels = upload(tmp_path / "data", f"{bucket}/data"), upload(tmp_path / "labels", f"{bucket}/labels")
    out = f"{bucket}/tune"
    key, value = WORKER_LABEL.split("=")
    remote_cfg = tune_config(data, labels, out, tuned_config=tmp_path / "tuned.yaml", **small).model_dump(
        mode="json", exclude_unset=True)
    remote_cfg["train"]["ray"]["label_selector"] = {key: value}  # every Ray Train worker on the worker node
    config = tmp_path / "tune.yaml"
    config.write_text(yaml.safe_dump(remote_cfg))
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    for node in ("head-a", "head-b"):  # the second job: a driver with an empty working copy
        submit(jobs, env, f"memprune-tune-{node}-{tmp_path.name}", "jobs/tune.py", str(config),
               entry=("env", f"MEMPRUNE_CACHE_DIR={tmp_path / node}", f"TMPDIR={tmp_path}", "python"), token=TOKEN)
        searched = json.loads((location(out) / "tune.json").read_text())
        if node == "head-a":
            first = searched
            committed(out, "tune")
            assert {f.split("/", 1)[0] for f in remote_files(out)} == {"ray"} | {
                p.name for p in (tmp_path / "local").iterdir() if not p.name.startswith(".")
                and p.name not in ("cache", "ray-tune")}
            assert [r["metric"] for r in searched["stage2_trials"]] == pytest.approx(
                [r["metric"] for r in local["stage2_trials"]], abs=1e-6)
            assert [r["status"] for r in searched["stage2_trials"]] == ["completed"]
            assert searched["out"] == out and str(tmp_path / node) not in json.dumps(searched)
            trial = searched["stage2_trials"][0]["dir"].removeprefix(f"{out}/")  # trials/stage2-...
            run = json.loads((location(out) / trial / "stage2" / "seed0" / "train.json").read_text())
            assert run["ray"]["storage"] == f"{out}/ray/{trial}"  # the checkpoints: in the bucket
            tuned = (location(out) / "train-tuned.yaml").read_text()
            assert f"out: {out}/train" in tuned and (tmp_path / "tuned.yaml").read_text() == tuned
            logs = list(Path(f"/proc/{worker.pid}/root{private}/ray").glob("session_*/logs/worker-*.out"))
            assert any(b":actor_name:RayTrainWorker" in f.read_bytes() for f in logs), len(logs)
    assert [r["reused"] for r in searched["stage2_trials"]] == [True]
    assert [r["metric"] for r in searched["stage2_trials"]] == [r["metric"] for r in first["stage2_trials"]]
