"""The `memprune` command line: one subcommand per stage, mirroring `jobs/`.

Every stage command takes the same door as its Ray job: a YAML config (`--config/-c`), `key=value`
overrides (`--set`), then its typed options, all validated once by the stage's config model
(`memprune.config.load_config`); then it calls the stage's `run(cfg)` and prints a short summary.
Options reach the config as typed values, never as YAML strings, so a path named `2024`, `true`
or `a: b` stays a path. Errors a user can fix exit with status 2 and one clear line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import typer

from memprune.cli.common import (  # noqa: F401  (app, main: the executable's entry; the rest: the commands' door)
    CONFIG,
    LLM_CONFIG,
    LLM_SET,
    NULL,
    SET,
    _csv,
    _top_k,
    app,
    console,
    fail,
    main,
    run_stage,
    user_errors,
)


@app.command()
def ingest(
    format: Optional[str] = typer.Option(None, "--format", "-f", help="Input format: msc, locomo or jsonl."),
    input: Optional[Path] = typer.Option(None, "--input", "-i", help="Source file or directory."),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="Output directory or URI (s3://...) for the corpus "
                                                                "tables."),
    split: Optional[str] = typer.Option(None, "--split", help="Split to read where the layout has splits (msc: valid)."),
    config: Optional[Path] = CONFIG,
    set_: Optional[list[str]] = SET,
) -> None:
    """Read a corpus into sessions/bullets(/qa) Parquet tables, with rejects and counts."""
    from memprune.ingest import IngestConfig, run

    cfg, summary = run_stage(IngestConfig, run, config, set_,
                             {"format": format, "input": input, "out": out, "split": split})
    c = summary["counts"]
    console.print(f"ingested {c['conversations']} conversations, {c['sessions']} sessions, {c['turns']} turns, "
                  f"{c['bullets']} bullets, {c['qa']} qa; {c['rejects']} rejects -> {cfg.out}", highlight=False)


@app.command()
def stats(data: Path = typer.Argument(..., help="A directory written by `memprune ingest` or `memprune synth`.")) -> None:
    """Print the corpus counts and the per-session bullet/turn distributions."""
    from memprune.ingest import corpus_stats

    with user_errors("stats"):
        result = corpus_stats(data)
    json.dump(result, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")


@app.command()
def synth(
    conversations: Optional[int] = typer.Option(None, "--conversations", "-n", help="Number of conversations [default: 100]."),
    sessions: Optional[int] = typer.Option(None, "--sessions", "-s", help="Sessions per conversation [default: 4]."),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="Output directory or URI (s3://...)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed; same seed, same corpus [default: 0]."),
    facts: Optional[int] = typer.Option(None, "--facts", help="Durable facts in each speaker's persona (1..20) [default: 6]."),
    oneoffs: Optional[int] = typer.Option(None, "--oneoffs", help="Mean one-off remarks per speaker per session [default: 2]."),
    mention_prob: Optional[float] = typer.Option(None, "--mention-prob",
                                                 help="Chance a known fact is restated in an intermediate session [default: 0.35]."),
    duplicates: Optional[float] = typer.Option(None, "--duplicates", help="Share of bullets given a verbatim or "
                                               "paraphrased duplicate in their session, with ground truth [default: 0]."),
    updates: Optional[float] = typer.Option(None, "--updates", help="Share of persona facts that get a new value in "
                                            "a later session (same speaker and slot), ground truth update_of "
                                            "[default: 0]."),
    config: Optional[Path] = CONFIG,
    set_: Optional[list[str]] = SET,
) -> None:
    """Generate a synthetic multi-session corpus whose bullets know whether they recur."""
    from memprune.synth import SynthConfig, run

    _, summary = run_stage(SynthConfig, run, config, set_, {
        "conversations": conversations, "sessions": sessions, "out": out, "seed": seed, "facts_per_speaker": facts,
        "oneoffs_per_session": oneoffs, "mention_prob": mention_prob, "duplicates": duplicates,
        "updates": updates, "progress": sys.stderr.isatty()})
    console.print(json.dumps(summary["counts"]), highlight=False)


@app.command()
def summarize(
    data: Optional[str] = typer.Option(None, "--data", "-d", help="Directory or URI with sessions.parquet."),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="Output dir or URI (s3://...): "
                                                                "bullets/summaries/sessions.parquet, summarize.json."),
    llm_config: Optional[Path] = LLM_CONFIG,
    llm_set: Optional[list[str]] = LLM_SET,
    chunk_sessions: Optional[int] = typer.Option(None, "--chunk-sessions", help="Sessions per resumable chunk [default: 2048]."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Only the first N sessions (a trial run)."),
    config: Optional[Path] = CONFIG,
    set_: Optional[list[str]] = SET,
) -> None:
    """Summarize each session into memory bullets citing their turns (resumable: rerun to resume)."""
    from memprune.summarize import SummarizeConfig, run

    cfg, summary = run_stage(SummarizeConfig, run, config, set_, {
        "data": data, "out": out, "llm_config": llm_config, "chunk_sessions": chunk_sessions, "limit": limit}, llm_set)
    c = summary["counts"]
    console.print(f"summarized {c['sessions_ok']}/{c['sessions']} sessions into {c['bullets']} bullets "
                  f"({c['sessions_error']} errors, {c['evidence_dropped']} evidence ids dropped) with {summary['llm']} "
                  f"-> {cfg.out}", highlight=False)


@app.command()
def label(
    data: Optional[str] = typer.Option(None, "--data", "-d", help="Directory or URI with sessions.parquet and "
                                                                  "bullets.parquet."),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="Output directory or URI (s3://...): "
                                                                "pairs/labels.parquet, label.json."),
    source: Optional[str] = typer.Option(None, "--source", help="judge (default), qa (QA evidence) or usage (a usage log)."),
    usage_log: Optional[Path] = typer.Option(None, "--usage-log", help="usage: log file (.parquet/.jsonl) or dir of them."),
    qa_grading: Optional[str] = typer.Option(None, "--qa-grading", help="qa: binary (default) or graded (by citing questions)."),
    qa_later_only: bool = typer.Option(False, "--qa-later-only", help="qa: count only questions reaching a later session."),
    judge: Optional[str] = typer.Option(None, "--judge", help="llm (the paper's judge), likelihood (log-prob gain) or "
                                                               "similarity (a CPU proxy; default)."),
    judge_mode: Optional[str] = typer.Option(None, "--judge-mode", help="llm: pairwise (one prompt per pair; default) "
                                                                         "or listwise (one per target turn)."),
    listwise_orders: Optional[int] = typer.Option(None, "--listwise-orders", help="listwise: score each list in N orders "
                                                                                   "(2 = also reversed) [default: 1]."),
    judge_set: Optional[str] = typer.Option(None, "--judge-set", help="Comma list of LLM config files: a consensus of "
                                                                       "these judges."),
    judge_samples: Optional[int] = typer.Option(None, "--judge-samples", help="llm: score each pair k times (consensus)."),
    judge_temperature: Optional[float] = typer.Option(None, "--judge-temperature",
                                                      help="Temperature of --judge-samples [default: 0.7]."),
    plan: bool = typer.Option(False, "--plan", help="Only count calls, tokens and GPU-hours of each judge mode "
                                                    "(tokenizer only, no model run)."),
    throughput: Optional[float] = typer.Option(None, "--throughput", help="--plan/cost: GPU prompt (prefill) "
                                                                           "tokens/s, for GPU-hours."),
    decode_throughput: Optional[float] = typer.Option(None, "--decode-throughput", help="--plan/cost: GPU generated "
                                                      "tokens/s [default: --throughput]."),
    measure: Optional[int] = typer.Option(None, "--measure", help="--plan: first judge N real pairs with the chosen "
                                          "judge here and plan the run's time from the measured throughput."),
    plan_tokenizer: Optional[str] = typer.Option(None, "--plan-tokenizer", help="Fallback tokenizer (dir or "
                                                 "tokenizer.json) when the judge model's is not local [default: MiniLM]."),
    speaker: Optional[str] = typer.Option(None, "--speaker", help="Target turns: all (default), same or other speaker than the bullet's."),
    context: Optional[int] = typer.Option(None, "--context", help="Turns of dialogue context before each target (llm; default 4)."),
    horizon: Optional[int] = typer.Option(None, "--horizon", help="Sessions ahead that give credit (default 1 = next only)."),
    decay: Optional[float] = typer.Option(None, "--decay", help="A score h sessions ahead counts score * decay**(h-1) (default 0.5)."),
    aggregation: Optional[str] = typer.Option(None, "--aggregation", help="Label per bullet: max (default) or mean."),
    shard_size: Optional[int] = typer.Option(None, "--shard-size", help="Texts (similarity) / pairs (llm) per shard."),
    model: Optional[str] = typer.Option(None, "--model", help="similarity: encoder path or hub id."),
    executor: Optional[str] = typer.Option(None, "--executor", help="similarity: local (in-process, default) or ray."),
    llm_config: Optional[Path] = LLM_CONFIG,
    llm_set: Optional[list[str]] = LLM_SET,
    config: Optional[Path] = CONFIG,
    set_: Optional[list[str]] = SET,
    no_progress: bool = typer.Option(False, "--no-progress", help="Hide progress bars."),
) -> None:
    """Write bullet labels: judged pairs (resumable: rerun to resume), QA evidence, or a usage log."""
    from memprune.label import LabelConfig, run
    from memprune.label.sources.common import SOURCES

    cfg, summary = run_stage(LabelConfig, run, config, set_, {
        "data": data, "out": out, "judge": judge, "speaker": speaker, "context_turns": context, "horizon": horizon,
        "decay": decay, "aggregation": aggregation, "shard_size": shard_size, "similarity.model": model,
        "similarity.executor": executor, "llm_config": llm_config, "source": source, "usage.log": usage_log,
        "qa.grading": qa_grading, "qa.later_only": True if qa_later_only else None,
        "judge_mode": judge_mode, "listwise.orders": listwise_orders, "judge_set": _csv(judge_set),
        "judge_samples": judge_samples, "judge_temperature": judge_temperature, "plan": True if plan else None,
        "cost.throughput": throughput, "cost.decode_throughput": decode_throughput, "cost.tokenizer": plan_tokenizer,
        "cost.measure": measure,
        "progress": False if no_progress else None}, llm_set)
    if summary["stage"] == "label-plan":
        from memprune.label.report import render_plan

        sys.stdout.write(render_plan(summary))
        console.print(f"plan -> {cfg.out}/plan.json, {cfg.out}/plan.md", highlight=False)
        return
    c, t = summary["counts"], summary["throughput"]
    if not SOURCES[summary["source"]].judged:
        extra = f", {c['events_rejected']} usage events rejected" if "events_rejected" in c else ""
        console.print(f"labelled {c['bullets_labelled']}/{c['bullets']} bullets from {summary['source']} "
                      f"({summary['rule']}; {c['bullets_unlabelled']} unlabelled{extra}) -> {cfg.out}", highlight=False)
        return
    console.print(f"labelled {c['bullets_labelled']}/{c['bullets']} bullets from {c['pairs']} pairs "
                  f"({c['pairs_error']} errors, {c['bullets_unlabelled']} unlabelled) with {summary['judge']}; "
                  f"{t['pairs_per_s']} pairs/s, {t['wall_s']} s -> {cfg.out}", highlight=False)
    if "cost" in summary:
        m = summary["cost"]["measured"]
        console.print(f"cost: {m['llm_calls']} LLM calls, {m['prompt_tokens']} prompt + {m['generated_tokens']} "
                      f"generated tokens ({m['prompt_tokens_per_labelled_pair'] or 0:.1f} prompt tokens per labelled "
                      f"pair)", highlight=False)


def _label_weights(items: Optional[list[str]]) -> Optional[dict[str, float]]:
    """`["qa=5", "judge=1"]` -> {"qa": 5.0, "judge": 1.0}; a malformed item is a user error."""
    if not items:
        return None
    out: dict[str, float] = {}
    for item in items:
        source, sep, w = item.partition("=")
        try:
            out[source.strip()] = float(w)
        except ValueError:
            sep = ""
        if not sep:
            fail(f"--label-weight {item!r} is not SOURCE=WEIGHT")
    return out


@app.command()
def train(
    data: Optional[str] = typer.Option(None, "--data", "-d", help="Corpus dir or URI with bullets.parquet."),
    labels: Optional[list[str]] = typer.Option(None, "--labels", "-l", help="Dir or URI with labels.parquet (`memprune label`); repeat to mix tables."),
    label_weight: Optional[list[str]] = typer.Option(None, "--label-weight", help="SOURCE=W loss weight per label source, e.g. qa=5 (repeatable)."),
    label_weight_by: Optional[str] = typer.Option(None, "--label-weight-by", help="none (default) or agreement: also "
                                                  "weigh rows by the judges' agreement (consensus labels)."),
    folds: Optional[int] = typer.Option(None, "--folds", help="k-fold by conversation: OUT/fold<i>/, pooled evaluation."),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="Output dir or URI (s3://...): <stage>/seed<k>/, run.json, train.md."),
    stages: Optional[str] = typer.Option(None, "--stages", help="Comma list of vanilla,stage1,stage2 (default all)."),
    seeds: Optional[str] = typer.Option(None, "--seeds", help="Comma list of seeds (default 0,1,2)."),
    encoder: Optional[str] = typer.Option(None, "--encoder", help="Encoder path or hub id (default local all-MiniLM-L6-v2)."),
    init: Optional[str] = typer.Option(None, "--init", help="Start from a scorer: a shipped one (default) or an "
                                                            "artifact dir; vanilla is it as it is, stage 1 starts there."),
    workers: Optional[int] = typer.Option(None, "--workers", help="Ray Train workers per trainer (0 = local mode)."),
    config: Optional[Path] = CONFIG,
    set_: Optional[list[str]] = SET,
    evaluate: bool = typer.Option(True, "--eval/--no-eval", help="Then run `memprune evaluate` into OUT/eval."),
) -> None:
    """Train the scorer stages (vanilla, stage 1, stage 2) over seeds on Ray Train (rerun to resume).

    A failure is one line: a user error exits 2; anything else (a bug) exits 1, its traceback in a log file.
    """
    from memprune.runtime import log_exception, one_line
    from memprune.train import TrainConfig, run

    seed_list = _csv(seeds)
    try:
        seed_values = [int(s) for s in seed_list] if seed_list else None
    except ValueError:
        fail(f"--seeds {seeds!r}: give comma-separated integers")
    try:
        cfg, summary = run_stage(TrainConfig, run, config, set_, {
            "data": data, "labels": labels or None, "out": out, "encoder": encoder, "init": init,
            "ray.num_workers": workers,
            "folds": folds, "stages": _csv(stages), "seeds": seed_values,
            "label_weights": _label_weights(label_weight), "label_weight_by": label_weight_by})
        for stage, entry in summary["stage_summary"].items():
            mse = entry.get("val_mse", {})
            console.print(f"{stage}: {len(entry['seeds'])} seed(s), val MSE {mse.get('mean', float('nan')):.4f}"
                          f" ± {mse.get('std', float('nan')):.4f}", highlight=False)
        console.print(f"trained in {summary['wall_s']:.1f} s -> {summary['out']}", highlight=False)
        if evaluate:
            from memprune.evaluate import EvalConfig
            from memprune.evaluate import run as run_evaluate

            _, result = run_stage(EvalConfig, run_evaluate, None, None,
                                  {"run": str(cfg.out), "out": f"{cfg.out}/eval", "data": cfg.data})
            console.print(f"evaluation report: {result['outputs']['report']}", highlight=False)
    except typer.Exit:
        raise
    except Exception as exc:  # not a user error (run_stage turned those into one line and exit 2)
        console.print(f"[bold red]error:[/] train failed: {type(exc).__name__}: {one_line(exc)} "
                      f"(details: {log_exception(exc, 'train')})", highlight=False, soft_wrap=True)
        raise typer.Exit(code=1) from None


@app.command()
def tune(
    data: Optional[str] = typer.Option(None, "--data", "-d", help="Corpus dir or URI with bullets.parquet."),
    labels: Optional[list[str]] = typer.Option(None, "--labels", "-l", help="Dir or URI with labels.parquet; repeat "
                                                                            "to mix."),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="Output dir or URI (s3://...): tune.json, tune.md, "
                                                                "tune.png, train-tuned.yaml, trials/."),
    stage1_trials: Optional[int] = typer.Option(None, "--stage1-trials", help="Stage-1 trials [default: 6]."),
    stage2_trials: Optional[int] = typer.Option(None, "--stage2-trials", help="Stage-2 trials [default: 8]."),
    train_fraction: Optional[float] = typer.Option(None, "--train-fraction", help="Share of the train conversations "
                                                   "the trials use (validation stays whole) [default: 1]."),
    tuned_config: Optional[Path] = typer.Option(None, "--tuned-config", help="Also write the best train config here."),
    config: Optional[Path] = CONFIG,
    set_: Optional[list[str]] = SET,
) -> None:
    """Search the stage-1 and stage-2 settings with Ray Tune (ASHA), selected on validation session Spearman."""
    from memprune.tune import TuneConfig, run

    _, summary = run_stage(TuneConfig, run, config, set_, {
        "data": data, "labels": labels or None, "out": out, "stage1_trials": stage1_trials,
        "stage2_trials": stage2_trials, "train_fraction": train_fraction, "tuned_config": tuned_config})
    best = summary["best_stage2"]
    console.print(f"stage 1: valid session Spearman {summary['stage1_chosen']['metric']}; best stage 2: "
                  f"{best['metric'] if best else None} ({summary['stopped_early']} trial(s) stopped early) "
                  f"-> {summary['out']}/tune.md", highlight=False)


@app.command()
def evaluate(
    run_dir: Optional[str] = typer.Option(None, "--run", help="Run directory or URI with <stage>/seed<k>/predictions.parquet."),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="Output directory or storage URI (s3://...) for metrics.json, report.md and figures."),
    data: Optional[str] = typer.Option(None, "--data", help="Corpus dir or URI (`memprune ingest`): token counts, QA retention."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="Token unit: encoder (default), whitespace, or a tokenizer.json."),
    threshold: Optional[float] = typer.Option(None, "--threshold", help="Pruning threshold of the main pruning table [default: 0.5]."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Pruning top-k of the threshold sweep, 0 = no cap [default: 5]."),
    relevance: Optional[float] = typer.Option(None, "--relevance-threshold", help="Relevant = label >= this [default: 0.5]."),
    valid: bool = typer.Option(False, "--valid", help="Also evaluate the validation split."),
    qa_draws: Optional[int] = typer.Option(None, "--qa-draws", help="Random-pruning draws of the QA baseline [default: 1000]."),
    figures: Optional[bool] = typer.Option(None, "--figures/--no-figures", help="Draw the PNG figures [default: on]."),
    config: Optional[Path] = CONFIG,
    set_: Optional[list[str]] = SET,
) -> None:
    """Metrics, significance, pruning view and QA-evidence retention of a trained run."""
    from memprune.evaluate import EvalConfig, run

    values = {"run": run_dir, "out": out, "data": data, "tokenizer": tokenizer, "rule.threshold": threshold,
              "relevance_threshold": relevance, "qa_draws": qa_draws, "figures": figures,
              "splits": ["test", "valid"] if valid else None}
    _, result = run_stage(EvalConfig, run, config, set_, values | _top_k(top_k))
    console.print(f"evaluated {', '.join(result['splits']['test']['stages'])} -> {result['outputs']['report']}",
                  highlight=False)


@app.command("dialogue-eval")
def dialogue_eval(
    data: Optional[str] = typer.Option(None, "--data", "-d", help="Corpus dir or URI with sessions.parquet and "
                                                                  "bullets.parquet."),
    pruned: Optional[str] = typer.Option(None, "--pruned", help="`memprune prune` output dir or URI (pruned/ store "
                                                                "with keep)."),
    llm_config: Optional[Path] = LLM_CONFIG,
    llm_set: Optional[list[str]] = LLM_SET,
    out: Optional[str] = typer.Option(None, "--out", "-o", help="Output dir or URI (s3://...): dialogue.json, "
                                                                "dialogue.md, generations.parquet."),
    turns: Optional[int] = typer.Option(None, "--turns", help="Target turns evaluated (default 200)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Sampling seed of the target turns (default 0)."),
    conditions: Optional[str] = typer.Option(None, "--conditions", help="Comma list of none,all,pruned,retrieval (default all four)."),
    retrieval_k: Optional[str] = typer.Option(None, "--retrieval-k", help="Bullets retrieved per turn, or 'pruned' (default 5)."),
    config: Optional[Path] = CONFIG,
    set_: Optional[list[str]] = SET,
) -> None:
    """Generate next-session replies with no/all/pruned/retrieved memory and score them (BLEU, ROUGE-L, BERTScore, MAUVE)."""
    from memprune.dialogue import DialogueEvalConfig, run

    values = {"data": data, "pruned": pruned, "out": out, "turns": turns, "seed": seed,
              "retrieval_k": _retrieval_k(retrieval_k, ("pruned",)),
              "conditions": _csv(conditions), "llm_config": llm_config}
    if llm_config is not None:
        values["llm"] = NULL  # the file replaces an inline `llm` section of the YAML config
    _, summary = run_stage(DialogueEvalConfig, run, config, set_, values, llm_set)
    for c, m in summary["metrics"].items():
        vals = ", ".join(f"{k} {m[k]['value']:.4g}" for k in ("bleu", "rouge_l", "bertscore_f1", "mauve")
                         if m.get(k, {}).get("value") is not None)
        console.print(f"{c}: {vals}; {summary['cost'][c]['prompt_tokens']['mean']:.0f} prompt tokens/turn", highlight=False)
    console.print(f"{summary['targets']['paired']} paired targets with {summary['generator']} -> {summary['out']}/dialogue.md",
                  highlight=False)


def _retrieval_k(value: Optional[str], allowed: tuple[str, ...]) -> Any:
    """`--retrieval-k`: an integer or one of the named sizes; anything else is a user error."""
    if value is None or value in allowed:
        return value
    try:
        return int(value)
    except ValueError:
        fail(f"--retrieval-k must be an integer or one of {', '.join(repr(a) for a in allowed)}, got {value!r}")


@app.command("qa-eval")
def qa_eval(
    data: Optional[str] = typer.Option(None, "--data", "-d", help="Corpus dir or URI with qa.parquet, "
                                                                  "sessions.parquet and bullets.parquet."),
    pruned: Optional[str] = typer.Option(None, "--pruned", help="`memprune prune` output dir or URI (pruned/ store "
                                                                "with keep)."),
    llm_config: Optional[Path] = typer.Option(None, "--llm-config", help="YAML file of the answering LLM (configs/llm/)."),
    llm_set: Optional[list[str]] = LLM_SET,
    judge_llm: Optional[Path] = typer.Option(None, "--judge-llm", help="YAML file of the judge LLM (CORRECT/WRONG verdicts)."),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="Output dir or URI (s3://...): qa.json, qa.md, "
                                                                "qa.png, answers.parquet."),
    conditions: Optional[str] = typer.Option(None, "--conditions", help="Comma list of none,all,pruned,retrieval,dialogue (default all five)."),
    retrieval_k: Optional[str] = typer.Option(None, "--retrieval-k", help="Bullets retrieved per question, 'pruned' or 'pruned_tokens' (default)."),
    config: Optional[Path] = CONFIG,
    set_: Optional[list[str]] = SET,
) -> None:
    """Answer the corpus's questions with no/all/pruned/retrieved memory or the raw dialogue; accuracy against memory tokens."""
    from memprune.qa import QAEvalConfig, run

    values = {"data": data, "pruned": pruned, "out": out, "conditions": _csv(conditions), "llm_config": llm_config,
              "judge_llm_config": judge_llm, "retrieval_k": _retrieval_k(retrieval_k, ("pruned", "pruned_tokens"))}
    if llm_config is not None:
        values["llm"] = NULL  # the file replaces an inline `llm` section of the YAML config
    if judge_llm is not None:
        values["judge_llm"] = NULL
    _, summary = run_stage(QAEvalConfig, run, config, set_, values, llm_set)
    group = "answerable" if summary["groups"].get("answerable") else "overall"
    for c, m in summary["metrics"][group].items():
        judge = f", J {m['judge']['value']:.3f}" if m.get("judge") else ""
        console.print(f"{c}: F1 {m['f1']['value']:.3f}, BLEU-1 {m['bleu1']['value']:.3f}{judge}; "
                      f"{m['memory_tokens']['mean']:.0f} memory tokens/question (p95 {m['memory_tokens']['p95']:.0f})",
                      highlight=False)
    q = summary["questions"]
    console.print(f"{q['evaluated']} questions ({group} shown) with {summary['generator']} -> {summary['out']}/qa.md",
                  highlight=False)


