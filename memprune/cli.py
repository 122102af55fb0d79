"""The `memprune` command line: one subcommand per stage, mirroring `jobs/`.

Each command parses its options, calls the stage function in `memprune.<stage>` and
prints a short summary; errors a user can fix exit with status 2 and one clear line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    help="memprune: keep the long-term memory of multi-session chatbots small and useful.",
)
console = Console(stderr=True)


def fail(message: str) -> None:
    """Print one clear error line and exit with status 2."""
    console.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code=2)


@app.command()
def ingest(
    format: str = typer.Option(..., "--format", "-f", help="Input format: msc, locomo or jsonl."),
    input: Path = typer.Option(..., "--input", "-i", help="Source file or directory."),
    out: Path = typer.Option(..., "--out", "-o", help="Output directory for the corpus tables."),
    split: Optional[str] = typer.Option(None, "--split", help="Split to read where the layout has splits (msc: valid)."),
) -> None:
    """Read a corpus into sessions/bullets(/qa) Parquet tables, with rejects and counts."""
    from memprune.adapters import IngestError
    from memprune.ingest import ingest as run_ingest

    try:
        summary = run_ingest(format, input, out, split=split)
    except IngestError as exc:
        fail(str(exc))
    counts = summary["counts"]
    console.print(
        f"ingested {counts['conversations']} conversations, {counts['sessions']} sessions, "
        f"{counts['turns']} turns, {counts['bullets']} bullets, {counts['qa']} qa; "
        f"{counts['rejects']} rejects -> {out}",
        highlight=False,
    )


@app.command()
def stats(data: Path = typer.Argument(..., help="A directory written by `memprune ingest` or `memprune synth`.")) -> None:
    """Print the corpus counts and the per-session bullet/turn distributions."""
    from memprune.adapters import IngestError
    from memprune.ingest import corpus_stats

    try:
        result = corpus_stats(data)
    except (IngestError, FileNotFoundError) as exc:
        fail(str(exc))
    json.dump(result, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")


@app.command()
def synth(
    conversations: int = typer.Option(100, "--conversations", "-n", min=1, help="Number of conversations."),
    sessions: int = typer.Option(4, "--sessions", "-s", min=2, help="Sessions per conversation."),
    out: Path = typer.Option(..., "--out", "-o", help="Output directory."),
    seed: int = typer.Option(0, "--seed", help="Random seed; same seed, same corpus."),
    facts: int = typer.Option(6, "--facts", min=1, max=20, help="Durable facts in each speaker's persona."),
    oneoffs: int = typer.Option(2, "--oneoffs", min=0, help="Mean one-off remarks per speaker per session."),
    mention_prob: float = typer.Option(0.35, "--mention-prob", min=0.0, max=1.0,
                                       help="Chance a known fact is restated in an intermediate session."),
) -> None:
    """Generate a synthetic multi-session corpus whose bullets know whether they recur."""
    from memprune.synth import generate

    try:
        summary = generate(conversations=conversations, sessions=sessions, out=out, seed=seed, facts_per_speaker=facts,
                           oneoffs_per_session=oneoffs, mention_prob=mention_prob, progress=sys.stderr.isatty())
    except ValueError as exc:
        fail(str(exc))
    console.print(json.dumps(summary["counts"]), highlight=False)


@app.command()
def evaluate(
    run: Path = typer.Option(..., "--run", help="Run directory with <stage>/seed<k>/predictions.parquet."),
    out: Path = typer.Option(..., "--out", "-o", help="Output directory for metrics.json, report.md and figures."),
    data: Optional[Path] = typer.Option(None, "--data", help="Corpus dir (`memprune ingest`): token counts, QA retention."),
    tokenizer: str = typer.Option("minilm", "--tokenizer", help="Token unit: minilm, whitespace, or a tokenizer.json path."),
    threshold: float = typer.Option(0.5, "--threshold", help="Pruning threshold of the main pruning table."),
    top_k: int = typer.Option(5, "--top-k", min=0, help="Pruning top-k of the threshold sweep (0 = no cap)."),
    relevance: float = typer.Option(0.5, "--relevance-threshold", help="Relevant = label >= this (Precision/Recall@k)."),
    validation: bool = typer.Option(False, "--validation", help="Also evaluate the validation split."),
    qa_draws: int = typer.Option(1000, "--qa-draws", min=1, help="Random-pruning draws of the QA baseline."),
    figures: bool = typer.Option(True, "--figures/--no-figures", help="Draw the PNG figures."),
) -> None:
    """Metrics, significance, pruning view and QA-evidence retention of a trained run."""
    from memprune.evaluate import EvalConfig, EvaluationError, evaluate_run
    from memprune.schema import SchemaError

    try:
        cfg = EvalConfig(
            prune_threshold=threshold, prune_top_k=top_k or None, relevance_threshold=relevance,
            splits=("test", "validation") if validation else ("test",), tokenizer=tokenizer,
            qa_draws=qa_draws, figures=figures,
        )
        result = evaluate_run(run, out, data_dir=data, config=cfg)
    except (EvaluationError, SchemaError, FileNotFoundError, ValueError) as exc:
        fail(str(exc))
    console.print(f"evaluated {', '.join(result['splits']['test']['stages'])} -> {result['outputs']['report']}",
                  highlight=False)


@app.command()
def label(
    data: Optional[Path] = typer.Option(None, "--data", "-d", help="Directory with sessions.parquet and bullets.parquet."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output directory (pairs/labels.parquet, label.json)."),
    source: Optional[str] = typer.Option(None, "--source", help="judge (default), qa (QA evidence) or usage (a usage log)."),
    usage_log: Optional[Path] = typer.Option(None, "--usage-log", help="usage: log file (.parquet/.jsonl) or dir of them."),
    qa_grading: Optional[str] = typer.Option(None, "--qa-grading", help="qa: binary (default) or graded (by citing questions)."),
    qa_later_only: bool = typer.Option(False, "--qa-later-only", help="qa: count only questions reaching a later session."),
    judge: Optional[str] = typer.Option(None, "--judge", help="llm (the paper's judge) or similarity (a CPU proxy; default)."),
    speaker: Optional[str] = typer.Option(None, "--speaker", help="Target turns: all (default), same or other speaker than the bullet's."),
    context: Optional[int] = typer.Option(None, "--context", min=0, help="Turns of dialogue context before each target (llm; default 4)."),
    horizon: Optional[int] = typer.Option(None, "--horizon", min=1, help="Sessions ahead that give credit (default 1 = next only)."),
    decay: Optional[float] = typer.Option(None, "--decay", help="A score h sessions ahead counts score * decay**(h-1) (default 0.5)."),
    aggregation: Optional[str] = typer.Option(None, "--aggregation", help="Label per bullet: max (default) or mean."),
    shard_size: Optional[int] = typer.Option(None, "--shard-size", min=1, help="Texts (similarity) / pairs (llm) per shard."),
    model: Optional[str] = typer.Option(None, "--model", help="similarity: encoder path or hub id."),
    executor: Optional[str] = typer.Option(None, "--executor", help="similarity: local (in-process, default) or ray."),
    llm_config: Optional[Path] = typer.Option(None, "--llm-config", help="llm: YAML file of the LLM config."),
    llm_set: Optional[list[str]] = typer.Option(None, "--llm-set", help="llm: key=value override of the LLM config (repeatable)."),
    config: Optional[Path] = typer.Option(None, "--config", help="A label YAML config; options given here override it."),
    no_progress: bool = typer.Option(False, "--no-progress", help="Hide progress bars."),
) -> None:
    """Write bullet labels: judged pairs (resumable: rerun to resume), QA evidence, or a usage log."""
    from memprune.config import ConfigError
    from memprune.label import LabelError, load_label_config, run_label
    from memprune.schema import SchemaError

    given = {"data": data, "out": out, "judge": judge, "speaker": speaker, "context_turns": context,
             "horizon": horizon, "decay": decay, "aggregation": aggregation, "shard_size": shard_size,
             "similarity.model": model, "similarity.executor": executor, "llm_config": llm_config,
             "llm_overrides": list(llm_set) if llm_set else None, "source": source, "usage.log": usage_log,
             "qa.grading": qa_grading, "qa.later_only": True if qa_later_only else None}
    values = {k: (str(v) if isinstance(v, Path) else v) for k, v in given.items() if v is not None}
    if no_progress:
        values["progress"] = False
    try:
        summary = run_label(load_label_config(config, values=values))
    except (LabelError, ConfigError, SchemaError, FileNotFoundError) as exc:
        fail(str(exc))
    c, t = summary["counts"], summary["throughput"]
    if summary.get("source", "judge") != "judge":
        extra = f", {c['events_rejected']} usage events rejected" if summary["source"] == "usage" else ""
        console.print(f"labelled {c['bullets_labelled']}/{c['bullets']} bullets from {summary['source']} "
                      f"({summary['rule']}; {c['bullets_unlabelled']} unlabelled{extra}) -> {summary['config']['out']}",
                      highlight=False)
        return
    console.print(
        f"labelled {c['bullets_labelled']}/{c['bullets']} bullets from {c['pairs']} pairs "
        f"({c['pairs_error']} errors, {c['bullets_unlabelled']} unlabelled) with {summary['judge']}; "
        f"{t['pairs_per_s']} pairs/s, {t['wall_s']} s -> {summary['config']['out']}",
        highlight=False,
    )


@app.command()
def summarize(
    data: Path = typer.Option(..., "--data", "-d", help="Directory with sessions.parquet."),
    out: Path = typer.Option(..., "--out", "-o", help="Output directory (bullets/summaries/sessions.parquet, summarize.json)."),
    llm: Path = typer.Option(..., "--llm", help="YAML file of the LLM config (see configs/llm/)."),
    llm_set: Optional[list[str]] = typer.Option(None, "--set", help="key=value override of the LLM config (repeatable)."),
    chunk_sessions: int = typer.Option(2048, "--chunk-sessions", min=1, help="Sessions per resumable chunk."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Only the first N sessions (a trial run)."),
) -> None:
    """Summarize each session into memory bullets citing their turns (resumable: rerun to resume)."""
    from memprune.config import ConfigError
    from memprune.llm import LLMConfig, LLMError, PromptError
    from memprune.schema import SchemaError
    from memprune.summarize import SummarizeError, summarize as run_summarize

    try:
        summary = run_summarize(data, out, LLMConfig.from_yaml(llm, llm_set), chunk_sessions=chunk_sessions,
                                limit=limit)
    except (SummarizeError, ConfigError, SchemaError, LLMError, PromptError, FileNotFoundError) as exc:
        fail(str(exc))
    c = summary["counts"]
    console.print(
        f"summarized {c['sessions_ok']}/{c['sessions']} sessions into {c['bullets']} bullets "
        f"({c['sessions_error']} errors, {c['evidence_dropped']} evidence ids dropped) with {summary['llm']} -> {out}",
        highlight=False,
    )

@app.command()
def train(
    data: Optional[Path] = typer.Option(None, "--data", "-d", help="Corpus dir with bullets.parquet."),
    labels: Optional[list[Path]] = typer.Option(None, "--labels", "-l", help="Dir with labels.parquet (`memprune label`); repeat to mix tables."),
    label_weight: Optional[list[str]] = typer.Option(None, "--label-weight", help="SOURCE=W loss weight per label source, e.g. qa=5 (repeatable)."),
    folds: Optional[int] = typer.Option(None, "--folds", min=2, help="k-fold by conversation: OUT/fold<i>/, pooled evaluation."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output dir: <stage>/seed<k>/, run.json, train.md."),
    stages: Optional[str] = typer.Option(None, "--stages", help="Comma list of vanilla,stage1,stage2 (default all)."),
    seeds: Optional[str] = typer.Option(None, "--seeds", help="Comma list of seeds (default 0,1,2)."),
    encoder: Optional[str] = typer.Option(None, "--encoder", help="Encoder path or hub id (default local all-MiniLM-L6-v2)."),
    workers: Optional[int] = typer.Option(None, "--workers", min=0, help="Ray Train workers per trainer (0 = local mode)."),
    config: Optional[Path] = typer.Option(None, "--config", help="A train YAML config; options given here override it."),
    set_: Optional[list[str]] = typer.Option(None, "--set", help="key=value override, e.g. stage1.epochs=20 (repeatable)."),
    evaluate: Optional[bool] = typer.Option(None, "--eval/--no-eval", help="End with `memprune evaluate` into OUT/eval (default on)."),
) -> None:
    """Train the scorer stages (vanilla, stage 1, stage 2) over seeds on Ray Train (rerun to resume)."""
    from memprune.config import ConfigError
    from memprune.schema import SchemaError
    from memprune.scorer import ScorerError
    from memprune.splits import SplitError
    from memprune.train import TrainError, load_train_config, run_training

    given = {"data": data, "labels": [str(p) for p in labels] if labels else None, "out": out, "encoder": encoder,
             "ray.num_workers": workers, "evaluate": evaluate, "folds": folds,
             "stages": [s.strip() for s in stages.split(",") if s.strip()] if stages else None}
    try:
        if seeds:
            given["seeds"] = [int(s) for s in seeds.split(",") if s.strip()]
        for item in label_weight or []:
            source, sep, w = item.partition("=")
            if not sep:
                raise ValueError(f"--label-weight {item!r} is not SOURCE=WEIGHT")
            given[f"label_weights.{source.strip()}"] = float(w)
        values = {k: (str(v) if isinstance(v, Path) else v) for k, v in given.items() if v is not None}
        summary = run_training(load_train_config(config, list(set_ or []), values))
    except (TrainError, ConfigError, SchemaError, ScorerError, SplitError, FileNotFoundError, ValueError) as exc:
        fail(str(exc))
    for stage, entry in summary["stage_summary"].items():
        mse = entry.get("val_mse", {})
        console.print(f"{stage}: {len(entry['seeds'])} seed(s), val MSE {mse.get('mean', float('nan')):.4f}"
                      f" ± {mse.get('std', float('nan')):.4f}", highlight=False)
    console.print(f"trained in {summary['wall_s']:.1f} s -> {summary['out']}", highlight=False)
    if "evaluation" in summary:
        console.print(f"evaluation report: {summary['evaluation']}", highlight=False)


@app.command()
def prune(
    scorer: Path = typer.Option(..., "--scorer", help="Scorer artifact directory (scorer.json + head.safetensors)."),
    input: Path = typer.Option(..., "--input", "-i", help="Bullets store: Parquet file, dir of Parquet files, or corpus dir."),
    out: Path = typer.Option(..., "--out", "-o", help="Output dir: pruned/ (store + score, keep), prune.json, prune.md."),
    threshold: Optional[float] = typer.Option(None, "--threshold", help="Drop bullets scored below this [default: 0.5]."),
    top_k: Optional[int] = typer.Option(None, "--top-k", min=0, help="Keep at most k per group, 0 = no cap [default: 5]."),
    group_by: Optional[str] = typer.Option(None, "--group-by", help="session, conversation or speaker [default: session]."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config (configs/prune-*.yaml); flags win."),
    set_: Optional[list[str]] = typer.Option(None, "--set", help="Extra config key=value (batch_size=256, actors=2, ...)."),
) -> None:
    """Score a bullets store with a trained scorer on Ray Data and prune it (threshold, then top-k per group)."""
    from memprune.config import ConfigError, load_config
    from memprune.prune import PruneConfig, PruneError, run_prune

    flags = [f"{k}={json.dumps(str(v))}" for k, v in (("scorer", scorer), ("input", input), ("out", out))]  # quoted: any path
    flags += [f"threshold={threshold}"] if threshold is not None else []
    flags += [f"top_k={top_k or 'null'}"] if top_k is not None else []
    flags += [f"group_by={json.dumps(group_by)}"] if group_by is not None else []
    try:
        cfg = load_config(config, [*(set_ or []), *flags], PruneConfig)
        summary = run_prune(cfg)
    except (ConfigError, PruneError, FileNotFoundError) as exc:
        fail(str(exc))
    r = summary["result"]
    console.print(
        f"kept {r['bullets_after']:.2f} of {r['bullets_before']:.2f} bullets per {cfg.group_by} "
        f"(-{r['bullet_reduction_pct'] or 0:.1f}% bullets, -{r['token_reduction_pct'] or 0:.1f}% tokens) -> {out}",
        highlight=False,
    )


@app.command("dialogue-eval")
def dialogue_eval(
    data: Optional[Path] = typer.Option(None, "--data", "-d", help="Corpus dir with sessions.parquet and bullets.parquet."),
    pruned: Optional[Path] = typer.Option(None, "--pruned", help="`memprune prune` output dir (pruned/ store with keep)."),
    llm: Optional[Path] = typer.Option(None, "--llm", help="YAML file of the generator's LLM config (configs/llm/)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output dir: dialogue.json, dialogue.md, generations.parquet."),
    turns: Optional[int] = typer.Option(None, "--turns", min=1, help="Target turns evaluated (default 200)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Sampling seed of the target turns (default 0)."),
    conditions: Optional[str] = typer.Option(None, "--conditions", help="Comma list of none,all,pruned,retrieval (default all four)."),
    retrieval_k: Optional[str] = typer.Option(None, "--retrieval-k", help="Bullets retrieved per turn, or 'pruned' (default 5)."),
    llm_set: Optional[list[str]] = typer.Option(None, "--llm-set", help="key=value override of the LLM config (repeatable)."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config (configs/dialogue-eval.yaml); flags win."),
    set_: Optional[list[str]] = typer.Option(None, "--set", help="Extra config key=value, e.g. bootstrap.samples=2000 (repeatable)."),
) -> None:
    """Generate next-session replies with no/all/pruned/retrieved memory and score them (BLEU, ROUGE-L, BERTScore, MAUVE)."""
    from memprune.config import ConfigError, load_config
    from memprune.dialogue import DialogueError, DialogueEvalConfig, run_dialogue_eval
    from memprune.llm import LLMError, PromptError
    from memprune.schema import SchemaError

    flags = [f"{k}={v}" for k, v in (("data", data), ("pruned", pruned), ("out", out), ("turns", turns),
                                     ("seed", seed), ("retrieval_k", retrieval_k)) if v is not None]
    if llm is not None:
        flags += [f"llm_config={llm}", "llm=null"]
    if conditions:
        flags.append(f"conditions=[{','.join(c.strip() for c in conditions.split(',') if c.strip())}]")
    try:
        cfg = load_config(config, [*(set_ or []), *flags], DialogueEvalConfig)
        if llm_set:
            cfg = DialogueEvalConfig.model_validate({**cfg.model_dump(), "llm_overrides": [*cfg.llm_overrides, *llm_set]})
        summary = run_dialogue_eval(cfg)
    except (ConfigError, DialogueError, SchemaError, LLMError, PromptError, FileNotFoundError, ValueError) as exc:
        fail(str(exc))
    for c, m in summary["metrics"].items():
        vals = ", ".join(f"{k} {m[k]['value']:.4g}" for k in ("bleu", "rouge_l", "bertscore_f1", "mauve")
                         if m.get(k, {}).get("value") is not None)
        console.print(f"{c}: {vals}; {summary['cost'][c]['prompt_tokens']['mean']:.0f} prompt tokens/turn", highlight=False)
    console.print(f"{summary['targets']['paired']} paired targets with {summary['generator']} -> {summary['out']}/dialogue.md",
                  highlight=False)

@app.command()
def quickstart(
    out: Path = typer.Option(Path("runs/quickstart"), "--out", "-o", help="Output directory."),
    data: Optional[str] = typer.Option(None, "--data", help="A real corpus as FORMAT:PATH (msc:, locomo:, jsonl:); default: synthetic."),
) -> None:
    """The whole method locally: corpus -> labels -> train (3 stages x 3 seeds) -> evaluate -> prune."""
    from rich.markdown import Markdown

    from memprune.pipeline import headline, quickstart_config, run_pipeline

    try:
        config = quickstart_config(str(out), data)
    except ValueError as exc:
        fail(str(exc))
    summary = run_pipeline(config)
    console.rule("[bold]memprune quickstart: done")
    console.print(Markdown(headline(Path(summary["report"]).parent)))
    console.print(f"report: {summary['report']}  ({summary['seconds']:.0f} s)", highlight=False)


if __name__ == "__main__":  # pragma: no cover
    app()
