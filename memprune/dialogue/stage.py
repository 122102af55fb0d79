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
`OUT/.work/<fingerprint>/` (`memprune.llm.chunked`: the fingerprint covers the generation rows, the
LLM config, the prompt template and the chunk size), so a rerun of the same command resumes and only
rescoring is repeated.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from rich.console import Console

from memprune.dialogue import metrics as M
from memprune.dialogue.config import DialogueEvalConfig
from memprune.dialogue.plan import (
    DialogueError,
    build_rows,
    bullets_by_session,
    memory_pool,
    sample_targets,
)
from memprune.dialogue.report import render_markdown
from memprune.dialogue.scoring import cost_table, score_replies
from memprune.encoders import SentenceEncoder, model_label, resolve_encoder
from memprune.errors import MemPruneError
from memprune.io import JsonlSink, OutputSet, atomic_path, check_out, read_table, write_summary
from memprune.llm import LLMConfig, outcome_summary
from memprune.llm.chunked import results_schema, run_llm_chunks
from memprune.llm.prompts import load_template, reply_messages
from memprune.rejects import Ledger
from memprune.runtime import torch_device

DIALOGUE_FORMAT = 1
console = Console(stderr=True)
RESULTS = results_schema("reply")


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


def missing_from_store(keep: Mapping[str, bool], bullet_ids: Iterable[str], store: str, policy: str, what: str,
                       error: type[MemPruneError] = DialogueError) -> list[str]:
    """The memory bullets absent from the pruned store, sorted; with `policy` "error" any is an `error` naming
    the store (`pruned_missing: drop` counts them as not kept instead)."""
    missing = sorted({b for b in bullet_ids if b not in keep})
    if missing and policy == "error":
        raise error(f"{store}: {len(missing)} memory bullet(s) of {what} are not in the pruned store, e.g. "
                    f"{missing[0]!r} (was it pruned from another bullets table? set pruned_missing: drop to count "
                    f"them as not kept)")
    return missing


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


def generate_replies(rows: pa.Table, llm: LLMConfig, out: Path, chunk_rows: int, block_rows: int,
                     progress: bool = True) -> tuple[pa.Table, dict[str, Any]]:
    """Replies for every generation row, in row order; chunks already under OUT/.work/<fingerprint>/ are reused."""
    return run_llm_chunks(rows, ["context", "memory", "target_speaker"], llm, "reply", out, chunk_rows, block_rows,
                          "dialogue-eval: generation chunks", progress)


def run(cfg: DialogueEvalConfig) -> dict[str, Any]:
    """Sample targets, build the memory conditions, generate, score; write OUT/ and return dialogue.json."""
    started = time.perf_counter()
    data, out = Path(cfg.data), check_out(cfg.out, "dialogue-eval")
    for name in ("sessions", "bullets"):
        if not (data / f"{name}.parquet").is_file():
            raise DialogueError(f"{data}: no {name}.parquet here (give a `memprune ingest`/`summarize` output directory)")
    llm = cfg.llm_settings()
    load_template(llm.prompt_name("reply"), "reply")
    llm.check_model()
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
        missing = missing_from_store(keep, (b.bullet_id for t in sampled.targets for b in memory_pool(
            by_session, t.conversation_id, t.session_index)), cfg.pruned, cfg.pruned_missing, "the evaluated turns")
        pruned_info["missing_bullets"] = len(missing)

    encoder_dir = resolve_encoder(cfg.encoder)
    device = torch_device(cfg.device)
    encoder = SentenceEncoder(encoder_dir, batch_size=cfg.encoder_batch_size,
                              max_length=cfg.encoder_max_length, device=device)
    rows = build_rows(sampled.targets, by_session, cfg.conditions, keep=keep, embed=encoder.encode,
                      retrieval_k=cfg.retrieval_k, retrieval_turns=cfg.retrieval_turns)
    counter = TokenCounter(llm, encoder_dir)
    prompt_tokens, memory_tokens = count_tokens(rows, llm, counter)
    console.print(f"dialogue-eval: {len(sampled.targets)} target turns (of {sampled.eligible} eligible) x "
                  f"{len(cfg.conditions)} conditions = {rows.num_rows} generations with {llm.describe('reply')}",
                  highlight=False)
    planned_s = time.perf_counter() - started

    with OutputSet(out, "dialogue-eval") as outputs:
        t_gen = time.perf_counter()
        results, chunks = generate_replies(rows, llm, out, cfg.chunk_targets * len(cfg.conditions), cfg.block_rows,
                                           cfg.progress)
        generation_s = time.perf_counter() - t_gen
        gen = rows.append_column("prompt_tokens", pa.array(prompt_tokens, pa.int64())) \
                  .append_column("memory_tokens", pa.array(memory_tokens, pa.int64()))
        for f in RESULTS:
            if f.name != "row_id":
                gen = gen.append_column(f, results.column(f.name))
        with atomic_path(outputs.path("generations.parquet")) as tmp:
            pq.write_table(gen, tmp)

        with JsonlSink(outputs.path("rejects.jsonl")) as sink:
            Ledger(sink).account(gen.select(["row_id", "error", "raw"]).to_pylist(), "reply",
                                 str(out / "generations.parquet"))

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
        write_summary(outputs.staging, "dialogue", summary, render_markdown(summary))
    console.print(f"dialogue-eval: {scores['paired']} paired targets scored -> {out / 'dialogue.md'}", highlight=False)
    return summary


run_dialogue_eval = run
