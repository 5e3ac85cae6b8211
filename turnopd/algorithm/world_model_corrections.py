"""World-model rollouts' two corrections (WMRL), as pure functions and small state over numbers (no I/O).

When most of a step's episodes play a learned world model instead of the real env, two things must
stay honest, each in two forms (world_model.debias, world_model.denoise):

1. Online Debiasing: a score measured on model episodes carries the model's bias. A share of
   episodes plays the real env; on those the model also gives its verdict, so the bias is measured
   there. `ppi`: subtracted from the model episodes' mean success (the prediction-powered mean of
   Angelopoulos et al., 2023; `debiased_mean`). `isotonic`: WMRL's map (xiyuanyang45/WMRL,
   wmrl/debias.py): a monotone, non-affine map from the model's score to the real one, fitted by
   bucketed isotonic regression on the (verdict, real outcome) pairs, through which every model
   score goes (`fit_calibration`, `OnlineDebiaser`). A GRPO advantage standardises rewards within a
   group, which cancels any affine correction; a piecewise-linear monotone one survives it.
2. Inverse-Variance Denoising: `trajectory_variance`: a trajectory whose states the model is unsure
   of is a noisier training signal; its token weight is scaled by the inverse of the model's
   estimated variance (from several sampled next observations per turn), normalised to mean 1 so the
   loss scale holds. `anchor_weight`: WMRL's (wmrl/denoise.py): the groups graded by the real env
   (anchor groups) are up-weighted by w = clip(1 + c s^2, 1, 4), s^2 the measured disagreement
   between calibrated model scores and real ones (`group_disagreement`, `InverseVarianceWeighter`).

Which groups are anchors is `anchor_groups` (WMRL's wmrl/anchor.py). And the fidelity measures of a
world model against the real env (`token_f1`, `expected_calibration_error`, `auroc`).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter, deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from turnopd.core.text import bag_of_words_f1


@dataclass(frozen=True)
class DebiasedMean:
    estimate: float   # the debiased mean, clipped to [low, high] of the signal's range
    stderr: float     # its standard error (0 when a term has fewer than 2 values)
    bias: float       # mean(model prediction - real outcome) on the real episodes


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _sample_variance(values: Sequence[float]) -> float:
    """Unbiased sample variance; 0 for fewer than two values (no spread can be measured)."""
    if len(values) < 2:
        return 0.0
    mean = _mean(values)
    return sum((v - mean) ** 2 for v in values) / (len(values) - 1)


def debiased_mean(model_predictions: Sequence[float], real_outcomes: Sequence[float],
                  real_predictions: Sequence[float], low: float = 0.0,
                  high: float = 1.0) -> DebiasedMean:
    """Online Debiasing of a signal (success, won) measured mostly on world-model episodes.

    With f_i the model's signal on the N model episodes, and (y_j, f_j) the real outcome and the
    model's prediction on the n real episodes (the model is run on the same real histories):

        bias  = (1/n) sum_j (f_j - y_j)
        mu    = (1/N) sum_i f_i - bias
        se^2  = Var(f_i) / N + Var(f_j - y_j) / n

    (the prediction-powered mean; unbiased for E[y] when the model's bias is the same on both
    sets of episodes). mu is clipped to [low, high]. With no model episodes, mu is the real mean.
    """
    if len(real_outcomes) != len(real_predictions):
        raise ValueError(f"real_outcomes ({len(real_outcomes)}) and real_predictions "
                         f"({len(real_predictions)}) must pair one to one")
    if not real_outcomes:
        raise ValueError("Online Debiasing needs at least one real episode "
                         "(world_model.real_fraction > 0)")
    residuals = [f - y for f, y in zip(real_predictions, real_outcomes, strict=True)]
    bias = _mean(residuals)
    if not model_predictions:
        estimate = _mean(real_outcomes)
        stderr = math.sqrt(_sample_variance(real_outcomes) / len(real_outcomes))
    else:
        estimate = _mean(model_predictions) - bias
        stderr = math.sqrt(_sample_variance(model_predictions) / len(model_predictions)
                           + _sample_variance(residuals) / len(residuals))
    return DebiasedMean(estimate=min(high, max(low, estimate)), stderr=stderr, bias=bias)


def sample_disagreement(samples: Sequence[Hashable]) -> float:
    """The model's uncertainty about one next observation, from K sampled observations:

        d = 1 - (count of the most frequent sample) / K

    0 when all K samples agree, (K - 1) / K when all differ.
    """
    if not samples:
        raise ValueError("sample_disagreement needs at least one sample")
    return 1.0 - Counter(samples).most_common(1)[0][1] / len(samples)


def trajectory_variance(turn_disagreements: Sequence[float]) -> float:
    """A trajectory's estimated variance: the chance that at least one of its T model turns leaves
    the model's modal path,

        sigma^2 = 1 - prod_t (1 - d_t)

    0 for a real-env trajectory (no model turns: the empty product is 1).
    """
    agree = 1.0
    for d in turn_disagreements:
        if not 0.0 <= d <= 1.0:
            raise ValueError(f"a disagreement is a share in [0, 1], got {d}")
        agree *= 1.0 - d
    return 1.0 - agree


def inverse_variance_weights(variances: Sequence[float], variance_floor: float) -> list[float]:
    """Inverse-Variance Denoising of per-trajectory weights, normalised to mean 1:

        w_i = (1 / (sigma_i^2 + eps)) / ((1/B) sum_k 1 / (sigma_k^2 + eps))

    eps = variance_floor > 0 bounds the weight of a certain trajectory (a real one has sigma^2 = 0):
    a trajectory with sigma^2 = eps weighs half of one with sigma^2 = 0.
    """
    if variance_floor <= 0:
        raise ValueError(f"variance_floor must be > 0, got {variance_floor}")
    if not variances:
        return []
    precisions = [1.0 / (v + variance_floor) for v in variances]
    mean_precision = _mean(precisions)
    return [p / mean_precision for p in precisions]


# --------------------------------------------------------------------------------------------
# WMRL's corrections (xiyuanyang45/WMRL, wmrl/debias.py, denoise.py, anchor.py), over anchor groups
# --------------------------------------------------------------------------------------------

# WMRL's defaults (the constants of its classes' signatures)
CALIBRATION_BINS = 10  # OnlineDebiaser(bins=10)
CALIBRATION_MIN_PAIRS = 200  # OnlineDebiaser(min_pairs=200): identity until then
CALIBRATION_REFIT_EVERY = 64  # OnlineDebiaser(refit_every=64)
CALIBRATION_MAX_PAIRS = 5000  # OnlineDebiaser(cap=5000): the FIFO of pairs
ANCHOR_HALF_LIFE = 64.0  # InverseVarianceWeighter(half_life=64), in anchor groups
ANCHOR_WARMUP = 32  # InverseVarianceWeighter(warmup=32): c is fixed after this many groups
ANCHOR_MAX_WEIGHT = 4.0  # InverseVarianceWeighter(w_max=4.0)
ANCHOR_TARGET_WEIGHT = 2.0  # InverseVarianceWeighter(target_weight=2.0): w when c is fixed
DEGENERATE_VARIANCE = 1e-9  # group_disagreement: a group whose real scores all agree says nothing


@dataclass(frozen=True)
class Calibration:
    """A fitted monotone map: breakpoints xs (increasing) and values ys (non-decreasing), linear in
    between and flat beyond the ends (np.interp)."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]


