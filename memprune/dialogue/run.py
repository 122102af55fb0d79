"""`memprune dialogue-eval`: generate next-session replies under memory conditions and score them.

Reads a corpus (`DATA/sessions.parquet`, `DATA/bullets.parquet`) and a pruned store (the
`memprune prune` output), samples target turns, builds one generation row per target and
memory condition (`memprune.dialogue.plan`), generates the replies through
`memprune.llm.run_llm(task="reply")` on Ray Data (any engine: vllm, http, hf), scores them
against the real turns (`memprune.dialogue.metrics`) and writes into `OUT/`:

- `generations.parquet`  one row per target x condition: context, memory, reference, reply,
                         errors, attempts, prompt and memory token counts;
- `rejects.jsonl`        rows whose reply failed after retries (with the raw model text);
- `dialogue.json`        everything measured: per condition metrics with bootstrap intervals,
                         paired differences, cost (bullets, prompt tokens), LLM outcome, settings;
- `dialogue.md`          the paper's Table 6 shape: one line per memory condition.

Generation runs in chunks of targets, each one `run_llm` pass written atomically under
`OUT/.work/<fingerprint>/` (the fingerprint covers the generation rows, the LLM config and the
prompt template), so a rerun of the same command resumes and only rescoring is repeated.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from memprune.dialogue import metrics as M
from memprune.dialogue.plan import (CONDITIONS, DialogueError, SampleSettings, build_rows, bullets_by_session,
                                    memory_pool, sample_targets)
from memprune.io import JsonlSink, atomic_path, read_table, resumable_chunks, write_json
from memprune.raysession import ensure_ray
from memprune.judge import model_label
from memprune.llm import LLMConfig, outcome_summary, run_llm
from memprune.llm.prompts import load_template, reply_messages
from memprune.llm.run import COMMON_FIELDS
from memprune.rejects import Ledger

DIALOGUE_FORMAT = 1
LABELS = {"none": "No memory", "all": "All memory", "retrieval": "Retrieval", "pruned": "Pruned memory"}
RESULTS = pa.schema([
    pa.field("row_id", pa.string(), nullable=False),
    pa.field("reply", pa.string()),
    pa.field("parse", pa.string()),
    *COMMON_FIELDS,
])
METRICS = ("bleu", "rouge_l", "bertscore_f1", "mauve")
METRIC_NAMES = {"bleu": "BLEU", "rouge_l": "ROUGE-L", "bertscore_f1": "BERTScore F1", "mauve": "MAUVE"}


# =================================================================== config


class BootstrapSettings(BaseModel):
    """Bootstrap over evaluated targets: resamples, interval level, seed."""

    model_config = ConfigDict(extra="forbid")

    samples: int = Field(1000, ge=0, description="Resamples of the targets (0 = no intervals).")
    confidence: float = Field(0.95, gt=0.0, lt=1.0, description="Percentile interval level.")
    seed: int = Field(0, description="Seed of the resampling (the same resamples for every condition).")


class BertScoreSettings(BaseModel):
    """BERTScore with a local encoder (never downloaded)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    model: str | None = Field(None, description="Local encoder directory; None = `encoder`.")
    num_layers: int | None = Field(None, ge=1, description="Layer whose embeddings are used; None = the last layer.")
    batch_size: int = Field(64, ge=1)


