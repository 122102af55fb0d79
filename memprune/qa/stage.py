"""`memprune qa-eval`: answer the questions of a corpus's `qa` table under memory conditions and score them.

Reads a corpus (`DATA/qa.parquet`, `DATA/sessions.parquet`, `DATA/bullets.parquet`) and a pruned
store (the `memprune prune` output, read by `memprune.memory.store`), builds one answer row per question and memory condition
(`memprune.qa.plan`), answers through `run_llm(task="answer")` on Ray Data (any engine), scores the
answers (`memprune.qa.metrics`: token F1, BLEU-1, abstention), asks the judge LLM for a CORRECT/WRONG
verdict when one is configured (`run_llm(task="qa_judge")`), and writes into `OUT/`:

- `answers.parquet`  one row per question x condition: memory, token counts, answer, scores, verdict;
- `rejects.jsonl`    answers and verdicts that failed after retries (with the raw model text);
- `qa.json`          accounting, scores per category and condition with bootstrap intervals, paired
                     differences, tokens per condition (mean, p95), settings;
- `qa.md`, `qa.png`  the tables per category and the accuracy against memory tokens.

Answers and verdicts run in resumable chunks under `OUT/.work/<fingerprint>/`
(`memprune.llm.chunked`): rerunning the same command after a crash or a kill redoes only what was
not finished, and only the scoring is repeated.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from rich.console import Console

from memprune.encoders import SentenceEncoder, resolve_encoder
from memprune.io import JsonlSink, atomic_path, read_table, write_summary
from memprune.outputs import OutputSet, check_out_location
from memprune.llm import LLMConfig, outcome_summary
from memprune.llm.chunked import run_llm_chunks
from memprune.llm.tasks import load_template
from memprune.llm.tokens import PromptTokens
from memprune.memory.conditions import bullets_by_session
from memprune.memory.cost import cost_table
from memprune.memory.store import load_keep, missing_from_store
from memprune.qa.config import QAEvalConfig
from memprune.qa.metrics import ABSTAIN, ABSTAIN_MARKERS, score_answer
from memprune.qa.plan import (
    ROWS,
    Corpus,
    QAError,
    Question,
    build_rows,
    load_questions,
    needs_keep,
    select_questions,
)
from memprune.qa.report import render_markdown, write_figure
from memprune.qa.scoring import category_label, score_groups
from memprune.rejects import Ledger
from memprune.runtime import torch_device
from memprune.storage import Location, directory

QA_FORMAT = 1
console = Console(stderr=True)
ANSWERS = pa.schema([
    *ROWS,
    pa.field("prompt_tokens", pa.int64()),
    pa.field("prediction", pa.string()),
    pa.field("parse", pa.string()),
    pa.field("raw", pa.string()),
    pa.field("error", pa.string()),
    pa.field("attempts", pa.int64()),
    pa.field("tokens_in", pa.int64()),
    pa.field("tokens_out", pa.int64()),
    pa.field("f1", pa.float64(), nullable=False),
    pa.field("bleu1", pa.float64(), nullable=False),
    pa.field("abstained", pa.bool_()),
    pa.field("verdict", pa.string()),
    pa.field("verdict_by", pa.string()),
    pa.field("judge_score", pa.float64()),
    pa.field("judge_raw", pa.string()),
    pa.field("judge_error", pa.string()),
    pa.field("judge_attempts", pa.int64()),
])
ANSWER_OUT = ("prediction", "parse", "raw", "error", "attempts", "tokens_in", "tokens_out")


def check_corpus(data: Path | Location) -> None:
    """A `QAError` naming the directory and the table when the corpus lacks qa, sessions or bullets."""
    for name in ("qa", "sessions", "bullets"):
        if not (data / f"{name}.parquet").is_file():
            hint = " (qa-eval needs a corpus with questions: `memprune ingest --format locomo` or a jsonl corpus " \
                   "with `qa`)" if name == "qa" else " (give a `memprune ingest`/`summarize` output directory)"
            raise QAError(f"{data}: no {name}.parquet here{hint}")


def read_corpus(data: Path | Location) -> tuple[pa.Table, pa.Table, pa.Table]:
    """(qa, sessions, bullets) of a corpus directory; a missing or empty table is a `QAError` naming it."""
    check_corpus(data)
    qa = read_table(data / "qa.parquet", "qa")
    if qa.num_rows == 0:
        raise QAError(f"{data / 'qa.parquet'}: the qa table is empty: no question to evaluate")
    return qa, read_table(data / "sessions.parquet", "sessions"), read_table(data / "bullets.parquet", "bullets")


def judge_inputs(rows: pa.Table, answers: pa.Table) -> pa.Table:
    """The judge's rows: answerable questions that got an answer (row_id, question, gold, prediction)."""
    mask = pc.and_(rows.column("answerable"), pc.is_valid(answers.column("prediction")))
    return pa.table({"row_id": rows.column("row_id"), "question": rows.column("question"),
                     "gold": rows.column("gold"), "prediction": answers.column("prediction")}).filter(mask)


