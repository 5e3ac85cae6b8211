"""Teacher familiarity: per-turn signals of how well the teacher knows a student state, and the two
loss controls that act on them. Pure functions over numbers and tensors, no I/O.

OPD asks the teacher to score states a weak student reached and no expert demonstration showed; there
its targets are guesses. The signals come from the teacher's scoring pass itself (no extra forward):

    context_logprob  mean teacher log-prob of the turn's context tokens: the prompt tokens of its
                     sequence after the previous action (the whole re-rendered prompt window in the
                     rollout engine's prompts; the observation and chat scaffolding in an append-only
                     chat), position 0 excluded. Higher: the state reads like the teacher's data.
    action_entropy   mean teacher entropy H_p = -sum_v T_p(v) log T_p(v) over the turn's action
                     positions: exact where the teacher's whole distribution is at hand, else from its
                     top-k plus one tail bucket (a lower bound). Lower: the teacher is sure.
    action_logprob   mean teacher log-prob of the student's own action tokens (the sampled-token
                     cross-entropy, the baseline the others must beat). Higher: it agrees.

Controls (recipe `familiarity.mode`), with x a turn's signal, tau the threshold and s the temperature,
d = +1 when higher x means more familiar, -1 otherwise:

    none    g = 1                                        (the loss unchanged)
    weight  g = sigmoid(d (x - tau) / s)                 (monotone in the signal)
    gate    g = 1[d (x - tau) >= 0]                      (unfamiliar turns get no KL)

and each action token's loss weight becomes w'_p = w_p g_p W / W', W = sum_p w_p, W' = sum_p w_p g_p
(over the global batch), so the step's total weight is the loss mode's (w' = 0 when W' = 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from turnopd.core.registry import Registry


@dataclass(frozen=True)
class Signal:
    """A familiarity signal: its name, which way is familiar, and what it measures."""

    name: str
    higher_is_familiar: bool
    unit: str


FAMILIARITY_SIGNALS: Registry[Signal] = Registry("familiarity signal")
for _signal in (Signal("context_logprob", True, "nats per context token"),
                Signal("action_entropy", False, "nats per action token"),
                Signal("action_logprob", True, "nats per action token")):
    FAMILIARITY_SIGNALS.register(_signal.name)(_signal)

FactorFn = Callable[[torch.Tensor, float, float, float], torch.Tensor]  # (x, tau, s, d) -> g
FAMILIARITY_MODES: Registry[FactorFn] = Registry("familiarity mode")


@FAMILIARITY_MODES.register("none")
def no_factors(x: torch.Tensor, threshold: float, temperature: float, direction: float) -> torch.Tensor:
    """g = 1."""
    return torch.ones_like(x)


@FAMILIARITY_MODES.register("weight")
def sigmoid_factors(x: torch.Tensor, threshold: float, temperature: float, direction: float) -> torch.Tensor:
    """g = sigmoid(d (x - tau) / s): 1/2 at the threshold, toward 1 on familiar turns."""
    if temperature <= 0:
        raise ValueError(f"familiarity temperature must be > 0, got {temperature}")
    return torch.sigmoid(direction * (x - threshold) / temperature)


@FAMILIARITY_MODES.register("gate")
def gate_factors(x: torch.Tensor, threshold: float, temperature: float, direction: float) -> torch.Tensor:
    """g = 1[d (x - tau) >= 0]: a turn on the unfamiliar side of the threshold gets no KL."""
    return (direction * (x - threshold) >= 0).to(x.dtype)


def familiarity_factors(values: torch.Tensor, mode: str, signal: str, threshold: float | None,
                        temperature: float = 1.0) -> torch.Tensor:
    """g per action token from its turn's signal value (see the module docstring for each mode)."""
    if mode == "none":
        return torch.ones_like(values, dtype=torch.get_default_dtype())
    if threshold is None:
        raise ValueError(f"familiarity mode {mode!r} needs a threshold")
    if bool(torch.isnan(values).any()):
        raise ValueError(f"familiarity signal {signal!r} is missing on some action tokens (the teacher did not "
                         "provide it)")
    direction = 1.0 if FAMILIARITY_SIGNALS.get(signal).higher_is_familiar else -1.0
    return FAMILIARITY_MODES.get(mode)(values.to(torch.get_default_dtype()), threshold, temperature, direction)


# --------------------------------------------------------------------------------------------
# The signals from a teacher's per-position scores
# --------------------------------------------------------------------------------------------


def entropy_from_logprobs(logprobs: torch.Tensor) -> torch.Tensor:
    """H = -sum_v p_v log p_v over the last dim of a full log-distribution (p_v = 0 contributes 0)."""
    terms = logprobs.exp() * logprobs
    return -torch.where(torch.isneginf(logprobs), torch.zeros_like(terms), terms).sum(-1)


def topk_tail_entropy(topk_logprobs: Sequence[float]) -> float:
    """Entropy of the teacher's top-k plus one tail bucket of mass 1 - sum_k p_k: a lower bound on the
    entropy of the whole distribution (exact as k covers it). -inf (padding) slots are dropped."""
    probs = [math.exp(lp) for lp in topk_logprobs if lp != -math.inf]
    tail = max(0.0, 1.0 - sum(probs))
    return -sum(p * math.log(p) for p in (*probs, tail) if p > 0)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def span_signals(logprobs: Sequence[float], spans: Sequence[tuple[int, int]],
                 entropies: Sequence[float] | None = None) -> list[dict[str, float]]:
    """Per action span (start, end) of one scored sequence (positions in order; logprobs[p] is the
    teacher's log-prob of token p, position 0 without context), its context_logprob (mean over
    positions [previous span's end or 1, start)), action_logprob (mean over [start, end)) and, with
    per-position entropies, action_entropy (mean over [start, end)); a mean over no position is NaN
    (an empty action: a teacher of another tokenizer reads no text in an answer of only its
    end-of-turn token)."""
    out, previous_end = [], 1
    for start, end in spans:
        signals = {"context_logprob": _mean(logprobs[previous_end:start]), "action_logprob": _mean(logprobs[start:end])}
        if entropies is not None:
            signals["action_entropy"] = _mean(entropies[start:end])
        out.append(signals)
        previous_end = end
    return out


def mask_spans(mask: Sequence[bool]) -> list[tuple[int, int]]:
    """The maximal runs [start, end) of True in a row's action mask (one run per turn: two turns'
    actions are always apart by the prompt tokens between them)."""
    spans, start = [], None
    for p, on in enumerate(mask):
        if on and start is None:
            start = p
        elif not on and start is not None:
            spans.append((start, p))
            start = None
    if start is not None:
        spans.append((start, len(mask)))
    return spans
