"""What one env worker runs, whatever hosts it: a process of the local pool (envs.pool) or a Ray actor
(envs.ray_pool). `WorkerEnvs` holds one `Env` per slot of the worker and answers one request at a time.
"""

from __future__ import annotations

import time
from typing import Any

from envs.base import EnvSpec, StepOutcome


def env_error(message: str) -> StepOutcome:
    """The outcome of an episode that the env (not the agent) ended."""
    return StepOutcome(observation="", done=True, won=False, info={"env_error": message})


class WorkerEnvs:
    """The envs of one worker's slots. A slot's game is closed when its episode ends, so a finished
    episode holds no memory; an exception raised by an env ends only that episode (its outcome names
    it). `step_latency_s` waits before every request, as a costly env's worker would be held."""

    def __init__(self, spec: EnvSpec, step_latency_s: float = 0.0):
        self.spec = spec
        self.step_latency_s = step_latency_s
        self.envs: dict[int, Any] = {}

    def answer(self, command: str, slot: int, arg: str) -> StepOutcome:
        """A "reset" (arg: the task id) or a "step" (arg: the action) of the slot's episode."""
        if self.step_latency_s:
            time.sleep(self.step_latency_s)
        try:
            if command == "reset":
                if slot not in self.envs:
                    self.envs[slot] = self.spec.make()
                outcome = self.envs[slot].reset(arg)
            else:
                outcome = self.envs[slot].step(arg)
        except Exception as exc:
            outcome = env_error(f"{type(exc).__name__}: {exc}")
        if outcome.done and slot in self.envs:
            self.envs[slot].close()
        return outcome

    def end(self, slots: list[int]) -> None:
        """Close the games of episodes the caller stopped early."""
        for slot in slots:
            if slot in self.envs:
                self.envs[slot].close()

    def close(self) -> None:
        for env in self.envs.values():
            env.close()
