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
verdicts / verdicts, a Wilson 95% interval) and coverage (verdicts / pairs).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, astuple, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

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


def cell(row: dict[str, Any]) -> str:
    if not row["pairs"]:
        return "-"
    if not row["verdicts"]:
        return f"- 0/{row['pairs']}"
    lo, hi = row["interval"]  # selective accuracy [interval], then coverage as verdicts/pairs
    return f"{100 * row['selective_accuracy']:.0f}% [{100 * lo:.0f}-{100 * hi:.0f}] {row['verdicts']}/{row['pairs']}"


def open_judges(cfg: RunConfig, spec: EnvSpec, bys: list[str], world_model: str | None) -> dict[str, Any]:
    judges: dict[str, Any] = {}
    if {"teacher", "teacher_policy"} & set(bys):
        teacher_spec = load_teacher_spec(cfg.teachers[cfg.env.name])
        build_missing_teacher(teacher_spec)  # from its sft_recipe, as `turnopd distill` does
        teacher = make_teacher(teacher_spec)
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
    return judges


def print_bench(console: Console, results: dict[str, Any], tasks: list[str]) -> None:
    """The tables by depth and by difference band, then each arm's interval over the tasks."""
    for title, key, labels in (("by changes kept (depth)", "by_depth", DEPTHS),
                               ("by |metric difference| (points)", "by_band", tuple(b[2] for b in BANDS))):
        table = Table(title=f"selective accuracy [95% Wilson] and coverage (verdicts/pairs), {title}")
        table.add_column("judge / memory")
        for label in (*labels, "all"):
            table.add_column(label, justify="right")
        table.add_column("picks of the first shown", justify="right")
        for arm, r in results.items():
            share = r["first_shown_picks"]
            table.add_row(arm, *(cell(r[key][label]) for label in (*labels, "all")),
                          "-" if share is None else f"{100 * share:.0f}%")
        console.print(table)
    for arm, r in results.items():
        if r["over_tasks"] is not None:
            i = r["over_tasks"]
            console.print(f"{arm}: selective accuracy over the {len(tasks)} tasks' means {100 * i['mean']:.1f}% "
                          f"(95% t [{100 * i['lo']:.1f}, {100 * i['hi']:.1f}], tasks {100 * i['min']:.0f}-{100 * i['max']:.0f}%)")


