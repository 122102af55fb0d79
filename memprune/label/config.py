"""Settings of `memprune label`, validated once: label source, pair building, judge, aggregation, sharding.

`LabelSettings` holds every option and is what the pipeline's `label:` section is; `LabelConfig`
adds the corpus directory (`data`) and the output directory (`out`).
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from memprune.config import ConfigModel, Place
from memprune.label.errors import LabelError  # noqa: F401  (re-exported: memprune.label.config.LabelError)
from memprune.label.judges import JUDGES, JudgeEntry, judge_of
from memprune.label.pairs import PairOptions
from memprune.label.sources.common import SOURCES


class SimilarityOptions(ConfigModel):
    """Settings of the similarity (encoder proxy) judge."""

    model: str | None = Field(None, description="Encoder path or hub id; default: local all-MiniLM-L6-v2.")
    batch_size: int = Field(128, ge=1)
    max_length: int = Field(128, ge=8)
    mapping: Literal["clip", "affine"] = "clip"
    device: str = "cpu"
    executor: Literal["local", "ray"] = Field("local", description="Encode shards in-process or on a Ray Data actor pool.")
    actors: int = Field(2, ge=1, description="Actor pool size for executor=ray.")


class ListwiseOptions(ConfigModel):
    """judge=llm, judge_mode=listwise: one prompt per target turn listing its bullets (`memprune.label.listwise`)."""

    orders: int = Field(1, ge=1, le=4, description="score each list in this many orders (2: also reversed)")
    seed: int = Field(0, description="seed of the per-turn shuffle of the bullets (position-bias control)")
    max_bullets: int = Field(20, ge=1, description="bullets per list; longer lists are split into chunks")
    max_prompt_tokens: int | None = Field(
        None, ge=64, description="prompt token budget of one list; None: the judge's max_model_len minus the output")
    tokens_per_bullet: int = Field(16, ge=4, description="generated-token budget per listed bullet (+ 8 per list)")


class LikelihoodOptions(ConfigModel):
    """judge=likelihood: gain = mean log p(turn | context, bullet) - mean log p(turn | context) (nats/token)."""

    mapping: Literal["tanh", "sigmoid"] = Field(
        "tanh", description="gain -> [0, 1]: tanh = tanh(max(gain, 0) / scale); sigmoid = 1 / (1 + exp(-gain / scale))")
    scale: float = Field(0.25, gt=0, description="nats per token of gain that map to tanh(1) ~ 0.76 (sigmoid: 0.73)")


class CostOptions(ConfigModel):
    """Cost accounting and `--plan`: which tokenizer counts prompt tokens, and the throughput for GPU-hours."""

    tokenizer: str | None = Field(
        None, description="fallback tokenizer (local dir or tokenizer.json) when the judge model's is not local; "
                          "default: the local all-MiniLM-L6-v2 tokenizer")
    throughput: float | None = Field(
        None, gt=0, description="GPU throughput in prompt tokens/s (prefill not served by the prefix cache)")
    decode_throughput: float | None = Field(
        None, gt=0, description="GPU throughput in generated tokens/s; None: the same as `throughput`")
    block_size: int = Field(16, ge=1, description="prefix-cache block: only whole blocks of a shared prefix are reused")
    measure: int | None = Field(
        None, ge=1, description="--plan: first judge this many real pairs with the chosen judge on this hardware and "
                                "plan the run's time from the measured throughput")


class QALabelSettings(ConfigModel):
    """source=qa: how QA evidence becomes labels (see `memprune.label.sources.qa_labels`)."""

    grading: Literal["binary", "graded"] = Field("binary", description="binary: cited at all; graded: by citing questions")
    grade_cap: int = Field(3, ge=1, description="graded: label = min(1, n_citing / grade_cap)")
    later_only: bool = Field(False, description="count only questions whose evidence reaches a later session")
    categories: list[int] | None = Field(None, description="only QA items of these categories (None = all)")


class UsageLabelSettings(ConfigModel):
    """source=usage: the usage log and how its events become labels (see `memprune.label.sources.usage_labels`)."""

    log: Path | None = Field(None, description="usage log: a .parquet/.jsonl file or a directory of them")
    aggregation: Literal["max", "mean"] = Field("max", description="label = max or mean of the event values")
    missing: Literal["unlabelled", "zero"] = Field("unlabelled", description="bullets without events")
    since: datetime | None = Field(None, description="count only events at or after this time")
    until: datetime | None = Field(None, description="count only events at or before this time")


class LabelSettings(ConfigModel):
    """Every option of `memprune label` except the paths (the pipeline's `label:` section)."""

    source: str = Field("judge", description="a label source of SOURCES: judge (LLM/similarity), qa or usage")
    qa: QALabelSettings = Field(default_factory=QALabelSettings)
    usage: UsageLabelSettings = Field(default_factory=UsageLabelSettings)
    judge: str = Field("similarity", description="which judge: a `judge` of the JUDGES registry (label/judges.py)")
    judge_mode: str = Field(
        "pairwise", description="llm: one prompt per pair (the paper's) or one per target turn listing its bullets")
    listwise: ListwiseOptions = Field(default_factory=ListwiseOptions)
    likelihood: LikelihoodOptions = Field(default_factory=LikelihoodOptions)
    judge_set: list[Path] = Field(
        default_factory=list, description="several LLM config files: every pair is scored by each (consensus)")
    judge_samples: int = Field(1, ge=1, description="llm: score every pair k times at judge_temperature (consensus)")
    judge_temperature: float = Field(0.7, gt=0, description="temperature of the judge_samples samples")
    cost: CostOptions = Field(default_factory=CostOptions)
    plan: bool = Field(False, description="only compute calls, tokens and GPU-hours of the judge modes (no model run)")
    speaker: Literal["all", "same", "other"] = "all"
    context_turns: int = Field(4, ge=0)
    horizon: int = Field(1, ge=1)
    decay: float = Field(0.5, gt=0.0, le=1.0)
    aggregation: Literal["max", "mean"] = "max"
    order: Literal["target", "bullet"] = "target"
    shard_size: int | None = Field(None, ge=1, description="Texts (similarity) or pairs (llm) per shard.")
    similarity: SimilarityOptions = Field(default_factory=SimilarityOptions)
    llm_config: Path | None = Field(None, description="A YAML file of memprune.llm.LLMConfig fields.")
    llm: dict[str, Any] | None = Field(None, description="LLMConfig fields set inline (merged over llm_config).")
    llm_overrides: list[str] = Field(default_factory=list, description="key=value LLMConfig overrides, applied last.")
    llm_block_rows: int = Field(64, ge=1, description="Rows per Ray Data block fed to the LLM judge.")
    progress: bool = True

    @model_validator(mode="after")
    def _judge_settings(self) -> "LabelConfig":
        entry = judge_of(self.judge, self.judge_mode)
        model_judge = entry.needs_llm
        if self.source not in SOURCES:
            raise ValueError(f"source={self.source}: no such label source; the sources: {', '.join(SOURCES)}")
        check = SOURCES[self.source].check
        if check is not None:
            check(self)
        if entry.by_target and self.order != "target":
            raise ValueError(f"the {entry.kind} judge groups pairs by target turn: set order=target")
        if self.cost.measure and not self.plan:
            raise ValueError("cost.measure (--measure) plans a run: give it with --plan")
        if self.judge_set and self.judge_samples > 1:
            raise ValueError("give either judge_set (several judges) or judge_samples (one judge sampled k times)")
        if self.judge_set and not model_judge:
            models = " or ".join(sorted({f"judge={e.judge}" for e in JUDGES.values() if e.needs_llm}))
            raise ValueError(f"judge_set needs {models} (judge is {self.judge})")
        if self.judge_samples > 1 and not entry.samples:
            sampled = " or ".join(sorted({f"judge={e.judge}" for e in JUDGES.values() if e.samples}))
            raise ValueError(f"judge_samples needs {sampled}; the {self.judge} judge is deterministic")
        for path in self.judge_set:
            if not Path(path).expanduser().is_file():
                raise ValueError(f"judge_set: {path}: no such LLM config file")
        return self

    def pair_options(self) -> PairOptions:
        return PairOptions(speaker=self.speaker, context_turns=self.context_turns, horizon=self.horizon,
                           order=self.order)

    def judge_entry(self) -> JudgeEntry:
        """The `JUDGES` entry these settings select (`judge`, and `judge_mode` for the LLM judge)."""
        return judge_of(self.judge, self.judge_mode)

    def effective_shard_size(self) -> int:
        return self.shard_size or self.judge_entry().shard_size

    def llm_settings(self) -> Any:
        """The judge's `memprune.llm.LLMConfig`: the `llm_config` file, then the inline `llm`, then `llm_overrides`."""
        from memprune.llm import LLMConfig

        return LLMConfig.resolve(self.llm_config, self.llm, self.llm_overrides)

    def judge_llm_settings(self) -> list[Any]:
        """One `LLMConfig` per judge: each `judge_set` file (+ inline `llm` and `llm_overrides`), else `llm_settings()`."""
        from memprune.llm import LLMConfig

        if not self.judge_set:
            return [self.llm_settings()]
        return [LLMConfig.resolve(path, self.llm, self.llm_overrides) for path in self.judge_set]


class LabelConfig(LabelSettings):
    """Everything `memprune label` needs: the settings plus the corpus and output directories."""

    data: Place = Field(description="corpus directory or URI (sessions.parquet, bullets.parquet)")
    out: Place = Field(description="output directory or storage URI (labels.parquet, label.json, ...)")