def fit_calibration(pairs: Iterable[tuple[float, float]], bins: int = CALIBRATION_BINS) -> Calibration | None:
    """Bucketed isotonic regression of the real score y on the model's score x (WMRL's
    `fit_calibration`, wmrl/debias.py):

        bin b = the x in [b/B, (b+1)/B) (np.digitize on the inner edges: x < 1/B is bin 0, x >= (B-1)/B
                the last, 1 included),
        per populated bin: x_b = mean x, y_b = mean y, n_b = its pairs,
        pool adjacent violators: while a bin's y_b is below its left neighbour's, both become one
                block of value (y_1 n_1 + y_2 n_2) / (n_1 + n_2),
        the map: through (x_b, y of b's block), linear in between, flat beyond.

    None (stay at identity) with fewer than 2 pairs or fewer than 2 populated bins."""
    points = np.asarray(list(pairs), dtype=float)
    if points.ndim != 2 or points.shape[0] < 2:
        return None
    x, y = points[:, 0], points[:, 1]
    edges = np.linspace(0.0, 1.0, bins + 1)
    index = np.clip(np.digitize(x, edges[1:-1]), 0, bins - 1)
    populated = [b for b in range(bins) if (index == b).any()]
    if len(populated) < 2:
        return None
    blocks: list[list[float]] = []  # [value, pairs, bins] per pooled block, left to right
    for b in populated:
        blocks.append([float(y[index == b].mean()), float((index == b).sum()), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (v2, w2, c2), (v1, w1, c1) = blocks.pop(), blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, c1 + c2])
    return Calibration(xs=tuple(float(x[index == b].mean()) for b in populated),
                       ys=tuple(v for v, _, c in blocks for _ in range(c)))


