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

from memprune.synth import generate

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
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        log.close()


def test_label_job_submitted_to_a_real_cluster(ray_head, tmp_path: Path) -> None:
    address, env = ray_head
    data, out = tmp_path / "data", tmp_path / "labels"
    generate(conversations=4, sessions=3, out=data, seed=0)
    runtime_env = {"excludes": [".venv", ".git", "runs", "**/__pycache__", ".pytest_cache", ".hypothesis"],
                   "env_vars": {"HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled"}}
    proc = subprocess.run(
        [str(BIN / "ray"), "job", "submit", "--address", address, "--working-dir", str(REPO),
         "--runtime-env-json", json.dumps(runtime_env), "--submission-id", "memprune-label-test", "--",
         "python", "jobs/label.py", "configs/label-similarity.yaml", f"data={data}", f"out={out}",
         "shard_size=64", "progress=false"],
        capture_output=True, text=True, env=env, timeout=480,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from ray.job_submission import JobStatus, JobSubmissionClient

    assert JobSubmissionClient(address).get_job_status("memprune-label-test") == JobStatus.SUCCEEDED
    labels = pq.read_table(out / "labels.parquet")
    bullets = pq.read_table(data / "bullets.parquet").to_pylist()
    last = max(b["session_index"] for b in bullets)
    assert labels.num_rows == sum(1 for b in bullets if b["session_index"] < last)
    assert all(0.0 <= x <= 1.0 for x in labels.column("label").to_pylist())
    summary = json.loads((out / "label.json").read_text())
    assert summary["judge"].startswith("similarity")
