"""Cost accounting and planning of a labeling run: LLM calls, prompt and generated tokens, prefix-cache reuse.

`memprune label --plan` renders every prompt a judge mode would send (`pairwise`, `listwise`,
`likelihood`) and counts tokens without running the model; a real run records the same plan for
its own mode next to what the engine measured. Rules, precisely:

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

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from memprune.encoders import model_label, resolve_encoder
from memprune.label.config import LabelError
from memprune.label.listwise import ScoredList, build_lists, output_budget
from memprune.label.pairs import PairPlan, target_groups
from memprune.llm.prompts import (
    NO_MEMORY,
    escape,
    judge_messages,
    listwise_messages,
    load_template,
    render_note,
    reply_messages,
)
from memprune.llm.tokens import has_chat_template, local_tokenizer, render_prompt
from memprune.tokens import backend_encoder

HOLE = "\ue000"  # a private-use character: survives escaping, never occurs in dialogue text
MODES = ("pairwise", "listwise", "likelihood")
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


def _holed(render: Callable[[str], str], hole_text: str) -> tuple[str, str]:
    """The prompt rendered around a hole: (text before, text after) the rendered `hole_text`."""
    full = render(HOLE)
    at = full.index(hole_text)
    return full[:at], full[at + len(hole_text):]


def pairwise_prompts(plan: PairPlan, groups: list[tuple[int, int]], counter: PromptCounter,
                     template: Any) -> Iterable[str]:
    """The pairwise judge prompt of every pair, in judging order (the bullet is the only part that changes)."""
    rows = plan.pairs.select(["context", "target", "target_speaker"])
    bullets = plan.pairs.column("bullet").to_pylist()
    for a, b in groups:
        row = rows.slice(a, 1).to_pylist()[0]
        head, tail = _holed(lambda h: counter.render(judge_messages({**row, "bullet": h}, template)), HOLE)
        for p in range(a, b):
            yield head + escape(bullets[p]) + tail


def listwise_prompts(plan: PairPlan, lists: list[ScoredList], groups: list[tuple[int, int]], counter: PromptCounter,
                     template: Any) -> Iterable[str]:
    """The listwise judge prompt of every list, in judging order."""
    rows = plan.pairs.select(["context", "target", "target_speaker"])
    bullets = plan.pairs.column("bullet").to_pylist()
    cache: dict[int, tuple[str, str]] = {}
    for lst in lists:
        if lst.group not in cache:
            cache.clear()
            row = rows.slice(groups[lst.group][0], 1).to_pylist()[0]
            cache[lst.group] = _holed(lambda h: counter.render(listwise_messages({**row, "bullets": [h]}, template)),
                                      f'<bullet id="1">{HOLE}</bullet>')
        head, tail = cache[lst.group]
        block = "\n".join(f'<bullet id="{i}">{escape(bullets[p])}</bullet>' for i, p in enumerate(lst.positions, 1))
        yield head + block + tail


def likelihood_prompts(plan: PairPlan, groups: list[tuple[int, int]], counter: PromptCounter,
                       template: Any) -> Iterable[str]:
    """Every sequence the likelihood judge scores: per target turn the no-memory baseline, then one per pair."""
    from memprune.label.likelihood import note

    rows = plan.pairs.select(["context", "target", "target_speaker"])
    bullets, speakers = plan.pairs.column("bullet").to_pylist(), plan.pairs.column("bullet_speaker").to_pylist()
    for a, b in groups:
        row = rows.slice(a, 1).to_pylist()[0]
        head, tail = _holed(lambda h: counter.render(reply_messages({**row, "memory": [h]}, template)),
                            f"<note>{HOLE}</note>")
        tail += row["target"]
        yield head + NO_MEMORY + tail
        for p in range(a, b):
            yield head + render_note(note(bullets[p], speakers[p]), 0) + tail


def list_budget(plan: PairPlan, groups: list[tuple[int, int]], counter: PromptCounter, template: Any,
                max_prompt_tokens: int | None, max_model_len: int | None,
                tokens_per_bullet: int) -> Callable[[list[int]], bool] | None:
    """`fits(positions)`: does the list prompt of these bullets (+ its output budget) fit the model? None: no limit."""
    if max_prompt_tokens is None and max_model_len is None:
        return None
    group_of = np.zeros(plan.pairs.num_rows, dtype=np.int64)
    for g, (a, b) in enumerate(groups):
        group_of[a:b] = g
    rows = plan.pairs.select(["context", "target", "target_speaker"])
    bullets = plan.pairs.column("bullet").to_pylist()
    fixed: dict[int, int] = {}

    def fits(positions: list[int]) -> bool:
        g = int(group_of[positions[0]])
        if g not in fixed:
            row = rows.slice(groups[g][0], 1).to_pylist()[0]
            text = counter.render(listwise_messages({**row, "bullets": [HOLE]}, template))
            fixed[g] = int(counter.count([text.replace(f'<bullet id="1">{HOLE}</bullet>', "")])[0])
        lines = [f'<bullet id="{len(positions):02d}">{escape(bullets[p])}</bullet>\n' for p in positions]
        prompt = fixed[g] + int(counter.count(["".join(lines)])[0])
        out = output_budget(len(positions), tokens_per_bullet)
        return ((max_prompt_tokens is None or prompt <= max_prompt_tokens)
                and (max_model_len is None or prompt + out <= max_model_len))

    return fits


def generated_per_call(mode: str, counter: PromptCounter, k: int = 1) -> int:
    """The planned output tokens of one call (+ 1 end token): a score object, a list of k scores, or one token."""
    if mode == "likelihood":
        return 1
    if mode == "pairwise":
        return int(counter.count(['{"score":0.5}'])[0]) + 1
    return int(counter.count([json.dumps([{"id": i, "score": 5} for i in range(1, k + 1)], separators=(",", ":"))])[0]) + 1


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
    block_size = cost.block_size
    groups = target_groups(plan)
    stats = PromptStats(counter, block_size)
    generated = 0
    if mode == "pairwise":
        template = load_template(llm.judge_prompt if llm else "judge_v1", "judge")
        texts: Iterable[str] = pairwise_prompts(plan, groups, counter, template)
        per_call = generated_per_call(mode, counter)
    elif mode == "listwise":
        template = load_template(llm.listwise_prompt if llm else "judge_listwise_v1", "listwise")
        fits = list_budget(plan, groups, counter, template, listwise.max_prompt_tokens,
                           getattr(llm, "max_model_len", None), listwise.tokens_per_bullet)
        lists = build_lists(plan, groups, listwise.seed, listwise.max_bullets, listwise.orders, fits)
        texts = listwise_prompts(plan, lists, groups, counter, template)
        generated = sum(generated_per_call(mode, counter, len(lst.positions)) for lst in lists)
        per_call = 0
    elif mode == "likelihood":
        template = load_template(llm.likelihood_prompt if llm else "reply_v1", "loglik")
        texts = likelihood_prompts(plan, groups, counter, template)
        per_call = 1
    else:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    for text in texts:
        stats.add(text)
    generated += per_call * stats.calls
    cache = mode != "likelihood"
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
