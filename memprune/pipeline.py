"""The whole method in one run: corpus -> labels -> scorer (3 stages x seeds) -> evaluation -> pruning.

`jobs/pipeline.py` and `memprune quickstart` call `run`. Each step writes under its own
directory of `out` and is resumable on its own, so a rerun after a crash redoes only what is
unfinished. `out` may be a local directory or a URI that pyarrow understands
(`s3://bucket/prefix`, `gs://...`, `file:///...`): every step then reads its inputs from the
URI and commits its output set there itself (Ray Train's storage is `<out>/train/ray`), so
every node and later job sees the same tables. The pruning rule is set once (`rule:`) and
used by both the evaluation's pruning tables and the prune step.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import Field, ValidationError, model_validator
from rich.console import Console

from memprune import stages as registry
from memprune.adapters import formats, get_adapter
from memprune.config import ConfigError, ConfigModel, merge, parse_overrides, validate
from memprune.decision import PruneRule
from memprune.evaluate.config import EvalSettings
from memprune.label.config import LabelSettings
from memprune.prune.config import PruneSettings
from memprune.storage import location
from memprune.synth.config import SynthSettings
from memprune.train.config import TrainSettings

STEPS = ("data", "label", "train", "evaluate", "prune")
Step = Literal["data", "label", "train", "evaluate", "prune"]
DIRS = {"data": "data", "label": "label", "train": "train", "evaluate": "report", "prune": "prune"}
console = Console(stderr=True)


class CorpusSpec(SynthSettings):
    """Where the corpus comes from: generated (`synth`, with the synth settings) or ingested from a source format."""

    format: Literal["synth", "msc", "locomo", "jsonl"] = "synth"
    conversations: int = Field(60, description="synth: number of conversations (a quick local run)")
    input: str | None = Field(None, description="source path for msc/locomo/jsonl")
    split: str | None = Field(None, description="split for layouts that have them (msc: valid)")

    @model_validator(mode="after")
    def _input(self) -> "CorpusSpec":
        if self.format != "synth" and self.input is None:
            raise ValueError(f"corpus.format={self.format} needs corpus.input")
        return self


class PipelineConfig(ConfigModel):
    """Config of `jobs/pipeline.py`: shared paths, the pruning rule, and each step's settings."""

    out: str = Field(description="local directory or storage URI (s3://..., file://...) for every step's output")
    corpus: CorpusSpec = Field(default_factory=CorpusSpec)
    steps: list[Step] = Field(default_factory=lambda: list(STEPS))
    rule: PruneRule = Field(default_factory=PruneRule, description="the pruning rule of the evaluation and the prune step")
    label: LabelSettings = Field(default_factory=LabelSettings)
    train: TrainSettings = Field(default_factory=TrainSettings)
    evaluate: EvalSettings = Field(default_factory=EvalSettings)
    prune: PruneSettings = Field(default_factory=PruneSettings)
    prune_scorer: str | None = Field(
        None, description="stage/seed of the scorer that prunes, e.g. stage2/seed0 (default: last trained stage, first seed)"
    )

    @model_validator(mode="before")
    @classmethod
    def _rule_once(cls, data: Any) -> Any:
        """A step's own `rule` is refused before that step's settings are checked, so the message names the fix."""
        for section in ("evaluate", "prune"):
            given = data.get(section) if isinstance(data, dict) else None
            if (isinstance(given, dict) and "rule" in given) or (
                    isinstance(given, ConfigModel) and "rule" in given.model_fields_set):
                raise ValueError(f"{section}.rule: set the pruning rule once, as the top-level `rule`")
        return data

    @model_validator(mode="after")
    def _one_rule(self) -> "PipelineConfig":
        self.prune = _with_rule(PruneSettings, self.prune, self.rule, "prune")
        if "evaluate" in self.steps:
            # The evaluation reports the rule's policy the paper's way: no min-keep, no floor, no duplicate merging
            # (for the paper's rule its Table 4). Checked only when evaluate runs: without it a rule only prune can
            # use is fine.
            paper = PruneRule.of(**{**self.rule.model_dump(), "min_keep": 0, "floor": None, "dedup": False})
            self.evaluate = _with_rule(EvalSettings, self.evaluate, paper, "evaluate")
        return self


S = TypeVar("S", bound=ConfigModel)


def _with_rule(model: type[S], settings: S, rule: PruneRule, step: str) -> S:
    """`settings` with the pipeline's `rule`, validated again by the step's own model.

    A `model_copy(update=...)` would skip the step's checks of its rule (evaluate measures sessions
    and needs a threshold), so a bad rule would load, run label and train, then fail at that step.
    """
    try:
        return model.model_validate({**settings.model_dump(), "rule": rule.model_dump()})
    except ValidationError as exc:
        problems = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
        raise ValueError(f"the {step} step cannot use the pipeline's rule: {problems}"
                         + (" (or leave evaluate out of steps)" if step == "evaluate" else "")) from exc


