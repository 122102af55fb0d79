"""Cost accounting and planning of a labeling run: LLM calls, prompt and generated tokens, prefix-cache reuse.

`memprune label --plan` renders every prompt a judge mode would send (each `JUDGES` entry's `plan`: the judge module
renders its own prompts) and counts tokens without running the model; a real run records the same plan for its own
mode next to what the engine measured. Rules, precisely:

- tokenizer: the judge model's own (its local directory: tokenizer and chat template), else a named
  fallback (`cost.tokenizer`, default the local all-MiniLM-L6-v2 tokenizer; without a chat template
  the messages are joined under `<|role|>` header lines). The prompt text is `memprune.llm.tokens`'s
  `render_prompt`, the one every LLM prompt count uses. The report names the tokenizer.
- prompts are counted line by line with a cache (a corpus repeats the same system text, context
  turns and bullets thousands of times); merges across a line break are ignored, and the plan
  reports that error measured on a sample against whole-prompt tokenization (`line_split_error`).
- generated tokens: pairwise, one `{"score":x}` object; listwise, the schema's array for the list (compact
  JSON, as vLLM's structured output writes it);
  likelihood, one token per request (`max_tokens=1`); each + 1 end token. Retries are not planned.
- prefix-cache reuse: in the order the prompts are sent, the part of each prompt shared with the
  previous one, counted in whole cache blocks (`cost.block_size`, vLLM's 16 tokens), over all
  prompt tokens. vLLM reads no prefix cache for requests that ask for prompt log-probabilities,
  so the likelihood judge reuses nothing (`prefix_cache_used: false`).
- GPU-hours = (prompt tokens not served from the cache / throughput + generated tokens /
  decode throughput) / 3600, with the throughputs (tokens/s per GPU) given by the user
  (`--throughput`, `--decode-throughput`; the decode one defaults to the first).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from memprune.encoders import model_label, resolve_encoder
from memprune.label.config import LabelError
from memprune.label.judges import JUDGES
from memprune.label.pairs import PairPlan, target_groups
from memprune.llm.tasks import load_template
from memprune.llm.tokens import has_chat_template, local_tokenizer, render_prompt
from memprune.tokens import backend_encoder

HOLE = "\ue000"  # a private-use character: survives escaping, never occurs in dialogue text
LINE_CHECK_PROMPTS = 32


class PromptCounter:
    """Renders chat messages as the judge model would see them and counts their tokens line by line."""

    def __init__(self, model: str | None, fallback: str | None = None, trust_remote_code: bool = False) -> None:
        from transformers import AutoTokenizer

        if local_tokenizer(model):
            self.tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
            self.name = f"{model_label(model)} (the judge model's tokenizer)"
        else:
            where = str(Path(fallback).expanduser()) if fallback else resolve_encoder(None)
            self.tokenizer = _fallback_tokenizer(where)
            why = "the judge model's tokenizer is not local" if model is not None else "no judge model given"
            self.name = f"{model_label(where)} (fallback: {why})"
        self.chat = has_chat_template(self.tokenizer)
        if not self.chat:
            self.name += ", no chat template: <|role|> header lines"
        self._encode = backend_encoder(self.tokenizer.backend_tokenizer)
        self._lines: dict[str, tuple[int, ...]] = {}

    def render(self, messages: list[dict[str, str]]) -> str:
        """The prompt text, as `memprune.llm.tokens` defines it for every LLM prompt count."""
        return render_prompt(self.tokenizer, messages)

    def line_ids(self, lines: Sequence[str]) -> list[tuple[int, ...]]:
        """Token ids of each line (cached; new lines are encoded in one batch)."""
        new = [line for line in dict.fromkeys(lines) if line not in self._lines]
        for line, ids in zip(new, self._encode(new)):
            self._lines[line] = tuple(ids)
        return [self._lines[line] for line in lines]

    def count(self, texts: Sequence[str]) -> np.ndarray:
        """Tokens per text, line by line."""
        return np.array([sum(map(len, self.line_ids(t.splitlines(keepends=True)))) for t in texts], dtype=np.int64)

    def count_exact(self, texts: Sequence[str]) -> np.ndarray:
        """Tokens per text, each text tokenized whole (the reference of `line_split_error`)."""
        return np.array([len(ids) for ids in self._encode(list(texts))], dtype=np.int64)


def _fallback_tokenizer(where: str) -> Any:
    """The tokenizer at `where` (a tokenizer.json or a tokenizer directory); a path that holds none is one
    LabelError naming `cost.tokenizer`, not the loader's traceback (nothing is ever downloaded)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        if Path(where).is_file():  # a tokenizer.json
            return PreTrainedTokenizerFast(tokenizer_file=where)
        return AutoTokenizer.from_pretrained(where)
    except Exception as exc:  # OSError (no such path/repo), ValueError or the tokenizers' parse error (not a tokenizer)
        path_like = Path(where).is_absolute() or where.startswith((".", "~"))  # not a (cached) hub id
        reason = "no such file or directory" if path_like and not Path(where).exists() else \
            f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        raise LabelError(f"cost.tokenizer (--plan-tokenizer) {where!r} cannot be loaded: give a local tokenizer.json or "
                         f"a tokenizer directory ({reason})") from None


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PromptStats:
    """Streaming counts of prompts in sending order: calls, tokens, tokens reusable from the previous prompt."""

    def __init__(self, counter: PromptCounter, block_size: int) -> None:
        self.counter, self.block = counter, block_size
        self.calls = self.tokens = self.reusable = 0
        self._prev: tuple[list[str], list[tuple[int, ...]]] = ([], [])
        self.sample: list[str] = []

    def add(self, text: str) -> None:
        lines = text.splitlines(keepends=True)
        ids = self.counter.line_ids(lines)
        shared = 0
        for a, b, ia, ib in zip(self._prev[0], lines, self._prev[1], ids):
            if a == b:
                shared += len(ib)
                continue
            shared += _common(ia, ib)
            break
        self.calls += 1
        self.tokens += sum(map(len, ids))
        self.reusable += (shared // self.block) * self.block
        self._prev = (lines, ids)
        if len(self.sample) < LINE_CHECK_PROMPTS:
            self.sample.append(text)

    def line_split_error(self) -> float | None:
        """(line-by-line count - whole-prompt count) / whole-prompt count over the first prompts."""
        if not self.sample:
            return None
        line, whole = self.counter.count(self.sample).sum(), self.counter.count_exact(self.sample).sum()
        return float((line - whole) / whole) if whole else None


def holed(render: Callable[[str], str], hole_text: str) -> tuple[str, str]:
    """The prompt rendered around a hole: (text before, text after) the rendered `hole_text`."""
    full = render(HOLE)
    at = full.index(hole_text)
    return full[:at], full[at + len(hole_text):]


def gpu_hours(uncached_prompt_tokens: float, generated_tokens: float, cost: Any) -> float | None:
    """GPU-hours at the user's throughputs (`cost.throughput`, `cost.decode_throughput`); None without one."""
    if not cost.throughput:
        return None
    decode = cost.decode_throughput or cost.throughput
    return (uncached_prompt_tokens / cost.throughput + generated_tokens / decode) / 3600


def plan_mode(mode: str, plan: PairPlan, counter: PromptCounter, llm: Any, listwise: Any, cost: Any,
              instances: int = 1) -> dict[str, Any]:
    """Calls, prompt and generated tokens, per-pair cost, prefix-cache reuse and GPU-hours of one judge mode.

    `llm` (an LLMConfig or None) names the prompts and the model length; `listwise` and `cost` are
    the label settings' sections; `instances` multiplies the calls (judge samples or several judges
    of the same model).
    """
    entry = JUDGES.get(mode)
    if entry is None or entry.plan is None or entry.task is None:
        planned = ", ".join(k for k, e in JUDGES.items() if e.plan is not None)
        raise ValueError(f"mode must be one of {planned}, got {mode!r}")
    groups = target_groups(plan)
    stats = PromptStats(counter, cost.block_size)
    template = load_template(llm.prompt_name(entry.task) if llm else entry.default_prompt, entry.task)
    texts, generated, per_call = entry.plan(plan, groups, counter, template, llm, listwise)
    for text in texts:
        stats.add(text)
    generated += per_call * stats.calls
    cache = entry.prefix_cache
    reusable = stats.reusable if cache else 0
    calls, prompt, generated = stats.calls * instances, stats.tokens * instances, generated * instances
    pairs = plan.pairs.num_rows
    effective = prompt - reusable * instances + generated
    return {
        "mode": mode,
        "pairs": pairs,
        "judges": instances,
        "calls": calls,
        "prompt_tokens": prompt,
        "generated_tokens": generated,
        "prompt_tokens_per_pair": prompt / pairs if pairs else None,
        "generated_tokens_per_pair": generated / pairs if pairs else None,
        "calls_per_pair": calls / pairs if pairs else None,
        "prefix_cache_used": cache,
        "prefix_cache_reusable_share": (reusable / stats.tokens) if stats.tokens else None,
        "prefix_shared_share": (stats.reusable / stats.tokens) if stats.tokens else None,
        "effective_tokens": effective,
        "gpu_hours": gpu_hours(prompt - reusable * instances, generated, cost),
        "line_split_error": stats.line_split_error(),
    }