class MauveSettings(BaseModel):
    """MAUVE on mean-pooled features of `encoder`, computed by memprune (nothing downloaded)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    min_samples: int = Field(10, ge=2, description="Below this many paired targets MAUVE is not computed.")
    num_buckets: int | None = Field(None, ge=2, description="k-means histogram size; None = the library's auto (n/10).")
    kmeans_num_redo: int = Field(5, ge=1)
    kmeans_max_iter: int = Field(500, ge=1)
    seed: int = Field(25, description="k-means seed (MAUVE's default).")
    bootstrap: int = Field(0, ge=0, description="Bootstrap resamples for a MAUVE interval (0 = point value only; "
                                                "each resample reclusters, seconds each).")


class DialogueEvalConfig(BaseModel):
    """Config of the dialogue evaluation (`jobs/dialogue_eval.py`, `memprune dialogue-eval`)."""

    model_config = ConfigDict(extra="forbid")

    data: str = Field(..., description="Corpus directory with sessions.parquet and bullets.parquet.")
    pruned: str | None = Field(None, description="Pruned store: a `memprune prune` output dir, its pruned/ dir, "
                                                 "or a Parquet file with bullet_id and keep.")
    out: str = Field(..., description="Output directory.")
    llm_config: str | None = Field(None, description="YAML file of the generator's LLM config.")
    llm: dict[str, Any] | None = Field(None, description="Inline LLM config fields (instead of llm_config).")
    llm_overrides: list[str] = Field(default_factory=list, description="key=value overrides of the LLM config.")
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
    encoder_max_length: int = Field(256, ge=8)
    encoder_batch_size: int = Field(64, ge=1)
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Device of the encoders on the driver.")
    pruned_missing: Literal["error", "drop"] = Field(
        "error", description="A memory bullet absent from the pruned store: error, or count it as not kept.")
    bertscore: BertScoreSettings = Field(default_factory=BertScoreSettings)
    mauve: MauveSettings = Field(default_factory=MauveSettings)
    bootstrap: BootstrapSettings = Field(default_factory=BootstrapSettings)
    chunk_targets: int = Field(256, ge=1, description="Targets per resumable generation chunk.")
    block_rows: int = Field(16, ge=1, description="Rows per Ray Data block (spreads work over engine replicas).")
    progress: bool = True

    @field_validator("conditions")
    @classmethod
    def _conditions(cls, value: list[str]) -> list[str]:
        bad = [c for c in value if c not in CONDITIONS]
        if bad or not value or len(set(value)) != len(value):
            raise ValueError(f"conditions must be distinct values among {list(CONDITIONS)}, got {value}")
        return value

    @model_validator(mode="after")
    def _checks(self) -> "DialogueEvalConfig":
        if (self.llm is None) == (self.llm_config is None):
            raise ValueError("set exactly one of `llm_config` (a YAML file) or an inline `llm` section")
        needs = "pruned" in self.conditions or ("retrieval" in self.conditions and self.retrieval_k == "pruned")
        if needs and not self.pruned:
            raise ValueError("the pruned condition (and retrieval_k: pruned) needs `pruned` (a `memprune prune` output)")
        return self

    def llm_settings(self) -> LLMConfig:
        """The generator's LLM config from the file or the inline section, with overrides applied."""
        return LLMConfig.resolve(self.llm_config, self.llm, self.llm_overrides)

    def sample_settings(self) -> SampleSettings:
        return SampleSettings(turns=self.turns, seed=self.seed, min_context_turns=self.min_context_turns,
                              context_turns=self.context_turns, max_per_session=self.max_per_session,
                              require_memory=self.require_memory)


# =================================================================== inputs


def pruned_files(path: str | Path) -> list[Path]:
    """The Parquet files of a pruned store: `DIR/pruned/part-*.parquet`, a dir of Parquet files, or one file."""
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.exists():
        raise DialogueError(f"{p}: pruned store not found (give a `memprune prune` output directory)")
    if (p / "pruned").is_dir():
        p = p / "pruned"
    files = sorted(f for f in p.glob("*.parquet") if not f.name.startswith((".", "_")))
    if not files:
        raise DialogueError(f"{p}: no Parquet files here (expected the pruned store of `memprune prune`)")
    return files


