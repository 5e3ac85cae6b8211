"""Accuracy-vs-wall-clock comparison of runs: the math behind `turnopd frontier` and `turnopd sweep`.

Definitions (docs/algorithm.md, Metrics). "x" is a point on the compared axis: the optimizer step, or the
training wall-clock (seconds of the ledger's training clock, which excludes eval and checkpoint).
- A run's evaluations are points (step, training wall-clock, Avg@k). Between evaluations accuracy
  is step-wise ("step-wise interpolation"): at x it is the Avg@k of the last evaluation at or before
  x; before the first evaluation it is undefined; after the last one it holds (the run finished,
  or has not been evaluated since). Runs with different eval cadences compare this way.
- Steps done and training wall-clock of a run: the largest step and training clock in any of its
  records (for a run in progress: so far).
- Final Avg@k: a run's last evaluation (for a run in progress: its latest).
- Same-Step Avg@k: each run's accuracy at the largest step every compared run has reached.
- Least-Time Avg@k: each run's accuracy at the shortest training wall-clock any compared run has
  needed for its steps.
- Time to reach an accuracy a: the x of the first evaluation after step 0 with Avg@k >= a that
  holds from then on (every later evaluation >= a too), so that one lucky evaluation does not count,
  and neither does a start that is already at a baseline which ends at or below it.
- Speedup against a baseline: (the baseline's time to reach the Avg@k of its last evaluation along
  the way, the curve's own metric, not the final sampled one) / (this run's time to reach that
  same accuracy); None when the run never reaches it. Work ratio: the same with the
  cumulative work done by the step that reaches it (generated tokens, teacher-scored tokens,
  trained tokens, env steps: measures that do not move with the machine's load as the clock does).
- Intervals (95%, bootstrap, 2000 resamples, a fixed seed): the final Avg@k of a group resamples
  its held-out tasks and its seeds; a difference from the baseline resamples the tasks once for
  both (paired by task) and the seeds jointly when both groups have the same seeds (paired by
  seed); a speedup or work ratio resamples each group's seeds. The final Avg@k is the final
  sampled evaluation ("final_eval", eval.final_k samples per task) where the run has one, else its
  last evaluation.
- Over seeds (t): beside the bootstrap, each group's final Avg@k and its difference from the
  baseline, paired by seed (the seeds both ran), get the t interval over seeds, mean +- t(0.975,
  n-1) s / sqrt(n): with few seeds a percentile bootstrap over seeds is too narrow. The smallest
  effect the seeds could detect (two-sided 5%, power 80%) is (t(0.975, n-1) + t(0.80, n-1)) s / sqrt(n)
  with s the paired differences' standard deviation. The clock ratio and each work ratio (per seed the
  baseline seed's whole run over this run's, at equal steps): their geometric mean over seeds with
  the t interval of the logs (ratio_interval), so the inverse ratio is exactly its reciprocal.
- Equal budget: per seed, this run's last evaluation within the baseline seed's budget, in training
  clock (its evaluations up to the baseline's training clock) and in work (up to the baseline's
  cumulative env steps, or another WORK measure), against the baseline's last evaluation, paired
  by seed with the t interval.
- Non-inferiority at a margin M (points, given before the runs): non-inferior when the t interval
  of the final difference lies above -M, inferior when it lies below -M, else inconclusive.
- Random streams: each group's resamples come from its own stream, seeded by the seed and the
  group's run names, so the order of the run folders does not change any interval.
- Seeds: runs of the same method and recipe (their config.yaml equal up to name, seed and
  output_dir) with distinct seeds form a group, labelled from its runs (group_labels), never their
  order; groups are sorted by label. A group's accuracy at x is the mean over its
  evaluated seeds of their step-wise accuracies, from the first x at which every such seed has been
  evaluated; a group's time to reach an accuracy is read on that seed-mean curve. Its point figures
  (final, Same-Step, Least-Time) are the mean and sample standard deviation across seeds.
- Pareto frontier: of the plotted points (each group's seed-mean curve), those no other point
  beats, i.e. none has x <= and accuracy >= with one of them strictly better.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import statistics
import warnings
import zlib
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from omegaconf import OmegaConf

from turnopd.config import RunConfig
from turnopd.core.ledger import EXCLUDED_FROM_TRAINING
from turnopd.core.methods import method_of
from turnopd.core.metrics import StepRecord, read_metrics

Axis = Literal["time", "step"]

# Avg@k means over seeds carry float rounding; "reached the target" allows for it.
ACCURACY_TOLERANCE = 1e-9
DEFAULT_CONFIG = json.loads(json.dumps(dataclasses.asdict(RunConfig()), default=str))
# config.yaml keys that differ between the seeds of one recipe, so they do not split a group (tracker:
# where a run is filed, e.g. two sweeps' groups, not what it trains).
PER_RUN_CONFIG_KEYS = ("name", "seed", "output_dir", "tracker")
DEFAULT_BASELINE_METHOD = "vanilla_opd"
WORK = ("tokens_generated", "tokens_scored", "tokens_trained", "env_steps")  # train-record work measures
BOOTSTRAP = 2000  # resamples of each interval
CONFIDENCE = 0.95
TURN_BAND = 10  # turns per band of the per-turn KL table


class FrontierError(ValueError):
    """Runs that cannot be compared: names the folder, run or choice at fault."""


@dataclass(frozen=True)
class EvalPoint:
    step: int
    train_time_s: float
    avg_at_k: float
    per_task: dict[str, float] = field(default_factory=dict, compare=False, hash=False)

    def at(self, by: Axis) -> float:
        return self.train_time_s if by == "time" else self.step


@dataclass
class SavedRun:
    """One run folder's metrics.jsonl, parsed."""

    name: str  # the folder's name (runs/<name>, or <name>-2 when distill found the name taken)
    path: Path
    method: str
    seed: int | None
    total_steps: int | None
    train: list[StepRecord]
    evals: list[EvalPoint]  # sorted by step, one per step
    eval_time_s: float  # all evaluations, outside the training clock
    k: int | None
    split: str | None
    recipe_key: str | None  # config.yaml without the per-run keys; None when there is no config.yaml
    final_eval: EvalPoint | None = None  # the final sampled evaluation, when the run made one
    teacher: float | None = None  # the teacher's Avg@k on the same tasks
    models: dict[str, dict[str, Any]] = field(default_factory=dict)  # the start record's: {role: {path, weights}}
    code: str | None = None  # the start record's code fingerprint (turnopd.core.source); None in older runs
    budget_step: int | None = None  # the step at which trainer.budget ended the run
    budget: dict[str, Any] | None = None  # its budget_reached record: unit, amount, spent (the work achieved)

    @property
    def final(self) -> EvalPoint | None:
        """The final Avg@k: the sampled final evaluation, else the last evaluation."""
        return self.final_eval or (self.evals[-1] if self.evals else None)

    def work_by(self, step: float) -> dict[str, float]:
        """Cumulative work of the train records up to `step`."""
        return {key: float(sum(getattr(r, key) or 0 for r in self.train if r.step <= step)) for key in WORK}

    @property
    def steps_done(self) -> int:
        return max([r.step for r in self.train] + [e.step for e in self.evals], default=0)

    @property
    def train_time_s(self) -> float:
        times = [r.train_time_s for r in self.train] + [e.train_time_s for e in self.evals]
        return max(times, default=0.0)

    @property
    def complete(self) -> bool:
        """All steps trained (or the training budget reached) and the final evaluation written."""
        last = self.budget_step or self.total_steps
        return last is not None and bool(self.evals) and self.steps_done >= last and self.evals[-1].step >= last

    def extent(self, by: Axis) -> float:
        return self.train_time_s if by == "time" else self.steps_done


