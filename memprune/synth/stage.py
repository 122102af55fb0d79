"""`memprune synth`: stream a synthetic corpus to OUT/sessions.parquet, OUT/bullets.parquet and OUT/synth.json.

Conversations are generated one at a time (`memprune.synth.generator`) and flushed as a row
group every `batch_rows` bullets (every `batch_rows // 10` sessions, which hold all their turns),
so memory stays bounded whatever the size. Files appear atomically when complete.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from memprune.io import TableSink, write_json
from memprune.outputs import OutputSet
from memprune.schema import SESSIONS, SYNTH_BULLETS
from memprune.synth.config import SynthConfig, SynthSettings
from memprune.synth.generator import (
    GENERATOR_VERSION,
    SynthConversation,
    synth_conversation,
)

# `duplicates` > 0: the ground truth of the injected duplicates (the bullet copied, verbatim or paraphrase)
DUPLICATE_BULLETS = SYNTH_BULLETS.append(pa.field("dup_source", pa.string())).append(pa.field("dup_kind", pa.string()))
# `updates` > 0: the ground truth of the injected fact updates (the bullet of the old value this one replaces)
UPDATE = pa.field("update_of", pa.string())


def bullets_schema(settings: SynthSettings) -> pa.Schema:
    """The bullets table's schema: the ground truth columns of injected duplicates and updates when asked for."""
    schema = DUPLICATE_BULLETS if settings.duplicates else SYNTH_BULLETS
    return schema.append(UPDATE) if settings.updates else schema


def _offsets(lengths: list[int]) -> pa.Array:
    out = [0] * (len(lengths) + 1)
    total = 0
    for i, n in enumerate(lengths, 1):
        total += n
        out[i] = total
    return pa.array(out, type=pa.int32())


class _SessionBatch:
    """Column lists for a batch of `sessions` rows (turns flattened with offsets)."""

    def __init__(self) -> None:
        self.cid: list[str] = []
        self.index: list[int] = []
        self.speakers: list[str] = []
        self.time: list[str] = []
        self.n_turns: list[int] = []
        self.turn_id: list[str] = []
        self.turn_speaker: list[str] = []
        self.turn_text: list[str] = []

    def add(self, conv: SynthConversation) -> int:
        """Add every session of `conv`; return the number of turns added."""
        added = 0
        for sess in conv.sessions:
            self.cid.append(conv.conversation_id)
            self.index.append(sess.session_index)
            self.speakers += conv.speakers
            self.time.append(sess.time)
            self.n_turns.append(len(sess.turns))
            for a, b, c in sess.turns:
                self.turn_id.append(a)
                self.turn_speaker.append(b)
                self.turn_text.append(c)
            added += len(sess.turns)
        return added

    def __len__(self) -> int:
        return len(self.cid)

    def table(self) -> pa.Table:
        turns = pa.StructArray.from_arrays(
            [pa.array(self.turn_id, pa.string()), pa.array(self.turn_speaker, pa.string()),
             pa.array(self.turn_text, pa.string())],
            fields=list(SESSIONS.field("turns").type.value_type),
        )
        arrays = [
            pa.array(self.cid, pa.string()),
            pa.array(self.index, pa.int32()),
            pa.ListArray.from_arrays(_offsets([2] * len(self.cid)), pa.array(self.speakers, pa.string()),
                                     type=SESSIONS.field("speakers").type),
            pa.ListArray.from_arrays(_offsets(self.n_turns), turns, type=SESSIONS.field("turns").type),
            pa.array(self.time, pa.string()),
        ]
        return pa.Table.from_arrays(arrays, schema=SESSIONS)


