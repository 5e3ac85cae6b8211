"""Env throughput, side by side in one run: every registered env, stepped in-process, through the pool
with 1 worker and through the pool with 2 workers.

    python benchmarks/env_throughput.py                      # all registered envs
    python benchmarks/env_throughput.py --envs alfworld --episodes 8
    python benchmarks/env_throughput.py --envs alfworld --ray   # also through Ray actors (env.pool=ray)

Per env: reset seconds (one env, in-process), env steps/s (in-process, pool 1 worker, pool 2 workers;
the pool rows include pickling and pipe traffic), the 2-worker/1-worker ratio, and the share of a
rollout step spent in the env when the policy is a stand-in that answers instantly, with the real
prompt rendering, answer formatting and action parsing around it. The stand-in picks a random
admissible action (seeded) where the env lists them, so that episodes run long as a weak student's
do, else it plays the env's expert. The policy side of a real run is an LLM, so the env's share there
is far lower; this says whether the env alone could keep up. A batch is the first --episodes tasks
of the env's held-out split, played to the end or to --max-turns; figures depend on the machine and
on what else runs on it. With --ray the pool runs also with its workers as Ray actors of a local
Ray cluster (envs.ray_pool, started once for the benchmark), 1 and 2 actors, on the same batch: the
overhead of env.pool=ray over env.pool=local on one machine.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from dataclasses import dataclass
from functools import partial

from record import MIN_REPEATS, Summary, save_result
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from envs import ENVS, make_env_spec
from envs.base import EnvSpec, PromptContext, StepOutcome, format_answer, recent_pairs
from envs.pool import EnvPool
from turnopd.config import EnvConfig, RayEnvConfig


@dataclass
class RolloutTimes:
    env_s: float = 0.0  # inside env steps (pool.step or env.step)
    policy_s: float = 0.0  # prompt rendering + stand-in policy + answer parsing
    steps: int = 0
    reset_s: float = 0.0  # wall time of the batch's reset


class InProcess:
    """The same reset/step interface as EnvPool, one env object per slot in this process."""

    def __init__(self, spec: EnvSpec):
        self.spec = spec
        self.envs: list = []

    def reset(self, task_ids: list[str]) -> list[StepOutcome]:
        while len(self.envs) < len(task_ids):
            self.envs.append(self.spec.make())
        return [env.reset(task) for env, task in zip(self.envs, task_ids, strict=False)]

    def step(self, actions: dict[int, str]) -> dict[int, StepOutcome]:
        return {slot: self.envs[slot].step(action) for slot, action in actions.items()}


def play_batch(spec: EnvSpec, runner, tasks: list[str], config: EnvConfig, advance) -> RolloutTimes:
    """One rollout of the batch, timing the env and the stand-in policy separately."""
    times = RolloutTimes()
    start = time.perf_counter()
    outcomes = dict(enumerate(runner.reset(tasks)))
    times.reset_s = time.perf_counter() - start
    advance()
    experts = {slot: spec.expert(task) for slot, task in enumerate(tasks)}
    rng = random.Random(0)
    goals = {slot: o.info.get("task", "") for slot, o in outcomes.items()}
    history: dict[int, list[tuple[str, str]]] = {slot: [] for slot in outcomes}
    live = [slot for slot, o in outcomes.items() if not o.done]
    for turn in range(config.max_turns):
        if not live:
            break
        start = time.perf_counter()
        actions = {}
        for slot in live:
            outcome = outcomes[slot]
            ctx = PromptContext(task=goals[slot], step=turn, observation=outcome.observation,
                                history=recent_pairs(history[slot], config.history_length),
                                admissible=outcome.admissible, answer_format=config.answer_format)
            spec.render_prompt(ctx)
            choice = rng.choice(outcome.admissible) if outcome.admissible else experts[slot].act(outcome)
            answer = format_answer(choice, config.answer_format)
            actions[slot] = spec.parse_action(answer).action
            history[slot].append((outcome.observation, actions[slot]))
        times.policy_s += time.perf_counter() - start
        start = time.perf_counter()
        outcomes.update(runner.step(actions))
        times.env_s += time.perf_counter() - start
        times.steps += len(actions)
        live = [slot for slot in live if not outcomes[slot].done]
    advance()
    return times


def held_out_split(spec: EnvSpec) -> str:
    default = EnvConfig().eval_split
    return default if default in spec.splits() else spec.splits()[-1]


# each pool run: its label -> (workers, whether they are Ray actors)
POOLS = {"pool 1 worker": (1, False), "pool 2 workers": (2, False),
         "ray pool 1 actor": (1, True), "ray pool 2 actors": (2, True)}
RUNS = ("in-process", *(label for label, (_, on_ray) in POOLS.items() if not on_ray))
RAY_RUNS = tuple(label for label, (_, on_ray) in POOLS.items() if on_ray)


def measure(spec: EnvSpec, tasks: list[str], config: EnvConfig, advance, runs=RUNS) -> dict[str, RolloutTimes]:
    """One repeat: the same batch in-process and through each pool of `runs`."""
    measured = {}
    for run in runs:
        if run == "in-process":
            runner = InProcess(spec)
            runner.reset(tasks[:1])  # warm-up: engine imports and caches are not a reset's cost
            measured[run] = play_batch(spec, runner, tasks, config, advance)
            continue
        num_workers, on_ray = POOLS[run]
        workers = {}
        if on_ray:
            from envs.ray_pool import RayWorkers

            workers = {"workers": partial(RayWorkers, ray_config=RayEnvConfig())}  # joins the benchmark's cluster
        with EnvPool(spec, num_workers=num_workers, step_timeout_s=600, **workers) as pool:
            measured[run] = play_batch(spec, pool, tasks, config, advance)
    return measured


def summaries(name: str, episodes: int, repeats: list[dict[str, RolloutTimes]]) -> list[Summary]:
    def rate(times: RolloutTimes) -> float:
        return times.steps / times.env_s

    return [Summary.of(f"{name}: reset ms/episode (in-process)", [1000 * r["in-process"].reset_s / episodes
                                                                   for r in repeats], "ms"),
            *(Summary.of(f"{name}: env steps/s {run}", [rate(r[run]) for r in repeats], "steps/s") for run in repeats[0]),
            Summary.of(f"{name}: pool 2 workers / 1 worker", [rate(r["pool 2 workers"]) / rate(r["pool 1 worker"])
                                                               for r in repeats], "x"),
            Summary.of(f"{name}: env share of a stand-in rollout step (2 workers)",
                       [100 * r["pool 2 workers"].env_s / (r["pool 2 workers"].env_s + r["pool 2 workers"].policy_s)
                        for r in repeats], "%"),
            *([Summary.of(f"{name}: ray pool 2 actors / pool 2 workers",
                          [rate(r["ray pool 2 actors"]) / rate(r["pool 2 workers"]) for r in repeats], "x")]
              if "ray pool 2 actors" in repeats[0] else [])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs", nargs="*", default=None, help="envs to measure (default: all registered)")
    parser.add_argument("--episodes", type=int, default=8, help="episodes per batch")
    parser.add_argument("--max-turns", type=int, default=None, help="default: the env's default_max_turns")
    parser.add_argument("--repeats", type=int, default=MIN_REPEATS)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--ray", action="store_true", help="also through Ray actors (a local Ray cluster)")
    args = parser.parse_args()
    names = args.envs or ENVS.names()
    runs = RUNS + RAY_RUNS if args.ray else RUNS
    if args.ray:
        import ray

        ray.init(address="local", include_dashboard=False, num_cpus=os.cpu_count())
    console = Console()
    found, samples = [], []
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("ETA"), TimeRemainingColumn(), console=console)
    with progress:
        bar = progress.add_task("env throughput", total=len(names) * len(runs) * 2 * args.repeats)
        for name in names:
            try:
                spec = make_env_spec(EnvConfig(name=name), args.data_dir)
            except Exception as exc:  # an env without its data is reported, not fatal
                console.print(f"[yellow]{name}: skipped ({type(exc).__name__}: {str(exc).splitlines()[0]})")
                progress.advance(bar, len(runs) * 2 * args.repeats)
                continue
            config = EnvConfig(name=name, max_turns=args.max_turns or spec.default_max_turns)
            tasks = spec.tasks(held_out_split(spec))[: args.episodes]
            progress.update(bar, description=name)
            repeats = [measure(spec, tasks, config, lambda: progress.advance(bar), runs) for _ in range(args.repeats)]
            found += summaries(name, len(tasks), repeats)
            samples += [{"env": name, "repeat": k, "run": run, **vars(times)}
                        for k, r in enumerate(repeats) for run, times in r.items()]
    save_result("env_throughput", f"env throughput, {', '.join(names)}: in-process and through the pool"
                f"{' (local processes and Ray actors)' if args.ray else ''} "
                f"({args.episodes} episodes a batch; stand-in policy: a random admissible action, else the expert)",
                found, samples)


if __name__ == "__main__":
    main()
