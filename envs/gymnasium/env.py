"""One gymnasium episode at a time, as text, inside an env-pool worker.

The mapping (stated, the same for every env id):
- observation: a `Text` space's string as it is; else the env's ANSI rendering (render_mode "ansi",
  e.g. FrozenLake's grid; the highlighted cell, the agent's, is written in [brackets], colours dropped);
  else the observation's repr ("observation: (14, 10, 0)" for Blackjack);
- action: a `Text` space takes the action text; a `Discrete` space takes one of the action names
  (the spec's `actions`, name i = action i); anything else is invalid and not played;
- reward: gymnasium's reward of the step; done: terminated or truncated; won: terminated with a
  positive reward (FrozenLake's goal, Taxi's drop-off, a won Blackjack hand).
"""

from __future__ import annotations

import re
from typing import Any

from envs.adapters import seed_of
from envs.base import StepOutcome

_HIGHLIGHT = re.compile(r"\x1b\[4\dm(.*?)\x1b\[0m")  # a background colour: the agent's cell
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def make_gym_env(env_id: str, make_kwargs: dict[str, Any]) -> Any:
    """gymnasium.make, with the ANSI rendering when the env has one."""
    import gymnasium

    env = gymnasium.make(env_id, **make_kwargs)
    if "ansi" in env.metadata.get("render_modes", []):
        env.close()
        env = gymnasium.make(env_id, render_mode="ansi", **make_kwargs)
    return env


def is_text_space(space: Any) -> bool:
    import gymnasium

    return isinstance(space, gymnasium.spaces.Text)


class GymnasiumEnv:
    """The Env of one pool slot: a gymnasium env made on first reset; task ids are reset seeds."""

    def __init__(self, env_id: str, make_kwargs: dict[str, Any], actions: list[str], task: str):
        self.env_id, self.make_kwargs, self.actions, self.task = env_id, make_kwargs, actions, task
        self.env: Any = None
        self.observation = ""

    def text(self, observation: Any) -> str:
        if is_text_space(self.env.observation_space):
            return observation
        if self.env.render_mode == "ansi":
            return _ANSI.sub("", _HIGHLIGHT.sub(r"[\1]", self.env.render())).strip("\n")
        return f"observation: {observation!r}"

    def reset(self, task_id: str) -> StepOutcome:
        if self.env is None:
            self.env = make_gym_env(self.env_id, self.make_kwargs)
        observation, _ = self.env.reset(seed=seed_of(task_id))
        self.observation = self.text(observation)
        return StepOutcome(self.observation, admissible=self.actions or None, info={"task": self.task})

    def step(self, action: str) -> StepOutcome:
        if is_text_space(self.env.action_space):
            played: Any = action
            valid = self.env.action_space.contains(action)
        else:
            played = self.actions.index(action) if action in self.actions else None
            valid = played is not None
        if not valid:  # not played: the same observation again
            return StepOutcome(self.observation, admissible=self.actions or None, info={"invalid": True})
        observation, reward, terminated, truncated, _ = self.env.step(played)
        self.observation = self.text(observation)
        return StepOutcome(self.observation, reward=float(reward), done=terminated or truncated,
                           won=bool(terminated and reward > 0), admissible=self.actions or None)

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
