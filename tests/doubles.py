"""In-process stand-ins used beside tests of the real engines (tests/envs/test_pool.py plays the real
EnvPool; tests/rollout/test_engine_alfworld.py the real ALFWorld games)."""

from __future__ import annotations

import asyncio
from typing import Any


class InProcessPool:
    """The EnvPool interface, its envs stepped in this process: the batch calls (reset, step) and
    the per-slot ones the rollout engine awaits (reset_slot, step_slot, end). Refuses to step an
    ended episode, as envs.pool.EnvPool does; records the slots stepped at each step index and the
    slots ended early."""

    num_workers = 1
    ledger_resource = "env"

    def __init__(self, spec: Any):
        self.spec = spec
        self.envs: dict[int, Any] = {}
        self.done: dict[int, bool] = {}
        self.steps: dict[int, int] = {}
        self.stepped: dict[int, list[int]] = {}  # step index -> slots stepped
        self.ended: list[int] = []

    async def reset_slot(self, slot: int, task_id: str):
        self.envs[slot] = self.spec.make()
        outcome = self.envs[slot].reset(task_id)
        self.done[slot], self.steps[slot] = outcome.done, 0
        return outcome

    async def step_slot(self, slot: int, action: str):
        assert not self.done[slot], "stepped an episode that had ended"
        self.stepped.setdefault(self.steps[slot], []).append(slot)
        self.steps[slot] += 1
        outcome = self.envs[slot].step(action)
        self.done[slot] = outcome.done
        return outcome

    def end(self, slots: list[int]) -> None:
        assert not any(self.done[s] for s in slots), "ended an episode that had ended"
        self.ended += slots

    def reset(self, task_ids: list[str]):
        return [asyncio.run(self.reset_slot(slot, task)) for slot, task in enumerate(task_ids)]

    def step(self, actions: dict[int, str]):
        return {slot: asyncio.run(self.step_slot(slot, action)) for slot, action in actions.items()}
