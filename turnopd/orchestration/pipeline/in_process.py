"""`pipeline.mode: sync`: each step's episodes are played and scored in the training process."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from envs.pool import EnvPool
from teachers import Teacher, replica_stats
from turnopd.config import RunConfig
from turnopd.core.ledger import Ledger
from turnopd.core.types import Trajectory
from turnopd.orchestration.pipeline.base import PIPELINE_MODES, PipelineMode, PipelineStats
from turnopd.orchestration.pipeline.mixture import MixturePlan, play_mixture
from turnopd.orchestration.pipeline.plan import BatchPlan, play_and_score, step_episodes
from turnopd.orchestration.preflight import Setup
from turnopd.rollout import Policy


class InProcessRollouts:
    """sync: each step's episodes are played and scored in the training process when the step
    takes them, with the weights the loop has just given the policy."""

    def __init__(self, cfg: RunConfig, setup: Setup, pool: EnvPool, policy: Policy,
                 teachers: dict[str, Teacher], ledger: Ledger, addons: Any = None,
                 pools: dict[str, EnvPool] | None = None):
        self.cfg, self.setup, self.pool, self.policy, self.pools = cfg, setup, pool, policy, pools
        self.teachers, self.ledger, self.addons = teachers, ledger, addons
        self._stats = PipelineStats("sync")

    def take(self, plan: BatchPlan | MixturePlan) -> list[Trajectory]:
        """Step `plan.step`'s episodes, played and scored now (with the run's add-ons:
        turnopd.orchestration.addons; a multi-env run's, which has none, in each env's pool)."""
        if isinstance(plan, MixturePlan):
            self._stats = PipelineStats("sync", weight_version=plan.step)
            return play_mixture(self.cfg, self.setup, self.pools, self.policy, self.teachers, plan, self.ledger)
        world, judge = (self.addons.world, self.addons.judge) if self.addons is not None else (None, None)
        if self.addons is not None:
            self.addons.start_batch(plan.step)
        trajectories = play_and_score(self.cfg, self.setup.spec, self.pool, self.policy, self.teachers,
                                      step_episodes(self.cfg, self.setup.train_tasks, plan), self.ledger,
                                      world=world, judge=judge, step=plan.step)
        added = self.addons.end_batch(trajectories) if self.addons is not None else {}
        self._stats = dataclasses.replace(PipelineStats("sync", weight_version=plan.step), **added)
        return trajectories

    def prepare(self, plan: BatchPlan) -> None:
        """Nothing starts early: the batch is played when its step takes it."""

    def publish(self, weights: nn.Module, version: int) -> None:
        """Nothing to send: the policy plays with the loop's own (updated) weights."""

    def stats(self) -> PipelineStats:
        return self._stats

    def take_replica_stats(self) -> dict[str, Any]:
        return replica_stats(self.teachers)


@contextmanager
def _open_in_process(cfg: RunConfig, setup: Setup, *, policy: Policy, pool: EnvPool, teachers: dict[str, Teacher],
                     ledger: Ledger, addons: Any = None, pools: dict[str, EnvPool] | None = None,
                     **_: Any) -> Iterator[InProcessRollouts]:
    yield InProcessRollouts(cfg, setup, pool, policy, teachers, ledger, addons, pools)


PIPELINE_MODES.register("sync")(PipelineMode(open=_open_in_process, off_policy=False))
