"""What the distillation loop asks of a rollout source, and the registry of pipeline modes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from torch import nn

from turnopd.core.registry import Registry
from turnopd.core.types import Trajectory
from turnopd.orchestration.pipeline.plan import BatchPlan


@dataclass
class PipelineStats:
    """A step's record of where its trajectories came from."""

    mode: str
    weight_version: int = 0  # the trainer's weights when the step trained (optimizer steps before it)
    staleness_max: int = 0  # versions the trained trajectories lag the trainer
    staleness_mean: float = 0.0
    dropped_stale: int = 0  # this step: older than pipeline.max_staleness, dropped untrained
    queued: int = 0  # after the step took its batch: generated and received, not trained yet
    generator_restarts: int = 0  # since the run (re)started
    judge: dict[str, int] | None = None  # judge block: the step's turnopd.rollout.judge.JudgeStats


class Rollouts(Protocol):
    """Where the loop gets each step's scored trajectories.

    take(plan)                 the step's trajectories (this rank's share), teacher-scored, each played
                               within its turn limit from the plan
    prepare(plan)              the next step's plan, made while this step trains, before this step's
                               depth update: asynchronous modes start generating it now (so there step
                               k's update first caps step k + 2; sync plays at take, k + 1)
    publish(weights, version)  new student weights after an optimizer step
    stats()                    PipelineStats of the batch `take` returned last
    take_replica_stats()       per teacher served by replicas, each replica's requests, failures,
                               up and mean latency since the last call, wherever the scoring ran
                               (teachers.replica_stats)
    """

    def take(self, plan: BatchPlan) -> list[Trajectory]: ...
    def prepare(self, plan: BatchPlan) -> None: ...
    def publish(self, weights: nn.Module, version: int) -> None: ...
    def stats(self) -> PipelineStats: ...
    def take_replica_stats(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class PipelineMode:
    """A registered `pipeline.mode`: how its rollout source opens (see open_rollouts), and whether it
    trains on tokens sampled by older weights (then k1's importance ratio needs objective.clip_eps)."""

    open: Callable[..., Rollouts]
    off_policy: bool


PIPELINE_MODES: Registry[PipelineMode] = Registry("pipeline mode")
