"""The one token counter of prune and evaluate: the encoder's tokenizer by default, words, or a tokenizer.json."""

from __future__ import annotations

from pathlib import Path

import pytest

from memprune.tokens import TokenizerError, token_counter, unit_name


def test_minilm_token_counter(minilm_path):
    count, unit = token_counter("encoder", encoder="minilm")
    assert "MiniLM" in unit and unit == unit_name("encoder", "sentence-transformers/all-MiniLM-L6-v2")
    assert count(["hello world", "hello " * 1000]).tolist() == [2, 1000]  # no [CLS]/[SEP], no truncation
    count_path, _ = token_counter(minilm_path)
    assert count_path(["hello world"]).tolist() == [2]
    with pytest.raises(TokenizerError, match="tokenizer file not found"):
        token_counter(str(Path(minilm_path) / "nope.json"))


def test_whitespace_and_missing_encoder():
    count, unit = token_counter("whitespace")
    assert count(["a b  c", ""]).tolist() == [3, 0] and unit == "whitespace words"
    with pytest.raises(TokenizerError, match="needs an encoder"):
        token_counter("encoder")
