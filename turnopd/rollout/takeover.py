"""Takeovers: an episode that starts from another episode's state. `Takeover` stands in for the env
pool: each slot's reset replays its given actions in the real env first, and its outcome carries
them as "prior_steps" (turnopd.rollout.render.PriorStep), and the reset's "task", which the agent loop puts
in the prompt history but not in the trajectory (turnopd.rollout.agent_loop). The teacher audit takes over student states
this way (turnopd.orchestration.audit)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from envs.base import StepOutcome
from turnopd.rollout.render import PriorStep


class Takeover:
    """The env pool `real`, with slot i's episode first replaying replays[i] (stopped where the env
    ends the episode)."""

    ledger_resource = "env"  # its steps are the real env's

    def __init__(self, real: Any, replays: Sequence[Sequence[str]]):
        self.real, self.replays = real, replays

    async def reset_slot(self, slot: int, task_id: str) -> StepOutcome:
        outcome = reset = await self.real.reset_slot(slot, task_id)
        prior: list[PriorStep] = []
        for action in self.replays[slot]:
            if outcome.done:
                break
            next_outcome = await self.real.step_slot(slot, action)
            prior.append(PriorStep(outcome.observation, outcome.admissible, action, outcome.info))
            outcome = next_outcome
        if not prior:
            return outcome
        return dataclasses.replace(outcome, info={**outcome.info, "task": reset.info.get("task", ""), "prior_steps": prior})

    async def step_slot(self, slot: int, action: str) -> StepOutcome:
        return await self.real.step_slot(slot, action)

    def end(self, slots: list[int]) -> None:
        self.real.end(slots)
