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
) -> None:
    """Generate a synthetic multi-session corpus whose bullets know whether they recur."""
    from memprune.synth import generate

    summary = generate(conversations=conversations, sessions=sessions, out=out, seed=seed)
    console.print(json.dumps(summary["counts"]), highlight=False)


if __name__ == "__main__":  # pragma: no cover
    app()
