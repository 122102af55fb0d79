"""What the GPU check's sections share: their types (sizes, child kinds, sections, goals), nvidia-smi sampling,
progress lines, partial figures and Markdown tables (bench/common.py is what every bench shares)."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Generic, Literal, NamedTuple, Self, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")
Some = Annotated[list[T], Field(min_length=1)]  # a size's list that may not be empty
Precision = Literal["bf16", "fp32"]


class Sizes(BaseModel):
    """What a child process runs on, sent to it as JSON. A section's defaults are its full (GPU) sizes, `tiny(bf16)`
    its CPU ones (`bf16`: whether the CPU has bf16 kernels). Strict: `--set` refuses a value of the wrong type."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    @classmethod
    def full(cls) -> Self:
        return cls()

    @classmethod
    def tiny(cls, bf16: bool) -> Self:
        return cls()

    def changed(self, key: str, text: str) -> Self:
        """A copy with `key` set to `text` read as YAML (`8000`, `[128,256]`, `true`); ValueError in one line."""
        import yaml

        try:
            return self.model_validate({**self.model_dump(), key: yaml.safe_load(text)})
        except yaml.YAMLError as exc:
            raise ValueError(f"not YAML: {' '.join(str(exc).split())}") from None
        except ValidationError as exc:
            raise ValueError("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']} (got {e['input']!r})"
                                       for e in exc.errors())) from None


Z = TypeVar("Z", bound=Sizes)


@dataclass(frozen=True)
class Child(Generic[Z]):
    """A kind of child process, `gpu_check.py --child NAME PAYLOAD` (PAYLOAD: the JSON of its sizes plus `out`):
    `run(sizes, out)`, whose result it writes to OUT/NAME.json."""

    name: str
    sizes: type[Z]
    run: Callable[[Z, Path], dict[str, Any]]

    def command(self, sizes: Z, out: Path) -> list[str]:
        payload = json.dumps({"out": str(out), **sizes.model_dump(mode="json")})
        return [sys.executable, str(REPO / "bench" / "gpu_check.py"), "--child", self.name, payload]

    def main(self, payload: str) -> None:
        """In the child process: run on `payload`, write the result."""
        fields = json.loads(payload)
        out = Path(fields.pop("out"))
        result = self.run(self.sizes.model_validate(fields), out)
        (out / f"{self.name}.json").write_text(json.dumps(result, indent=2, default=str))


class Goal(NamedTuple):
    """A figure (`key`) of a passed section's result against the value it should reach: gpu_check.md's Goals."""

    key: str
    text: str
    target: float


@dataclass(frozen=True)
class Section(Child[Z]):
    """A section of the check: a child process on its sizes (`doc`: what it measures, for --help), then its lines
    in the report of a passed result. `unavailable()`: why it cannot run on this machine (it is then reported as
    not measured) or None; `helpers`: the other child kinds its `run` starts."""

    doc: str
    headline: Callable[[dict[str, Any]], str]
    markdown: Callable[[dict[str, Any]], list[str]]
    unavailable: Callable[[], str | None] = lambda: None
    goals: tuple[Goal, ...] = ()
    helpers: tuple[Child[Any], ...] = ()


def smi(*fields: str) -> list[float] | None:
    """GPU 0's `fields` from nvidia-smi (e.g. utilization.gpu, memory.used in MiB); None without it."""
    try:
        line = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10).stdout.splitlines()[0]
        return [float(v) for v in line.split(",")]
    except (OSError, IndexError, ValueError, subprocess.TimeoutExpired):
        return None


@contextmanager
def gpu_sampled(into: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Sample GPU utilisation (%) and memory used (MiB, all processes) every 0.5 s into `into`; None on a CPU."""
    samples: list[list[float]] = []
    halt = threading.Event()

    def loop() -> None:
        while not halt.is_set() and (got := smi("utilization.gpu", "memory.used")):
            samples.append(got)
            halt.wait(0.5)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield into
    finally:
        halt.set()
        thread.join()
        util, mem = [u for u, _ in samples], [m for _, m in samples]
        into.update(gpu_util_mean_pct=round(statistics.mean(util), 1) if util else None,
                    gpu_util_max_pct=max(util, default=None), gpu_mem_peak_mib=max(mem, default=None))


def one_line(exc: BaseException) -> str:
    """`Type: message`, on one line (memprune's `one_line` of the message)."""
    from memprune.runtime import one_line as message

    return f"{type(exc).__name__}: {message(exc)[:240]}"


GPU_IDLE_MIB = (smi("memory.used") or [0.0])[0]  # what other processes hold when this one starts


def wait_gpu_free(limit_s: float = 120.0) -> None:
    """Wait until the GPU's memory is back near where it was at the start: engine actors exit after their dataset."""
    deadline = time.monotonic() + limit_s
    while (time.monotonic() < deadline and (got := smi("memory.used", "memory.total"))
           and got[0] > GPU_IDLE_MIB + 0.05 * got[1]):
        time.sleep(2)


def progress(message: str) -> None:
    sys.stdout.write(f"[gpu-check] {message}\n")  # one write: whole lines from the sections' threads
    sys.stdout.flush()


def keep_partial(out: Path, name: str, figures: dict[str, Any]) -> None:
    """Save a section's figures so far (OUT/NAME.partial.json): a section killed at its budget still reports them."""
    path = out / f"{name}.partial.json"
    path.with_suffix(".tmp").write_text(json.dumps(figures, indent=2, default=str))
    path.with_suffix(".tmp").replace(path)


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def table(rows: list[dict[str, Any]], keys: list[str]) -> list[str]:
    """A Markdown table of `rows`, one column per key (– where a row lacks it), then a blank line."""
    from memprune.markdown import table as markdown_table

    return [*markdown_table(keys, [["–" if r.get(k) is None else r.get(k) for k in keys] for r in rows]), ""]
