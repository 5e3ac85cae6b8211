"""The wall-clock ledger: what each step spent its time on, honestly when work overlaps.

Two kinds of account:

- phases, the training loop's own sequential parts, each timed by one context manager:
      with ledger.phase("train"): ...
  rollout (playing and scoring the step's episodes here, or waiting for them), probe (the same for
  a probe batch), train (forward/backward/step), weight_sync, eval, checkpoint, trainer_idle (an
  asynchronous pipeline's trainer waiting for the generator process). A phase opened inside another
  is absorbed by the outer one, so a step's phases add up to at most its wall-clock.
- busy time per resource: generation, env, world_model, judge, teacher (and trainer, the train phase), which the
  asynchronous agent loop runs at the same time (episodes generate while others step their env):
      with ledger.busy("env"): await pool.step_slot(...)
  Holders of one resource may overlap (several episodes in the env pool at once); its busy time is
  the union of their intervals, so it never exceeds the wall-clock, and wall-clock minus busy is
  the resource's idle time. Resources overlap each other, so their busy times do not add up.

The training clock is the wall-clock of the run minus eval and checkpoint time (loop overhead
counts as training); it continues across resumes. With an asynchronous pipeline
(turnopd.orchestration.pipeline) generation runs in another process, so its busy times and its own
phases (startup, idle: waiting for a request or for newer weights, weight_sync, rollout, probe) are
measured there and added here with `add_generator`. `end_step` keeps the ended step's wall-clock
(`last_step_time_s`, the time since the previous `end_step`), busy times (`last_busy`) and
generator phases (`last_generator_phases`) for its record.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

EXCLUDED_FROM_TRAINING = ("eval", "checkpoint")
RESOURCES = ("generation", "env", "world_model", "judge", "teacher", "trainer")


class Ledger:
    def __init__(self, train_time_offset: float = 0.0, wall_time_offset: float = 0.0,
                 clock=time.monotonic):
        self._clock = clock
        self._start = clock()
        self._train_offset = train_time_offset
        self._wall_offset = wall_time_offset
        self._excluded = 0.0
        self._depth = 0
        self.step_phases: dict[str, float] = defaultdict(float)  # since the last `end_step`
        self.totals: dict[str, float] = defaultdict(float)
        self.step_busy: dict[str, float] = defaultdict(float)  # since the last `end_step`
        self.busy_totals: dict[str, float] = defaultdict(float)
        self.generator_step_phases: dict[str, float] = defaultdict(float)  # since the last `end_step`
        self.generator_totals: dict[str, float] = defaultdict(float)
        self._holders: dict[str, int] = defaultdict(int)  # per resource: holders now
        self._busy_since: dict[str, float] = {}  # per held resource: when its current interval began
        self._step_start = self._start
        self.last_step_time_s = 0.0
        self.last_busy: dict[str, float] = {}
        self.last_generator_phases: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self._depth:  # nested: the outer phase owns this time
            yield
            return
        self._depth += 1
        t0 = self._clock()
        try:
            yield
        finally:
            dt = self._clock() - t0
            self._depth -= 1
            self.step_phases[name] += dt
            self.totals[name] += dt
            if name in EXCLUDED_FROM_TRAINING:
                self._excluded += dt
            if name == "train":
                self._add_busy("trainer", dt)

    @contextmanager
    def busy(self, resource: str) -> Iterator[None]:
        """`resource` works inside the block; blocks of one resource may overlap (their union counts)."""
        if self._holders[resource] == 0:
            self._busy_since[resource] = self._clock()
        self._holders[resource] += 1
        try:
            yield
        finally:
            self._holders[resource] -= 1
            if self._holders[resource] == 0:
                self._add_busy(resource, self._clock() - self._busy_since.pop(resource))

    def _add_busy(self, resource: str, seconds: float) -> None:
        self.step_busy[resource] += seconds
        self.busy_totals[resource] += seconds

    def wall_time(self) -> float:
        return self._wall_offset + self._clock() - self._start

    def train_time(self) -> float:
        return self._train_offset + self._clock() - self._start - self._excluded

    def add_generator(self, phases: dict[str, float], busy: dict[str, float]) -> None:
        """The generator process's own phases and its busy seconds per resource since its last answer."""
        for name, seconds in phases.items():
            self.generator_step_phases[name] += seconds
            self.generator_totals[name] += seconds
        for resource, seconds in busy.items():
            self._add_busy(resource, seconds)

    def end_step(self) -> dict[str, float]:
        """The phase times of the step that just ended; starts a new step. A resource held across
        the boundary counts up to it in the ended step and from it in the next."""
        now = self._clock()
        for resource in list(self._busy_since):
            self._add_busy(resource, now - self._busy_since[resource])
            self._busy_since[resource] = now
        self.last_step_time_s, self._step_start = now - self._step_start, now
        self.last_busy = dict(self.step_busy)
        self.step_busy.clear()
        self.last_generator_phases = dict(self.generator_step_phases)
        self.generator_step_phases.clear()
        out = dict(self.step_phases)
        self.step_phases.clear()
        return out
