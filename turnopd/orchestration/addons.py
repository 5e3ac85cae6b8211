"""The research add-ons a recipe turns on, opened around a run in one place so that the loop
(turnopd.orchestration.distill) reads without them: world-model rollouts (`world_model.path`,
turnopd.rollout.world_model_pool), the judge (`judge.by`, turnopd.rollout.judge) and a student that
reads screenshots (an env that shows them, turnopd.loaders.screens). The loop hands `Addons` to its
rollout source and calls its two step hooks; the episode loop sees them only through its hooks
(an action source, an episode runner, a renderer: turnopd.rollout.agent_loop)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from turnopd.core.types import Trajectory
from turnopd.loaders.screens import ScreenPixels
from turnopd.orchestration.run_log import screenshot_fields
from turnopd.rollout.judge import Judge, open_judge
from turnopd.rollout.world_model_pool import WorldModelPool, open_world_model


@dataclass
class Addons:
    world: WorldModelPool | None = None  # plays the episodes it is told to, and judges the others
    judge: Judge | None = None  # chooses each real turn's action among k candidates
    screens: ScreenPixels | None = None  # the student's screenshots, by pixel-store key

    def start_batch(self, step: int) -> None:
        """Before step `step`'s episodes: their sampling streams and the judge's memory keys."""
        for addon in (self.world, self.judge):
            if addon is not None:
                addon.start_batch(step)

    def end_batch(self, trajectories: list[Trajectory]) -> dict[str, Any]:
        """After the step's episodes: the judge commits their attempts to its memory; the pipeline
        stats' fields (the judge's counts)."""
        if self.judge is None:
            return {}
        stats = dataclasses.asdict(self.judge.stats)
        self.judge.commit(trajectories)  # the step's attempts join the memory the next steps' judge reads
        return {"judge": stats}

    def record_fields(self, trajectories: list[Trajectory], result: Any) -> dict[str, Any]:
        """The step record's fields the add-ons add (the screenshots' counts, before the store is freed)."""
        if self.screens is None:
            return {}
        return {"screenshots": screenshot_fields(self.screens, trajectories, result)}

    def between_steps(self) -> None:
        """After a step's training and evaluations: no trajectory holds its screenshots any more."""
        if self.screens is not None:
            self.screens.free_between_steps()


@contextmanager
def open_addons(run: Any, pool: Any) -> Iterator[Addons]:
    """The add-ons of a DistillRun's recipe, over the run's real env pool (closed on exit)."""
    cfg, spec = run.cfg, run.setup.spec
    with open_world_model(cfg, spec, pool) as world:
        yield Addons(world, open_judge(cfg, spec, run.teachers, world, run.run_dir, run.start_step), run.screens)
