"""Benchmark the prune job's object-storage path against its local-disk path, on the same store and scorer.

For each size a synthetic store (`memprune synth`) and a vanilla scorer are made (by `bench/common.py`'s helpers,
kept under --out). The job then runs twice on a fresh local Ray each time: input, scorer and output on the
local disk, then all three on S3. The S3 endpoint is `AWS_ENDPOINT_URL` when set (with the usual credentials),
else moto's standalone server started here on a free loopback port, so the figures measure memprune's
storage path plus an S3 protocol round trip, not a network. The tiny random encoder (default) keeps the
forward pass small, so that the I/O shows; `--encoder minilm` measures the real one.

    python bench/storage_bench.py --bullets 100000 1000000

Prints one line per size (wall seconds and bullets/s of each path, and the S3/local ratio) and writes
OUT/storage_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import make_scorers, make_store  # noqa: E402


def _s3_endpoint(out: Path) -> tuple[str, subprocess.Popen | None]:
    if os.environ.get("AWS_ENDPOINT_URL"):
        return os.environ["AWS_ENDPOINT_URL"], None
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    log = open(out / "moto.log", "w")
    proc = subprocess.Popen([str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    for _ in range(300):
        try:
            with urllib.request.urlopen(endpoint, timeout=2):
                break
        except OSError:
            time.sleep(0.2)
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID=os.environ.get("AWS_ACCESS_KEY_ID", "bench"),
                      AWS_SECRET_ACCESS_KEY=os.environ.get("AWS_SECRET_ACCESS_KEY", "bench"),
                      AWS_DEFAULT_REGION=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"))
    return endpoint, proc


def _job(scorer: str, store: str, out: str, args: argparse.Namespace) -> dict:
    """One prune job in a fresh process (its own Ray); its prune.json."""
    code = ("import json, sys\nfrom memprune.prune import PruneConfig, run_prune\n"
            "s = run_prune(PruneConfig(scorer=sys.argv[1], input=sys.argv[2], out=sys.argv[3], progress=False, "
            "block_rows=int(sys.argv[4]), actors=int(sys.argv[5]) if sys.argv[5] != '0' else None, "
            "rule={'top_k': 5}))\nprint('RESULT ' + json.dumps(s['timing']))\n")
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, scorer, store, out, str(args.block_rows), str(args.actors or 0)],
                          capture_output=True, text=True, env={**os.environ, "MEMPRUNE_QUIET": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"job failed ({out}): {proc.stderr[-2000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return {"process_s": round(time.perf_counter() - started, 2), **json.loads(line[7:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bullets", type=int, nargs="+", default=[100_000])
    parser.add_argument("--encoder", default="tiny", choices=["tiny", "minilm"])
    parser.add_argument("--block-rows", type=int, default=4096)
    parser.add_argument("--actors", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("/tmp/memprune-storage-bench"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    endpoint, server = _s3_endpoint(args.out)
    from pyarrow import fs

    s3 = fs.S3FileSystem(endpoint_override=endpoint, allow_bucket_creation=True)
    bucket = f"memprune-bench-{uuid.uuid4().hex[:8]}"
    s3.create_dir(bucket)
    scorer = make_scorers(args.out, [args.encoder])[args.encoder]
    fs.copy_files(str(scorer), f"{bucket}/scorer", source_filesystem=fs.LocalFileSystem(), destination_filesystem=s3)
    rows = []
    try:
        for n in args.bullets:
            store = make_store(n, args.out)
            fs.copy_files(str(store / "bullets.parquet"), f"{bucket}/store-{n}/bullets.parquet", source_filesystem=fs.LocalFileSystem(),
                          destination_filesystem=s3)
            local = _job(str(scorer), str(store), str(args.out / f"pruned-local-{n}"), args)
            remote = _job(f"s3://{bucket}/scorer", f"s3://{bucket}/store-{n}/bullets.parquet",
                          f"s3://{bucket}/pruned-{n}", args)
            row = {"bullets": n, "encoder": args.encoder, "local": local, "s3": remote,
                   "s3_over_local_throughput": round(remote["bullets_per_s"] / local["bullets_per_s"], 3)}
            rows.append(row)
            print(f"{n:>9} bullets ({args.encoder}): local {local['wall_s']:.1f} s ({local['bullets_per_s']:.0f}/s), "
                  f"s3 {remote['wall_s']:.1f} s ({remote['bullets_per_s']:.0f}/s): s3/local {row['s3_over_local_throughput']:.2f}",
                  flush=True)
    finally:
        if server is not None:
            server.terminate()
    report = {"endpoint": endpoint, "moto": server is not None, "rows": rows}
    (args.out / "storage_bench.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out / 'storage_bench.json'}")


if __name__ == "__main__":
    main()
