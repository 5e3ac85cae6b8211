"""Text measures shared by the envs' metrics and the world model's fidelity, and token-id edits."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence


def bag_of_words_f1(predicted: Sequence[str], reference: Sequence[str]) -> float:
    """F1 of two token lists with c the tokens they share, counted with multiplicity: precision
    p = c / |predicted|, recall r = c / |reference|, F1 = 2pr / (p + r); 0 when they share none
    (an empty list shares none: callers that score two empty texts as equal say so first)."""
    common = sum((Counter(predicted) & Counter(reference)).values())
    if not common:
        return 0.0
    precision, recall = common / len(predicted), common / len(reference)
    return 2 * precision * recall / (precision + recall)


def expand_placeholders(ids: Sequence[int], placeholder: int, copies: int) -> list[int]:
    """`ids` with each `placeholder` token repeated `copies` times: an image placeholder becomes the
    image-token positions a VLM fills with its image's features (LLaVA's processor does the same)."""
    out: list[int] = []
    for token in ids:
        out.extend([token] * copies if token == placeholder else [token])
    return out