def verdicts(rows: list[dict[str, Any]], judged: dict[str, dict[str, Any]] | None) -> None:
    """Fill verdict, verdict_by and judge_score in `rows` (answer rows with scores) in place.

    Unanswerable questions are decided by abstention; a failed answer or verdict scores 0;
    without a judge (`judged` None) every verdict column stays null.
    """
    for r in rows:
        r.update(verdict=None, verdict_by=None, judge_score=None, judge_raw=None, judge_error=None, judge_attempts=None)
        if judged is None:
            continue
        r["judge_score"] = 0.0
        if r["prediction"] is None:
            continue
        if not r["answerable"]:
            r.update(verdict="CORRECT" if r["abstained"] else "WRONG", verdict_by="abstention",
                     judge_score=1.0 if r["abstained"] else 0.0)
            continue
        j = judged[r["row_id"]]
        r.update(verdict=j["verdict"], verdict_by="judge", judge_score=1.0 if j["verdict"] == "CORRECT" else 0.0,
                 judge_raw=j["raw"], judge_error=j["error"], judge_attempts=j["attempts"])


def accounting(answers: pa.Table, conditions: list[str], judged: bool) -> dict[str, Any]:
    """Every answer row accounted: seen = answered + errors per condition; the verdicts likewise."""
    out: dict[str, Any] = {}
    for c in conditions:
        mine = answers.filter(pc.equal(answers.column("condition"), c))
        entry: dict[str, Any] = {"seen": mine.num_rows,
                                 "answered": mine.num_rows - mine.column("prediction").null_count,
                                 "errors": sum(1 for e in mine.column("error").to_pylist() if e)}
        if judged:
            by = mine.column("verdict_by").to_pylist()
            judge_errors = sum(1 for e in mine.column("judge_error").to_pylist() if e)
            entry["verdicts"] = {"by_judge": by.count("judge") - judge_errors, "judge_errors": judge_errors,
                                 "by_abstention": by.count("abstention"), "answer_failed": entry["errors"]}
        if entry["seen"] != entry["answered"] + entry["errors"]:
            raise RuntimeError(f"condition {c}: {entry} does not reconcile")
        out[c] = entry
    return out


@dataclass
class Plan:
    """The answer rows of a run and what the report says about how they were chosen."""

    questions: list[Question]
    table_questions: int
    excluded: dict[str, int]
    rows: pa.Table
    prompt_tokens: list[int]
    token_unit: str
    encoder: str
    pruned: dict[str, Any] | None
    notes: list[str] = field(default_factory=list)


def plan(cfg: QAEvalConfig, llm: LLMConfig) -> Plan:
    """Questions, memory conditions and answer rows with their token counts (no LLM call yet)."""
    data = directory(cfg.data, "--data")
    qa, sessions, bullets = read_corpus(data)
    all_questions = load_questions(qa)
    questions, excluded = select_questions(all_questions, cfg.questions, cfg.seed, cfg.categories)
    if not questions:
        raise QAError(f"{data / 'qa.parquet'}: no question left after the filters (categories {cfg.categories})")
    corpus = Corpus.build(sessions, bullets_by_session(bullets))
    keep, pruned_info, notes = None, None, []
    if needs_keep(cfg.conditions, cfg.retrieval_k):
        keep, pruned_info = load_keep(cfg.pruned)
        convs = {q.conversation_id for q in questions}
        missing = missing_from_store(keep, (b.bullet_id for c in convs for s in corpus.by_session.get(c, {}).values()
                                            for b in s), cfg.pruned, cfg.pruned_missing,
                                     "the evaluated conversations")
        pruned_info["missing_bullets"] = len(missing)
        if missing:
            notes.append(f"{len(missing)} memory bullet(s) absent from the pruned store counted as not kept")
    encoder_dir = resolve_encoder(cfg.encoder)
    embed = None
    if "retrieval" in cfg.conditions:
        embed = SentenceEncoder(encoder_dir, batch_size=cfg.encoder_batch_size, max_length=cfg.encoder_max_length,
                                device=torch_device(cfg.device)).encode
    counter = PromptTokens(llm, encoder_dir)
    rows = build_rows(questions, corpus, cfg.conditions, counter.texts, keep=keep, embed=embed,
                      retrieval_k=cfg.retrieval_k, dialogue_tokens=cfg.dialogue_tokens, scope=cfg.scope)
    prompts = counter.prompts(rows, "answer", cfg.progress)
    if llm.max_model_len:
        over = sum(1 for p in prompts if p + llm.sampling.max_tokens_for("answer", 1) > llm.max_model_len)
        if over:
            notes.append(f"{over} answer prompt(s) plus max_tokens exceed the generator's max_model_len "
                         f"{llm.max_model_len}: they fail as error rows (lower dialogue_tokens or raise max_model_len)")
    return Plan(questions, len(all_questions), excluded, rows, prompts, counter.unit, encoder_dir, pruned_info, notes)