def _step(step: str, cfg: PipelineConfig, dirs: dict[str, str]) -> dict[str, Any]:
    """Run one step from its typed settings and the shared directories (paths or URIs under `out`); its headline."""
    if step == "data":
        c = cfg.corpus
        if c.format == "synth":
            from memprune.synth import SynthConfig
            from memprune.synth import run as synth

            result = synth(validate(SynthConfig, {**c.model_dump(include=set(SynthSettings.model_fields)),
                                                  "out": dirs["data"]}, "pipeline data"))
        else:
            from memprune.ingest import ingest

            result = ingest(c.format, c.input or "", dirs["data"], split=c.split)
        return result["counts"]
    if step == "label":
        from memprune.label import LabelConfig
        from memprune.label import run as label

        result = label(validate(LabelConfig, {**cfg.label.model_dump(), "data": dirs["data"], "out": dirs["label"]},
                                "pipeline label"))
        return {"bullets_labelled": result["counts"]["bullets_labelled"], "pairs": result["counts"].get("pairs"),
                "error_rate": result.get("error_rate")}
    if step == "train":
        from memprune.train import TrainConfig
        from memprune.train import run as train

        train(validate(TrainConfig, {**cfg.train.model_dump(), "data": dirs["data"], "labels": [dirs["label"]],
                                     "out": dirs["train"]}, "pipeline train"))
        return {"stages": cfg.train.stages, "seeds": cfg.train.seeds}
    if step == "evaluate":
        from memprune.evaluate import EvalConfig
        from memprune.evaluate import run as evaluate

        evaluate(validate(EvalConfig, {**cfg.evaluate.model_dump(), "run": dirs["train"], "out": dirs["evaluate"],
                                       "data": dirs["data"]}, "pipeline evaluate"))
        return {"report": f"{dirs['evaluate']}/report.md"}
    from memprune.prune import PruneConfig
    from memprune.prune import run as prune

    scorer = f"{dirs['train']}/{cfg.prune_scorer or f'{cfg.train.stages[-1]}/seed{cfg.train.seeds[0]}'}"
    result = prune(validate(PruneConfig, {**cfg.prune.model_dump(), "scorer": scorer,
                                          "input": f"{dirs['data']}/bullets.parquet", "out": dirs["prune"]},
                            "pipeline prune"))
    headline = {"rows_in": result["input"]["rows"], "rows_out": result["output"]["rows"],
                "bullet_reduction_pct": result["result"]["bullet_reduction_pct"],
                "token_reduction_pct": result["result"]["token_reduction_pct"],
                "review": (result["emitted"].get("review") or {}).get("path")}
    return headline | _emptied(result)


def _emptied(result: dict[str, Any]) -> dict[str, Any]:
    """Print the warning `memprune prune` prints when pruning left many groups empty; it also goes to pipeline.json."""
    from memprune.prune.report import emptied_warning

    warning = emptied_warning(result)
    if warning is None:
        return {}
    console.print(f"[bold yellow]warning:[/] {warning}", highlight=False)
    return {"warning": warning}


NEEDS = {"data": (), "label": ("data",), "train": ("data", "label"), "evaluate": ("data", "train"),
         "prune": ("data", "train")}


def run(cfg: PipelineConfig) -> dict[str, Any]:
    """Run the requested steps in order; return a summary with each step's headline numbers."""
    c = cfg.corpus
    if "data" in cfg.steps and c.format != "synth" and not Path(c.input or "").exists():
        raise ConfigError(f"{c.input}: corpus.input not found (no such file or directory)")
    root = location(cfg.out.rstrip("/"), "out")
    root.check_reachable()
    dirs = {step: str(root / name) for step, name in DIRS.items()}
    summary: dict[str, Any] = {"out": cfg.out, "steps": {}}
    started = time.perf_counter()
    for step in (s for s in STEPS if s in cfg.steps):
        console.rule(f"[bold]memprune pipeline: {step}")
        for need in NEEDS[step]:  # an earlier step's output
            if not (root / DIRS[need]).exists():
                raise FileNotFoundError(f"step {need!r} has no output at {dirs[need]}; run it first (steps: {cfg.steps})")
        t0 = time.perf_counter()
        headline = _step(step, cfg, dirs)
        summary["steps"][step] = {"seconds": round(time.perf_counter() - t0, 2), "dir": dirs[step], **headline}
    summary["seconds"] = round(time.perf_counter() - started, 2)
    summary["report"] = f"{dirs['evaluate']}/report.md"
    # one small object, written whole (temp + rename on a disk, one PUT on object storage), after every step
    (root / "pipeline.json").write_text(json.dumps(summary, indent=2, sort_keys=True, ensure_ascii=False, default=str)
                                        + "\n")
    return summary


def quickstart_config(out: str, data: str | None = None, overrides: list[str] | None = None) -> PipelineConfig:
    """The quickstart: the local pipeline on a synthetic corpus, or on `data` given as FORMAT:PATH;
    `overrides` are `key=value` items (the CLI's --set) over its settings."""
    corpus = CorpusSpec()
    if data:
        fmt, sep, path = data.partition(":")
        if not sep or fmt not in formats():
            raise ConfigError(f"--data must be FORMAT:PATH with FORMAT {', '.join(formats())}, got {data!r}")
        corpus = CorpusSpec(format=fmt, input=path, split=get_adapter(fmt).default_split)
    first, second = (s.name for s in registry.trained_chain())  # the optimiser sections of stage 1 and stage 2
    return validate(PipelineConfig, merge({
        "out": out,
        "corpus": corpus.model_dump(),
        "label": {"judge": "similarity"},
        "train": {"seeds": [0, 1, 2], "max_length": 32,
                  first: {"epochs": 40, "lr": 0.003, "batch_size": 64, "patience": 5},
                  second: {"epochs": 2, "lr": 0.0005, "batch_size": 32, "patience": 1},
                  "ray": {"num_workers": 1, "cpus_per_worker": 1}},
    }, parse_overrides(overrides)), "quickstart --set")


def headline(report_dir: str | Path) -> str:
    """The report's main tables (test split, mean ± std over seeds) as Markdown; `report_dir` may be a URI."""
    from memprune.evaluate.report import quality_tables
    from memprune.storage import location

    metrics = json.loads((location(report_dir) / "metrics.json").read_text())
    split = metrics["splits"].get("test") or next(iter(metrics["splits"].values()))
    return "\n".join(quality_tables(split, metrics["config"]["baseline"], metrics["config"]["ks"]))


run_pipeline = run
