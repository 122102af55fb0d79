"""Answer scores of qa-eval (pure): the LoCoMo normalisation, token F1, BLEU-1 and abstention.

- **Normalisation** (the LoCoMo paper's evaluation code): commas removed, lower case, ASCII
  punctuation removed, the words `a`, `an`, `the`, `and` removed, whitespace collapsed.
- **Token F1**: the normalised words, Porter-stemmed (nltk), as multisets:
  `P = common / |prediction|`, `R = common / |gold|`, `F1 = 2PR / (P + R)`, 0 without overlap.
- **LoCoMo category rules** (`rules="locomo"`): category 1 (multi-hop) splits prediction and gold
  at commas and averages, over the gold parts, the best F1 of any prediction part; category 3
  scores against the gold text before the first `;`. `rules="plain"` is token F1 everywhere.
- **BLEU-1** (sacrebleu-free): the normalised words *without* stemming, clipped unigram
  precision times the brevity penalty `exp(1 - |gold| / |prediction|)` when the prediction is
  shorter than the gold; 0 for an empty prediction. One reference, no smoothing, 0-1.
- **Abstention**: the answer contains "no information available" or "not mentioned" (any case),
  LoCoMo's test for its adversarial questions. A question without a gold answer scores 1 on
  every metric when the answer abstains and 0 otherwise.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from functools import lru_cache
from typing import Literal

ABSTAIN = "No information available"
ABSTAIN_MARKERS = ("no information available", "not mentioned")
Rules = Literal["locomo", "plain"]

_ARTICLES = re.compile(r"\b(a|an|the|and)\b")
_PUNCT = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """LoCoMo's answer normalisation: no commas, lower case, no punctuation, no a/an/the/and, single spaces."""
    s = text.replace(",", "").lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", s).split())


@lru_cache(maxsize=1)
def _stemmer():  # noqa: ANN202 - nltk has no types
    from nltk.stem import PorterStemmer

    return PorterStemmer()


def answer_tokens(text: str, stem: bool = True) -> list[str]:
    """The normalised words of `text`, Porter-stemmed unless `stem` is False."""
    words = normalize_answer(text).split()
    if not stem:
        return words
    stemmer = _stemmer()
    return [stemmer.stem(w) for w in words]


def token_f1(prediction: str, gold: str) -> float:
    """Token-level F1 of the stemmed normalised words (multisets), 0 without overlap."""
    pred, ref = answer_tokens(prediction), answer_tokens(gold)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def multi_answer_f1(prediction: str, gold: str) -> float:
    """LoCoMo's multi-hop F1: mean over the comma-separated gold parts of the best F1 of any prediction part."""
    preds = [p.strip() for p in prediction.split(",")]
    golds = [g.strip() for g in gold.split(",")]
    return sum(max(token_f1(p, g) for p in preds) for g in golds) / len(golds)


def bleu1(prediction: str, gold: str) -> float:
    """BLEU-1 on the unstemmed normalised words: clipped unigram precision times the brevity penalty."""
    pred, ref = answer_tokens(prediction, stem=False), answer_tokens(gold, stem=False)
    if not pred:
        return 0.0
    clipped = sum((Counter(pred) & Counter(ref)).values())
    penalty = 1.0 if len(pred) > len(ref) else math.exp(1.0 - len(ref) / len(pred))
    return penalty * clipped / len(pred)


def is_abstention(answer: str) -> bool:
    """Whether the answer says the memory does not hold the answer (LoCoMo's adversarial check)."""
    low = answer.lower()
    return any(marker in low for marker in ABSTAIN_MARKERS)


def scoring_gold(gold: str, category: int | None, rules: Rules) -> str:
    """The gold text scored against: LoCoMo's category 3 keeps the part before the first `;`."""
    return gold.split(";")[0].strip() if rules == "locomo" and category == 3 else gold


def score_answer(prediction: str | None, gold: str | None, category: int | None, rules: Rules = "locomo"
                 ) -> tuple[float, float, bool | None]:
    """(F1, BLEU-1, abstained) of one answer; a failed answer (None) scores 0 with abstained None.

    Without a gold answer (unanswerable/adversarial) both scores are 1 for an abstention, else 0.
    """
    if prediction is None:
        return 0.0, 0.0, None
    abstained = is_abstention(prediction)
    if gold is None:
        value = 1.0 if abstained else 0.0
        return value, value, abstained
    ref = scoring_gold(gold, category, rules)
    f1 = multi_answer_f1(prediction, ref) if rules == "locomo" and category == 1 else token_f1(prediction, ref)
    return f1, bleu1(prediction, ref), abstained
