"""`turnopd judge bench RECIPE`: how often a judge picks, before running them, the change that helps
(Rehearse's pairwise benchmark), measured on pairs whose outcomes the env itself gives; and `turnopd
judge play RECIPE`: the recipe's student with and without a judge on the held-out tasks.

The benchmark (for an env whose steps report a metric, envs.base.MetricReader: autoresearch):
1. Walks. On each task of the split, `walks` seeded walks start from its starting setup; at a state
   every single change (the env's admissible actions but submit) is run in the env (memoised: an
   exact oracle), then the walk tries changes in a random order, each try an attempt of the memory,
   until one helps (kept: depth + 1) or none does (the walk ends), up to `max_depth` kept changes.
2. Pairs. At each state, up to `pairs_per_state` pairs (a change that helped, one that did not),
   drawn round-robin over the bands of their metric difference (|diff| < 2, 2-5, >= 5 points).
3. Judges. Each judge and memory mode asks each pair in both orders (strict consensus); its memory is
   the walk's attempts before the state (same task, nothing later).
Reported per arm and depth (0, 1, 2, >= 3 changes kept) and per band: selective accuracy (right
verdicts / verdicts, a Wilson 95% interval) and coverage (verdicts / pairs); the mean over the tasks
with its t interval (pairs of a task share its states: the task is the honest unit); and the cliff
(Rehearse's: selective accuracy once >= 2 successful changes have accumulated before the pair against
0-1), stratified by difference band so that a depth where the changes differ less cannot pass for one.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, astuple, dataclass, field
from pathlib import Path
from typing import Any

from envs import make_env_spec
from envs.base import EnvSpec, MetricReader
from teachers import load_teacher_spec, make_teacher
from turnopd.algorithm.judge import Attempt, Decision, consensus, memory_lines
from turnopd.analysis.audit import wilson_interval
from turnopd.config import RecipeError, RunConfig
from turnopd.core.progress import progress_bar
from turnopd.orchestration.sft import build_missing_teacher
from turnopd.rollout.judge import make_judge

BANDS = ((0.0, 2.0, "<2"), (2.0, 5.0, "2-5"), (5.0, float("inf"), ">=5"))  # |metric difference|, points
DEPTHS = ("0", "1", "2", ">=3")
EARLY = ("0", "1")  # successful changes accumulated before the pair: the cliff compares these with the rest


@contextmanager
def counter(label: str, total: int) -> Iterator[Callable[[], None]]:
    """A rich bar with rate and ETA; yields the function that advances it (a log file gets a line per 10%)."""
    progress = progress_bar(label, "")
    done, start = 0, time.monotonic()

    def advance() -> None:
        nonlocal done
        done += 1
        progress.update(bar, advance=1)
        if not progress.console.is_terminal and done % max(1, total // 10) == 0:
            elapsed = time.monotonic() - start
            progress.console.print(f"{label}: {done}/{total}, {done / elapsed:.2f}/s, {elapsed:.0f} s, "
                                   f"ETA {elapsed / done * (total - done):.0f} s")

    with progress:
        bar = progress.add_task(label, total=total)
        yield advance


def depth_label(depth: int) -> str:
    return DEPTHS[min(depth, 3)]


def band_label(difference: float) -> str:
    return next(label for lo, hi, label in BANDS if lo <= abs(difference) < hi)


@dataclass
class State:
    """A walk's state: the task, its kept changes (`path`), the env's observation there, the walk's
    attempts before it, and every single change's reading (change -> (metric, helped))."""

    task_id: str
    walk: int
    path: list[str]
    goal: str
    first_observation: str
    history: list[tuple[str, str]]
    observation: str
    memory: list[Attempt]
    results: dict[str, tuple[float, bool, float]] = field(default_factory=dict)  # change -> (metric, helped, diff)

    @property
    def depth(self) -> int:
        return len(self.path)


@dataclass(frozen=True)
class Pair:
    state: int  # index into the states
    good: str  # the change that helped
    bad: str  # the change that did not
    difference: float  # good's metric - bad's metric


