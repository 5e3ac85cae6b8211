"""A multi-env run's batches (recipe key `envs`, turnopd.config.env_mixture): each step's episodes are
each env's share (turnopd.config.mixture_counts), planned by that env's own depth controller (its turn
limits within its own horizon), played in its own env pool and scored by its own teacher (teachers
are routed by each trajectory's env); one student trains on the mixed batch. The envs' shares play in
turn, each all at once in its pool: one env's episodes overlap each other, not another env's.

A single-env run goes through the same `env_parts` and `open_pools` (one part, its recipe as it is);
its plan stays a BatchPlan and its batch is played as before."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

from envs.pool import EnvPool
from teachers import Teacher
from turnopd.algorithm.controllers import DepthSchedule, EnvDepths, make_depth_schedule
from turnopd.config import RunConfig, env_views
from turnopd.core.ledger import Ledger
from turnopd.core.types import EpisodeSummary, Trajectory
from turnopd.orchestration.pipeline.plan import BatchPlan, plan_batch, play_and_score, step_episodes
from turnopd.orchestration.preflight import Setup
from turnopd.rollout import Policy


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
    multi-env run each env's from its own controller (a mixture takes no budget in work: its recipe
    check refuses one)."""
    if not cfg.envs:
        return plan_batch(depth, step, cfg, work_left)
    return MixturePlan(step, {env: plan_batch(depth.schedules[env], step, view) for env, view in env_views(cfg).items()})


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
    """A multi-env step's episodes: each env's share played in its pool and scored (its teacher), in turn."""
    parts, trajectories = env_parts(cfg, setup), []
    for env, env_plan in plan.envs.items():
        view, part = parts[env]
        trajectories += play_and_score(view, part.spec, pools[env], policy, teachers,
                                       step_episodes(view, part.train_tasks, env_plan), ledger, step=plan.step)
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
