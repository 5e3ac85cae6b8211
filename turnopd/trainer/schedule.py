"""Learning-rate schedule: linear warm-up, then constant, cosine or linear decay."""

from __future__ import annotations

import math

LR_SCHEDULES = ("constant", "cosine", "linear")


def lr_factor(step: int, total_steps: int, warmup_steps: int, schedule: str) -> float:
    """Multiplier of the base learning rate for optimizer step `step` (0-based) of `total_steps`.

    Warm-up: (step + 1) / warmup_steps, reaching 1 on the last warm-up step (the first step is not
    wasted at lr = 0). Afterwards, with progress p = (step - warmup) / (total - warmup):
    constant 1, cosine (1 + cos(pi p)) / 2, linear 1 - p; the last step still has lr > 0.
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; allowed: {', '.join(LR_SCHEDULES)}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return 1.0 - progress
    return 1.0
