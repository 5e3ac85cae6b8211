"""A multi-env run's mixture: how each step's episodes are shared between its envs (pure functions)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """`total` whole units shared by `weights` (summing to 1), largest remainder (Hamilton): each gets
    the floor of its quota total * w, then the units left over go one each to the largest remainders
    (ties to the earlier entry). Deterministic, so every step of a run (and its resume) gets the same."""
    quotas = [total * w for w in weights]
    counts = [math.floor(q + 1e-9) for q in quotas]  # 1e-9: a quota of 2.9999999 from rounding is 3
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in by_remainder[:total - sum(counts)]:
        counts[i] += 1
    return counts


def mixture_episodes(episodes_per_step: int, group_size: int, weights: Sequence[float] | None,
                     fixed: Sequence[int] | None) -> list[int]:
    """Each env's episodes a step: the `fixed` counts when given, else episodes_per_step apportioned by
    `weights` in whole groups of group_size (a group is episodes of one task, so never split)."""
    if fixed is not None:
        return list(fixed)
    return [groups * group_size for groups in apportion(episodes_per_step // group_size, weights)]
