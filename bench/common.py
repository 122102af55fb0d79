"""What the benches share: the offline environment of their child processes, a child run that prints one JSON
result, the peak memory of a process tree, and the synthetic stores and scorers they measure on."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def child_env() -> dict[str, str]:
    """The environment of a bench's child process: offline, Ray without auth, memprune importable."""
    env = dict(os.environ)
    for k, v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_AUTH_MODE": "disabled",
                 "TOKENIZERS_PARALLELISM": "false", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}.items():
        env.setdefault(k, v)
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


def make_store(bullets: int, out: Path) -> Path:
    """A synthetic store of about `bullets` bullets (memprune synth, 4 sessions), reused when present."""
    store = out / f"synth-{bullets}"
    if (store / "bullets.parquet").is_file():
        return store
    from memprune.synth import SynthSettings, synth_conversation

    pilot = SynthSettings(conversations=200, sessions=4, seed=0)
    per_conv = sum(len(synth_conversation(i, pilot).bullets) for i in range(200)) / 200
    n = max(1, math.ceil(bullets / per_conv))
    subprocess.run([sys.executable, "-m", "memprune.cli", "synth", "-n", str(n), "--out", str(store), "--seed", "0"],
                   check=True, env=child_env(), cwd=ROOT)
    return store


def make_scorers(out: Path, encoders: list[str]) -> dict[str, Path]:
    """Vanilla scorer artifacts: MiniLM (the real encoder) and optionally a tiny random BERT."""
    from memprune.encoders import minilm_path
    from memprune.scorer import Scorer, ScorerConfig

    made: dict[str, Path] = {}
    for name in encoders:
        path = out / f"scorer-{name}"
        if not (path / "scorer.json").is_file():
            if name == "minilm":
                encoder = minilm_path()
            elif name == "tiny":
                encoder = str(tiny_encoder(out / "encoder-tiny"))
            else:
                raise SystemExit(f"unknown encoder {name!r} (minilm, tiny)")
            Scorer.build(ScorerConfig(encoder=encoder), seed=0).save(path)
        made[name] = path
    return made


def tiny_encoder(path: Path) -> Path:
    """A 2-layer, 64-dim BERT with random weights and MiniLM's tokenizer, saved locally."""
    if (path / "config.json").is_file():
        return path
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from memprune.encoders import minilm_path

    tok = AutoTokenizer.from_pretrained(minilm_path())
    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=tok.vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=128, max_position_embeddings=512))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def run_child(script: str, kind: str, args: dict[str, Any], mark: str = "") -> dict[str, Any]:
    """Run one measurement of `script` (`--child KIND ARGS`) in a fresh Python process: the result is its last
    stdout line (the last starting with `mark`, where given) as JSON."""
    proc = subprocess.run([sys.executable, script, "--child", kind, json.dumps(args)], env=child_env(), cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{kind} measurement failed for {args}")
    lines = [ln[len(mark):] for ln in proc.stdout.splitlines() if ln.startswith(mark) and ln.strip()]
    if not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise SystemExit(f"{kind}: no result line for {args}")
    return json.loads(lines[-1])


class PeakMemory(threading.Thread):
    """Samples this process and all its descendants (Ray's too): peak summed PSS, CPU seconds per process.

    PSS costs ~5 ms per process to read (the kernel walks the page tables), so it is sampled
    every `pss_every` seconds only; CPU times (cheap) every `interval` seconds.
    """

    def __init__(self, interval: float = 0.5, pss_every: float = 2.0) -> None:
        super().__init__(daemon=True)
        self.interval, self.pss_every, self.peak, self.samples = interval, pss_every, 0, 0
        self.cpu: dict[int, float] = {}
        self._lock = threading.Lock()
        self._stop_event = threading.Event()

    def sample(self, pss: bool = True) -> None:
        import psutil

        root = psutil.Process()
        total = 0
        for p in [root, *root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                with self._lock:
                    self.cpu[p.pid] = t.user + t.system
                if pss:
                    info = p.memory_full_info()
                    total += getattr(info, "pss", info.rss)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        if pss:
            self.peak = max(self.peak, total)
            self.samples += 1

    def cpu_snapshot(self) -> dict[int, float]:
        self.sample(pss=False)
        with self._lock:
            return dict(self.cpu)

    def run(self) -> None:
        last_pss = 0.0
        while not self._stop_event.is_set():
            now = time.monotonic()
            self.sample(pss=now - last_pss >= self.pss_every)
            if now - last_pss >= self.pss_every:
                last_pss = now
            self._stop_event.wait(self.interval)

    def stop(self) -> int:
        self._stop_event.set()
        self.join()
        self.sample()
        return self.peak
