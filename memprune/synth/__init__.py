"""Synthetic multi-session corpora whose bullets know whether they recur (`memprune synth`).

    from memprune.synth import generate
    generate(out="runs/synth", conversations=100, sessions=4, seed=0)

- `vocabulary`: speakers, persona fact categories with templates, one-off remarks, small talk.
- `generator`: one conversation at a time, deterministic from (seed, index).
- `config`: `SynthSettings` / `SynthConfig`; `stage`: `run(cfg)` streams the tables to Parquet.
"""

from __future__ import annotations

from memprune.synth.config import SynthConfig, SynthSettings
from memprune.synth.generator import (
    GENERATOR_VERSION,
    SynthBullet,
    SynthConversation,
    conversation_id,
    synth_conversation,
)
from memprune.synth.stage import generate, run

__all__ = [
    "GENERATOR_VERSION",
    "SynthBullet",
    "SynthConfig",
    "SynthConversation",
    "SynthSettings",
    "conversation_id",
    "generate",
    "run",
    "synth_conversation",
]