def answers_table(cfg: QAEvalConfig, planned: Plan, answered: pa.Table, judged: dict[str, dict[str, Any]] | None
                  ) -> pa.Table:
    """The `ANSWERS` table: the plan's rows, the answers, their scores and verdicts."""
    table = planned.rows.append_column("prompt_tokens", pa.array(planned.prompt_tokens, pa.int64()))
    for name in ANSWER_OUT:
        table = table.append_column(ANSWERS.field(name), answered.column(name))
    records = table.to_pylist()
    for r in records:
        r["f1"], r["bleu1"], r["abstained"] = score_answer(r["prediction"], r["gold"], r["category"], cfg.f1_rules)
    verdicts(records, judged)
    return pa.Table.from_pylist(records, schema=ANSWERS)


def run(cfg: QAEvalConfig) -> dict[str, Any]:
    """Plan the questions x conditions, answer, judge, score; write OUT/ and return qa.json."""
    started = time.perf_counter()
    out = check_out_location(cfg.out, "qa-eval")
    check_corpus(directory(cfg.data, "--data"))
    llm, judge = cfg.llm_settings(), cfg.judge_settings()
    load_template(llm.prompt_name("answer"), "answer")
    llm.check_model()
    if judge is not None:
        load_template(judge.prompt_name("qa_judge"), "qa_judge")
        judge.check_model()
    planned = plan(cfg, llm)
    rows = planned.rows
    console.print(f"qa-eval: {len(planned.questions)} questions x {len(cfg.conditions)} conditions = {rows.num_rows} "
                  f"answers with {llm.describe('answer')}"
                  + (f", verdicts by {judge.describe('qa_judge')}" if judge else ""), highlight=False)
    planned_s = time.perf_counter() - started

    with OutputSet(out, "qa-eval") as outputs:
        summary = _answer_and_score(cfg, planned, llm, judge, outputs, started, planned_s)
    console.print(f"qa-eval: {len(planned.questions)} questions scored -> {out / 'qa.md'}", highlight=False)
    return summary