class _BulletBatch:
    """Column lists for a batch of synthetic `bullets` rows (evidence flattened with offsets)."""

    def __init__(self, schema: pa.Schema = SYNTH_BULLETS) -> None:
        self.schema = schema
        self.cols: dict[str, list[Any]] = {n: [] for n in schema.names}
        self.n_evidence: list[int] = []
        self.evidence: list[str] = []

    def add(self, conv: SynthConversation) -> None:
        c = self.cols
        for b in conv.bullets:
            c["bullet_id"].append(b.bullet_id)
            c["conversation_id"].append(conv.conversation_id)
            c["session_index"].append(b.session_index)
            c["speaker"].append(b.speaker)
            c["text"].append(b.text)
            c["recurs"].append(b.recurs)
            c["kind"].append(b.kind)
            if "dup_source" in c:
                c["dup_source"].append(b.dup_source)
                c["dup_kind"].append(b.dup_kind)
            if "update_of" in c:
                c["update_of"].append(b.update_of)
            self.n_evidence.append(len(b.evidence))
            self.evidence += b.evidence

    def __len__(self) -> int:
        return len(self.n_evidence)

    def table(self) -> pa.Table:
        arrays = []
        for f in self.schema:
            if f.name == "evidence":
                arrays.append(pa.ListArray.from_arrays(_offsets(self.n_evidence), pa.array(self.evidence, pa.string()),
                                                       type=f.type))
            else:
                arrays.append(pa.array(self.cols[f.name], f.type))
        return pa.Table.from_arrays(arrays, schema=self.schema)


def run(config: SynthConfig) -> dict[str, Any]:
    """Generate the corpus of `config` into `config.out`; return the summary written to synth.json."""
    counts: dict[str, Any] = {"conversations": 0, "sessions": 0, "turns": 0, "bullets": 0, "recurs": 0}
    by_kind: dict[str, int] = {}
    iterator: Any = range(config.conversations)
    if config.progress:
        from tqdm import tqdm

        iterator = tqdm(iterator, desc="synth", unit="conv")
    settings = SynthSettings.model_validate(config.model_dump(include=set(SynthSettings.model_fields)))
    session_rows = config.batch_rows // 10
    b_schema = bullets_schema(settings)
    with OutputSet(config.out, "synth") as outputs:
        with TableSink(outputs.path("sessions.parquet"), SESSIONS) as s_sink, \
                TableSink(outputs.path("bullets.parquet"), b_schema) as b_sink:
            s_batch, b_batch = _SessionBatch(), _BulletBatch(b_schema)
            for i in iterator:
                conv = synth_conversation(i, settings)
                counts["turns"] += s_batch.add(conv)
                b_batch.add(conv)
                for b in conv.bullets:
                    counts["recurs"] += b.recurs
                    if b.dup_kind:
                        counts[f"duplicates_{b.dup_kind}"] = counts.get(f"duplicates_{b.dup_kind}", 0) + 1
                    by_kind[b.kind] = by_kind.get(b.kind, 0) + 1
                    counts["updates"] = counts.get("updates", 0) + (b.update_of is not None)
                counts["conversations"] += 1
                counts["sessions"] += len(conv.sessions)
                counts["bullets"] += len(conv.bullets)
                if len(s_batch) >= session_rows:
                    s_sink.write_table(s_batch.table())
                    s_batch = _SessionBatch()
                if len(b_batch) >= config.batch_rows:
                    b_sink.write_table(b_batch.table())
                    b_batch = _BulletBatch(b_schema)
            if len(s_batch):
                s_sink.write_table(s_batch.table())
            if len(b_batch):
                b_sink.write_table(b_batch.table())
        counts["bullets_by_kind"] = dict(sorted(by_kind.items()))
        summary = {
            "generator": f"memprune.synth v{GENERATOR_VERSION}",
            "seed": config.seed,
            "config": settings.model_dump(mode="json"),
            "counts": counts,
            "files": {"sessions": "sessions.parquet", "bullets": "bullets.parquet"},
            "recurs_definition": (
                "true iff the bullet's fact is stated again by the same speaker, with the same key entity words, "
                "in a later session of the same conversation; always false in the final session, for one-offs "
                "and for stray facts"
            ),
        }
        write_json(outputs.path("synth.json"), summary)
    return summary


def generate(out: str | Any, **settings: Any) -> dict[str, Any]:
    """`run(SynthConfig(out=out, **settings))` for Python callers; invalid settings raise `ConfigError`."""
    from memprune.config import validate

    return run(validate(SynthConfig, {"out": out, **settings}, "synth"))