def apply_calibration(calibration: Calibration | None, scores: Sequence[float]) -> list[float]:
    """The scores through the map (None: the identity, what a run does before its first fit)."""
    if calibration is None:
        return [float(r) for r in scores]
    return np.interp(np.asarray(scores, dtype=float), calibration.xs, calibration.ys).tolist()


@dataclass(frozen=True)
class BiasStats:
    before: float  # mean ((x - mean x) - (y - mean y))^2: the raw scores' centred squared residual
    after: float  # the same with f(x) for x
    reduction: float  # 1 - after / max(before, 1e-9)


def bias_stats(model_scores: Sequence[float], real_scores: Sequence[float],
               calibration: Calibration | None) -> BiasStats:
    """The centred squared residual of model scores x against real scores y, before and after the
    map f (WMRL's `bias_stats`):

        before = mean_i ((x_i - mean x) - (y_i - mean y))^2,   after = the same with f(x_i),

    centred because a group-normalised advantage sees only differences within a group, so a constant
    offset is no bias to it."""
    x, y = np.asarray(model_scores, dtype=float), np.asarray(real_scores, dtype=float)
    fx = np.asarray(apply_calibration(calibration, x.tolist()))
    before = float((((x - x.mean()) - (y - y.mean())) ** 2).mean())
    after = float((((fx - fx.mean()) - (y - y.mean())) ** 2).mean())
    return BiasStats(before, after, 1.0 - after / max(1e-9, before))


