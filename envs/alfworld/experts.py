"""ALFWorld experts, one object per episode, `act(outcome) -> command` (the main process runs them).

- `WalkthroughExpert`: the game file's `walkthrough`, the plan the game was generated with. It knows
  where every object is, so it wins in a handful of steps.
- `HandcodedExpert`: alfworld's own handcoded expert (alfworld.agents.expert), which explores
  receptacles from what the observations say, as a model that has never seen the game must. It reads
  the engine's facts (the env sends them in info["facts"] when this expert is selected).

Both assume the command they returned was the one played.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

from envs.alfworld.game import import_alfworld
from envs.base import StepOutcome

FALLBACK_COMMAND = "look"  # what ALFWorld's expert wrapper plays when it has nothing better
HANDCODED_MAX_STEPS = 200  # as alfworld's AlfredExpert wrapper


class WalkthroughExpert:
    def __init__(self, walkthrough: list[str]):
        self.walkthrough = list(walkthrough)
        self.played = 0

    def act(self, outcome: StepOutcome) -> str:
        if self.played >= len(self.walkthrough):
            return FALLBACK_COMMAND
        self.played += 1
        return self.walkthrough[self.played - 1]


def task_params(task_id: str) -> dict[str, Any]:
    """ALFRED's pddl_params from the task folder name `<type>-<object>-<movable recep>-<recep>-<scene>`
    (the 4th field is the light to toggle in look_at_obj_in_light), as alfworld's expert reads them
    from traj_data.json, which json_2.1.1 game folders do not carry."""
    import_alfworld()
    import alfworld.gen.constants as constants

    task_type, obj, mrecep, recep, _scene = task_id.split("/")[0].split("-")
    sliced = obj.endswith("Sliced")
    params = {
        "task_type": task_type,
        "object_target": obj.removesuffix("Sliced"),
        "object_sliced": sliced,
        "mrecep_target": "" if mrecep == "None" else mrecep,
        "parent_target": "" if task_type == "look_at_obj_in_light" else recep,
        "toggle_target": recep if task_type == "look_at_obj_in_light" else "",
    }
    # alfworld lower-cases the names that are ALFRED object classes (HandCodedAgent.reset)
    return {k: v.lower() if v in constants.OBJECTS else v for k, v in params.items()}


class HandcodedExpert:
    def __init__(self, task_id: str, seed: int = 0):
        import_alfworld()
        from alfworld.agents.expert import HandCodedTWAgent

        params = task_params(task_id)
        policy_class = HandCodedTWAgent(max_steps=HANDCODED_MAX_STEPS).get_task_policy(params)
        self.policy = policy_class(params, max_steps=HANDCODED_MAX_STEPS)
        self.last_command: str | None = None
        # The expert draws from the global `random`; it gets its own stream so that an episode is
        # reproducible from (task, seed) and the caller's random state is left alone.
        self._random_state = random.Random(f"{task_id}:{seed}").getstate()

    def act(self, outcome: StepOutcome) -> str:
        outer_state = random.getstate()
        random.setstate(self._random_state)
        try:
            command = self._next_command(outcome)
        finally:
            self._random_state = random.getstate()
            random.setstate(outer_state)
        self.last_command = command
        return command

    def _next_command(self, outcome: StepOutcome) -> str:
        from alfworld.agents.expert import HandCodedAgentFailed, HandCodedAgentTimeout

        if self.last_command is None:  # the reset observation lists the room's receptacles
            self.policy.observe(outcome.observation)
            return FALLBACK_COMMAND
        if "facts" not in outcome.info:
            raise ValueError("the handcoded ALFWorld expert needs the engine's facts: make the env with "
                             "options.expert=handcoded")
        admissible = outcome.admissible or []
        state = {
            "feedback": outcome.observation,
            "admissible_commands": admissible,
            "facts": [SimpleNamespace(name=name, names=args) for name, args in outcome.info["facts"]],
        }
        try:
            command = self.policy.act(state, _as_put(self.last_command))
        except (HandCodedAgentTimeout, HandCodedAgentFailed):
            return FALLBACK_COMMAND
        # HandCodedAgent.act's escape from repeating itself, then AlfredExpert's admissibility check
        if command == self.last_command or (self.last_command == "look" and command not in admissible):
            command = random.choice(admissible)
        return command if command in admissible else FALLBACK_COMMAND


def _as_put(command: str) -> str:
    """alfworld 0.4's grammar says "move X to Y" where the expert's state tracking still looks for the
    old "put X in/on Y" (it would never see an object leave its hands); show it the old verb."""
    return "put " + command.removeprefix("move ").replace(" to ", " in/on ", 1) if command.startswith("move ") else command