def play_path(env: Any, task_id: str, path: list[str]) -> tuple[Any, list[tuple[str, str]]]:
    """The env at the state `path` (kept changes) leads to: the last outcome and the (observation,
    action) history."""
    outcome, history = env.reset(task_id), []
    for action in path:
        history.append((outcome.observation, action))
        outcome = env.step(action)
    return outcome, history


def build_states(spec: EnvSpec, tasks: list[str], walks: int, max_depth: int, seed: int,
                 advance: Callable[[], None] = lambda: None) -> list[State]:
    """The walks' states, every change of each one run (see the module docstring)."""
    env = spec.make()
    states: list[State] = []
    try:
        for task_id in tasks:
            for walk in range(walks):
                rng = random.Random(f"judge-bench/{seed}/{task_id}/{walk}")
                reset = env.reset(task_id)
                goal, first = reset.info.get("task", ""), reset.observation
                path: list[str] = []
                memory: list[Attempt] = []
                while True:
                    at, history = play_path(env, task_id, path)
                    state = State(task_id, walk, list(path), goal, first, history, at.observation, list(memory))
                    changes = [a for a in at.admissible or [] if a != "submit"]
                    for change in changes:
                        reading = spec.read_metric(play_path(env, task_id, [*path, change])[0].observation)
                        if reading is not None and reading.change is not None:
                            state.results[change] = (reading.metric, reading.helps, reading.change)
                    states.append(state)
                    advance()
                    if len(path) == max_depth:
                        break
                    rng.shuffle(changes)
                    kept = None
                    for change in changes:
                        if change not in state.results:
                            continue
                        metric, helped, diff = state.results[change]
                        memory.append(Attempt(task_id, change, metric - diff, metric, helped, (0, len(memory))))
                        if helped:
                            kept = change
                            break
                    if kept is None:
                        break
                    path.append(kept)
    finally:
        env.close()
    return states


def sample_pairs(states: list[State], per_state: int, seed: int) -> list[Pair]:
    """Up to `per_state` (helped, did not) pairs per state, round-robin over the difference bands."""
    pairs = []
    for i, state in enumerate(states):
        rng = random.Random(f"judge-bench-pairs/{seed}/{i}")
        good = [c for c, (_, helped, _) in state.results.items() if helped]
        bad = [c for c, (_, helped, _) in state.results.items() if not helped]
        by_band: dict[str, list[Pair]] = defaultdict(list)
        for g in good:
            for b in bad:
                diff = state.results[g][0] - state.results[b][0]
                by_band[band_label(diff)].append(Pair(i, g, b, diff))
        for band in by_band.values():
            rng.shuffle(band)
        chosen: list[Pair] = []
        while len(chosen) < per_state and any(by_band.values()):
            for _, _, label in BANDS:
                if by_band[label] and len(chosen) < per_state:
                    chosen.append(by_band[label].pop())
        pairs += chosen
    return pairs


async def judge_pairs(by: Any, memory_mode: str, states: list[State], pairs: list[Pair], threshold: float,
                      limit: int, advance: Callable[[], None] = lambda: None) -> tuple[list[bool | None], float | None]:
    """Per pair: None (no consensus) or whether the verdict is the change that helped; and the share of
    the ordered picks that chose the change shown first (0.5 for no position bias; 1 or 0: all one side)."""
    out: list[bool | None] = []
    first = made = 0
    for pair in pairs:
        state = states[pair.state]
        candidates = [pair.good, pair.bad]
        # state.memory is the walk's tries before the state, ordered (0, n): (1,) comes after all of them
        lines = memory_lines(memory_mode, state.memory, state.task_id, (1,), candidates, threshold, limit)
        decision = Decision(state.task_id, pair.state, state.goal, state.first_observation, state.history,
                            state.observation, (0, state.depth))
        picks = await by.picks(decision, candidates, lines)
        first += (picks[(0, 1)] == 0) + (picks[(1, 0)] == 1)
        made += (picks[(0, 1)] is not None) + (picks[(1, 0)] is not None)
        vote = consensus(picks[(0, 1)], picks[(1, 0)])
        out.append(None if vote is None else vote == 0)
        advance()
    return out, first / made if made else None


