"""Env throughput, side by side in one run: every registered env, stepped in-process, through the pool
with 1 worker and through the pool with 2 workers.

    python benchmarks/env_throughput.py                      # all registered envs
    python benchmarks/env_throughput.py --envs alfworld --episodes 8

Per env: reset seconds (one env, in-process), env steps/s (in-process, pool 1 worker, pool 2 workers;
the pool rows include pickling and pipe traffic), the 2-worker/1-worker ratio, and the share of a
rollout step spent in the env when the policy is a stand-in that answers instantly, with the real
prompt rendering, answer formatting and action parsing around it. The stand-in picks a random
admissible action (seeded) where the env lists them, so that episodes run long as a weak student's
do, else it plays the env's expert. The policy side of a real run is an LLM, so the env's share there
is far lower; this says whether the env alone could keep up. A batch is the first --episodes tasks
of the env's held-out split, played to the end or to --max-turns; figures depend on the machine and
on what else runs on it.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

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
from turnopd.config import EnvConfig


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs", nargs="*", default=None, help="envs to measure (default: all registered)")
    parser.add_argument("--episodes", type=int, default=8, help="episodes per batch")
    parser.add_argument("--max-turns", type=int, default=None, help="default: the env's default_max_turns")
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args()
    names = args.envs or ENVS.names()
    console = Console()

    rows = []
    runs = ("in-process", "pool 1 worker", "pool 2 workers")
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("ETA"), TimeRemainingColumn(), console=console)
    with progress:
        bar = progress.add_task("env throughput", total=len(names) * len(runs) * 2)

        def advance() -> None:
            progress.advance(bar)

        for name in names:
            try:
                spec = make_env_spec(EnvConfig(name=name), args.data_dir)
            except Exception as exc:  # an env without its data is reported, not fatal
                console.print(f"[yellow]{name}: skipped ({type(exc).__name__}: {str(exc).splitlines()[0]})")
                progress.advance(bar, len(runs) * 2)
                continue
            config = EnvConfig(name=name, max_turns=args.max_turns or spec.default_max_turns)
            split = held_out_split(spec)
            tasks = spec.tasks(split)[: args.episodes]
            measured: dict[str, RolloutTimes] = {}
            for run in runs:
                progress.update(bar, description=f"{name}: {run}")
                if run == "in-process":
                    runner = InProcess(spec)
                    runner.reset(tasks[:1])  # warm-up: engine imports and caches are not a reset's cost
                    measured[run] = play_batch(spec, runner, tasks, config, advance)
                else:
                    with EnvPool(spec, num_workers=int(run.split()[1]), step_timeout_s=600) as pool:
                        measured[run] = play_batch(spec, pool, tasks, config, advance)
            rows.append((name, split, len(tasks), measured))

    console.print(f"\n## Env throughput ({args.episodes} episodes per batch; stand-in policy: random admissible "
                  "action, else the env's expert)\n")
    header = ("| env | split | steps | reset ms/episode | steps/s in-process | steps/s pool 1w | steps/s pool 2w "
              "| 2w / 1w | env share of a rollout step (2w) |")
    print(header)
    print("|" + "---|" * header.count(" | ") + "---|")
    for name, split, n, m in rows:
        rate = {run: m[run].steps / m[run].env_s if m[run].env_s else float("nan") for run in runs}
        two = m["pool 2 workers"]
        share = two.env_s / (two.env_s + two.policy_s)
        print(f"| {name} | {split} | {two.steps} | {1000 * m['in-process'].reset_s / n:.1f} | {rate['in-process']:.1f} "
              f"| {rate['pool 1 worker']:.1f} | {rate['pool 2 workers']:.1f} "
              f"| {rate['pool 2 workers'] / rate['pool 1 worker']:.2f}x | {100 * share:.1f}% |")


if __name__ == "__main__":
    main()
