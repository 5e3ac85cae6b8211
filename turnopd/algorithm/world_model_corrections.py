"""World-model rollouts' two corrections (WMRL), as pure functions over numbers (no I/O).

When most of a step's episodes play a learned world model instead of the real env, two things must
stay honest:

1. Online Debiasing: a success rate measured on model episodes carries the model's bias. A small
   share of episodes plays the real env; on those the model also predicts the outcome, so the bias
   is measured there and subtracted (the prediction-powered mean of Angelopoulos et al., 2023).
2. Inverse-Variance Denoising: a trajectory whose states the model is unsure of is a noisier
   training signal; its token weight is scaled by the inverse of the model's estimated variance
   (from several sampled next observations per turn), normalised to mean 1 so the loss scale holds.

And the fidelity measures of a world model against the real env (`token_f1`,
`expected_calibration_error`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

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