def _required(record: dict[str, Any], key: str, where: str) -> Any:
    if key not in record:
        raise FrontierError(f"{where}: a {record.get('kind')!r} record lacks {key!r}")
    return record[key]


def load_run(run_dir: str | Path, per_seed_keys: Sequence[str] = (), env: str | None = None) -> SavedRun:
    """Read a run folder (runs/<name>, possibly still being written). `per_seed_keys`: dotted config keys that
    may differ between the seeds of one group besides PER_RUN_CONFIG_KEYS (an arm whose trainer.budget.amount
    each seed matches to another run's work); `env`: a multi-env run's one env (env_evaluation)."""
    path = Path(run_dir)
    metrics_path = path / "metrics.jsonl"
    if not metrics_path.is_file():
        nested = sorted(p.parent.name for p in path.glob("*/metrics.jsonl"))
        hint = f"; its subfolders {', '.join(nested)} are runs" if nested else ""
        raise FrontierError(f"run folder {path} has no metrics.jsonl{hint}")
    where = str(metrics_path)
    records = [env_evaluation(r, env, where) for r in read_metrics(metrics_path)] if env else read_metrics(metrics_path)
    starts = [r for r in records if r.get("kind") == "start"]
    start = starts[-1] if starts else {}
    warn_mixed_starts(starts, where)
    train_records = [r for r in records if r.get("kind") == "train"]
    for r in train_records:
        _required(r, "step", where), _required(r, "train_time_s", where)
    train = sorted(map(StepRecord.from_json, train_records), key=lambda r: r.step)

    eval_records = [r for r in records if r.get("kind") == "eval"]
    split = eval_records[-1].get("split") if eval_records else None
    other_splits = {r.get("split") for r in eval_records} - {split}
    if other_splits:
        warnings.warn(f"{where}: comparing evaluations on {split!r} only, not "
                      f"{sorted(map(str, other_splits))}", stacklevel=2)
    by_step: dict[int, EvalPoint] = {}  # a step evaluated twice (a resume) keeps the later record
    eval_time_s = 0.0
    for r in eval_records:
        if r.get("split") != split:
            continue
        step = _required(r, "step", where)
        by_step[step] = EvalPoint(step, float(_required(r, "train_time_s", where)),
                                  float(_required(r, "avg_at_k", where)), r.get("per_task") or {})
        eval_time_s += r.get("eval_time_s") or 0.0

    config = _load_config(path / "config.yaml")
    method = start.get("method")
    if method is None and config is not None:
        method = method_of(config)
    seed = start.get("seed", config.get("seed") if config else None)
    recipe_key = None
    if config is not None:
        recipe_key = json.dumps(_without(_with_defaults(config, DEFAULT_CONFIG), [*PER_RUN_CONFIG_KEYS, *per_seed_keys]),
                                sort_keys=True, default=str)
    finals = [r for r in records if r.get("kind") == "final_eval"]
    final_eval = (EvalPoint(finals[-1]["step"], float(finals[-1]["train_time_s"]), float(finals[-1]["avg_at_k"]),
                            finals[-1].get("per_task") or {}) if finals else None)
    teachers = [r for r in records if r.get("kind") == "teacher_eval"]
    budget = [r for r in records if r.get("kind") == "budget_reached"]
    return SavedRun(
        name=path.name, path=path, method=method or "unknown", seed=seed,
        total_steps=start.get("total_steps"), train=train, evals=[by_step[s] for s in sorted(by_step)],
        eval_time_s=eval_time_s, k=eval_records[-1].get("k") if eval_records else None, split=split,
        recipe_key=recipe_key, final_eval=final_eval,
        teacher=float(teachers[-1]["avg_at_k"]) if teachers else None, models=start.get("models") or {},
        code=(start.get("code") or {}).get("source"),
        budget_step=budget[-1]["step"] if budget else None, budget=budget[-1] if budget else None,
    )


