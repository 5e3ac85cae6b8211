"""A multi-env run's batches (recipe key `envs`, turnopd.config.env_mixture): each step's episodes are
each env's share (turnopd.config.mixture_counts), planned by that env's own depth controller (its turn
limits within its own horizon), played in its own env pool and scored by its own teacher (teachers
are routed by each trajectory's env); one student trains on the mixed batch. The envs' shares play at
the same time, each in its own pool, their turns sharing the policy's generation batches (in sync here,
play_mixture; in one_step_off and pool, the generator answers each env's requests as they come).
Under trainer.budget in work, the last step keeps the mixture's first episodes in an order that
interleaves the envs by their shares (mixture_order), so the run ends within one episode of the budget
and its last step keeps the mixture as near as it can.

A single-env run goes through the same `env_parts` and `open_pools` (one part, its recipe as it is);
its plan stays a BatchPlan and its batch is played as before."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

from envs.pool import EnvPool
from teachers import Teacher
from turnopd.algorithm.controllers import DepthSchedule, EnvDepths, make_depth_schedule
from turnopd.config import RunConfig, env_views
from turnopd.core.distributed import rank_and_world
from turnopd.core.ledger import Ledger
from turnopd.core.progress import EpisodeProgress
from turnopd.core.types import EpisodeSummary, Trajectory
from turnopd.orchestration.pipeline.plan import (
    BatchPlan,
    episode_work_bounds,
    plan_batch,
    score,
    step_episodes,
    teacher_tokenizer,
    within_budget,
)
from turnopd.orchestration.preflight import Setup
from turnopd.rollout import Policy
from turnopd.rollout.agent_loop import play_all


@dataclass(frozen=True)
class MixturePlan:
    """What step `step` of a multi-env run trains on: each env's BatchPlan, by env name, in recipe order."""

    step: int
    envs: dict[str, BatchPlan]

    @property
    def episodes(self) -> int:
        return sum(plan.episodes for plan in self.envs.values())

    @property
    def probes(self) -> int:
        return sum(plan.probes for plan in self.envs.values())

    @property
    def is_probe_step(self) -> bool:
        return all(plan.is_probe_step for plan in self.envs.values())

    @property
    def cap(self) -> int:
        """The deepest cap of the step's envs (each env's own is in its plan)."""
        return max(plan.cap for plan in self.envs.values())


def env_parts(cfg: RunConfig, setup: Setup) -> dict[str, tuple[RunConfig, Setup]]:
    """Each env of the run, by name: the recipe as it sees it (turnopd.config.env_views) and its Setup;
    a single-env run's one env with its recipe and Setup as they are."""
    if not cfg.envs:
        return {cfg.env.name: (cfg, setup)}
    return {env: (view, setup.envs[env]) for env, view in env_views(cfg).items()}


def make_depth(cfg: RunConfig) -> DepthSchedule | EnvDepths:
    """The run's depth controller: one within env.max_turns, or a multi-env run's one per env."""
    if not cfg.envs:
        return make_depth_schedule(cfg.depth, horizon=cfg.env.max_turns)
    return EnvDepths({env: make_depth_schedule(cfg.depth, horizon=view.env.max_turns)
                      for env, view in env_views(cfg).items()})


def plan_step(depth: DepthSchedule | EnvDepths, step: int, cfg: RunConfig, work_left: float | None = None
              ) -> BatchPlan | MixturePlan:
    """Step `step`'s plan (pipeline.plan.plan_batch, within what trainer.budget leaves: `work_left`), in a
    multi-env run each env's from its own controller, the budget held by the mixture as a whole
    (mixture_within_budget)."""
    if not cfg.envs:
        return plan_batch(depth, step, cfg, work_left)
    views = env_views(cfg)
    plans = {env: plan_batch(depth.schedules[env], step, view) for env, view in views.items()}
    if work_left is not None:
        plans = mixture_within_budget(plans, views, work_left)
    return MixturePlan(step, plans)


def mixture_order(counts: dict[str, int]) -> list[str]:
    """The envs of a step's episodes in the order a budget keeps them: each next episode is the env's
    whose kept share lags its share of the step most (ties to the earlier env), so every prefix keeps
    the mixture as near as whole episodes can (counts 4 and 2: a, b, a, a, b, a)."""
    total, kept, order = sum(counts.values()), dict.fromkeys(counts, 0), []
    for n in range(1, total + 1):
        env = max(counts, key=lambda e: (counts[e] * n / total - kept[e], -list(counts).index(e)))
        kept[env] += 1
        order.append(env)
    return order