def load_keep(path: str | Path) -> tuple[dict[str, bool], dict[str, Any]]:
    """bullet id -> keep flag of a pruned store, and what the report says about it (files, rule)."""
    files = pruned_files(path)
    keep: dict[str, bool] = {}
    for f in files:
        try:
            schema = pq.read_schema(f)
        except (pa.ArrowInvalid, OSError) as exc:
            raise DialogueError(f"{f}: cannot read as Parquet: {exc}") from exc
        for col, typ in (("bullet_id", pa.string()), ("keep", pa.bool_())):
            if col not in schema.names:
                raise DialogueError(f"{f}: column {col!r} missing (not a pruned store: run `memprune prune`)")
            if not schema.field(col).type.equals(typ):
                raise DialogueError(f"{f}: column {col!r} has type {schema.field(col).type}, expected {typ}")
        table = pq.read_table(f, columns=["bullet_id", "keep"])
        ids, flags = table.column("bullet_id").to_pylist(), table.column("keep").to_pylist()
        for i, (bid, flag) in enumerate(zip(ids, flags)):
            if bid is None or flag is None:
                raise DialogueError(f"{f}: row {i}: {'bullet_id' if bid is None else 'keep'} is null")
            if bid in keep:
                raise DialogueError(f"{f}: row {i}: bullet_id {bid!r} appears twice in the pruned store")
            keep[bid] = bool(flag)
    info: dict[str, Any] = {"path": str(Path(path)), "files": [str(f) for f in files], "bullets": len(keep),
                            "kept": sum(keep.values())}
    report = files[0].parent.parent / "prune.json" if files[0].parent.name == "pruned" else None
    if report is not None and report.is_file():
        try:
            rule = json.loads(report.read_text(encoding="utf-8")).get("rule") or {}
            info["rule"] = {k: rule.get(k) for k in ("threshold", "top_k", "group_by")}
        except (ValueError, OSError):
            pass
    return keep, info


