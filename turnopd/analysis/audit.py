"""The teacher audit's figures (`turnopd teacher audit`): does a familiarity signal tell where the
teacher's targets are worth imitating? Pure functions over numbers, and the audit's plot.

The ground truth is a takeover: from a student state (turn t of a student episode), the teacher plays
greedily to the end; its success there says whether its targets at that state lead anywhere. A
signal predicts it when the states it calls familiar are the ones the teacher wins from: the AUC
(the probability that a random won state has a more familiar signal than a random lost one, ties
counting one half) is above 1/2.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from turnopd.analysis.frontier import BOOTSTRAP, percentile_interval, t_interval


def auc(scores: Sequence[float], labels: Sequence[bool], strata: Sequence[int] | None = None) -> float | None:
    """Mann-Whitney AUC = (1 / |P|) sum_{(i, j) in P} (1[s_i > s_j] + 1/2 1[s_i = s_j]) over the pairs P
    of a positive i and a negative j; with `strata` (say depth bands), only pairs within one stratum,
    so that what the signal shares with the stratum does not count. None without a pair."""
    strata = [0] * len(scores) if strata is None else strata
    wins, pairs = 0.0, 0
    for stratum in set(strata):
        pos = [s for s, y, g in zip(scores, labels, strata, strict=True) if y and g == stratum]
        neg = [s for s, y, g in zip(scores, labels, strata, strict=True) if not y and g == stratum]
        wins += sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
        pairs += len(pos) * len(neg)
    return wins / pairs if pairs else None


def bootstrap_auc(scores: Sequence[float], labels: Sequence[bool], rng: np.random.Generator,
                  strata: Sequence[int] | None = None, resamples: int = BOOTSTRAP) -> tuple[float, float] | None:
    """A percentile interval (95%) of the AUC over states resampled with replacement (resamples
    without a pair are dropped); None when fewer than 10 resamples had one."""
    arrays = [np.asarray(a) for a in (scores, labels, [0] * len(scores) if strata is None else strata)]
    values = []
    for _ in range(resamples):
        pick = rng.integers(0, len(arrays[0]), len(arrays[0]))
        value = auc(*(a[pick].tolist() for a in arrays))
        if value is not None:
            values.append(value)
    return percentile_interval(values) if len(values) >= 10 else None


def paired_difference(episodes: Sequence[int], differences: Sequence[float], rng: np.random.Generator,
                      resamples: int = BOOTSTRAP) -> dict[str, Any]:
    """Two teachers' takeovers from the same states: d_s = won_second(s) - won_first(s), and
    difference = (1 / n) sum_s d_s, with two 95% percentile bootstrap intervals: `by_state`
    resamples the states; `by_episode` resamples whole episodes (a state's episode: its states
    share a game, so they are not independent) and takes sum d / number of states drawn."""
    d = np.asarray(differences, dtype=float)
    groups = [d[np.asarray(episodes) == e] for e in sorted(set(episodes))]
    by_state = [float(d[rng.integers(0, len(d), len(d))].mean()) for _ in range(resamples)]
    by_episode = []
    for _ in range(resamples):
        drawn = [groups[i] for i in rng.integers(0, len(groups), len(groups))]
        by_episode.append(sum(float(g.sum()) for g in drawn) / sum(len(g) for g in drawn))
    return {"states": len(d), "episodes": len(groups), "difference": float(d.mean()),
            "only_first": int((d < 0).sum()), "only_second": int((d > 0).sum()),
            "by_state": percentile_interval(by_state), "by_episode": percentile_interval(by_episode)}


def teacher_lead(teacher: Mapping[str, float], student: Mapping[str, float], min_points: float) -> dict[str, Any]:
    """How far the teacher leads the student on the same held-out tasks (`turnopd teacher lead`), paired
    by task. With t_i and s_i a task's successes / k (its Avg@k) for the teacher and the student,
    d_i = 100 (t_i - s_i) in points; lead = (1 / n) sum_i d_i with its 95% t interval over the n tasks
    (None for one task); `passes` when the lead reaches `min_points` (a distillation experiment's gate:
    a teacher that does not lead its student has nothing to show by distilling)."""
    if set(teacher) != set(student):
        raise ValueError(f"the teacher played {len(teacher)} tasks and the student {len(student)}, not the same ones")
    if not teacher:
        raise ValueError("no tasks to compare the teacher and the student on")
    differences = [100 * (teacher[task] - student[task]) for task in sorted(teacher)]
    interval = t_interval(differences)
    lead = sum(differences) / len(differences)
    return {"tasks": len(differences), "teacher": 100 * sum(teacher.values()) / len(teacher),
            "student": 100 * sum(student.values()) / len(student), "lead_points": lead,
            "interval": None if interval is None else [interval.lo, interval.hi],
            "teacher_ahead": sum(d > 0 for d in differences), "student_ahead": sum(d < 0 for d in differences),
            "min_points": min_points, "passes": lead >= min_points}


class AuditMismatch(ValueError):
    """Two audits that did not take over from the same states."""


def compare_audits(first: dict[str, Any], second: dict[str, Any], band_width: int, seed: int = 0) -> list[dict[str, Any]]:
    """The second audit's teacher against the first's on the states both took over from: one row for
    all of them, then one per band of `band_width` turns (paired_difference each). Both audits must
    have played the same student episodes (same recipe seed, student, split and states)."""
    def keyed(report: dict[str, Any]) -> dict[tuple[int, int], dict[str, Any]]:
        return {(s["episode"], s["turn"]): s for s in report["states"]}

    a, b = keyed(first), keyed(second)
    if a.keys() != b.keys() or any(a[k]["task_id"] != b[k]["task_id"] or a[k]["student_won"] != b[k]["student_won"]
                                   for k in a):
        raise AuditMismatch(f"the audits took over from different states ({first['teacher']}: {len(a)}, "
                            f"{second['teacher']}: {len(b)}, {len(a.keys() & b.keys())} shared); run both with the same "
                            "recipe seed, student, --episodes, --per-band, --band-width and split")
    rng = np.random.default_rng(seed)
    keys = sorted(a)
    rows = []
    for label, chosen in [("all", keys), *(
            (f"{band * band_width + 1}-{(band + 1) * band_width}", [k for k in keys if k[1] // band_width == band])
            for band in sorted({k[1] // band_width for k in keys}))]:
        row = paired_difference([k[0] for k in chosen], [b[k]["won"] - a[k]["won"] for k in chosen], rng)
        rows.append({"turns": label, "first": sum(a[k]["won"] for k in chosen) / len(chosen),
                     "second": sum(b[k]["won"] for k in chosen) / len(chosen), **row})
    return rows


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float] | None:
    """The Wilson score interval of a proportion (95% for z = 1.96):
    (p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n), p = successes / n."""
    if n == 0:
        return None
    p = successes / n
    centre = p + z * z / (2 * n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)


def oriented(value: float, higher_is_familiar: bool) -> float:
    """A signal turned so that higher reads more familiar (the AUC's convention)."""
    return value if higher_is_familiar else -value


def sample_states(depths: Sequence[int], band_width: int, per_band: int, seed: int) -> list[tuple[int, int]]:
    """(episode, turn) pairs: for each band of `band_width` turns ([0, w), [w, 2w), ...), up to
    `per_band` of the states the episodes of the given depths reached in it (turn t < depth), drawn
    without replacement with `seed`; sorted."""
    rng = random.Random(seed)
    by_band: dict[int, list[tuple[int, int]]] = {}
    for episode, depth in enumerate(depths):
        for turn in range(depth):
            by_band.setdefault(turn // band_width, []).append((episode, turn))
    picked = [state for band in sorted(by_band) for state in rng.sample(by_band[band], min(per_band, len(by_band[band])))]
    return sorted(picked)


def quantiles(values: Sequence[float], qs: Sequence[float] = (0.1, 0.25, 0.5, 0.75, 0.9)) -> dict[str, float]:
    """Named quantiles (q10, q25, ...) of the values, for a familiarity.threshold."""
    return {f"q{round(100 * q)}": float(np.quantile(values, q)) for q in qs}


def plot_audit(report: dict[str, Any], out: Path) -> Path:
    """Panel 1: takeover success from the student states, the teacher's and the student's (both
    greedy, the same budget), by depth band, with 95% Wilson intervals; panel 2: each signal's ROC curve for predicting the
    takeover's success (the AUC and its interval in the legend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    bands = report["bands"]
    x = np.arange(len(bands))
    for offset, key, label in ((-0.18, "takeover", "teacher takes over"), (0.18, "student", "student takes over")):
        rates = [100 * b[key]["rate"] for b in bands]
        lows = [100 * (b[key]["rate"] - b[key]["interval"][0]) for b in bands]
        highs = [100 * (b[key]["interval"][1] - b[key]["rate"]) for b in bands]
        left.bar(x + offset, rates, 0.36, yerr=[lows, highs], capsize=3, label=label)
    left.set_xticks(x, [f"turns {b['first_turn'] + 1}-{b['last_turn'] + 1}\n(n={b['states']})" for b in bands])
    left.set_ylabel("success from the state (%)")
    left.set_title("Who wins from student states, by depth")
    left.legend()
    labels = [s["won"] for s in report["states"]]
    for name, summary in report["signals"].items():
        scores = [oriented(s["signals"][name], summary["higher_is_familiar"]) for s in report["states"]]
        fpr, tpr = roc_curve(scores, labels)
        interval = summary["auc_interval"]
        auc_text = "n/a" if summary["auc"] is None else f"{summary['auc']:.2f}" + (
            f" [{interval[0]:.2f}, {interval[1]:.2f}]" if interval else "")
        right.plot(fpr, tpr, label=f"{name}: AUC {auc_text}")
    right.plot([0, 1], [0, 1], color="grey", linestyle=":")
    right.set_xlabel("false positive rate")
    right.set_ylabel("true positive rate")
    right.set_title("Familiarity predicting takeover success")
    right.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def roc_curve(scores: Sequence[float], labels: Sequence[bool]) -> tuple[list[float], list[float]]:
    """(false positive rates, true positive rates) as the threshold falls through the distinct scores."""
    pos, neg = sum(labels), len(labels) - sum(labels)
    fpr, tpr = [0.0], [0.0]
    for threshold in sorted(set(scores), reverse=True):
        above = [y for s, y in zip(scores, labels, strict=True) if s >= threshold]
        tpr.append(sum(above) / pos if pos else 0.0)
        fpr.append((len(above) - sum(above)) / neg if neg else 0.0)
    return fpr, tpr