def summarize(verdicts: list[bool | None], keys: list[str], labels: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Per label: pairs, verdicts, right, coverage, selective accuracy and its Wilson interval."""
    rows = {}
    for label in (*labels, "all"):
        chosen = [v for v, k in zip(verdicts, keys, strict=True) if label in ("all", k)]
        decided = [v for v in chosen if v is not None]
        right = sum(decided)
        rows[label] = {"pairs": len(chosen), "verdicts": len(decided), "right": right,
                       "coverage": len(decided) / len(chosen) if chosen else None,
                       "selective_accuracy": right / len(decided) if decided else None,
                       "interval": wilson_interval(right, len(decided))}
    return rows


def task_interval(by_task: dict[str, dict[str, Any]], tasks: list[str]) -> dict[str, float] | None:
    """The mean of the tasks' selective accuracies with its 95% t interval over tasks (None with fewer
    than 2 tasks that have a verdict)."""
    from turnopd.analysis.frontier import t_interval

    values = [by_task[t]["selective_accuracy"] for t in tasks if by_task[t]["selective_accuracy"] is not None]
    interval = t_interval(values)
    return None if interval is None else {"mean": interval.value, "lo": interval.lo, "hi": interval.hi,
                                          "min": min(values), "max": max(values), "tasks": len(values)}


def band_counts(right: list[bool | None], late: list[bool], bands: list[str]) -> Any:
    """Per band (BANDS order) and side (early, late): right verdicts and verdicts, an int array [3, 2, 2]."""
    import numpy as np

    counts = np.zeros((len(BANDS), 2, 2), dtype=np.int64)
    index = {label: i for i, (_, _, label) in enumerate(BANDS)}
    for v, is_late, band in zip(right, late, bands, strict=True):
        if v is not None:
            counts[index[band], int(is_late)] += (int(v), 1)
    return counts


def counts_difference(counts: Any) -> float | None:
    """Late minus early selective accuracy, stratified by difference band: per band b with verdicts both
    early and late, d_b = right_late,b / verdicts_late,b - right_early,b / verdicts_early,b, averaged
    with weights w_b = verdicts_early,b + verdicts_late,b; None when no band has both."""
    total = weight = 0.0
    for (right_early, early), (right_late, late) in counts:
        if early and late:
            total += (early + late) * (right_late / late - right_early / early)
            weight += early + late
    return float(total / weight) if weight else None


def band_weighted_difference(right: list[bool | None], late: list[bool], bands: list[str]) -> float | None:
    """counts_difference of the pairs' verdicts (right: None for no verdict; late: >= 2 changes kept)."""
    return counts_difference(band_counts(right, late, bands))


def cliff(right: list[bool | None], depths: list[str], bands: list[str], tasks: list[str],
          seed: int = 0) -> dict[str, Any]:
    """The confidence cliff: selective accuracy early (0-1 changes kept before the pair) and late (>= 2),
    and late - early stratified by band (band_weighted_difference) with its 95% percentile interval from
    resampling the tasks (a resample with no band judged on both sides gives no value; their count is
    kept)."""
    import numpy as np

    from turnopd.analysis.frontier import BOOTSTRAP, percentile_interval

    late = [d not in EARLY for d in depths]
    sides = {name: [v for v, is_late in zip(right, late, strict=True) if v is not None and is_late == side]
             for name, side in (("early", False), ("late", True))}
    names = sorted(set(tasks))
    per_task = np.stack([band_counts(*zip(*[(v, lt, b) for v, lt, b, t in zip(right, late, bands, tasks, strict=True)
                                            if t == name], strict=True)) for name in names])
    rng, stats = np.random.default_rng(seed), []
    for _ in range(BOOTSTRAP):
        value = counts_difference(per_task[rng.integers(len(names), size=len(names))].sum(axis=0))
        if value is not None:
            stats.append(value)
    difference = band_weighted_difference(right, late, bands)
    return {**{f"{name}_verdicts": len(v) for name, v in sides.items()},
            **{name: sum(v) / len(v) if v else None for name, v in sides.items()},
            "difference": difference,
            "interval": percentile_interval(stats) if difference is not None and stats else None,
            "resamples_without_value": BOOTSTRAP - len(stats)}


