"""Answer scores of extractive QA: SQuAD v1.1's normalization and exact match, and token F1 under
the rule of each dataset's official evaluation.

F1 rules (`f1_score(..., rule=...)`), each the best score over the accepted answers:

- "squad": SQuAD v1.1's evaluate-v1.1.py, F1 = 2PR/(P+R) on normalized tokens, 0 when nothing
  is shared;
- "hotpotqa": HotpotQA's hotpot_evaluate_v1.py (and 2WikiMultihopQA's 2wikimultihop_evaluate_v1.1.py,
  which copies it): as "squad", but 0 when the normalized prediction or answer is one of 'yes',
  'no', 'noanswer' and the two differ ('yes' against 'yes no' scores 0, not 0.67);
- "musique": MuSiQue's metrics/answer.py compute_f1 (SQuAD 2.0's): as "squad", but when the
  prediction or the answer normalizes to no tokens, 1 if both do, else 0.

OFFICIAL_F1 maps a dataset to its official rule.
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence

from turnopd.core.text import bag_of_words_f1

_PUNCTUATION = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")

F1_RULES = ("squad", "hotpotqa", "musique")
OFFICIAL_F1 = {"hotpotqa": "hotpotqa", "2wiki": "hotpotqa", "musique": "musique"}  # dataset -> rule
YES_NO = ("yes", "no", "noanswer")  # HotpotQA's special answers


def normalize_answer(text: str) -> str:
    """SQuAD's normalize_answer: lowercase, drop punctuation, drop articles, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, answers: Sequence[str]) -> float:
    """1.0 if the normalized prediction equals any normalized answer, else 0.0."""
    predicted = normalize_answer(prediction)
    return float(any(predicted == normalize_answer(a) for a in answers))


def token_f1(prediction: str, answer: str, rule: str = "squad") -> float:
    """Token F1 of `prediction` against one answer under `rule` (see the module doc): P =
    common/|prediction tokens|, R = common/|answer tokens|, common counted with multiplicity."""
    if rule not in F1_RULES:
        raise ValueError(f"unknown F1 rule {rule!r}; allowed: {', '.join(F1_RULES)}")
    predicted, wanted = normalize_answer(prediction), normalize_answer(answer)
    if rule == "hotpotqa" and predicted != wanted and (predicted in YES_NO or wanted in YES_NO):
        return 0.0
    predicted_tokens, wanted_tokens = predicted.split(), wanted.split()
    if rule == "musique" and not (predicted_tokens and wanted_tokens):
        return float(predicted_tokens == wanted_tokens)
    return bag_of_words_f1(predicted_tokens, wanted_tokens)


def f1_score(prediction: str, answers: Sequence[str], rule: str = "squad") -> float:
    """The best token F1 over the answers under `rule` (0.0 when there is none)."""
    if rule not in F1_RULES:
        raise ValueError(f"unknown F1 rule {rule!r}; allowed: {', '.join(F1_RULES)}")
    return max((token_f1(prediction, answer, rule) for answer in answers), default=0.0)
