"""The whole method in one run: corpus -> labels -> scorer (3 stages x seeds) -> evaluation -> pruning.

`jobs/pipeline.py` and `memprune quickstart` call `run_pipeline`. Each stage writes under its
own directory of `out` and is resumable on its own, so a rerun after a crash redoes only what
is unfinished. `out` may be a local directory or a URI that pyarrow understands
(`s3://bucket/prefix`, `gs://...`, `file:///...`): stages then run in a local staging
directory and each finished stage's directory is uploaded, so every node and later job sees
the same tables.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from rich.console import Console

from memprune.io import write_json

STAGES = ("data", "label", "train", "evaluate", "prune")
Stage = Literal["data", "label", "train", "evaluate", "prune"]
console = Console(stderr=True)


class CorpusSpec(BaseModel):
    """Where the corpus comes from: generated (`synth`) or ingested from a source format."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["synth", "msc", "locomo", "jsonl"] = "synth"
    input: str | None = Field(None, description="source path for msc/locomo/jsonl")
    split: str | None = Field(None, description="split for layouts that have them (msc: valid)")
    conversations: int = Field(60, ge=2, description="synth: number of conversations")
    sessions: int = Field(4, ge=2, description="synth: sessions per conversation")
    seed: int = Field(0, description="synth: generator seed")


class PipelineConfig(BaseModel):
    """Config of `jobs/pipeline.py`: shared paths plus each stage's own config section."""

    model_config = ConfigDict(extra="forbid")

    out: str = Field(description="local directory or storage URI (s3://..., file://...) for every stage's output")
    corpus: CorpusSpec = Field(default_factory=CorpusSpec)
    stages: list[Stage] = Field(default_factory=lambda: list(STAGES))
    staging_dir: str | None = Field(None, description="local working copy when `out` is a URI (default: a temp dir)")
    label: dict[str, Any] = Field(default_factory=dict, description="memprune.label.LabelConfig fields")
    train: dict[str, Any] = Field(default_factory=dict, description="memprune.train.TrainConfig fields")
    evaluate: dict[str, Any] = Field(default_factory=dict, description="memprune.evaluate.EvalConfig fields")
    prune: dict[str, Any] = Field(default_factory=dict, description="memprune.prune.PruneConfig fields")
    prune_scorer: str | None = Field(
        None, description="stage/seed of the scorer that prunes, e.g. stage2/seed0 (default: last trained stage, first seed)"
    )


def is_uri(path: str) -> bool:
    return "://" in path


def _upload(local: Path, uri: str) -> None:
    """Copy a finished stage directory to `uri` (any pyarrow filesystem)."""
    from pyarrow import fs

    filesystem, root = fs.FileSystem.from_uri(uri)
    filesystem.create_dir(root, recursive=True)
    fs.copy_files(str(local), root, source_filesystem=fs.LocalFileSystem(), destination_filesystem=filesystem)


def _download(uri: str, local: Path) -> bool:
    """Fetch a stage directory from `uri` into `local`; False when it does not exist there."""
    from pyarrow import fs

    filesystem, root = fs.FileSystem.from_uri(uri)
    if filesystem.get_file_info(root).type == fs.FileType.NotFound:
        return False
    local.mkdir(parents=True, exist_ok=True)
    fs.copy_files(root, str(local), source_filesystem=filesystem, destination_filesystem=fs.LocalFileSystem())
    return True


def _scorer_dir(train_dir: Path, cfg: PipelineConfig, train_cfg: Any) -> Path:
    if cfg.prune_scorer:
        return train_dir / cfg.prune_scorer
    return train_dir / train_cfg.stages[-1] / f"seed{train_cfg.seeds[0]}"