def mixture_within_budget(plans: dict[str, BatchPlan], views: dict[str, RunConfig], work_left: float
                          ) -> dict[str, BatchPlan]:
    """The envs' plans cut to the mixture's first episodes (mixture_order; each env's own first ones:
    its probes) whose work bounds reach `work_left` (pipeline.plan.within_budget over the whole step,
    so the run ends within one episode of the budget, whichever env's). An env left no episode has no
    plan this step."""
    order = mixture_order({env: plan.episodes for env, plan in plans.items()})
    bounds = {env: iter(episode_work_bounds(views[env], plan.turn_limits, plan.probes)) for env, plan in plans.items()}
    kept = Counter(within_budget(tuple(order), work_left, tuple(next(bounds[env]) for env in order),
                                 at_least=rank_and_world()[1]))
    return {env: BatchPlan(plan.step, plan.turn_limits[:kept[env]], min(plan.probes, kept[env]))
            for env, plan in plans.items() if kept[env]}


def plan_work_bound(cfg: RunConfig, plan: BatchPlan | MixturePlan) -> int:
    """The most of trainer.budget's unit a plan's episodes can spend (pipeline.plan.episode_work_bounds),
    each env's at its own horizon."""
    views = env_views(cfg) if cfg.envs else {cfg.env.name: cfg}
    return sum(sum(episode_work_bounds(views[env], env_plan.turn_limits, env_plan.probes))
               for env, env_plan in env_plans(cfg, plan).items())


def env_plans(cfg: RunConfig, plan: BatchPlan | MixturePlan) -> dict[str, BatchPlan]:
    """A step's plan by env: a multi-env run's envs' plans, a single-env run's one."""
    return plan.envs if isinstance(plan, MixturePlan) else {cfg.env.name: plan}


class EnvPools(dict):
    """The run's env pools, by env name, in recipe order."""

    @property
    def first(self) -> EnvPool:
        """The first env's pool: a single-env run's only one (what its add-ons and generator use)."""
        return next(iter(self.values()))


@contextmanager
def open_pools(cfg: RunConfig, setup: Setup) -> Iterator[EnvPools]:
    """An env pool per env of the run, closed together."""
    with ExitStack() as stack:
        yield EnvPools({env: stack.enter_context(EnvPool.for_config(part.spec, view.env))
                        for env, (view, part) in env_parts(cfg, setup).items()})


def play_mixture(cfg: RunConfig, setup: Setup, pools: dict[str, EnvPool], policy: Policy,
                 teachers: dict[str, Teacher], plan: MixturePlan, ledger: Ledger) -> list[Trajectory]:
    """A multi-env step's episodes, in recipe order: every env's share at once, each in its pool
    (pipeline.plan.play_and_score without add-ons, which a mixture has none of), then each trajectory
    scored by its env's teacher. Playing the envs together lets one env's turns fill the generation
    batches another env's longer episodes leave part-empty."""
    parts = env_parts(cfg, setup)
    batches = {env: step_episodes(parts[env][0], parts[env][1].train_tasks, env_plan)
               for env, env_plan in plan.envs.items()}
    phase = "probe" if plan.is_probe_step else "rollout"
    with ledger.phase(phase), EpisodeProgress(f"step {plan.step} {phase}", sum(len(b.tasks) for b in batches.values()),
                                              enabled=rank_and_world()[0] == 0) as progress:
        async def play_envs() -> list[list[Trajectory]]:
            return await asyncio.gather(*(
                play_all(parts[env][1].spec, pools[env], policy, episodes.tasks, env_config=parts[env][0].env,
                         sampling=episodes.sampling, turn_limits=episodes.turn_limits, probes=episodes.probes,
                         ledger=ledger, on_episode=progress.episode_done, prompt=parts[env][0].prompt,
                         teacher_tokenizer=teacher_tokenizer(cfg, teachers, env))
                for env, episodes in batches.items() if episodes.tasks))  # a rank may have none of an env

        trajectories = [t for played in asyncio.run(play_envs()) for t in played]
        with ledger.busy("teacher"):
            score(cfg, teachers, trajectories)  # each by its env's teacher (teachers.score_trajectories)
    return trajectories


def per_env_fields(depth: EnvDepths, plan: MixturePlan, updated: bool,
                   episodes: list[EpisodeSummary]) -> dict[str, dict[str, Any]]:
    """A multi-env step record's per_env (turnopd.core.metrics.StepRecord.per_env), from every rank's episodes."""
    diagnostics = depth.diagnostics() if updated else {}
    fields = {}
    for env, env_plan in plan.envs.items():
        mine = [e for e in episodes if e.env_name == env]
        measured = diagnostics.get(env, {})
        fields[env] = {"rollout_depth_cap": env_plan.cap, "probes": env_plan.probes, "episodes": len(mine),
                       "mean_turns": sum(e.depth for e in mine) / max(len(mine), 1),
                       "success_rate": sum(e.success for e in mine) / max(len(mine), 1),
                       **{key: measured.get(key) for key in ("h_eff", "h_cov", "h_cov_measured")}}
    return fields
