"""A real Ray cluster on loopback: `ray start --head`, `ray job submit --working-dir`, SUCCEEDED, outputs.

The head runs with `--block` in its own process group, so the test stops exactly that cluster
(never `ray stop`, which would also kill the test session's own local Ray instance).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def wait_for(url: str, head: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if head.poll() is not None:
            raise RuntimeError(f"the Ray head exited with status {head.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f} s")


@pytest.fixture()
def ray_head(tmp_path: Path):
    """A one-node Ray cluster on 127.0.0.1 with the job server; yields the dashboard address."""
    gcs, dash, agent_http, agent_grpc, metrics, env_agent, client, node_mgr, obj_mgr = free_ports(9)
    # the venv first on PATH, as with an activated environment: the job's `python` is this interpreter
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("RAY_ADDRESS", None)
    log = open(tmp_path / "head.log", "w")
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs}",
         "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
         f"--dashboard-agent-listen-port={agent_http}", f"--dashboard-agent-grpc-port={agent_grpc}",
         f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={env_agent}",
         f"--ray-client-server-port={client}", f"--node-manager-port={node_mgr}",
         f"--object-manager-port={obj_mgr}", "--num-cpus=2", "--disable-usage-stats"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )
    address = f"http://127.0.0.1:{dash}"
    try:
        wait_for(f"{address}/api/version", head, timeout=120)
        yield address, env
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=5)
        except subprocess.TimeoutExpired:  # its graceful stop waits on every process in turn (30 s and more)
            pass
        try:
            os.killpg(head.pid, signal.SIGKILL)  # whatever of this cluster is still up
        except ProcessLookupError:
            pass
        head.wait(timeout=60)
        log.close()
        # `ray start` named this cluster in /tmp/ray/ray_current_cluster; forget it, as `ray stop` would
        from ray._common.utils import get_ray_address_file

        current = Path(get_ray_address_file(None))
        if current.exists() and current.read_text().strip().endswith(f":{gcs}"):
            current.unlink()


RUNTIME_ENV = {"excludes": [".venv", ".git", "runs", "**/__pycache__", ".pytest_cache", ".hypothesis"],
               "env_vars": {"HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled"}}
TINY_TRAIN = ["train.stages=[vanilla,stage1]", "train.seeds=[0]", "train.max_length=24", "train.split.valid=1",
              "train.split.test=1", "train.stage1={epochs: 2, lr: 0.003, batch_size: 32, patience: 2}",
              "train.ray.num_workers=0", "train.embed.actors=1"]


def submit(address: str, env: dict, job_id: str, *args: str, wait: bool = True, entry: tuple[str, ...] = ("python",),
           token: str | None = None) -> None:
    """`ray job submit --working-dir REPO -- python jobs/...` (`entry` before the args: the entrypoint is a shell
    command); waiting for it, it must succeed (`finish`). `token`: the cluster has Ray's token auth on, and the
    submission, the job and the wait use it as the README says (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN)."""
    runtime_env = RUNTIME_ENV
    if token is not None:
        env = {**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
        runtime_env = {**RUNTIME_ENV, "env_vars": {**RUNTIME_ENV["env_vars"], "RAY_AUTH_MODE": "token"}}
    proc = subprocess.run(
        [str(BIN / "ray"), "job", "submit", "--address", address, "--working-dir", str(REPO),
         "--runtime-env-json", json.dumps(runtime_env), "--submission-id", job_id, *([] if wait else ["--no-wait"]),
         "--", *entry, *args],
        capture_output=True, text=True, env=env, timeout=480,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if wait:
        finish(address, job_id, token=token)


def jobs_client(address: str, token: str | None = None):
    """The job server's client (with the bearer token where the cluster has token auth on)."""
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(address, headers=None if token is None else {"Authorization": f"Bearer {token}"})


def finish(address: str, job_id: str, timeout: float = 480, token: str | None = None) -> None:
    """Wait for a submitted job; it must end SUCCEEDED (else its log's tail is the failure)."""
    from ray.job_submission import JobStatus

    client = jobs_client(address, token)
    deadline = time.monotonic() + timeout
    while (status := client.get_job_status(job_id)) not in {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}:
        assert time.monotonic() < deadline, f"{job_id} still {status} after {timeout:.0f} s"
        time.sleep(1)
    assert status == JobStatus.SUCCEEDED, client.get_job_logs(job_id)[-3000:]


def test_jobs_submitted_to_a_real_cluster(ray_head, scorer_dir: Path, tmp_path: Path) -> None:
    """jobs/label.py, jobs/train.py and jobs/prune.py submitted at once, as users queue jobs on a cluster, on one
    real cluster (jobs/pipeline.py goes through `ray job submit` in tests/test_cluster_two_nodes.py)."""
    from helpers import labels_for

    from memprune.io import write_table
    from memprune.synth import generate

    address, env = ray_head
    data, given = tmp_path / "data", tmp_path / "given-labels"
    generate(conversations=6, sessions=3, out=data, seed=5)
    write_table(labels_for(pq.read_table(data / "bullets.parquet")), given / "labels.parquet", "labels")

    labels, train, pruned = tmp_path / "labels", tmp_path / "train", tmp_path / "pruned"
    jobs = {
        "memprune-label-test": ["jobs/label.py", "configs/label-similarity.yaml", f"data={data}", f"out={labels}",
                                "shard_size=64", "progress=false"],
        "memprune-train-test": ["jobs/train.py", "configs/train-local.yaml", f"data={data}", f"labels={given}",
                                f"out={train}", *(a.removeprefix("train.") for a in TINY_TRAIN)],
        "memprune-prune-test": ["jobs/prune.py", "configs/prune-local.yaml", f"scorer={scorer_dir}", f"input={data}",
                                f"out={pruned}", "progress=false"],
    }
    for job_id, args in jobs.items():
        submit(address, env, job_id, *args, wait=False)
    for job_id in jobs:
        finish(address, job_id)

    table = pq.read_table(labels / "labels.parquet")
    bullets = pq.read_table(data / "bullets.parquet").to_pylist()
    last = max(b["session_index"] for b in bullets)
    assert table.num_rows == sum(1 for b in bullets if b["session_index"] < last)
    assert all(0.0 <= x <= 1.0 for x in table.column("label").to_pylist())
    assert json.loads((labels / "label.json").read_text())["judge"].startswith("similarity")
    assert (train / "stage1" / "seed0" / "head.safetensors").is_file() and not (train / "eval").exists()
    summary = json.loads((pruned / "prune.json").read_text())
    assert summary["input"]["rows"] == summary["output"]["rows"] == len(bullets)
