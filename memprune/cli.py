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
    """Judge bullet x next-session turn pairs and write pseudo labels (resumable: rerun to resume)."""
    from memprune.config import ConfigError
    from memprune.label import LabelError, load_label_config, run_label
    from memprune.schema import SchemaError

    given = {"data": data, "out": out, "judge": judge, "speaker": speaker, "context_turns": context,
             "horizon": horizon, "decay": decay, "aggregation": aggregation, "shard_size": shard_size,
             "similarity.model": model, "similarity.executor": executor, "llm_config": llm_config,
             "llm_overrides": list(llm_set) if llm_set else None}
    values = {k: (str(v) if isinstance(v, Path) else v) for k, v in given.items() if v is not None}
    if no_progress:
        values["progress"] = False
    try:
        summary = run_label(load_label_config(config, values=values))
    except (LabelError, ConfigError, SchemaError, FileNotFoundError) as exc:
        fail(str(exc))
    c, t = summary["counts"], summary["throughput"]
    console.print(
        f"labelled {c['bullets_labelled']}/{c['bullets']} bullets from {c['pairs']} pairs "
        f"({c['pairs_error']} errors, {c['bullets_unlabelled']} unlabelled) with {summary['judge']}; "
        f"{t['pairs_per_s']} pairs/s, {t['wall_s']} s -> {summary['config']['out']}",
        highlight=False,
    )

if __name__ == "__main__":  # pragma: no cover
    app()
