"""Settings of `memprune synth`: what to generate (`SynthSettings`) and where (`SynthConfig`); `seed` fixes everything."""

from __future__ import annotations


from pydantic import ConfigDict, Field, field_validator, model_validator

from memprune.config import ConfigModel, Place
from memprune.synth.vocabulary import DURABLE, ONEOFF_ITEMS


class SynthSettings(ConfigModel):
    """What to generate (the pipeline's synthetic `corpus:` section too). Same settings, byte-identical files."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    conversations: int = Field(100, description="number of conversations")
    sessions: int = Field(4, description="sessions per conversation")
    seed: int = Field(0, description="generator seed: same seed, same corpus")
    facts_per_speaker: int = Field(6, description="durable facts in each speaker's persona (1..20)")
    oneoffs_per_session: int = Field(2, description="mean one-off remarks per speaker per session")
    mention_prob: float = Field(0.35, description="chance a known fact is restated in an intermediate session")
    stray_prob: float = Field(0.0, description="share of persona facts stated once and never again")
    duplicates: float = Field(0.0, description="share of bullets that get a duplicate (verbatim or paraphrased) in "
                                               "their session, with ground truth (dup_source, dup_kind)")
    updates: float = Field(0.0, description="share of persona facts stated twice or more that change value from a "
                                            "later mention on (same speaker and slot, a new key), with ground truth "
                                            "update_of")

    @field_validator("conversations")
    @classmethod
    def _conversations(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"conversations must be >= 1, got {v}")
        return v

    @field_validator("sessions")
    @classmethod
    def _sessions(cls, v: int) -> int:
        if v < 2:
            raise ValueError(f"sessions must be >= 2 (a fact can only recur in a later session), got {v}")
        return v

    @field_validator("facts_per_speaker")
    @classmethod
    def _facts(cls, v: int) -> int:
        if not 1 <= v <= 20:
            raise ValueError(f"facts_per_speaker must be in 1..20, got {v}")
        return v

    @field_validator("oneoffs_per_session")
    @classmethod
    def _oneoffs(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"oneoffs_per_session must be >= 0, got {v}")
        return v

    @field_validator("mention_prob", "stray_prob", "duplicates", "updates")
    @classmethod
    def _probability(cls, v: float) -> float:
        if not 0.0 <= v <= 1.0:  # also rejects NaN
            raise ValueError(f"must be in [0, 1], got {v}")
        return v

    @model_validator(mode="after")
    def _vocabulary(self) -> "SynthSettings":
        if self.updates and self.facts_per_speaker > len(DURABLE):
            raise ValueError(f"updates need one fact per category and speaker: facts_per_speaker must be <= "
                             f"{len(DURABLE)}, got {self.facts_per_speaker}")
        most = 2 * self.sessions * (self.oneoffs_per_session + 1)
        if most > len(ONEOFF_ITEMS):
            raise ValueError(
                f"sessions={self.sessions} x oneoffs_per_session={self.oneoffs_per_session} may need {most} distinct "
                f"one-off remarks per conversation, but the vocabulary has {len(ONEOFF_ITEMS)} "
                "(one-offs must never repeat); lower --sessions or --oneoffs"
            )
        return self


class SynthConfig(SynthSettings):
    """`memprune synth`: the settings plus the output directory and how it is written."""

    out: Place = Field(description="output directory or storage URI (s3://...): sessions/bullets.parquet, synth.json")
    batch_rows: int = Field(50_000, ge=10, description="bullets per Parquet row group (bounded memory)")
    progress: bool = False
