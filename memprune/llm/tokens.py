"""The one count of LLM prompt tokens: what a prompt costs the model it is sent to (dialogue-eval, qa-eval, label --plan).

What is counted, precisely: the chat messages of a task exactly as `run_llm` sends them
(`memprune.llm.run.prepare_rows`: the configured template version, the row's inputs, the same escaping),
rendered through the model's chat template with the generation prompt, then tokenized without adding
special tokens again (the template writes them). These are the ids the `hf` engine generates from
(`apply_chat_template(tokenize=True)` is exactly this), and the prompt vLLM renders from the same
messages, so a row's `prompt_tokens` equals the engine's `tokens_in`.

The model's tokenizer is read only from a local model directory (nothing is downloaded). Without one
(an HTTP endpoint, a hub id) a fallback tokenizer counts instead (the evaluations' encoder), and
without a chat template the messages are rendered under `<|role|>` header lines: both are
approximations, and `unit` says which count a report holds. Plain texts (memory notes) are counted in
the same unit, without special tokens.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
from tqdm import tqdm

from memprune.encoders import model_label
from memprune.llm.config import LLMConfig
from memprune.llm.run import prepare_rows
from memprune.llm.tasks import task_spec

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
BATCH = 256


def local_tokenizer(model: str | None) -> bool:
    """Whether `model` is a local directory holding a tokenizer (so its own tokens can be counted offline)."""
    return model is not None and Path(model).is_dir() and any((Path(model) / f).is_file() for f in TOKENIZER_FILES)


def has_chat_template(tokenizer: Any) -> bool:
    """Whether the tokenizer carries a chat template (the engines render prompts with it)."""
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The prompt text the model sees: its chat template with the generation prompt, or, without a template,
    `<|role|>` header lines (an approximation of one) and the assistant header."""
    if has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


class PromptTokens:
    """Prompt and text token counts in one unit: the LLM's own tokenizer and chat template when its model is a
    local directory, else the `fallback` tokenizer directory (the report prints `unit`)."""

    def __init__(self, llm: LLMConfig, fallback: str) -> None:
        from transformers import AutoTokenizer

        self.llm = llm
        if local_tokenizer(llm.model):
            self.tok = AutoTokenizer.from_pretrained(llm.model, trust_remote_code=llm.trust_remote_code)
            source = f"generator tokenizer ({Path(llm.model).name})"
        else:
            self.tok = AutoTokenizer.from_pretrained(fallback)
            source = f"encoder tokenizer ({model_label(fallback)})"
        self.chat = has_chat_template(self.tok)
        how = "with its chat template" if self.chat else "on the messages under <|role|> header lines (no chat template)"
        why = "" if local_tokenizer(llm.model) else f": the generator {llm.model!r} is not a local directory"
        self.unit = f"{source} {how}{why}"

    def texts(self, texts: Sequence[str]) -> list[int]:
        """Tokens of each text (no special tokens added, no truncation); an empty text is 0."""
        if not len(texts):
            return []
        ids = self.tok(list(texts), add_special_tokens=False, truncation=False, verbose=False)["input_ids"]
        return [len(x) for x in ids]

    def text(self, text: str) -> int:
        """Tokens of one text (no special tokens added)."""
        return self.texts([text])[0] if text else 0

    def prompt(self, messages: list[dict[str, str]]) -> int:
        """Tokens of the prompt these chat messages become (`render_prompt`, no special tokens added again)."""
        return self.text(render_prompt(self.tok, messages))

    def prompts(self, rows: pa.Table, task: str, progress: bool = False) -> list[int]:
        """Tokens of the prompt `run_llm(task=task)` sends for every row, in row order; a row whose inputs make
        no prompt (an input error row of `run_llm`, never sent) counts 0."""
        inputs = rows.select([c for c in task_spec(task).inputs if c in rows.column_names]).to_pylist()
        counts: list[int] = []
        with tqdm(total=len(inputs), desc=f"{task} prompt tokens", unit="prompt", disable=not progress) as bar:
            for start in range(0, len(inputs), BATCH):
                states = prepare_rows(inputs[start:start + BATCH], self.llm, task)  # type: ignore[arg-type]
                counts += self.texts([render_prompt(self.tok, json.loads(s["_mp_messages"])) if s["_mp_messages"]
                                      else "" for s in states])
                bar.update(len(states))
        return counts