def _device(setting: str) -> str:
    if setting != "auto":
        return setting
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class TokenCounter:
    """Prompt token counts: the generator's tokenizer + chat template when the model is a local directory,
    else the encoder's tokenizer on the message contents (the report says which)."""

    def __init__(self, llm: LLMConfig, encoder_dir: str) -> None:
        from transformers import AutoTokenizer

        model = Path(llm.model)
        self.chat = False
        if model.is_dir() and any((model / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            self.tok = AutoTokenizer.from_pretrained(str(model), trust_remote_code=llm.trust_remote_code)
            self.chat = getattr(self.tok, "chat_template", None) is not None
            how = "with its chat template" if self.chat else "on the message contents (no chat template)"
            self.unit = f"generator tokenizer ({model.name}) {how}"
        else:
            self.tok = AutoTokenizer.from_pretrained(encoder_dir)
            self.unit = (f"encoder tokenizer ({model_label(encoder_dir)}) on the message contents: the generator "
                         f"{llm.model!r} is not a local directory")

    def text(self, text: str) -> int:
        """Tokens of `text` (no special tokens)."""
        return len(self.tok(text, add_special_tokens=False, truncation=False, verbose=False)["input_ids"]) if text else 0

    def prompt(self, messages: list[dict[str, str]]) -> int:
        """Tokens of the whole prompt as the generator sees it (approximately, without a chat template)."""
        if self.chat:
            ids = self.tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return len(ids)
        return self.text("\n\n".join(m["content"] for m in messages))


def count_tokens(rows: pa.Table, llm: LLMConfig, counter: TokenCounter) -> tuple[list[int], list[int]]:
    """(prompt tokens, memory tokens) of every generation row; memory = the bullet texts alone."""
    template = load_template(llm.prompt_name("reply"), "reply")
    prompt, memory = [], []
    for row in rows.select(["context", "memory", "target_speaker"]).to_pylist():
        prompt.append(counter.prompt(reply_messages(row, template)))
        memory.append(counter.text("\n".join(n["text"] for n in row["memory"])))
    return prompt, memory


# =================================================================== generation (Ray Data)


def _fingerprint(rows: pa.Table, llm: LLMConfig) -> str:
    h = hashlib.sha256()
    sink = pa.BufferOutputStream()
    inputs = rows.select(["row_id", "context", "memory", "target_speaker"]).combine_chunks()
    with pa.ipc.new_stream(sink, inputs.schema) as writer:
        writer.write_table(inputs)
    h.update(sink.getvalue().to_pybytes())
    template = load_template(llm.prompt_name("reply"), "reply")
    h.update(json.dumps({"llm": llm.model_dump(mode="json"), "template": template.messages}, sort_keys=True).encode())
    return h.hexdigest()[:16]


def _generate_chunk(rows: pa.Table, llm: LLMConfig, block_rows: int) -> pa.Table:
    """One chunk of generation rows through `run_llm(task="reply")`; returns its `RESULTS` rows."""
    import ray

    inputs = rows.select(["row_id", "context", "memory", "target_speaker"])
    blocks = [inputs.slice(s, block_rows) for s in range(0, inputs.num_rows, block_rows)]
    out = run_llm(ray.data.from_arrow(blocks), llm, task="reply")
    got = []
    for batch in out.iter_batches(batch_size=None, batch_format="pyarrow"):
        got.extend({k: r.get(k) for k in RESULTS.names} for r in batch.to_pylist())
    want = rows.column("row_id").to_pylist()
    if sorted(r["row_id"] for r in got) != sorted(want):
        raise RuntimeError(f"run_llm returned {len(got)} rows for a chunk of {len(want)}; rerun to retry the chunk")
    order = {rid: i for i, rid in enumerate(want)}
    got.sort(key=lambda r: order[r["row_id"]])
    return pa.Table.from_pylist(got, schema=RESULTS)


def generate_replies(rows: pa.Table, llm: LLMConfig, out: Path, chunk_rows: int, block_rows: int,
                     progress: bool = True) -> tuple[pa.Table, dict[str, Any]]:
    """Replies for every generation row, in row order; chunks already under OUT/.work/<fingerprint>/ are reused."""

    work = out / ".work" / _fingerprint(rows, llm)
    results, stats = resumable_chunks(rows, chunk_rows, work, lambda chunk: _generate_chunk(chunk, llm, block_rows),
                                      RESULTS, "dialogue-eval: generation chunks", progress, setup=ensure_ray)
    if results.column("row_id").to_pylist() != rows.column("row_id").to_pylist():
        raise RuntimeError(f"{work}: the saved chunks do not match the generation rows; delete it and rerun")
    return results, stats


# =================================================================== scoring


def _stat(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "median": None, "total": 0}
    return {"mean": statistics.fmean(values), "median": float(statistics.median(values)), "total": float(sum(values))}


def cost_table(gen: pa.Table, conditions: list[str]) -> dict[str, dict[str, Any]]:
    """Per condition: memory bullets per target, prompt and memory tokens (mean, median, total), engine tokens."""
    rows = gen.select(["condition", "n_memory", "prompt_tokens", "memory_tokens", "tokens_in", "tokens_out"]).to_pylist()
    out: dict[str, dict[str, Any]] = {}
    for c in conditions:
        mine = [r for r in rows if r["condition"] == c]
        out[c] = {
            "targets": len(mine),
            "bullets": _stat([r["n_memory"] for r in mine]),
            "prompt_tokens": _stat([r["prompt_tokens"] for r in mine]),
            "memory_tokens": _stat([r["memory_tokens"] for r in mine]),
            "engine_tokens_in": sum(r["tokens_in"] or 0 for r in mine),
            "engine_tokens_out": sum(r["tokens_out"] or 0 for r in mine),
        }
    if "all" in out:
        base = out["all"]
        for c, entry in out.items():
            for key in ("prompt_tokens", "memory_tokens", "bullets"):
                b, v = base[key]["total"], entry[key]["total"]
                entry[f"{key}_vs_all_pct"] = 100.0 * (v - b) / b if b else None
    return out


def _value(point: float | None, boot: np.ndarray | None, confidence: float) -> dict[str, Any]:
    return {"value": point, "ci": None if boot is None or point is None else M.percentile_ci(boot, confidence)}


def score_replies(gen: pa.Table, conditions: list[str], cfg: DialogueEvalConfig, encoder: Any,
                  bertscore: M.BertScore | None) -> dict[str, Any]:
    """Metrics per condition on the targets that have a reply under every condition (paired), with intervals."""
    rows = gen.select(["turn_id", "condition", "reference", "reply"]).to_pylist()
    by_turn: dict[str, dict[str, str | None]] = {}
    refs: dict[str, str] = {}
    for r in rows:
        by_turn.setdefault(r["turn_id"], {})[r["condition"]] = r["reply"]
        refs[r["turn_id"]] = r["reference"]
    paired = [t for t, replies in by_turn.items() if all(replies.get(c) for c in conditions)]
    n = len(paired)
    result: dict[str, Any] = {"targets": len(by_turn), "paired": n, "per_condition": {}, "comparisons": {},
                              "notes": []}
    if n == 0:
        result["notes"].append("no target has a reply under every condition: no metrics")
        return result
    references = [refs[t] for t in paired]
    hyps = {c: [str(by_turn[t][c]) for t in paired] for c in conditions}
    conf = cfg.bootstrap.confidence
    idx = M.bootstrap_indices(n, cfg.bootstrap.samples, cfg.bootstrap.seed)
    boots: dict[str, dict[str, np.ndarray]] = {c: {} for c in conditions}
    points: dict[str, dict[str, float | None]] = {c: {} for c in conditions}
    extra: dict[str, dict[str, Any]] = {c: {} for c in conditions}

    for c in conditions:
        stats = M.bleu_stats(hyps[c], references)
        points[c]["bleu"] = M.bleu_from_stats(stats.sum(axis=0))
        rouge = M.rouge_l(hyps[c], references)
        points[c]["rouge_l"] = float(rouge.mean())
        if len(idx):
            boots[c]["bleu"] = M.bleu_bootstrap(stats, idx)
            boots[c]["rouge_l"] = M.mean_bootstrap(rouge, idx)
    if bertscore is not None:
        flat = [h for c in conditions for h in hyps[c]]
        scores = bertscore(flat, references * len(conditions))
        for k, c in enumerate(conditions):
            part = {m: v[k * n:(k + 1) * n] for m, v in scores.items()}
            points[c]["bertscore_f1"] = float(part["f1"].mean())
            extra[c]["bertscore_precision"] = float(part["precision"].mean())
            extra[c]["bertscore_recall"] = float(part["recall"].mean())
            if len(idx):
                boots[c]["bertscore_f1"] = M.mean_bootstrap(part["f1"], idx)
    else:
        result["notes"].append("BERTScore disabled")
    mauve_cfg = cfg.mauve
    if mauve_cfg.enabled and n >= mauve_cfg.min_samples:
        settings = M.MauveSettings(num_buckets=mauve_cfg.num_buckets, kmeans_num_redo=mauve_cfg.kmeans_num_redo,
                                   kmeans_max_iter=mauve_cfg.kmeans_max_iter, seed=mauve_cfg.seed)
        texts = sorted(set(references) | {h for c in conditions for h in hyps[c]})
        emb = encoder.encode(texts)
        index = {t: i for i, t in enumerate(texts)}
        p = emb[[index[t] for t in references]]
        midx = idx[:mauve_cfg.bootstrap]
        for c in conditions:
            q = emb[[index[t] for t in hyps[c]]]
            points[c]["mauve"] = M.mauve_score(p, q, settings)
            if len(midx):
                boots[c]["mauve"] = M.mauve_bootstrap(p, q, midx, settings)
        if not len(midx):
            result["notes"].append("MAUVE is a corpus-level score reported as a point value without an interval "
                                   "(set mauve.bootstrap to resample it; each resample reclusters)")
        if n < 500:
            result["notes"].append(f"MAUVE on {n} paired targets: it is a distribution-level score and is noisy "
                                   f"below a few hundred samples (num_buckets {'auto = n/10' if settings.num_buckets is None else settings.num_buckets})")
    elif mauve_cfg.enabled:
        result["notes"].append(f"MAUVE not computed: {n} paired targets < mauve.min_samples {mauve_cfg.min_samples}")
    for c in conditions:
        entry = {m: _value(points[c].get(m), boots[c].get(m), conf) for m in METRICS}
        entry.update(extra[c])
        entry["n"] = n
        result["per_condition"][c] = entry
    # paired differences: pruned against every other condition, and all memory against none
    pairs = [("pruned", c) for c in conditions if c != "pruned" and "pruned" in conditions]
    if "all" in conditions and "none" in conditions:
        pairs.append(("all", "none"))
    for a, b in pairs:
        comp: dict[str, Any] = {}
        for m in METRICS:
            pa_, pb = points[a].get(m), points[b].get(m)
            if pa_ is None or pb is None:
                continue
            delta = pa_ - pb
            ba, bb = boots[a].get(m), boots[b].get(m)
            if ba is not None and bb is not None and len(ba) == len(bb) and len(ba):
                d = ba - bb
                comp[m] = {"delta": delta, "ci": M.percentile_ci(d, conf), "p_better": float(np.mean(d > 0))}
            else:
                comp[m] = {"delta": delta, "ci": None, "p_better": None}
        result["comparisons"][f"{a}-{b}"] = comp
    return result


# =================================================================== the job


def run_dialogue_eval(cfg: DialogueEvalConfig) -> dict[str, Any]:
    """Sample targets, build the memory conditions, generate, score; write OUT/ and return dialogue.json."""
    from rich.console import Console

    from memprune.judge import SimilarityJudge
    from memprune.scorer import resolve_encoder

    console = Console(stderr=True)
    started = time.perf_counter()
    data, out = Path(cfg.data), Path(cfg.out)
    for name in ("sessions", "bullets"):
        if not (data / f"{name}.parquet").is_file():
            raise DialogueError(f"{data}: no {name}.parquet here (give a `memprune ingest`/`summarize` output directory)")
    llm = cfg.llm_settings()
    load_template(llm.prompt_name("reply"), "reply")
    sessions = read_table(data / "sessions.parquet", "sessions")
    bullets = read_table(data / "bullets.parquet", "bullets")
    by_session = bullets_by_session(bullets)
    sampled = sample_targets(sessions, by_session, cfg.sample_settings())
    if not sampled.targets:
        raise DialogueError(f"{data}: no eligible target turn (excluded: {sampled.excluded}); "
                            f"a target needs an earlier session with bullets and min_context_turns earlier turns")

    keep, pruned_info = (None, None)
    missing: list[str] = []
    needs_keep = "pruned" in cfg.conditions or ("retrieval" in cfg.conditions and cfg.retrieval_k == "pruned")
    if cfg.pruned and needs_keep:
        keep, pruned_info = load_keep(cfg.pruned)
        for t in sampled.targets:
            missing.extend(b.bullet_id for b in memory_pool(by_session, t.conversation_id, t.session_index)
                           if b.bullet_id not in keep)
        missing = sorted(set(missing))
        if missing and cfg.pruned_missing == "error":
            raise DialogueError(f"{cfg.pruned}: {len(missing)} memory bullet(s) of the evaluated turns are not in the "
                                f"pruned store, e.g. {missing[0]!r} (was it pruned from another bullets table? "
                                f"set pruned_missing: drop to count them as not kept)")
        pruned_info["missing_bullets"] = len(missing)

    encoder_dir = resolve_encoder(cfg.encoder)
    device = _device(cfg.device)
    encoder = SimilarityJudge(model=encoder_dir, batch_size=cfg.encoder_batch_size,
                              max_length=cfg.encoder_max_length, device=device)
    rows = build_rows(sampled.targets, by_session, cfg.conditions, keep=keep, embed=encoder.encode,
                      retrieval_k=cfg.retrieval_k, retrieval_turns=cfg.retrieval_turns)
    counter = TokenCounter(llm, encoder_dir)
    prompt_tokens, memory_tokens = count_tokens(rows, llm, counter)
    console.print(f"dialogue-eval: {len(sampled.targets)} target turns (of {sampled.eligible} eligible) x "
                  f"{len(cfg.conditions)} conditions = {rows.num_rows} generations with {llm.describe('reply')}",
                  highlight=False)
    planned_s = time.perf_counter() - started

    out.mkdir(parents=True, exist_ok=True)
    t_gen = time.perf_counter()
    results, chunks = generate_replies(rows, llm, out, cfg.chunk_targets * len(cfg.conditions), cfg.block_rows,
                                       cfg.progress)
    generation_s = time.perf_counter() - t_gen
    gen = rows.append_column("prompt_tokens", pa.array(prompt_tokens, pa.int64())) \
              .append_column("memory_tokens", pa.array(memory_tokens, pa.int64()))
    for f in RESULTS:
        if f.name != "row_id":
            gen = gen.append_column(f, results.column(f.name))
    with atomic_path(out / "generations.parquet") as tmp:
        pq.write_table(gen, tmp)

    sink = JsonlSink(out / "rejects.jsonl")
    ledger = Ledger(sink)
    try:
        for r in gen.select(["row_id", "error", "raw"]).to_pylist():
            ledger.saw("reply")
            if r["error"]:
                ledger.reject(source=str(out / "generations.parquet"), record=r["row_id"], field="reply",
                              kind="reply", reason=r["error"], value=r["raw"])
            else:
                ledger.wrote("reply")
    except BaseException:
        sink.abort()
        raise
    sink.close()

    t_score = time.perf_counter()
    bert = None
    if cfg.bertscore.enabled:
        bert_dir = resolve_encoder(cfg.bertscore.model) if cfg.bertscore.model else encoder_dir
        bert = M.BertScore(bert_dir, cfg.bertscore.num_layers, cfg.bertscore.batch_size, device)
    scores = score_replies(gen, cfg.conditions, cfg, encoder, bert)
    scoring_s = time.perf_counter() - t_score

    outcome = {c: outcome_summary(gen.filter(pc.equal(gen.column("condition"), c))) for c in cfg.conditions}
    notes = list(scores.pop("notes"))
    if missing:
        notes.append(f"{len(missing)} memory bullet(s) absent from the pruned store counted as not kept")
    summary: dict[str, Any] = {
        "format": DIALOGUE_FORMAT,
        "data": str(data),
        "out": str(out),
        "generator": llm.describe("reply"),
        "conditions": list(cfg.conditions),
        "targets": {"sampled": len(sampled.targets), "eligible": sampled.eligible, "excluded": sampled.excluded,
                    "seed": cfg.seed, "paired": scores["paired"],
                    "sessions": len({(t.conversation_id, t.session_index) for t in sampled.targets}),
                    "conversations": len({t.conversation_id for t in sampled.targets})},
        "metrics": scores["per_condition"],
        "comparisons": scores["comparisons"],
        "cost": cost_table(gen, cfg.conditions),
        "tokens": counter.unit,
        "llm_outcome": outcome,
        "rejects": sink.count,
        "pruned": pruned_info,
        "retrieval": {"k": cfg.retrieval_k, "query_turns": cfg.retrieval_turns, "encoder": encoder_dir,
                      "similarity": "cosine of L2-normalised mean-pooled embeddings"} if "retrieval" in cfg.conditions else None,
        "metric_settings": {
            "bleu": "sacrebleu corpus BLEU, 13a tokenizer, 0-100",
            "rouge_l": "rouge_score rougeL F-measure, stemmer on, 0-1 (mean over replies)",
            "bertscore_f1": None if bert is None else f"bert_score F1 with {model_label(bert.model_dir)}, layer {bert.num_layers}, "
                                                       f"no baseline rescaling, no idf, 0-1 (mean over replies)",
            "mauve": f"mauve-text on mean-pooled {model_label(encoder_dir)} features (not GPT-2 large), 0-1",
            "bootstrap": cfg.bootstrap.model_dump(), "mauve_bootstrap": cfg.mauve.bootstrap,
        },
        "chunks": chunks,
        "notes": notes,
        "timing": {"plan_s": round(planned_s, 3), "generation_s": round(generation_s, 3),
                   "scoring_s": round(scoring_s, 3), "total_s": round(time.perf_counter() - started, 3)},
        "config": cfg.model_dump(mode="json"),
        "llm": llm.model_dump(mode="json"),
    }
    write_json(out / "dialogue.json", summary)
    with atomic_path(out / "dialogue.md") as tmp:
        tmp.write_text(render_markdown(summary), encoding="utf-8")
    console.print(f"dialogue-eval: {scores['paired']} paired targets scored -> {out / 'dialogue.md'}", highlight=False)
    return summary


def run(config: DialogueEvalConfig) -> dict[str, Any]:
    """Run the dialogue evaluation from its config (the `jobs/dialogue_eval.py` entry point)."""
    return run_dialogue_eval(config)


# =================================================================== report


def _cell(entry: dict[str, Any] | None, digits: int) -> str:
    if not entry or entry.get("value") is None:
        return "n/a"
    text = f"{entry['value']:.{digits}f}"
    if entry.get("ci"):
        lo, hi = entry["ci"]
        text += f" [{lo:.{digits}f}, {hi:.{digits}f}]"
    return text


def _delta(entry: dict[str, Any] | None, digits: int) -> str:
    if not entry:
        return "n/a"
    text = f"{entry['delta']:+.{digits}f}"
    if entry.get("ci"):
        lo, hi = entry["ci"]
        text += f" [{lo:+.{digits}f}, {hi:+.{digits}f}]"
    if entry.get("p_better") is not None:
        text += f" (P>0 {entry['p_better']:.2f})"
    return text


DIGITS = {"bleu": 2, "rouge_l": 4, "bertscore_f1": 4, "mauve": 4}


def condition_label(condition: str, summary: dict[str, Any]) -> str:
    """Row label of the Table 6 shape, with the retrieval k and the pruning rule."""
    if condition == "retrieval" and summary.get("retrieval"):
        k = summary["retrieval"]["k"]
        return f"Retrieval (top-{k}, LD-Agent-style)" if k != "pruned" else "Retrieval (k = pruned count)"
    if condition == "pruned" and (summary.get("pruned") or {}).get("rule"):
        rule = summary["pruned"]["rule"]
        return f"Pruned memory (t={rule.get('threshold')}, k={rule.get('top_k')})"
    return LABELS[condition]


def render_markdown(summary: dict[str, Any]) -> str:
    """dialogue.md: one line per memory condition (metrics with intervals, cost), then paired differences."""
    t = summary["targets"]
    boot = summary["metric_settings"]["bootstrap"]
    level = int(round(100 * boot["confidence"]))
    lines = [
        "# Dialogue evaluation: replies with memory conditions",
        "",
        f"Generator `{summary['generator']}` on `{summary['data']}`: {t['sampled']} target turns (seed {t['seed']}, "
        f"{t['eligible']} eligible) from {t['sessions']} sessions of {t['conversations']} conversations; "
        f"{t['paired']} have a reply under every condition and are scored (paired). "
        f"Intervals: {level}% percentile bootstrap over targets ({boot['samples']} resamples, seed {boot['seed']}).",
        "",
        "| Memory | bullets / turn | prompt tokens / turn | memory tokens / turn | BLEU | ROUGE-L | BERTScore F1 | MAUVE | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in summary["conditions"]:
        m = summary["metrics"].get(c, {})
        cost = summary["cost"][c]
        errors = summary["llm_outcome"][c]["errors"]
        mean = lambda k: "n/a" if cost[k]["mean"] is None else f"{cost[k]['mean']:.1f}"  # noqa: E731
        pct = cost.get("prompt_tokens_vs_all_pct")
        tokens = mean("prompt_tokens") + (f" ({pct:+.0f}% vs all)" if pct is not None and c != "all" else "")
        lines.append(f"| {condition_label(c, summary)} | {mean('bullets')} | {tokens} | {mean('memory_tokens')} | "
                     + " | ".join(_cell(m.get(k), DIGITS[k]) for k in METRICS) + f" | {errors} |")
    if summary["comparisons"]:
        lines += ["", "Paired differences (A - B; bootstrap interval; P>0 = share of resamples where A is higher):", "",
                  "| A - B | " + " | ".join(METRIC_NAMES[k] for k in METRICS) + " |",
                  "|---|" + "---|" * len(METRICS)]
        for name, comp in summary["comparisons"].items():
            lines.append(f"| {name} | " + " | ".join(_delta(comp.get(k), DIGITS[k]) for k in METRICS) + " |")
    ms = summary["metric_settings"]
    lines += ["", "Metrics: " + "; ".join(f"{METRIC_NAMES[k]}: {ms[k]}" for k in METRICS if ms.get(k)) + ".",
              f"Prompt tokens: {summary['tokens']}. Errors: replies that stayed empty or unusable after retries "
              f"(`rejects.jsonl`); scored targets exclude them under every condition."]
    for note in summary["notes"]:
        lines.append(f"- {note}")
    tm = summary["timing"]
    lines += ["", f"Time: {tm['total_s']} s (generation {tm['generation_s']} s, scoring {tm['scoring_s']} s); "
              f"generation chunks {summary['chunks']['chunks']} ({summary['chunks']['reused']} reused).", ""]
    return "\n".join(lines)