def warn_mixed_starts(starts: list[dict[str, Any]], where: str) -> None:
    """A run resumed on another build of its models or of the code says so (its start records differ)."""
    if len({json.dumps(r["models"], sort_keys=True) for r in starts if r.get("models")}) > 1:
        warnings.warn(f"{where}: its starts name different model weights (resumed on another build): "
                      f"{starts[0].get('models')} then {starts[-1].get('models')}", stacklevel=3)
    codes = list(dict.fromkeys(r["code"]["source"] for r in starts if r.get("code")))
    if len(codes) > 1:
        warnings.warn(f"{where}: its starts ran different builds of the code (resumed on another): "
                      f"{' then '.join(codes)}", stacklevel=3)


EVAL_KINDS = ("eval", "final_eval", "teacher_eval")


def env_evaluation(record: dict[str, Any], env: str, where: str) -> dict[str, Any]:
    """An evaluation record of a multi-env run as env `env`'s alone (`turnopd frontier --env`): its
    per_env entry, with the record's step and clocks and the env's tasks of per_task (keyed env/task).
    A record without per_env is a single-env run's, taken as it is (to compare with the mixture's env)."""
    per_env = record.get("per_env")
    if record.get("kind") not in EVAL_KINDS or per_env is None:
        return record
    if env not in per_env:
        raise FrontierError(f"{where}: the evaluation at step {record.get('step')} has no env {env!r}; its envs: "
                            f"{', '.join(sorted(per_env))}")
    prefix = f"{env}/"
    return {**record, **per_env[env], "per_task": {task[len(prefix):]: score for task, score in
                                                   (record.get("per_task") or {}).items() if task.startswith(prefix)}}


