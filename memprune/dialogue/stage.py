"""`memprune dialogue-eval`: generate next-session replies under memory conditions and score them.

Reads a corpus (`DATA/sessions.parquet`, `DATA/bullets.parquet`) and a pruned store (the
`memprune prune` output, read by `memprune.memory.store`), samples target turns, builds one generation row per target and
memory condition (`memprune.dialogue.plan`), generates the replies through
`memprune.llm.run_llm(task="reply")` on Ray Data (any engine: vllm, http, hf), scores them
against the real turns (`memprune.dialogue.metrics`) and writes into `OUT/`:

- `generations.parquet`  one row per target x condition: context, memory, reference, reply,
                         errors, attempts, prompt tokens (`memprune.llm.tokens`: the reply prompt as
                         the engine gets it) and memory tokens (the bullet texts);
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

import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from rich.console import Console

from memprune.dialogue import metrics as M
from memprune.dialogue.config import DialogueEvalConfig
from memprune.dialogue.plan import DialogueError, build_rows, sample_targets
from memprune.dialogue.report import render_markdown
from memprune.dialogue.scoring import score_replies
from memprune.encoders import SentenceEncoder, model_label, resolve_encoder
from memprune.io import JsonlSink, atomic_path, read_table, write_summary
from memprune.outputs import OutputSet, check_out_location
from memprune.llm import LLMConfig, outcome_summary
from memprune.llm.chunked import results_schema, run_llm_chunks
from memprune.llm.tasks import load_template
from memprune.llm.tokens import PromptTokens
from memprune.memory.conditions import bullets_by_session, memory_pool
from memprune.memory.cost import cost_table
from memprune.memory.store import load_keep, missing_from_store
from memprune.rejects import Ledger
from memprune.runtime import torch_device
from memprune.storage import Location, directory

DIALOGUE_FORMAT = 1
console = Console(stderr=True)
RESULTS = results_schema("reply")


def memory_tokens(rows: pa.Table, counter: PromptTokens) -> list[int]:
    """Tokens of every generation row's memory: the bullet texts alone, one per line (no note tags)."""
    return counter.texts(["\n".join(n["text"] for n in memory) for memory in rows.column("memory").to_pylist()])


def generate_replies(rows: pa.Table, llm: LLMConfig, out: Path | Location, chunk_rows: int, block_rows: int,
                     progress: bool = True) -> tuple[pa.Table, dict[str, Any]]:
    """Replies for every generation row, in row order; chunks already under OUT/.work/<fingerprint>/ are reused."""
    return run_llm_chunks(rows, ["context", "memory", "target_speaker"], llm, "reply", out, chunk_rows, block_rows,
                          "dialogue-eval: generation chunks", progress)


def run(cfg: DialogueEvalConfig) -> dict[str, Any]:
    """Sample targets, build the memory conditions, generate, score; write OUT/ and return dialogue.json."""
    started = time.perf_counter()
    data, out = directory(cfg.data, "--data"), check_out_location(cfg.out, "dialogue-eval")
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
    counter = PromptTokens(llm, encoder_dir)
    prompt_tokens = counter.prompts(rows, "reply", cfg.progress)
    memory_counts = memory_tokens(rows, counter)
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
                  .append_column("memory_tokens", pa.array(memory_counts, pa.int64()))
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