@app.command()
def quickstart(
    out: Path = typer.Option(Path("runs/quickstart"), "--out", "-o", help="Output directory."),
    data: Optional[str] = typer.Option(None, "--data", help="A real corpus as FORMAT:PATH (msc:, locomo:, jsonl:); default: synthetic."),
    set_: Optional[list[str]] = SET,
) -> None:
    """The whole method locally: corpus -> labels -> train (3 stages x 3 seeds) -> evaluate -> prune.

    `--set` changes the pipeline config, e.g. `--set train.seeds=[0] --set corpus.conversations=20`.
    """
    from rich.markdown import Markdown

    from memprune.pipeline import headline, quickstart_config, run

    with user_errors("quickstart"):
        summary = run(quickstart_config(str(out), data, set_))
    console.rule("[bold]memprune quickstart: done")
    console.print(Markdown(headline(summary["report"].rsplit("/", 1)[0])))
    review = summary["steps"].get("prune", {}).get("review")
    if review:
        console.print(f"review: {review} (the prune step's decision, record by record, in any browser)",
                      highlight=False, soft_wrap=True)
    console.print(f"report: {summary['report']}  ({summary['seconds']:.0f} s)", highlight=False)


@app.command()
def serve(
    scorer: Optional[str] = typer.Option(None, "--scorer", help="A shipped scorer by name (`memprune scorers`), or an artifact "
                                                                  "directory or URI (s3://...) [default: default]."),
    host: Optional[str] = typer.Option(None, "--host", help="Address to listen on [default: 127.0.0.1]."),
    port: Optional[int] = typer.Option(None, "--port", help="Port [default: 8000]."),
    config: Optional[Path] = CONFIG,
    set_: Optional[list[str]] = SET,
) -> None:
    """Serve the pruning decision on Ray Serve: /v1/score, /v1/decide, /v1/prune (configured stores), /healthz.

    `--set stores.mem0=mem0:mem0.yaml` names a store clients may prune; apply needs the bearer token in
    $MEMPRUNE_SERVE_TOKEN. Ctrl-C stops it.
    """
    from memprune.serve import ServeConfig, run

    run_stage(ServeConfig, run, config, set_, {"scorer": scorer, "host": host, "port": port})


