"""Answer scores of extractive QA: SQuAD v1.1's normalization, exact match and token F1."""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

_PUNCTUATION = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """SQuAD's normalize_answer: lowercase, drop punctuation, drop articles, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, answers: Sequence[str]) -> float:
    """1.0 if the normalized prediction equals any normalized answer, else 0.0."""
    predicted = normalize_answer(prediction)
    return float(any(predicted == normalize_answer(a) for a in answers))


def f1_score(prediction: str, answers: Sequence[str]) -> float:
    """The best token F1 over the answers: F1 = 2PR/(P+R), P = common/|prediction tokens|,
    R = common/|answer tokens|, common counted with multiplicity (0 when nothing is shared)."""
    predicted = normalize_answer(prediction).split()
    best = 0.0
    for answer in answers:
        wanted = normalize_answer(answer).split()
        common = sum((Counter(predicted) & Counter(wanted)).values())
        if common:
            precision, recall = common / len(predicted), common / len(wanted)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best