def run_judge_bench(cfg: RunConfig, *, split: str, max_tasks: int | None, walks: int, max_depth: int,
                    pairs_per_state: int, bys: list[str], memories: list[str], world_model: str | None,
                    output: str | None) -> dict[str, Any]:
    """The benchmark of the module docstring; prints its tables and writes them to a JSON file."""
    spec = make_env_spec(cfg.env, cfg.data_dir)
    if not isinstance(spec, MetricReader):
        raise RecipeError(f"judge bench needs an env whose steps report a metric; {cfg.env.name} reports none")
    tasks = spec.tasks(split)[:max_tasks]
    judges = open_judges(cfg, spec, bys, world_model or cfg.world_model.path)  # a missing model fails before the jobs
    console = Console(width=None if sys.stdout.isatty() else 200)
    start = time.monotonic()
    with counter("states", len(tasks) * walks * (max_depth + 1)) as advance:  # at most: a walk may end sooner
        states = build_states(spec, tasks, walks, max_depth, cfg.seed, advance)
    pairs = sample_pairs(states, pairs_per_state, cfg.seed)
    console.print(f"{len(states)} states on {len(tasks)} {split} tasks, {len(pairs)} pairs "
                  f"({time.monotonic() - start:.0f} s)")
    arms = [(by, m) for by in bys for m in (memories if by == "teacher" else ["none"])]  # the others read none
    results: dict[str, Any] = {}
    depth_keys = [depth_label(states[p.state].depth) for p in pairs]
    task_keys = [states[p.state].task_id for p in pairs]
    band_keys = [band_label(p.difference) for p in pairs]
    with counter("pairs judged", len(arms) * len(pairs)) as advance:
        for by, memory in arms:
            right, first_share = asyncio.run(judge_pairs(judges[by], memory, states, pairs,
                                                         cfg.judge.similarity_threshold, cfg.judge.memory_limit, advance))
            results[f"{by}/{memory}"] = {"by_depth": summarize(right, depth_keys, DEPTHS),
                                         "by_band": summarize(right, band_keys, tuple(b[2] for b in BANDS)),
                                         "by_task": (by_task := summarize(right, task_keys, tuple(tasks))),
                                         # pairs of a task share its states: the task is the unit of an honest interval
                                         "over_tasks": task_interval(by_task, tasks),
                                         "first_shown_picks": first_share, "right": right}
    print_bench(console, results, tasks)
    report = {"recipe": cfg.name, "split": split, "tasks": tasks, "walks": walks, "max_depth": max_depth,
              "pairs_per_state": pairs_per_state, "seed": cfg.seed, "states": len(states),
              "pairs": [asdict(p) | {"depth": states[p.state].depth, "task_id": states[p.state].task_id} for p in pairs],
              "threshold": cfg.judge.similarity_threshold, "memory_limit": cfg.judge.memory_limit,
              "arms": results, "wall_time_s": time.monotonic() - start}
    path = Path(output or Path(cfg.output_dir) / "judge_bench" / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    console.print(f"wrote {path}")
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
    difference against `none` and the smallest effect it could detect, the share of episodes that
    reached `none`'s mean final improvement (the target, returned) and their runs to reach it."""
    from turnopd.analysis.frontier import detectable_effect, t_interval

    baseline = episodes["none"]
    target = sum(e.improvement for e in baseline) / len(baseline)
    rows = {}
    for arm, played in episodes.items():
        diffs = [e.improvement - b.improvement for e, b in zip(played, baseline, strict=True)]
        hit = [r for e in played if (r := runs_to_reach(e, target)) is not None]
        rows[arm] = {"improvement": t_interval([e.improvement for e in played]),
                     "won": sum(e.won for e in played) / len(played), "runs": sum(e.runs for e in played) / len(played),
                     "difference": t_interval(diffs), "detectable": detectable_effect(diffs) if arm != "none" else None,
                     "reached": len(hit) / len(played), "runs_to_reach": sum(hit) / len(hit) if hit else None,
                     **clock[arm]}
    return rows, target


def play_table(rows: dict[str, dict[str, Any]], target: float, title: str) -> Table:
    table = Table(title=f"{title}; target {target:+.2f} points (none's mean final improvement)")
    for column in ("arm", "final improvement [95% t]", "vs none [95% t]", "detectable", "won", "real runs",
                   "reached target", "runs to reach", "judged turns", "verdicts/pairs", "overrides", "wall s",
                   "judge s"):
        table.add_column(column, justify="left" if column == "arm" else "right")

    def interval(i: Any) -> str:
        return "-" if i is None else f"{i.value:+.2f} [{i.lo:+.2f}, {i.hi:+.2f}]"

    for arm, r in rows.items():
        table.add_row(arm, interval(r["improvement"]), "-" if arm == "none" else interval(r["difference"]),
                      "-" if r["detectable"] is None else f"{r['detectable']:.2f}", f"{100 * r['won']:.0f}%",
                      f"{r['runs']:.1f}", f"{100 * r['reached']:.0f}%",
                      "-" if r["runs_to_reach"] is None else f"{r['runs_to_reach']:.1f}", str(r.get("turns", "-")),
                      f"{r['verdicts']}/{r['pairs']}" if "pairs" in r else "-", str(r.get("overrides", "-")),
                      f"{r['wall_s']:.0f}",
                      f"{r.get('judge_s', 0.0):.0f}")
    return table


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
    console = Console(width=None if sys.stdout.isatty() else 200)
    episodes: dict[str, list[Episode]] = {a: [] for a in arms}
    clock: dict[str, dict[str, float]] = {}
    with EnvPool.for_config(spec, cfg.env) as pool, counter("episodes", seeds * len(arms) * len(tasks)) as advance:
        for arm in arms:
            episodes[arm], clock[arm] = play_arm(cfg, spec, pool, policy, tasks, seeds, arm, teacher, advance)
    rows, target = play_rows(episodes, clock)
    console.print(play_table(rows, target, f"{len(tasks)} {split} tasks x {seeds} seeds"))
    report = {"recipe": cfg.name, "split": split, "tasks": tasks, "seeds": seeds, "k": cfg.judge.k,
              "temperature": cfg.judge.temperature, "target": target,
              "rows": {a: {k: (asdict(v) if hasattr(v, "__dataclass_fields__") else v) for k, v in r.items()}
                       for a, r in rows.items()},
              "episodes": {a: [asdict(e) for e in played] for a, played in episodes.items()}}
    path = Path(output or Path(cfg.output_dir) / "judge_play" / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    console.print(f"wrote {path}")
    return report
