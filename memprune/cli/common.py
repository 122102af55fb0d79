"""What every `memprune` command shares: the app, the one door for options (`run_stage`), one-line errors."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn, Optional, TypeVar

import typer
from pydantic import BaseModel
from rich.console import Console
from rich.markup import escape

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,  # help text is plain: its "[default: ...]" stays text, never markup
    pretty_exceptions_show_locals=False,
    help="memprune: keep the long-term memory of multi-session chatbots small and useful.",
)
console = Console(stderr=True)
M = TypeVar("M", bound=BaseModel)
NULL = object()  # an option that sets a config key to null, as opposed to an option not given (None)

CONFIG = typer.Option(None, "--config", "-c", help="A YAML config of this command; the options given here win.")
SET = typer.Option(None, "--set", help="key=value override of the config, dotted keys reach sections (repeatable).")
LLM_CONFIG = typer.Option(None, "--llm-config", help="YAML file of the LLM config (configs/llm/).")
LLM_SET = typer.Option(None, "--llm-set", help="key=value override of the LLM config (repeatable).")


_EXECUTABLE = False  # set by `main`, the `memprune` executable: only it configures the process's output


@app.callback()
def options(ctx: typer.Context,
            verbose: bool = typer.Option(False, "--verbose", "-v",
                                         help="Show Ray's and the libraries' log lines and warnings (MEMPRUNE_LOG=debug "
                                              "does the same); by default they go to a log file."),
            ray_host: Optional[str] = typer.Option(None, "--ray-host", metavar="ADDRESS",
                                                   help="The address of this machine that a Ray memprune starts listens "
                                                        "on, for other machines to join it (MEMPRUNE_RAY_HOST); by default "
                                                        "127.0.0.1 only.")) -> None:
    """memprune: keep the long-term memory of multi-session chatbots small and useful."""
    from memprune.raysession import RAY_HOST_ENV
    from memprune.runtime import configure_output

    if ray_host is not None:
        try:
            ipaddress.ip_address(ray_host)
        except ValueError:
            fail(f"--ray-host {ray_host!r}: an IP address of this machine (e.g. 10.0.0.5), not a name")
        os.environ[RAY_HOST_ENV] = ray_host
    if _EXECUTABLE:  # not when the app is called as a library (tests, notebooks)
        configure_output(verbose, command=ctx.invoked_subcommand or "memprune", native=True)


def main() -> None:
    """The `memprune` executable: the CLI app, quiet at the native level too (see `configure_output`)."""
    global _EXECUTABLE
    _EXECUTABLE = True
    app()


def fail(message: str) -> NoReturn:
    """Print one clear error line and exit with status 2."""
    # The message is text, not markup: a path like `nope:x:` or a list like `['a']` prints as it is.
    console.print(f"[bold red]error:[/] {escape(' '.join(message.split()))}", highlight=False, soft_wrap=True,
                  emoji=False)
    raise typer.Exit(code=2)


@contextmanager
def user_errors(command: str) -> Iterator[None]:
    """A user error (here or inside a Ray worker) becomes one line and exit 2; its traceback goes to a log file."""
    from memprune.runtime import log_exception, user_error

    try:
        yield
    except typer.Exit:
        raise
    except Exception as exc:
        error = user_error(exc) or (exc if isinstance(exc, (FileNotFoundError, NotADirectoryError)) else None)
        if error is None:
            raise
        fail(f"{error} (details: {log_exception(exc, command)})" if error is not exc else str(error))


def _typed(value: Any) -> Any:
    return str(value) if isinstance(value, Path) else [_typed(v) for v in value] if isinstance(value, list) else value


def run_stage(model: type[M], run: Callable[[M], dict[str, Any]], config: Optional[Path], set_: Optional[list[str]],
              values: dict[str, Any], llm_set: Optional[list[str]] = None) -> tuple[M, dict[str, Any]]:
    """Load `model` from the config file, `--set` overrides and the given (non-None) options; run it.

    `--llm-set` items are appended to the config's `llm_overrides`. A user error exits 2 with one line.
    """
    from memprune.config import load_config

    given = {k: None if v is NULL else _typed(v) for k, v in values.items() if v is not None}
    with user_errors(model.__name__):
        cfg = load_config(config, list(set_ or []), model, values=given)
        if llm_set:
            cfg = model.model_validate({**cfg.model_dump(), "llm_overrides": [*cfg.llm_overrides, *llm_set]})
        return cfg, run(cfg)


def _csv(text: Optional[str]) -> Optional[list[str]]:
    return [s.strip() for s in text.split(",") if s.strip()] if text else None


def _top_k(top_k: Optional[int]) -> dict[str, Any]:
    """`--top-k`: 0 means no cap (null in the config); absent leaves the config's value."""
    if top_k is None:
        return {}
    if top_k < 0:
        fail(f"--top-k must be >= 0 (0 = no cap), got {top_k}")
    return {"rule.top_k": top_k or NULL}
