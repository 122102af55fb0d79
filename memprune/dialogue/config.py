"""Settings of `memprune dialogue-eval`: targets, memory conditions, retrieval, metrics; the pruned store, the
generator LLM and the bootstrap are `memprune.memory.config.MemoryEvalConfig`, shared with qa-eval."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from memprune.config import ConfigModel
from memprune.dialogue.plan import CONDITIONS, SampleSettings
from memprune.memory.config import MemoryEvalConfig


class BertScoreSettings(ConfigModel):
    """BERTScore with a local encoder (never downloaded)."""

    enabled: bool = True
    model: str | None = Field(None, description="Local encoder directory; None = `encoder`.")
    num_layers: int | None = Field(None, ge=1, description="Layer whose embeddings are used; None = the last layer.")
    batch_size: int = Field(64, ge=1)


class MauveSettings(ConfigModel):
    """MAUVE on mean-pooled features of `encoder`, computed by memprune (nothing downloaded)."""

    enabled: bool = True
    min_samples: int = Field(10, ge=2, description="Below this many paired targets MAUVE is not computed.")
    num_buckets: int | None = Field(None, ge=2, description="k-means histogram size; None = the library's auto (n/10).")
    kmeans_num_redo: int = Field(5, ge=1)
    kmeans_max_iter: int = Field(500, ge=1)
    seed: int = Field(25, description="k-means seed (MAUVE's default).")
    bootstrap: int = Field(0, ge=0, description="Bootstrap resamples for a MAUVE interval (0 = point value only; "
                                                "each resample reclusters, seconds each).")


class DialogueEvalConfig(MemoryEvalConfig):
    """Config of the dialogue evaluation (`jobs/dialogue_eval.py`, `memprune dialogue-eval`)."""

    CONDITIONS: ClassVar[tuple[str, ...]] = CONDITIONS

    data: str = Field(..., description="Corpus directory or URI with sessions.parquet and bullets.parquet.")
    conditions: list[str] = Field(default_factory=lambda: list(CONDITIONS), description="Memory conditions.")
    turns: int = Field(200, ge=1, description="Target turns evaluated (sampled deterministically).")
    seed: int = Field(0, description="Sampling seed of the target turns.")
    min_context_turns: int = Field(1, ge=0, description="A target needs at least this many earlier turns in its session.")
    context_turns: int | None = Field(None, ge=0, description="Dialogue turns before the target in the prompt; None = all.")
    max_per_session: int | None = Field(None, ge=1, description="At most this many targets per session.")
    require_memory: bool = Field(True, description="Only targets whose earlier sessions have at least one bullet.")
    retrieval_k: int | Literal["pruned"] = Field(
        5, description="Bullets the retrieval baseline takes; 'pruned' = as many as pruned memory has for that turn.")
    retrieval_turns: int = Field(4, ge=0, description="Recent dialogue turns that form the retrieval query.")
    encoder: str | None = Field(None, description="Encoder for retrieval, MAUVE features and default BERTScore "
                                                  "(local dir or hub id; None = the local all-MiniLM-L6-v2).")
    bertscore: BertScoreSettings = Field(default_factory=BertScoreSettings)
    mauve: MauveSettings = Field(default_factory=MauveSettings)
    chunk_targets: int = Field(256, ge=1, description="Targets per resumable generation chunk.")

    @model_validator(mode="after")
    def _checks(self) -> "DialogueEvalConfig":
        needs = "pruned" in self.conditions or ("retrieval" in self.conditions and self.retrieval_k == "pruned")
        if needs and not self.pruned:
            raise ValueError("the pruned condition (and retrieval_k: pruned) needs `pruned` (a `memprune prune` output)")
        return self

    def sample_settings(self) -> SampleSettings:
        return SampleSettings(turns=self.turns, seed=self.seed, min_context_turns=self.min_context_turns,
                              context_turns=self.context_turns, max_per_session=self.max_per_session,
                              require_memory=self.require_memory)
