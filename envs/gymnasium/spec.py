"""The gymnasium adapter's EnvSpec: one gymnasium env id (env option `id`) as a text env.

Tasks are reset seeds: split "train" plays seeds 0..train_tasks-1, "test" the next test_tasks seeds
(task id "seed-N"); the task type is the env id. Options:
  id            the gymnasium env id, e.g. FrozenLake-v1 (required)
  make_kwargs   keyword arguments of gymnasium.make, e.g. {is_slippery: false}
  actions       the names of a Discrete action space's actions, in order (known for FrozenLake,
                CliffWalking, Taxi and Blackjack); not used by a Text action space
  task          the goal the prompt states (default: "reach the goal of <id>")
  train_tasks, test_tasks   the number of seeds in each split
envs/gymnasium/env.py states how observations, actions, rewards and ends map to text and outcomes.
There is no expert: a gymnasium env has none to give.
"""

from __future__ import annotations

import importlib.util
from typing import Any, NoReturn

from envs.adapters import SeedTasks
from envs.base import ParsedAction, extract_action
from envs.gymnasium.env import GymnasiumEnv, is_text_space, make_gym_env

INSTALL = 'pip install -e ".[gymnasium]"'
OPTIONS: dict[str, Any] = {"id": None, "make_kwargs": {}, "actions": None, "task": None, "train_tasks": 200,
                           "test_tasks": 50}
KNOWN_ACTIONS = {
    "FrozenLake-v1": ["left", "down", "right", "up"],
    "FrozenLake8x8-v1": ["left", "down", "right", "up"],
    "CliffWalking-v1": ["up", "right", "down", "left"],
    "Taxi-v4": ["south", "north", "east", "west", "pickup", "dropoff"],
    "Blackjack-v1": ["stick", "hit"],
}


def checked_env_id(env_id: Any) -> str:
    """The option `id`, checked against gymnasium's registry (the package must be installed)."""
    if importlib.util.find_spec("gymnasium") is None:
        raise ValueError(f"env gymnasium needs the gymnasium package, which is not installed: {INSTALL}")
    import gymnasium

    if not env_id:
        raise ValueError("env gymnasium needs option `id`, a gymnasium env id, e.g. env.options.id=FrozenLake-v1")
    if env_id not in gymnasium.envs.registry:
        near = [name for name in gymnasium.envs.registry if str(env_id).split("-")[0].lower() in name.lower()]
        raise ValueError(f"unknown gymnasium env id {env_id!r}" + (f"; did you mean {', '.join(near)}?" if near else ""))
    return env_id


def checked_actions(env_id: str, make_kwargs: dict[str, Any], actions: list[str] | None) -> list[str]:
    """The action names: none for a Text action space, else one per Discrete action."""
    import gymnasium

    env = make_gym_env(env_id, make_kwargs)
    space = env.action_space
    env.close()
    if is_text_space(space):
        return []
    if not isinstance(space, gymnasium.spaces.Discrete):
        raise ValueError(f"gymnasium env {env_id}: action space {space} is neither Text nor Discrete")
    names = list(actions or KNOWN_ACTIONS.get(env_id, []))
    if len(names) != space.n or len(set(names)) != len(names):
        raise ValueError(f"gymnasium env {env_id} has {space.n} actions: set env.options.actions to {space.n} "
                         f"distinct names, in the order of the action indices (got {names or 'none'})")
    return names


class GymnasiumSpec(SeedTasks):
    name = "gymnasium"
    default_max_turns = 20
    observation_version = "1"

    def __init__(self, config: Any, data_dir: str | None = None):
        # data_dir is not used: the env makes its own states from seeds
        self.options = self.check_block(config, OPTIONS)
        self.env_id = self.task_kind = checked_env_id(self.options["id"])
        self.check_task_types()
        self.make_kwargs = dict(self.options["make_kwargs"])
        self.actions = checked_actions(self.env_id, self.make_kwargs, self.options["actions"])
        self.task = self.options["task"] or f"reach the goal of {self.env_id}"

    def make(self) -> GymnasiumEnv:
        return GymnasiumEnv(self.env_id, self.make_kwargs, self.actions, self.task)

    def expert(self, task_id: str) -> NoReturn:
        raise ValueError("env gymnasium has no expert (a gymnasium env has none to give); train a teacher by "
                         "other means or distill from an existing one")

    def parse_action(self, text: str) -> ParsedAction:
        parsed = extract_action(text)
        return ParsedAction(parsed.action, parsed.valid and (not self.actions or parsed.action in self.actions))