def _answer_and_score(cfg: QAEvalConfig, planned: Plan, llm: LLMConfig, judge: LLMConfig | None, outputs: OutputSet,
                      started: float, planned_s: float) -> dict[str, Any]:
    """Answers and verdicts (resumable, under OUT/.work), their scores; every output into the output set."""
    out, rows = outputs.loc, planned.rows
    chunk_rows = cfg.chunk_questions * len(cfg.conditions)
    t0 = time.perf_counter()
    answered, answer_chunks = run_llm_chunks(rows, ["question", "memory"], llm, "answer", out, chunk_rows,
                                             cfg.block_rows, "qa-eval: answer chunks", cfg.progress)
    judged, judge_chunks = None, None
    if judge is not None:
        judged, inputs = {}, judge_inputs(rows, answered)
        if inputs.num_rows:
            result, judge_chunks = run_llm_chunks(inputs, ["question", "gold", "prediction"], judge, "qa_judge", out,
                                                  chunk_rows, cfg.block_rows, "qa-eval: verdict chunks", cfg.progress)
            judged = {r["row_id"]: r for r in result.to_pylist()}
    generation_s = time.perf_counter() - t0

    answers = answers_table(cfg, planned, answered, judged)
    with atomic_path(outputs.path("answers.parquet")) as tmp:
        pq.write_table(answers, tmp)
    with JsonlSink(outputs.path("rejects.jsonl")) as sink:
        ledger = Ledger(sink)
        ledger.account(answered.select(["row_id", "error", "raw"]).to_pylist(), "answer", str(out / "answers.parquet"))
        ledger.account(list((judged or {}).values()), "verdict", str(out / "answers.parquet"))
    t1 = time.perf_counter()
    scores = score_groups(answers, cfg.conditions, cfg.category_names, cfg.bootstrap, judge is not None)
    scoring_s = time.perf_counter() - t1

    questions = planned.questions
    by_category: dict[str, int] = {}
    for q in questions:
        label = category_label(q.category, cfg.category_names)
        by_category[label] = by_category.get(label, 0) + 1
    summary: dict[str, Any] = {
        "format": QA_FORMAT,
        "data": cfg.data,
        "out": str(out),
        "generator": llm.describe("answer"),
        "judge": judge.describe("qa_judge") if judge else None,
        "conditions": list(cfg.conditions),
        "questions": {"table": planned.table_questions, "evaluated": len(questions), "excluded": planned.excluded,
                      "answerable": sum(q.answerable for q in questions),
                      "unanswerable": sum(not q.answerable for q in questions), "by_category": by_category,
                      "conversations": len({q.conversation_id for q in questions}), "seed": cfg.seed},
        "accounting": accounting(answers, cfg.conditions, judge is not None),
        "groups": scores["groups"],
        "metrics": scores["metrics"],
        "comparisons": scores["comparisons"],
        "tokens": cost_table(answers, cfg.conditions, unit="questions", notes="notes"),
        "token_unit": planned.token_unit,
        "memory": {"scope": cfg.scope, "dialogue_tokens": cfg.dialogue_tokens,
                   "retrieval": {"k": cfg.retrieval_k, "encoder": planned.encoder, "query": "the question",
                                 "similarity": "cosine of L2-normalised mean-pooled embeddings"}
                   if "retrieval" in cfg.conditions else None,
                   "memory_tokens": "the notes as the prompt renders them (text with session, date and speaker "
                                    "tags), token counts summed"},
        "pruned": planned.pruned,
        "llm_outcome": {c: outcome_summary(answered.filter(pc.equal(rows.column("condition"), c)))
                        for c in cfg.conditions},
        "judge_outcome": outcome_summary(pa.Table.from_pylist(list(judged.values()))) if judged else None,
        "rejects": sink.count,
        "metric_settings": metric_settings(cfg, judge),
        "chunks": {"answers": answer_chunks, "verdicts": judge_chunks},
        "notes": planned.notes,
        "timing": {"plan_s": round(planned_s, 3), "generation_s": round(generation_s, 3),
                   "scoring_s": round(scoring_s, 3), "total_s": round(time.perf_counter() - started, 3)},
        "config": cfg.model_dump(mode="json"),
        "llm": llm.model_dump(mode="json"),
        "judge_llm": judge.model_dump(mode="json") if judge else None,
        "outputs": {"answers": str(out / "answers.parquet"), "report": str(out / "qa.md"),
                    "figure": str(out / "qa.png") if cfg.figures else None},
    }
    if cfg.figures:
        write_figure(summary, outputs.path("qa.png"))
    write_summary(outputs.staging, "qa", summary, render_markdown(summary))
    return summary


def metric_settings(cfg: QAEvalConfig, judge: LLMConfig | None) -> dict[str, Any]:
    """How each score is computed, for qa.json and the report."""
    return {
        "f1": f"token F1 of the LoCoMo-normalised, Porter-stemmed words ({cfg.f1_rules} rules), 0-1",
        "bleu1": "clipped unigram precision x brevity penalty on the normalised words (unstemmed), 0-1",
        "judge": None if judge is None else "share of CORRECT verdicts of the judge LLM (prompt "
                                            f"{Path(judge.prompt_name('qa_judge')).stem}), 0-1",
        "unanswerable": f"scored by abstention: the answer contains one of {list(ABSTAIN_MARKERS)} "
                        f"(the prompt asks for {ABSTAIN!r}) -> 1, else 0, on every metric",
        "failures": "an answer or verdict that failed after retries scores 0 (counted as wrong)",
        "bootstrap": cfg.bootstrap.model_dump(),
    }


run_qa_eval = run