def _with_defaults(config: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The config with the keys it lacks set to their defaults: a run saved before a key existed is
    the same recipe as one that recorded the key's default."""
    filled = dict(config)
    for key, default in defaults.items():
        if key not in filled:
            filled[key] = default
        elif isinstance(default, dict) and default and isinstance(filled[key], dict):
            filled[key] = _with_defaults(filled[key], default)
    return filled


def _without(config: dict[str, Any], dotted_keys: Sequence[str]) -> dict[str, Any]:
    """The config without those keys (a.b.c: key c of section a.b)."""
    kept = json.loads(json.dumps(config, default=str))
    for dotted in dotted_keys:
        *sections, key = dotted.split(".")
        section = kept
        for name in sections:
            section = section.get(name) if isinstance(section, dict) else None
        if isinstance(section, dict):
            section.pop(key, None)
    return kept


def _load_config(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    return OmegaConf.to_container(OmegaConf.load(path), resolve=False)


# ---- pure math -------------------------------------------------------------------------------------


def accuracy_at(evals: Sequence[EvalPoint], x: float, by: Axis) -> float | None:
    """Step-wise interpolation: Avg@k of the last evaluation at or before x (evals sorted), None
    before the first."""
    value = None
    for point in evals:
        if point.at(by) > x:
            break
        value = point.avg_at_k
    return value


def same_step(runs: Sequence[SavedRun]) -> int:
    """The largest step every run has reached."""
    return min(run.steps_done for run in runs)


def least_time(runs: Sequence[SavedRun]) -> float:
    """The shortest training wall-clock any run needed for its steps."""
    return min(run.train_time_s for run in runs)


@dataclass(frozen=True)
class MeanSpread:
    """Mean and sample standard deviation (0 for one value) of n values."""

    mean: float
    std: float
    n: int


def mean_spread(values: Iterable[float | None]) -> MeanSpread | None:
    """Mean and spread of the values that exist; None when none does."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    std = statistics.stdev(present) if len(present) > 1 else 0.0
    return MeanSpread(statistics.fmean(present), std, len(present))


@dataclass(frozen=True)
class CurvePoint:
    x: float
    mean: float
    std: float


def mean_curve(eval_lists: Sequence[Sequence[EvalPoint]], by: Axis) -> list[CurvePoint]:
    """The seed-mean step-wise accuracy at every x where some seed was evaluated, from the first x
    at which every evaluated seed has been. Seeds without evaluations are left out."""
    evaluated = [evals for evals in eval_lists if evals]
    xs = sorted({point.at(by) for evals in evaluated for point in evals})
    curve = []
    for x in xs:
        values = [accuracy_at(evals, x, by) for evals in evaluated]
        if None in values:
            continue
        spread = mean_spread(values)
        curve.append(CurvePoint(x, spread.mean, spread.std))
    return curve


def time_to_reach(curve: Sequence[CurvePoint], target: float) -> float | None:
    """x of the first curve point from which accuracy >= target holds (at it and at every later
    point); None when never. Callers leave step-0 evaluations out of the curve."""
    reached = None
    for point in curve:
        if point.mean >= target - ACCURACY_TOLERANCE:
            reached = point.x if reached is None else reached
        else:
            reached = None
    return reached


# Student t quantiles for df = 1..30 (past 30 the normal's, within 2%): the two-sided 95% interval's
# t(0.975, df), and t(0.80, df) for 80% power
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
T_80 = (1.376, 1.061, 0.978, 0.941, 0.920, 0.906, 0.896, 0.889, 0.883, 0.879, 0.876, 0.873, 0.870, 0.868, 0.866,
        0.865, 0.863, 0.862, 0.861, 0.860, 0.859, 0.858, 0.858, 0.857, 0.856, 0.856, 0.855, 0.855, 0.854, 0.854)


def _t(table: tuple[float, ...], normal: float, df: int) -> float:
    return table[df - 1] if df <= len(table) else normal


def t_interval(values: Sequence[float]) -> Interval | None:
    """Mean of per-seed values with its 95% t interval, mean +- t(0.975, n-1) s / sqrt(n); None for
    fewer than 2 values."""
    n = len(values)
    if n < 2:
        return None
    mean, half = statistics.fmean(values), _t(T_975, 1.960, n - 1) * statistics.stdev(values) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half)


def ratio_interval(ratios: Sequence[float]) -> Interval | None:
    """The paired ratio over seeds (docs/frontiers.md, "Work ratio"): the geometric mean of per-seed
    ratios with the t interval of their logs, exp(mean log r +- t(0.975, n-1) s_log / sqrt(n)), so that
    the inverse ratio is exactly 1/value [1/hi, 1/lo]; None for fewer than 2."""
    logs = t_interval([math.log(r) for r in ratios])
    return None if logs is None else Interval(math.exp(logs.value), math.exp(logs.lo), math.exp(logs.hi))


def detectable_effect(differences: Sequence[float]) -> float | None:
    """The smallest true mean difference a two-sided 5% t test over these paired differences detects
    with 80% power: (t(0.975, n-1) + t(0.80, n-1)) s / sqrt(n); None for fewer than 2."""
    n = len(differences)
    if n < 2:
        return None
    return (_t(T_975, 1.960, n - 1) + _t(T_80, 0.842, n - 1)) * statistics.stdev(differences) / math.sqrt(n)


def non_inferiority(difference: Interval | None, margin: float) -> str | None:
    """The verdict at margin `margin` (same units as the difference) from its interval."""
    if difference is None:
        return None
    if difference.lo > -margin:
        return "non-inferior"
    if difference.hi < -margin:
        return "inferior"
    return "inconclusive"


def group_stream(seed: int, group: RunGroup) -> np.random.Generator:
    """The group's own random stream: the same whatever order its runs and the others were given in."""
    return np.random.default_rng([seed, zlib.crc32("|".join(sorted(run.name for run in group.runs)).encode())])


def paired_by_seed(runs: Sequence[SavedRun], base: Sequence[SavedRun]) -> list[tuple[SavedRun, SavedRun]]:
    """(run, baseline run) of each seed both groups ran, in seed order."""
    theirs = {run.seed: run for run in base}
    return [(run, theirs[run.seed]) for run in sorted(runs, key=lambda r: r.seed) if run.seed in theirs]


def last_evaluation_within(run: SavedRun, budget: float, unit: str) -> float | None:
    """Avg@k of the run's last evaluation whose training clock (unit "train_time_s") or cumulative
    work by its step (a WORK unit) is within `budget`; None when none is."""
    within = [e for e in run.evals if (e.train_time_s if unit == "train_time_s" else run.work_by(e.step)[unit])
              <= budget + ACCURACY_TOLERANCE]
    return within[-1].avg_at_k if within else None


@dataclass
class SeedComparison:
    """Against the baseline, paired by seed: differences and ratios with their t intervals."""

    seeds: list[int]
    final: Interval | None  # this group's final Avg@k over seeds
    difference: Interval | None  # final minus the baseline's
    detectable: float | None  # the smallest difference these seeds could detect
    clock_ratio: list[float]  # per seed: the baseline's training clock / this one's (whole runs)
    clock_ratio_interval: Interval | None  # ratio_interval(clock_ratio)
    work_ratio: dict[str, Interval]  # per WORK key: ratio_interval of the baseline's work / this one's (whole runs)
    equal_clock: Interval | None  # last evaluation within the baseline's clock minus the baseline's last
    equal_work: Interval | None  # the same within the baseline's work (`work_unit`)
    work_unit: str
    verdict: str | None = None  # non-inferiority at the margin given


def compare_by_seed(runs: Sequence[SavedRun], base: Sequence[SavedRun], work_unit: str = "env_steps",
                    margin: float | None = None) -> SeedComparison:
    """The paired-by-seed figures of a group against the baseline group (module docstring)."""
    pairs = [(a, b) for a, b in paired_by_seed(runs, base) if a.final and b.final]
    differences = [a.final.avg_at_k - b.final.avg_at_k for a, b in pairs]
    finals = [run.final.avg_at_k for run in runs if run.final]

    def equal_budget(unit: str) -> Interval | None:
        values = [(last_evaluation_within(a, b.train_time_s if unit == "train_time_s" else b.work_by(math.inf)[unit],
                                          unit), b.evals[-1].avg_at_k) for a, b in pairs if b.evals]
        return t_interval([mine - theirs for mine, theirs in values if mine is not None])

    clock = [b.train_time_s / a.train_time_s for a, b in pairs if a.train_time_s > 0 and b.train_time_s > 0]
    work = {key: ratio_interval([b.work_by(math.inf)[key] / a.work_by(math.inf)[key] for a, b in pairs
                                 if a.work_by(math.inf)[key] > 0 and b.work_by(math.inf)[key] > 0]) for key in WORK}
    difference = t_interval(differences)
    return SeedComparison(
        seeds=[a.seed for a, _ in pairs], final=t_interval(finals), difference=difference,
        detectable=detectable_effect(differences), clock_ratio=clock, clock_ratio_interval=ratio_interval(clock),
        work_ratio={key: interval for key, interval in work.items() if interval is not None},
        equal_clock=equal_budget("train_time_s"), equal_work=equal_budget(work_unit), work_unit=work_unit,
        verdict=non_inferiority(difference, margin) if margin is not None else None)


def percentile_interval(values: Sequence[float]) -> tuple[float, float]:
    """The central CONFIDENCE interval of bootstrap values (numpy's linear percentiles)."""
    lo, hi = np.percentile(np.asarray(values, dtype=float), [50 * (1 - CONFIDENCE), 50 * (1 + CONFIDENCE)])
    return float(lo), float(hi)


@dataclass(frozen=True)
class Interval:
    value: float
    lo: float
    hi: float


def _task_matrix(finals: Sequence[EvalPoint]) -> tuple[list[str], np.ndarray]:
    """Tasks every seed's final evaluation scored, and their scores [seeds, tasks]."""
    tasks = sorted(set.intersection(*(set(f.per_task) for f in finals))) if finals else []
    return tasks, np.array([[f.per_task[t] for t in tasks] for f in finals], dtype=float)


def bootstrap_accuracy(finals: Sequence[EvalPoint], rng: np.random.Generator) -> Interval | None:
    """A group's final Avg@k (mean over seeds of each seed's task mean) with the interval from
    resampling tasks and seeds; None without per-task scores."""
    tasks, scores = _task_matrix(finals)
    if not tasks:
        return None
    n_seeds, n_tasks = scores.shape
    stats = [scores[rng.integers(n_seeds, size=n_seeds)][:, rng.integers(n_tasks, size=n_tasks)].mean()
             for _ in range(BOOTSTRAP)]
    return Interval(float(scores.mean()), *percentile_interval(stats))


def bootstrap_difference(finals: dict[Any, EvalPoint], base: dict[Any, EvalPoint],
                         rng: np.random.Generator) -> Interval | None:
    """Final Avg@k minus the baseline's, paired by task (both resample the same tasks) and by seed
    when both groups ran the same seeds (keys); None without shared per-task scores."""
    tasks_a, _ = _task_matrix(list(finals.values()))
    tasks_b, _ = _task_matrix(list(base.values()))
    tasks = sorted(set(tasks_a) & set(tasks_b))
    if not tasks:
        return None
    a = np.array([[f.per_task[t] for t in tasks] for f in finals.values()])
    b = np.array([[f.per_task[t] for t in tasks] for f in base.values()])
    paired_seeds = list(finals) == list(base)
    stats = []
    for _ in range(BOOTSTRAP):
        cols = rng.integers(len(tasks), size=len(tasks))
        rows_a = rng.integers(len(a), size=len(a))
        rows_b = rows_a if paired_seeds else rng.integers(len(b), size=len(b))
        stats.append(a[rows_a][:, cols].mean() - b[rows_b][:, cols].mean())
    return Interval(float(a.mean() - b.mean()), *percentile_interval(stats))


def reach_curve(runs: Sequence[SavedRun], by: Axis) -> list[CurvePoint]:
    """The seed-mean curve without the step-0 evaluations (a start never counts as reaching)."""
    return mean_curve([[e for e in run.evals if e.step > 0] for run in runs], by)


def reach(runs: Sequence[SavedRun], target: float) -> tuple[float | None, dict[str, float] | None]:
    """(training time, mean cumulative work by that step) when the seed-mean curve reaches the
    target and holds it; (None, None) when it never does."""
    time = time_to_reach(reach_curve(runs, "time"), target)
    step = time_to_reach(reach_curve(runs, "step"), target)
    if time is None or step is None:
        return None, None
    works = [run.work_by(step) for run in runs]
    return time, {key: statistics.fmean(w[key] for w in works) for key in WORK}


def bootstrap_ratios(runs: Sequence[SavedRun], base: Sequence[SavedRun], target: float,
                     rng: np.random.Generator) -> dict[str, list[float]]:
    """Resampled (seeds of each group) speedup ("time") and work ratios (per WORK key): each the
    baseline's cost to reach the target over the run's; a resample where either never reaches it
    gives no value (its share not reached is then the missing ones)."""
    out: dict[str, list[float]] = defaultdict(list)
    for _ in range(BOOTSTRAP):
        mine = [runs[i] for i in rng.integers(len(runs), size=len(runs))]
        theirs = [base[i] for i in rng.integers(len(base), size=len(base))]
        (t_a, w_a), (t_b, w_b) = reach(mine, target), reach(theirs, target)
        if t_a is None or t_b is None:
            continue
        if t_a > 0:
            out["time"].append(t_b / t_a)
        for key in WORK:
            if w_a[key] > 0:
                out[key].append(w_b[key] / w_a[key])
    return out


def speedup(baseline_time: float | None, run_time: float | None) -> float | None:
    """baseline_time / run_time; None when either never reached the target. A run that starts at the
    target (time 0) is infinitely faster, unless the baseline did as well (1x)."""
    if baseline_time is None or run_time is None:
        return None
    if run_time == 0:
        return 1.0 if baseline_time == 0 else math.inf
    return baseline_time / run_time


def pareto_front(points: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (x, accuracy) points that no other point beats (x <= and accuracy >=, one strictly),
    sorted by x; duplicates appear once."""
    front: list[tuple[float, float]] = []
    for x, acc in sorted(set(points), key=lambda p: (p[0], -p[1])):
        if not front or acc > front[-1][1]:
            front.append((x, acc))
    return front


def _pooled_shares(runs: Sequence[SavedRun], field: str) -> dict[str, float]:
    """Share of the pooled training clock of each entry of the train records' `field`."""
    total = sum(run.train_time_s for run in runs)
    if total <= 0:
        return {}
    seconds: dict[str, float] = {}
    for run in runs:
        for record in run.train:
            for name, s in getattr(record, field).items():
                if name not in EXCLUDED_FROM_TRAINING:
                    seconds[name] = seconds.get(name, 0.0) + s
    return {name: s / total for name, s in seconds.items()}


def phase_shares(runs: Sequence[SavedRun]) -> dict[str, float]:
    """Share of the pooled training clock per ledger phase (eval and checkpoint are outside it);
    "other" is what no phase covers (loop overhead)."""
    shares = _pooled_shares(runs, "phases")
    if shares:
        shares["other"] = max(0.0, 1.0 - sum(shares.values()))
    return shares


def busy_shares(runs: Sequence[SavedRun]) -> dict[str, float]:
    """Share of the pooled training clock each resource (generation, env, teacher, trainer) was busy;
    resources work at the same time, so the shares overlap and may add up to more than 100%."""
    return _pooled_shares(runs, "busy")


def mean_of_field(runs: Sequence[SavedRun], key: str) -> float | None:
    """Mean over all train records of the runs of a numeric field (missing, None or NaN skipped)."""
    values = [getattr(r, key) for run in runs for r in run.train]
    numbers = [float(v) for v in values if isinstance(v, int | float) and math.isfinite(v)]
    return statistics.fmean(numbers) if numbers else None


def turn_kl_bands(runs: Sequence[SavedRun], width: int, signal: str | None = None) -> list[float]:
    """The per-turn KL profile (or, with `signal`, that familiarity signal's profile in
    `turn_signal_profiles`) in bands of `width` turns (turns [0, width), [width, 2 width), ...): for
    band b, the mean over the runs' train records of their profile entries t with
    b * width <= t < (b + 1) * width (an entry is turn t's mean over the trajectories that reached
    it). As many bands as the deepest profile needs."""
    by_band: dict[int, list[float]] = defaultdict(list)
    for run in runs:
        for record in run.train:
            profile = record.turn_kl_profile if signal is None else record.turn_signal_profiles.get(signal)
            for t, value in enumerate(profile or []):
                by_band[t // width].append(value)
    return [statistics.fmean(by_band[b]) if by_band[b] else math.nan for b in range(max(by_band, default=-1) + 1)]


# ---- groups and the comparison ----------------------------------------------------------------------


@dataclass
class RunGroup:
    """The seeds of one method and recipe (one run when it has no siblings)."""

    label: str
    method: str
    runs: list[SavedRun]

    def curve(self, by: Axis) -> list[CurvePoint]:
        return mean_curve([run.evals for run in self.runs], by)


def mixed_builds(runs: Sequence[SavedRun]) -> list[str]:
    """One line per model folder that the runs name with more than one weights fingerprint (start
    records' `models`), and one if they ran more than one build of the code (`code`): runs of different
    builds are not paired replicates, however alike their configs (runs without fingerprints, older
    ones, are not checked)."""
    builds: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for run in sorted(runs, key=lambda run: run.name):  # the lines do not follow the folders' order
        for role, model in run.models.items():
            if model.get("weights"):
                builds[f"{role} {model['path']}"][model["weights"]].append(run.name)
        if run.code:
            builds["the code"][run.code].append(run.name)
    return [f"{what} has {len(by_build)} builds among these runs: "
            + "; ".join(f"{build} in {', '.join(names)}" for build, names in by_build.items())
            for what, by_build in builds.items() if len(by_build) > 1]


def group_runs(runs: Sequence[SavedRun]) -> list[RunGroup]:
    """Groups sorted by label, seeds in order, whatever the order of `runs`. Runs of one method and
    recipe whose seeds repeat (or are unknown) are not replicates and stay single. Labels
    (group_labels) come from the runs' methods and names, never from their position."""
    folders = [run.path.resolve() for run in runs]
    if len(set(folders)) < len(folders):
        twice = sorted({str(f) for f in folders if folders.count(f) > 1})
        raise FrontierError(f"run folders given twice: {', '.join(twice)}")
    grouped: dict[tuple[str, str | None], list[SavedRun]] = {}
    for run in runs:
        grouped.setdefault((run.method, run.recipe_key), []).append(run)
    replicate_sets: list[list[SavedRun]] = []
    for members in grouped.values():
        seeds = [run.seed for run in members]
        if None in seeds or len(set(seeds)) < len(seeds):  # not seed replicates: compare them one by one
            replicate_sets += [[run] for run in members]
        else:
            replicate_sets.append(sorted(members, key=lambda run: run.seed))
    labels = group_labels(replicate_sets)
    return sorted((RunGroup(label, members[0].method, members) for label, members in zip(labels, replicate_sets,
                                                                                         strict=True)),
                  key=lambda group: group.label)


def group_labels(replicate_sets: Sequence[Sequence[SavedRun]]) -> list[str]:
    """Each group's label: a single run's name; several seeds' method when no other group has that
    method, else their names' common stem (equal_budget-vanilla_opd for equal_budget-vanilla_opd-s0..s7).
    Labels that still coincide get their group's first run folder appended."""
    methods = [members[0].method for members in replicate_sets]
    labels = [members[0].name if len(members) == 1 else
              members[0].method if methods.count(members[0].method) == 1 else name_stem(members)
              for members in replicate_sets]
    return [f"{label} ({members[0].path})" if labels.count(label) > 1 else label
            for label, members in zip(labels, replicate_sets, strict=True)]


def name_stem(runs: Sequence[SavedRun]) -> str:
    """What the runs' names share: each name without its "-s<seed>" suffix when those agree, else
    their common prefix (without trailing separators), else the method."""
    stems = {re.sub(rf"[-_]s?{run.seed}$", "", run.name) for run in runs}
    if len(stems) == 1:
        return stems.pop()
    return os.path.commonprefix([run.name for run in runs]).rstrip("-_ ") or runs[0].method


def resolve_baseline(groups: Sequence[RunGroup], choice: str | None) -> RunGroup:
    """The group named by `choice` (a group label, a run name, or a method only one group has); by
    default the vanilla OPD group, or with none the first group by label. Several groups matching
    (the choice, or vanilla OPD by default) are refused, with their labels."""
    if choice is None:
        vanilla = [g for g in groups if g.method == DEFAULT_BASELINE_METHOD]
        if len(vanilla) > 1:
            raise FrontierError(f"several {DEFAULT_BASELINE_METHOD} groups ({', '.join(g.label for g in vanilla)}); "
                                "name the baseline with --baseline")
        return vanilla[0] if vanilla else groups[0]
    matches = [g for g in groups if choice == g.label or any(choice == r.name for r in g.runs)]
    if not matches:
        matches = [g for g in groups if choice == g.method]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        allowed = sorted({g.label for g in groups} | {g.method for g in groups}
                         | {r.name for g in groups for r in g.runs})
        raise FrontierError(f"baseline {choice!r} is none of the compared runs or methods; "
                            f"allowed: {', '.join(allowed)}")
    labels = ", ".join(g.label for g in matches)
    raise FrontierError(f"baseline {choice!r} matches several groups ({labels}); name one of them")


@dataclass
class GroupSummary:
    group: RunGroup
    final: MeanSpread | None  # Avg@k of each seed's last evaluation
    same_step: MeanSpread | None
    least_time: MeanSpread | None
    time_to_target_s: float | None  # on the seed-mean curve
    speedup: float | None
    train_time_s: MeanSpread
    mean_cap: float | None
    mean_turns: float | None
    deep_turn_share: float | None
    eval_time_s: float  # mean per seed
    phase_shares: dict[str, float] = field(default_factory=dict)
    busy_shares: dict[str, float] = field(default_factory=dict)
    turn_kl_bands: list[float] = field(default_factory=list)  # turn_kl_bands(members, TURN_BAND)
    turn_signal_bands: dict[str, list[float]] = field(default_factory=dict)  # per familiarity signal logged
    familiarity_kept_share: float | None = None  # mean over steps; None without familiarity.mode weight/gate
    final_interval: Interval | None = None  # bootstrap over tasks and seeds
    difference: Interval | None = None  # final minus the baseline's, paired
    speedup_interval: tuple[float, float] | None = None  # over seeds
    reached_share: float | None = None  # of the speedup's resamples, those where both reached the target
    work: dict[str, float] = field(default_factory=dict)  # per seed, the whole run
    work_ratio: dict[str, Interval] = field(default_factory=dict)  # the baseline's work to target / this one's
    teacher: float | None = None
    by_seed: SeedComparison | None = None  # paired by seed against the baseline (None for the baseline)


@dataclass
class Comparison:
    rows: list[GroupSummary]
    baseline: RunGroup
    same_step: int
    least_time_s: float
    least_time_run: str  # the run that set the Least-Time point
    target: float | None  # the baseline's last evaluation along the way (seed mean)
    baseline_time_s: float | None  # when the baseline first reached it
    margin: float | None = None  # the non-inferiority margin given (Avg@k units, 0..1)


def compare(runs: Sequence[SavedRun], baseline: str | None = None, seed: int = 0, margin: float | None = None,
            work_unit: str = "env_steps") -> Comparison:
    """Every figure of the frontier tables, for the runs grouped by method and recipe (intervals
    from bootstrap resamples drawn with `seed`, a stream per group); `margin` (Avg@k units) gives
    each group a non-inferiority verdict against the baseline, `work_unit` the equal-work budget's unit."""
    if not runs:
        raise FrontierError("no runs to compare")
    groups = group_runs(runs)
    base = resolve_baseline(groups, baseline)
    step_point, time_point = same_step(runs), least_time(runs)
    fastest = min(runs, key=lambda run: (run.train_time_s, run.name))
    # the target is on the curve's own metric (the last evaluation along the way, e.g. greedy Avg@1),
    # not the final sampled Avg@k, which may be another k and temperature
    base_last = mean_spread(run.evals[-1].avg_at_k if run.evals else None for run in base.runs)
    target = base_last.mean if base_last else None
    base_time, base_work = reach(base.runs, target) if target is not None else (None, None)
    base_finals = {run.seed: run.final for run in base.runs if run.final}

    rows = []
    for group in groups:
        members, rng = group.runs, group_stream(seed, group)
        reach_time, reach_work = reach(members, target) if target is not None else (None, None)
        ratios = bootstrap_ratios(members, base.runs, target, rng) if target is not None and group is not base else {}
        finals = {run.seed: run.final for run in members if run.final}
        work_ratio = {}
        if reach_work is not None and base_work is not None:
            work_ratio = {key: Interval(base_work[key] / reach_work[key], *percentile_interval(ratios[key]))
                          for key in WORK if reach_work[key] > 0 and ratios.get(key)}
        rows.append(GroupSummary(
            group=group,
            final=mean_spread(run.final.avg_at_k if run.final else None for run in members),
            same_step=mean_spread(accuracy_at(run.evals, step_point, "step") for run in members),
            least_time=mean_spread(accuracy_at(run.evals, time_point, "time") for run in members),
            time_to_target_s=reach_time,
            speedup=speedup(base_time, reach_time),
            train_time_s=mean_spread(run.train_time_s for run in members),
            mean_cap=mean_of_field(members, "rollout_depth_cap"),
            mean_turns=mean_of_field(members, "mean_turns"),
            deep_turn_share=mean_of_field(members, "deep_turn_share"),
            eval_time_s=statistics.fmean(run.eval_time_s for run in members),
            phase_shares=phase_shares(members), busy_shares=busy_shares(members),
            turn_kl_bands=turn_kl_bands(members, TURN_BAND),
            turn_signal_bands={name: turn_kl_bands(members, TURN_BAND, name) for name in logged_signals(members)},
            familiarity_kept_share=mean_of_field(members, "familiarity_kept_share"),
            final_interval=bootstrap_accuracy(list(finals.values()), rng),
            difference=bootstrap_difference(finals, base_finals, rng) if group is not base else None,
            speedup_interval=percentile_interval(ratios["time"]) if ratios.get("time") else None,
            reached_share=len(ratios.get("time", [])) / BOOTSTRAP if ratios else None,
            work={key: statistics.fmean(run.work_by(math.inf)[key] for run in members) for key in WORK},
            work_ratio=work_ratio,
            teacher=mean_of_values(run.teacher for run in members),
            by_seed=compare_by_seed(members, base.runs, work_unit, margin) if group is not base else None,
        ))
    return Comparison(rows, base, step_point, time_point, fastest.name, target, base_time, margin)


def logged_signals(runs: Sequence[SavedRun]) -> list[str]:
    """The familiarity signals the runs' train records carry profiles of."""
    return sorted({name for run in runs for record in run.train for name in record.turn_signal_profiles})


def mean_of_values(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None