class OnlineDebiaser:
    """WMRL's `OnlineDebiaser` (wmrl/debias.py): a FIFO of at most `max_pairs` (model score, real
    score) pairs and the map fitted on them. The identity until `min_pairs` pairs have come; from
    then, a refit once `refit_every` pairs have come since the last fit (the first at pair
    `min_pairs`); a fit that finds fewer than 2 populated bins keeps the old map and the count, so the
    next pair tries again. `stats`: the BiasStats of the last fit over the FIFO."""

    def __init__(self, min_pairs: int = CALIBRATION_MIN_PAIRS, refit_every: int = CALIBRATION_REFIT_EVERY,
                 bins: int = CALIBRATION_BINS, max_pairs: int = CALIBRATION_MAX_PAIRS):
        self.min_pairs, self.refit_every, self.bins = min_pairs, refit_every, bins
        self.pairs: deque[tuple[float, float]] = deque(maxlen=max_pairs)
        self.since_fit = 0
        self.calibration: Calibration | None = None
        self.fits = 0
        self.stats: BiasStats | None = None

    def push(self, model_score: float, real_score: float) -> None:
        self.pairs.append((float(model_score), float(real_score)))
        self.since_fit += 1
        if len(self.pairs) >= self.min_pairs and self.since_fit >= self.refit_every:
            self.refit()

    def refit(self) -> bool:
        """Fit now; whether the map changed."""
        calibration = fit_calibration(self.pairs, self.bins)
        if calibration is None:
            return False
        self.calibration, self.since_fit, self.fits = calibration, 0, self.fits + 1
        model, real = zip(*self.pairs, strict=True)
        self.stats = bias_stats(model, real, calibration)
        return True

    def apply(self, scores: Sequence[float]) -> list[float]:
        return apply_calibration(self.calibration, scores)

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to go on as an uninterrupted one (JSON-able)."""
        return {"pairs": [list(pair) for pair in self.pairs], "since_fit": self.since_fit, "fits": self.fits,
                "calibration": None if self.calibration is None else [list(self.calibration.xs),
                                                                       list(self.calibration.ys)],
                "stats": None if self.stats is None else dataclasses.asdict(self.stats)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pairs.extend((float(x), float(y)) for x, y in state["pairs"])
        self.since_fit, self.fits = int(state["since_fit"]), int(state["fits"])
        self.calibration = None if state["calibration"] is None else Calibration(*map(tuple, state["calibration"]))
        self.stats = None if state["stats"] is None else BiasStats(**state["stats"])


def group_disagreement(calibrated: Sequence[float], real: Sequence[float]) -> float | None:
    """One anchor group's disagreement between the calibrated model scores d and the real ones s
    (WMRL's `group_disagreement`, wmrl/denoise.py):

        s^2 = mean_i ((d_i - mean d) - (s_i - mean s))^2 / Var(s)     (Var: population variance)

    None for a degenerate group (Var(s) < 1e-9: every real score the same), which carries no ranking
    and must not pull the running estimate to 0."""
    d, s = np.asarray(calibrated, dtype=float), np.asarray(real, dtype=float)
    variance = s.var()
    if variance < DEGENERATE_VARIANCE:
        return None
    return float((((d - d.mean()) - (s - s.mean())) ** 2).mean() / variance)


class InverseVarianceWeighter:
    """WMRL's `InverseVarianceWeighter` (wmrl/denoise.py): the anchor groups' weight

        w = clip(1 + c s^2, 1, max_weight),

    s^2 an exponential average of the groups' disagreements with half-life `half_life` groups
    (s^2 <- (1 - a) s^2 + a s^2_g, a = 1 - 0.5^(1 / half_life); the first group's sets it), and c fixed
    once, when `warmup` groups have been folded in and s^2 > 1e-12, at c = (target - 1) / s^2, so that
    w = target then; w tracks how the disagreement moves after that, not its scale. w = 1 until c is
    fixed."""

    def __init__(self, half_life: float = ANCHOR_HALF_LIFE, warmup: int = ANCHOR_WARMUP,
                 max_weight: float = ANCHOR_MAX_WEIGHT, target_weight: float = ANCHOR_TARGET_WEIGHT):
        self.half_life, self.warmup = half_life, warmup
        self.max_weight, self.target_weight = max_weight, target_weight
        self.disagreement: float | None = None
        self.groups = 0
        self.c: float | None = None

    def observe_group(self, calibrated: Sequence[float], real: Sequence[float]) -> float:
        """Fold one anchor group in (a degenerate one is skipped), fix c when due; the weight after."""
        s2 = group_disagreement(calibrated, real)
        if s2 is not None:
            a = 1.0 - 0.5 ** (1.0 / max(1.0, self.half_life))
            self.disagreement = s2 if self.disagreement is None else (1 - a) * self.disagreement + a * s2
            self.groups += 1
            if self.c is None and self.groups >= self.warmup and self.disagreement > 1e-12:
                self.c = (self.target_weight - 1.0) / self.disagreement
        return self.weight()

    def weight(self) -> float:
        if self.c is None or self.disagreement is None:
            return 1.0
        return min(self.max_weight, max(1.0, 1.0 + self.c * self.disagreement))

    def state_dict(self) -> dict[str, Any]:
        return {"disagreement": self.disagreement, "groups": self.groups, "c": self.c}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.disagreement, self.groups, self.c = state["disagreement"], int(state["groups"]), state["c"]


def anchor_groups(n_groups: int, rng_key: Sequence[int], fraction: float = 0.10, min_per_step: int = 1,
                  max_concurrent: int | None = None, in_flight: int = 0) -> list[int]:
    """Which of a step's n groups are anchors (graded by the real env, and by the model for the
    pairs), sorted (WMRL's `AnchorScheduler.select`, wmrl/anchor.py):

        k = min(n, max(min_per_step, round(fraction * n)))   (Python's round: half to even)
        k = min(k, max(0, max_concurrent - in_flight))         with a concurrency cap
        the k drawn uniformly without replacement by np.random.default_rng(rng_key).

    WMRL draws every step from one generator seeded once; here each step's draw is seeded by its own
    key (the run's seed and the step), so a resumed run anchors the groups an uninterrupted one did."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    if n_groups <= 0:
        return []
    want = min(n_groups, max(min_per_step, int(round(fraction * n_groups))))
    if max_concurrent is not None:
        want = min(want, max(0, max_concurrent - in_flight))
    rng = np.random.default_rng(list(rng_key))
    return sorted(rng.choice(n_groups, size=want, replace=False).tolist()) if want else []



def token_f1(prediction: str, reference: str) -> float:
    """Bag-of-words F1 of two texts (SQuAD's): with c the count of words they share (each word as
    often as it is in both, lowercased, split on whitespace), precision p = c / |prediction|,
    recall r = c / |reference|, F1 = 2pr / (p + r); 1 when both are empty, 0 when one is."""
    pred, ref = prediction.lower().split(), reference.lower().split()
    if not pred or not ref:
        return float(pred == ref)
    return bag_of_words_f1(pred, ref)


def expected_calibration_error(probabilities: Sequence[float], labels: Sequence[bool], bins: int = 10) -> float:
    """ECE of binary predictions: the examples go into `bins` equal-width bins of predicted
    probability (bin b holds p in [b/B, (b+1)/B), the last bin includes 1); with n_b examples in bin
    b, mean predicted probability conf_b and share of true labels freq_b,
    ECE = sum_b (n_b / N) * |freq_b - conf_b|."""
    if len(probabilities) != len(labels):
        raise ValueError(f"{len(probabilities)} probabilities for {len(labels)} labels")
    if not probabilities:
        raise ValueError("expected_calibration_error needs at least one prediction")
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    binned: dict[int, list[tuple[float, bool]]] = {}
    for p, label in zip(probabilities, labels, strict=True):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"a probability must be in [0, 1], got {p}")
        binned.setdefault(min(int(p * bins), bins - 1), []).append((p, bool(label)))
    return sum(len(items) * abs(_mean([float(y) for _, y in items]) - _mean([p for p, _ in items]))
               for items in binned.values()) / len(probabilities)


def auroc(scores: Sequence[float], labels: Sequence[bool]) -> float | None:
    """Area under the ROC curve of `scores` for binary `labels` (Mann-Whitney): over every pair of a
    positive and a negative example, the share where the positive scores higher, a tie counting
    one half, AUROC = (#{s_pos > s_neg} + #{s_pos = s_neg} / 2) / (n_pos n_neg); 1 ranks every
    positive first, 0.5 is chance. None (undefined) without both a positive and a negative."""
    if len(scores) != len(labels):
        raise ValueError(f"{len(scores)} scores for {len(labels)} labels")
    positives = [s for s, label in zip(scores, labels, strict=True) if label]
    negatives = [s for s, label in zip(scores, labels, strict=True) if not label]
    if not positives or not negatives:
        return None
    wins = sum((p > n) + 0.5 * (p == n) for p in positives for n in negatives)
    return wins / (len(positives) * len(negatives))
