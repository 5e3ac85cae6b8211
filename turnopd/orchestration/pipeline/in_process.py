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
from turnopd.orchestration.pipeline.plan import BatchPlan, play_and_score, step_episodes
from turnopd.orchestration.preflight import Setup
from turnopd.rollout import Policy
from turnopd.rollout.judge import Judge
from turnopd.rollout.world_model_pool import WorldModelPool


class InProcessRollouts:
    """sync: each step's episodes are played and scored in the training process when the step
    takes them, with the weights the loop has just given the policy."""

    def __init__(self, cfg: RunConfig, setup: Setup, pool: EnvPool, policy: Policy,
                 teachers: dict[str, Teacher], ledger: Ledger, world: WorldModelPool | None = None,
                 judge: Judge | None = None):
        self.cfg, self.setup, self.pool, self.policy = cfg, setup, pool, policy
        self.teachers, self.ledger, self.world, self.judge = teachers, ledger, world, judge
        self._stats = PipelineStats("sync")

    def take(self, plan: BatchPlan) -> list[Trajectory]:
        self._stats = PipelineStats("sync", weight_version=plan.step)
        if self.world is not None:
            self.world.start_batch(plan.step)
        if self.judge is not None:
            self.judge.start_batch(plan.step)
        trajectories = play_and_score(self.cfg, self.setup.spec, self.pool, self.policy, self.teachers,
                                      step_episodes(self.cfg, self.setup.train_tasks, plan), self.ledger,
                                      world=self.world, judge=self.judge, step=plan.step)
        if self.judge is not None:  # the step's attempts join the memory the next steps' judge reads
            self._stats = dataclasses.replace(self._stats, judge=dataclasses.asdict(self.judge.stats))
            self.judge.commit(trajectories)
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
                     ledger: Ledger, world: WorldModelPool | None = None, judge: Judge | None = None, **_: Any
                     ) -> Iterator[InProcessRollouts]:
    yield InProcessRollouts(cfg, setup, pool, policy, teachers, ledger, world, judge)


PIPELINE_MODES.register("sync")(PipelineMode(open=_open_in_process, off_policy=False))