scorers_app = typer.Typer(help="The scorers shipped with memprune: list them, or build one from its recipe.")
app.add_typer(scorers_app, name="scorers")


@scorers_app.callback(invoke_without_command=True)
def scorers(ctx: typer.Context, as_json: bool = typer.Option(False, "--json", help="Print the cards as JSON.")) -> None:
    """List the shipped scorers: name, version, encoder, the labels it learned and its headline figures."""
    if ctx.invoked_subcommand:
        return
    from memprune.scorers import SHIPPED

    with user_errors("scorers"):
        cards = {name: s.card() for name, s in SHIPPED.items()}
    if as_json:
        json.dump(cards, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
        return
    for name, card in cards.items():
        lo, msc = card.get("locomo", {}), card["msc"]["test"]
        figures = ", ".join(f"{b} {100 * v:.1f}% ({100 * lo['lift_over_best_baseline'][b]:+.1f} points over the best "
                            f"heuristic)" for b, v in sorted(lo.get("scorer", {}).items(), reverse=True))
        console.print(f"[bold]{name}[/bold] version {card['version']}  encoder {card['encoder']}\n"
                      f"  labels: {card['labels']}\n  trained on: {card['data']['trained_on']}\n"
                      f"  question-evidence retention on LoCoMo: {figures or 'not measured'}\n"
                      f"  MSC test: AUC {msc['auc']:.3f}, calibrated ECE {msc['ece_calibrated']:.3f}", highlight=False)


@scorers_app.command("build")
def scorers_build(
    out: Optional[str] = typer.Option(None, "--out", "-o", help="Artifact directory to write."),
    config: Optional[Path] = CONFIG,
    set_: Optional[list[str]] = SET,
) -> None:
    """Build a scorer from its recipe (configs/default-scorer.yaml makes `default`), with its card."""
    from memprune.train.shipped import ShippedRecipe, run

    cfg, card = run_stage(ShippedRecipe, run, config, set_, {"out": out})
    lo = card.get("locomo", {}).get("scorer", {})
    console.print(f"built {card['name']} version {card['version']} -> {cfg.out}  ("
                  + ", ".join(f"retention {b} {100 * v:.1f}%" for b, v in lo.items())
                  + f"; MSC test AUC {card['msc']['test']['auc']:.3f}; {card['build_seconds']:.0f} s)", highlight=False)


# The pruning and store commands live in their own module; importing it registers them on `app`.
from memprune.cli import prune as _prune_commands  # noqa: E402,F401  (registers prune, restore, score)
