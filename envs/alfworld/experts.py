"""ALFWorld experts, one object per episode, `act(outcome) -> command` (the main process runs them).

- `WalkthroughExpert`: the game file's `walkthrough`, the plan the game was generated with. It knows
  where every object is, so it wins in a handful of steps.
- `HandcodedExpert`: alfworld's own handcoded expert (alfworld.agents.expert), which explores
  receptacles from what the observations say, as a model that has never seen the game must. It reads
  the engine's facts (the env sends them in info["facts"] when this expert is selected).

- `ExplorerExpert`: plays `pick_and_place_simple` and `look_at_obj_in_light` games from the notebook
  the env option `notes` shows the agent (envs.alfworld.notes), deterministically: take the target
  object where it is seen, else open the closed receptacle it stands at, else go to the first place
  not visited yet; once holding the object, search again for the light (and use it) or for a
  receptacle of the goal type (open it if needed, put the object there). It never reads the
  engine's hidden facts, so every action it takes can be learnt from what the prompt shows.

All assume the command they returned was the one played, but the explorer, which can also label the
states another player reached (`label`, then `follow` with the command that player took: the
envs.base.RelabellingExpert protocol, for DAgger-style teacher data).
"""

from __future__ import annotations

import random
from types import SimpleNamespace

from envs.alfworld.game import import_alfworld, task_params  # noqa: F401  (task_params: re-exported)
from envs.alfworld.notes import Notebook
from envs.base import StepOutcome

FALLBACK_COMMAND = "look"  # what ALFWorld's expert wrapper plays when it has nothing better
HANDCODED_MAX_STEPS = 200  # as alfworld's AlfredExpert wrapper
EXPLORER_TASK_TYPES = ("pick_and_place_simple", "look_at_obj_in_light")


class WalkthroughExpert:
    def __init__(self, walkthrough: list[str]):
        self.walkthrough = list(walkthrough)
        self.played = 0

    def act(self, outcome: StepOutcome) -> str:
        if self.played >= len(self.walkthrough):
            return FALLBACK_COMMAND
        self.played += 1
        return self.walkthrough[self.played - 1]


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


class ExplorerExpert:
    """Plays one episode from the notebook (see the module docstring)."""

    def __init__(self, task_id: str, noise: float = 0.0, seed: int = 0):
        params = task_params(task_id)
        if params["task_type"] not in EXPLORER_TASK_TYPES:
            raise ValueError(f"the explorer ALFWorld expert plays {', '.join(EXPLORER_TASK_TYPES)}, not "
                             f"{params['task_type']}; use options.expert=handcoded for the other task types")
        self.task_type = params["task_type"]
        self.destination = params["parent_target"].lower()
        self.params = params
        self.notes: Notebook | None = None
        self.last_command: str | None = None
        # DART-style noise: with probability `noise` a mistake is played instead (a detour to a random
        # place, or a command the engine refuses), so that demonstrations show how to recover from one.
        # `exploring` marks that turn: it is played, not imitated.
        self.noise = noise
        self.exploring = False
        self._rng = random.Random(f"{task_id}:{seed}")

    def act(self, outcome: StepOutcome) -> str:
        command = self.label(outcome)
        self.exploring = self._rng.random() < self.noise
        if self.exploring:
            command = self._mistake(command, outcome.admissible or [])
        self.follow(command)
        return command

    def label(self, outcome: StepOutcome) -> str:
        """Its own choice after `outcome`, from the notebook kept of the commands followed so far."""
        if self.notes is None:
            self.notes = Notebook.for_task(self.params, outcome.observation)
        else:
            self.notes.update(self.last_command or "", outcome.observation)
        return self._choose(outcome.admissible or [])

    def follow(self, command: str) -> None:
        self.last_command = command

    def _mistake(self, command: str, admissible: list[str]) -> str:
        others = [a for a in admissible if a.startswith("go to ") and a != command]  # a detour
        if others and self._rng.random() < 0.5:
            return self._rng.choice(others)
        return f"go to {self.notes.location}" if self.notes and self.notes.location else "go to nowhere"

    def _choose(self, admissible: list[str]) -> str:
        notes = self.notes
        assert notes is not None
        here = notes.location
        opened = here is not None and f"close {here}" in admissible
        needed = notes.needed_here()  # what the notes line shows: its action can be copied from it
        if notes.holding is None:
            take = f"take {needed} from {here}" if needed else None
            if take in admissible:
                return take
            if here is not None and f"open {here}" in admissible and not opened:
                return f"open {here}"
            return self._explore(admissible)
        if self.task_type == "look_at_obj_in_light":
            return f"use {needed}" if needed and f"use {needed}" in admissible else self._explore(admissible)
        # holding the object: search for a receptacle of the destination type, open it, put it there
        if here is not None and here.split()[0] == self.destination:
            put = f"move {notes.holding} to {here}"
            if put in admissible:
                return put
            if f"open {here}" in admissible:
                return f"open {here}"
        return self._explore(admissible)

    def _explore(self, admissible: list[str]) -> str:
        assert self.notes is not None
        places = self.notes.not_visited(admissible)
        return f"go to {places[0]}" if places else FALLBACK_COMMAND