def run_pipeline(cfg: PipelineConfig) -> dict[str, Any]:
    """Run the requested stages in order; return a summary with each stage's headline numbers."""
    from memprune.evaluate import evaluate_run
    from memprune.ingest import ingest
    from memprune.label import LabelConfig, run_label
    from memprune.prune import PruneConfig, run_prune
    from memprune.synth import generate
    from memprune.train import TrainConfig, run_training

    remote = cfg.out if is_uri(cfg.out) else None
    if remote:
        root = Path(cfg.staging_dir or tempfile.mkdtemp(prefix="memprune-staging-"))
    else:
        root = Path(cfg.out)
    root.mkdir(parents=True, exist_ok=True)
    dirs = {stage: root / stage for stage in STAGES}
    dirs["evaluate"] = root / "report"
    summary: dict[str, Any] = {"out": cfg.out, "stages": {}}
    started = time.perf_counter()

    def needs(stage: str) -> None:
        """Make an earlier stage's output available locally (download it when `out` is a URI)."""
        if not dirs[stage].exists() and not (remote and _download(f"{remote.rstrip('/')}/{dirs[stage].name}", dirs[stage])):
            raise FileNotFoundError(f"stage {stage!r} has no output at {dirs[stage]}; run it first (stages: {cfg.stages})")

    label_cfg = LabelConfig.model_validate({**cfg.label, "data": dirs["data"], "out": dirs["label"]})
    train_cfg = TrainConfig.model_validate({**cfg.train, "data": dirs["data"], "labels": dirs["label"],
                                            "out": dirs["train"], "evaluate": False})  # its own stage here
    for stage in (s for s in STAGES if s in cfg.stages):
        console.rule(f"[bold]memprune pipeline: {stage}")
        t0 = time.perf_counter()
        if stage == "data":
            c = cfg.corpus
            if c.format == "synth":
                result = generate(conversations=c.conversations, sessions=c.sessions, out=dirs["data"], seed=c.seed)
            else:
                if c.input is None:
                    raise ValueError(f"corpus.format={c.format} needs corpus.input")
                result = ingest(c.format, c.input, dirs["data"], split=c.split)
            headline = result["counts"]
        elif stage == "label":
            needs("data")
            result = run_label(label_cfg)
            headline = {"bullets_labelled": result["counts"]["bullets_labelled"],
                        "pairs": result["counts"].get("pairs"), "error_rate": result.get("error_rate")}
        elif stage == "train":
            needs("data"), needs("label")
            result = run_training(train_cfg)
            headline = {"stages": train_cfg.stages, "seeds": train_cfg.seeds}
        elif stage == "evaluate":
            needs("data"), needs("train")
            result = evaluate_run(dirs["train"], dirs["evaluate"], data_dir=dirs["data"], config=eval_config(cfg.evaluate))
            headline = {"report": str(dirs["evaluate"] / "report.md")}
        else:  # prune
            needs("data"), needs("train")
            prune_cfg = PruneConfig.model_validate({
                "scorer": str(_scorer_dir(dirs["train"], cfg, train_cfg)),
                "input": str(dirs["data"] / "bullets.parquet"),
                "out": str(dirs["prune"]),
                **cfg.prune,
            })
            result = run_prune(prune_cfg)
            headline = {"rows_in": result["input"]["rows"], "rows_out": result["output"]["rows"],
                        "bullet_reduction_pct": result["result"]["bullet_reduction_pct"],
                        "token_reduction_pct": result["result"]["token_reduction_pct"]}
        if remote:
            _upload(dirs[stage], f"{remote.rstrip('/')}/{dirs[stage].name}")
        summary["stages"][stage] = {"seconds": round(time.perf_counter() - t0, 2), "dir": str(dirs[stage]), **headline}
    summary["seconds"] = round(time.perf_counter() - started, 2)
    summary["report"] = str(dirs["evaluate"] / "report.md")
    write_json(root / "pipeline.json", json.loads(json.dumps(summary, default=str)))
    if remote:
        _upload_file(root / "pipeline.json", f"{remote.rstrip('/')}/pipeline.json")
    return summary


def _upload_file(local: Path, uri: str) -> None:
    from pyarrow import fs

    filesystem, path = fs.FileSystem.from_uri(uri)
    with filesystem.open_output_stream(path) as fh:
        fh.write(local.read_bytes())


def eval_config(values: dict[str, Any]) -> Any:
    """An `EvalConfig` (a dataclass) from a config section; unknown keys are an error."""
    from dataclasses import fields

    from memprune.evaluate import EvalConfig

    known = {f.name for f in fields(EvalConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown evaluate option(s) {unknown}; known: {sorted(known)}")
    return EvalConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def quickstart_config(out: str, data: str | None = None) -> PipelineConfig:
    """The quickstart: the local pipeline on a synthetic corpus, or on `data` given as FORMAT:PATH."""
    corpus = CorpusSpec()
    if data:
        fmt, sep, path = data.partition(":")
        if not sep or fmt not in ("msc", "locomo", "jsonl"):
            raise ValueError(f"--data must be FORMAT:PATH with FORMAT msc, locomo or jsonl, got {data!r}")
        corpus = CorpusSpec(format=fmt, input=path, split="valid" if fmt == "msc" else None)
    return PipelineConfig(
        out=out,
        corpus=corpus,
        label={"judge": "similarity"},
        train={"seeds": [0, 1, 2], "max_length": 32,
               "stage1": {"epochs": 40, "lr": 0.003, "batch_size": 64, "patience": 5},
               "stage2": {"epochs": 2, "lr": 0.0005, "batch_size": 32, "patience": 1},
               "ray": {"num_workers": 1, "cpus_per_worker": 1}},
        prune={"threshold": 0.5, "top_k": 5},
    )


def headline(report_dir: str | Path) -> str:
    """The report's main tables (test split, mean ± std over seeds) as Markdown."""
    from memprune.report import quality_tables

    metrics = json.loads((Path(report_dir) / "metrics.json").read_text())
    split = metrics["splits"].get("test") or next(iter(metrics["splits"].values()))
    return "\n".join(quality_tables(split, metrics["config"]["baseline"], metrics["config"]["ks"]))