def builds(models: dict[str, Any]) -> dict[str, Any]:
    """What made a report's numbers: the code's fingerprint and each model folder's weights' (as a run's
    start record has them), so that reports of two builds are told apart."""
    from turnopd.core.source import code_build
    from turnopd.models import folder_builds

    return {"code": code_build(), "models": folder_builds(models)}


def open_judges(cfg: RunConfig, spec: EnvSpec, bys: list[str], world_model: str | None
                ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The judges by name, and the model folders they read (role -> path)."""
    judges: dict[str, Any] = {}
    models: dict[str, Any] = {}
    if {"teacher", "teacher_policy"} & set(bys):
        teacher_spec = load_teacher_spec(cfg.teachers[cfg.env.name])
        build_missing_teacher(teacher_spec)  # from its sft_recipe, as `turnopd distill` does
        teacher = make_teacher(teacher_spec)
        models["teacher"] = teacher_spec.model
        judges |= {by: make_judge(by, cfg, spec, teacher, None) for by in bys if by != "world_model"}
    if "world_model" in bys:
        from turnopd.config import PolicyConfig
        from turnopd.rollout.world_model_pool import WorldModelPool, load_world_model

        if world_model is None:
            raise RecipeError("judge bench --by world_model needs a world model: world_model.path or --world-model")
        model, meta = load_world_model(world_model, spec, cfg.env.name, PolicyConfig(temperature=0.0), cfg.seed)
        judges["world_model"] = make_judge("world_model", cfg, spec, None, WorldModelPool(
            spec, None, model, history_length=meta["history_length"],
            max_observation_tokens=meta["max_observation_tokens"], temperature=0.0, seed=cfg.seed))
        models["world_model"] = world_model
    return judges, models


def bench_summary(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every figure of the benchmark's tables, per arm, derived from the report's raw record (each
    pair's depth, band and task; each arm's verdicts), so that a saved report regenerates its tables."""
    pairs, tasks = report["pairs"], report["tasks"]
    depths = [depth_label(p["depth"]) for p in pairs]
    bands = [band_label(p["difference"]) for p in pairs]
    task_ids = [p["task_id"] for p in pairs]
    out = {}
    for arm, raw in report["arms"].items():
        right = raw["right"]
        by_task = summarize(right, task_ids, tuple(tasks))
        out[arm] = {"by_depth": summarize(right, depths, DEPTHS),
                    "by_band": summarize(right, bands, tuple(b[2] for b in BANDS)),
                    "by_task": by_task, "over_tasks": task_interval(by_task, tasks),
                    "cliff": cliff(right, depths, bands, task_ids, report["seed"]),
                    "first_shown_picks": raw["first_shown_picks"]}
    return out


def _cell(row: dict[str, Any]) -> str:
    """Selective accuracy [Wilson 95%] then coverage as verdicts/pairs."""
    if not row["pairs"]:
        return "-"
    if not row["verdicts"]:
        return f"- 0/{row['pairs']}"
    lo, hi = row["interval"]
    return f"{100 * row['selective_accuracy']:.0f}% [{100 * lo:.0f}-{100 * hi:.0f}] {row['verdicts']}/{row['pairs']}"


def _percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def builds_line(report: dict[str, Any]) -> list[str]:
    """The report's builds as a paragraph (none for a report written before they were recorded)."""
    if "code" not in report:
        return []
    models = ", ".join(f"{role} `{m['weights']}`" for role, m in report["models"].items())
    return [f"Builds: code `{report['code']['source']}`; {models}.", ""]


def bench_markdown(report: dict[str, Any], summary: dict[str, dict[str, Any]] | None = None) -> str:
    """The benchmark's tables as Markdown (what `judge bench` prints and a results page embeds):
    by depth with the interval over tasks, the cliff stratified by band, by band. `summary`:
    bench_summary(report), derived here when not given."""
    summary, tasks, pairs = summary or bench_summary(report), report["tasks"], report["pairs"]
    count = lambda key, labels: ", ".join(f"{sum(key(p) == label for p in pairs)} at {label}" for label in labels)  # noqa: E731
    band_names = tuple(b[2] for b in BANDS)
    lines = [*builds_line(report), f"{report['states']} states on {len(tasks)} {report['split']} tasks ({report['walks']} seeded walks a task, up to "
             f"{report['max_depth']} kept changes), {len(pairs)} pairs: by changes kept "
             f"{count(lambda p: depth_label(p['depth']), DEPTHS)}; by |difference| (points) "
             f"{count(lambda p: band_label(p['difference']), band_names)}.", "",
             "Selective accuracy [95% Wilson, pairs as independent] and coverage (verdicts/pairs) by changes kept "
             f"before the pair; the mean over the {len(tasks)} tasks with its 95% t interval (the honest unit):", "",
             "| judge / memory | 0 | 1 | 2 | >= 3 | all | over the tasks | picks of the first shown |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for arm, r in summary.items():
        o = r["over_tasks"]
        over = "-" if o is None else (f"{100 * o['mean']:.1f}% [{100 * o['lo']:.1f}, {100 * o['hi']:.1f}] "
                                      f"({o['tasks']} tasks)")
        lines.append(f"| {arm} | " + " | ".join(_cell(r["by_depth"][d]) for d in (*DEPTHS, "all"))
                     + f" | {over} | {_percent(r['first_shown_picks'])} |")
    lines += ["", "The cliff: selective accuracy with 0-1 successful changes accumulated before the pair (early) "
              "and >= 2 (late); late - early averaged over the difference bands, weighted by their verdicts "
              "(a band counts when judged on both sides), with its 95% interval from resampling the tasks:", "",
              "| judge / memory | early | late | late - early, by band [95%, tasks resampled] | "
              + " | ".join(f"{b}: early -> late" for b in band_names) + " |",
              "| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in band_names) + " |"]
    late = [depth_label(p["depth"]) not in EARLY for p in pairs]
    bands = [band_label(p["difference"]) for p in pairs]
    for arm, r in summary.items():
        c = r["cliff"]
        diff = "-" if c["difference"] is None else (
            f"{100 * c['difference']:+.1f}" + ("" if c["interval"] is None else
                                               f" [{100 * c['interval'][0]:+.1f}, {100 * c['interval'][1]:+.1f}]"))
        per_band = [" -> ".join(f"{_percent(right / verdicts if verdicts else None)} ({verdicts})"
                                for right, verdicts in band)
                    for band in band_counts(report["arms"][arm]["right"], late, bands)]
        lines.append(f"| {arm} | {_percent(c['early'])} ({c['early_verdicts']}) | {_percent(c['late'])} "
                     f"({c['late_verdicts']}) | {diff} | " + " | ".join(per_band) + " |")
    lines += ["", "By |metric difference| of the two changes (points):", "",
              "| judge / memory | " + " | ".join(band_names) + " | all |",
              "| --- | " + " | ".join("---:" for _ in band_names) + " | ---: |"]
    for arm, r in summary.items():
        lines.append(f"| {arm} | " + " | ".join(_cell(r["by_band"][b]) for b in (*band_names, "all")) + " |")
    return "\n".join(lines)


def run_judge_bench(cfg: RunConfig, *, split: str, max_tasks: int | None, walks: int, max_depth: int,
                    pairs_per_state: int, bys: list[str], memories: list[str], world_model: str | None,
                    output: str | None) -> dict[str, Any]:
    """The benchmark of the module docstring; prints its tables and writes them to a JSON file."""
    spec = make_env_spec(cfg.env, cfg.data_dir)
    if not isinstance(spec, MetricReader):
        raise RecipeError(f"judge bench needs an env whose steps report a metric; {cfg.env.name} reports none")
    tasks = spec.tasks(split)[:max_tasks]
    judges, models = open_judges(cfg, spec, bys, world_model or cfg.world_model.path)  # a missing model fails before the jobs
    start = time.monotonic()
    with counter("states", len(tasks) * walks * (max_depth + 1)) as advance:  # at most: a walk may end sooner
        states = build_states(spec, tasks, walks, max_depth, cfg.seed, advance)
    pairs = sample_pairs(states, pairs_per_state, cfg.seed)
    print(f"{len(states)} states on {len(tasks)} {split} tasks, {len(pairs)} pairs "
                  f"({time.monotonic() - start:.0f} s)")
    arms = [(by, m) for by in bys for m in (memories if by == "teacher" else ["none"])]  # the others read none
    results: dict[str, Any] = {}
    with counter("pairs judged", len(arms) * len(pairs)) as advance:
        for by, memory in arms:
            right, first_share = asyncio.run(judge_pairs(judges[by], memory, states, pairs,
                                                         cfg.judge.similarity_threshold, cfg.judge.memory_limit, advance))
            results[f"{by}/{memory}"] = {"right": right, "first_shown_picks": first_share}
    report = {"recipe": cfg.name, "split": split, "tasks": tasks, "walks": walks, "max_depth": max_depth,
              "pairs_per_state": pairs_per_state, "seed": cfg.seed, "states": len(states),
              "pairs": [asdict(p) | {"depth": states[p.state].depth, "task_id": states[p.state].task_id,
                                     "walk": states[p.state].walk} for p in pairs],
              "threshold": cfg.judge.similarity_threshold, "memory_limit": cfg.judge.memory_limit,
              "arms": results, "wall_time_s": time.monotonic() - start, **builds(models)}
    report["summary"] = bench_summary(report)  # the tables' figures, for readers of the JSON
    print(bench_markdown(report, report["summary"]), flush=True)
    path = Path(output or Path(cfg.output_dir) / "judge_bench" / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")
    return report


# judge play's arms: name -> (judge.by, judge.memory); "none" plays the student alone
PLAY_ARMS = {"none": ("none", "none"), "judge": ("teacher", "none"), "focused": ("teacher", "focused"),
             "full": ("teacher", "full"), "summary": ("teacher", "summary"), "policy": ("teacher_policy", "none")}


@dataclass
class Episode:
    """One played episode, read from its attempts: the final improvement (metric points), the real runs
    (jobs), each run's running improvement, whether it won."""

    task_id: str
    seed: int
    improvement: float
    runs: int
    curve: list[float]
    won: bool


def episode_of(spec: EnvSpec, trajectory: Any, seed: int) -> Episode:
    from turnopd.rollout.judge import trajectory_attempts

    curve, total = [], 0.0
    for a in trajectory_attempts(spec, trajectory, 0):
        total += a.after - a.before if a.worked else 0.0
        curve.append(total)
    return Episode(trajectory.task_id, seed, total, len(curve), curve, trajectory.success)


def runs_to_reach(episode: Episode, target: float) -> int | None:
    """The real runs the episode took to reach `target` improvement (None: never)."""
    return next((i + 1 for i, value in enumerate(episode.curve) if value >= target - 1e-9), None)


def play_rows(episodes: dict[str, list[Episode]], clock: dict[str, dict[str, float]]
              ) -> tuple[dict[str, dict[str, Any]], float]:
    """Per arm: the final improvement's mean and 95% t interval, won share, real runs, the paired
    difference against `none` (t over episodes, and t over tasks of each task's mean difference over
    the seeds: a task's episodes share its jobs) with the smallest effect it could detect, the share of
    episodes that reached `none`'s mean final improvement (the target, returned) and their runs to
    reach it."""
    from turnopd.analysis.frontier import detectable_effect, t_interval

    baseline = episodes["none"]
    target = sum(e.improvement for e in baseline) / len(baseline)
    rows = {}
    for arm, played in episodes.items():
        diffs = [e.improvement - b.improvement for e, b in zip(played, baseline, strict=True)]
        per_task: dict[str, list[float]] = defaultdict(list)
        for e, d in zip(played, diffs, strict=True):
            per_task[e.task_id].append(d)
        task_means = [sum(v) / len(v) for v in per_task.values()]
        hit = [r for e in played if (r := runs_to_reach(e, target)) is not None]
        rows[arm] = {"improvement": t_interval([e.improvement for e in played]),
                     "won": sum(e.won for e in played) / len(played), "runs": sum(e.runs for e in played) / len(played),
                     "difference": t_interval(diffs), "detectable": detectable_effect(diffs) if arm != "none" else None,
                     "by_task": t_interval(task_means), "tasks": len(task_means),
                     "detectable_by_task": detectable_effect(task_means) if arm != "none" else None,
                     "reached": len(hit) / len(played), "runs_to_reach": sum(hit) / len(hit) if hit else None,
                     **clock[arm]}
    return rows, target


def play_markdown(report: dict[str, Any]) -> str:
    """judge play's table as Markdown, derived from the report's episodes and clocks (what the command
    prints and a results page embeds)."""
    episodes = {arm: [Episode(**e) for e in played] for arm, played in report["episodes"].items()}
    rows, target = play_rows(episodes, report["clock"])

    def interval(i: Any) -> str:
        return "-" if i is None else f"{i.value:+.2f} [{i.lo:+.2f}, {i.hi:+.2f}]"

    n = len(report["tasks"])
    lines = [*builds_line(report), f"{n} {report['split']} tasks x {report['seeds']} seeds, k = {report['k']} candidates a turn; target "
             f"{target:+.2f} points (none's mean final improvement):", "",
             "| arm | final improvement [95% t] | vs none, by episode [95% t] | vs none, over the tasks [95% t] | "
             "detectable (episodes / tasks) | won | real runs | reached target | runs to reach | judged turns | "
             "verdicts / pairs | overrides | wall s | judge busy s |",
             "| --- |" + " ---: |" * 13]
    for arm, r in rows.items():
        base = arm == "none"
        detectable = "-" if base else " / ".join("-" if d is None else f"{d:.2f}"  # None: fewer than 2 episodes or tasks
                                                 for d in (r["detectable"], r["detectable_by_task"]))
        lines.append(" | ".join([
            f"| {arm}", interval(r["improvement"]), "-" if base else interval(r["difference"]),
            "-" if base else interval(r["by_task"]), detectable, _percent(r["won"]), f"{r['runs']:.1f}",
            _percent(r["reached"]), "-" if r["runs_to_reach"] is None else f"{r['runs_to_reach']:.1f}",
            str(r.get("turns", "-")), f"{r['verdicts']}/{r['pairs']}" if "pairs" in r else "-",
            str(r.get("overrides", "-")), f"{r['wall_s']:.0f}", f"{r.get('judge_s', 0.0):.0f} |"]))
    return "\n".join(lines)


def play_arm(cfg: RunConfig, spec: EnvSpec, pool: Any, policy: Any, tasks: list[str], seeds: int, arm: str,
             teacher: Any, advance: Callable[[], None]) -> tuple[list[Episode], dict[str, float]]:
    """One arm's episodes (each task once per seed, seed s sampling from cfg.seed + 1000 s, a fresh
    memory per seed) and its clock: wall, busy times, judge calls and counts."""
    from turnopd.core.ledger import Ledger
    from turnopd.rollout.agent_loop import POLICY_SAMPLE, rollout
    from turnopd.rollout.base import SamplingParams
    from turnopd.rollout.judge import Judge, JudgeStats, OutcomeMemory

    by, memory = PLAY_ARMS[arm]
    ledger, start, played = Ledger(), time.monotonic(), []
    judge_by = None if by == "none" else make_judge(by, cfg, spec, teacher, None)
    stats = JudgeStats()
    for seed in range(seeds):
        judge = None if judge_by is None else Judge(
            spec, judge_by, k=cfg.judge.k, temperature=cfg.judge.temperature, memory=memory,
            threshold=cfg.judge.similarity_threshold, limit=cfg.judge.memory_limit, outcomes=OutcomeMemory())
        sampling = SamplingParams(temperature=cfg.policy.temperature, top_p=cfg.policy.top_p,
                                  max_new_tokens=cfg.policy.max_new_tokens, stop=tuple(cfg.policy.stop),
                                  seed=cfg.seed + 1000 * seed)
        for t in rollout(spec, pool, policy, tasks, env_config=cfg.env, sampling=sampling, ledger=ledger,
                         actions=judge or POLICY_SAMPLE):
            played.append(episode_of(spec, t, seed))
            advance()
        if judge is not None:
            stats = JudgeStats(*(a + b for a, b in zip(astuple(stats), astuple(judge.stats), strict=True)))
    return played, {"wall_s": time.monotonic() - start, **{f"{r}_s": s for r, s in ledger.busy_totals.items()},
                    "judge_calls": judge_by.calls if judge_by is not None else 0, **asdict(stats)}


def run_judge_play(cfg: RunConfig, *, split: str, max_tasks: int | None, seeds: int, arms: list[str],
                   output: str | None) -> dict[str, Any]:
    """The recipe's student on the split's tasks, once per seed and arm (the same sampling seeds in
    every arm: paired), k candidates a turn under the recipe's judge.k and judge.temperature. Prints per
    arm the final improvement (mean over episodes with a 95% t interval), the won share, the real runs,
    the paired difference against `none` with the smallest effect it could detect, and the runs each
    arm needed to reach `none`'s mean final improvement."""
    from envs.pool import EnvPool
    from turnopd.orchestration.preflight import check_setup
    from turnopd.orchestration.startup import build_missing_models
    from turnopd.rollout.base import make_policy

    unknown = [a for a in arms if a not in PLAY_ARMS]
    if unknown or "none" not in arms:
        raise RecipeError(f"judge play --arms: {unknown or arms}; arms are {', '.join(PLAY_ARMS)}, `none` among them "
                          "(the baseline the others are compared with)")
    setup, _ = check_setup(cfg)
    build_missing_models(cfg, setup)
    spec = setup.spec
    if not isinstance(spec, MetricReader):
        raise RecipeError(f"judge play needs an env whose steps report a metric; {cfg.env.name} reports none")
    tasks = spec.tasks(split)[:max_tasks]
    policy = make_policy(cfg.policy, str(setup.student_path), seed=cfg.seed)
    teacher = make_teacher(setup.teacher_specs[cfg.env.name]) if any(a != "none" for a in arms) else None
    episodes: dict[str, list[Episode]] = {a: [] for a in arms}
    clock: dict[str, dict[str, float]] = {}
    with EnvPool.for_config(spec, cfg.env) as pool, counter("episodes", seeds * len(arms) * len(tasks)) as advance:
        for arm in arms:
            episodes[arm], clock[arm] = play_arm(cfg, spec, pool, policy, tasks, seeds, arm, teacher, advance)
    report = {"recipe": cfg.name, "split": split, "tasks": tasks, "seeds": seeds, "k": cfg.judge.k,
              "temperature": cfg.judge.temperature, "clock": clock,
              **builds({"student": setup.student_path} | {"teacher": setup.teacher_specs[cfg.env.name].model}),
              "episodes": {a: [asdict(e) for e in played] for a, played in episodes.items()}}
    print(play_markdown(report), flush=True)
    path = Path(output or Path(cfg.output_dir) / "judge_play" / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")
    return report
