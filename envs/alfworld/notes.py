"""A notebook of what an ALFWorld agent has seen (the env option `notes`).

ALFWorld hides where things are: an agent must search the room's receptacles one by one and
remember where it has been. A model with a long context can keep that memory itself; a tiny one
cannot, and loops. With the env option `notes: true` the env appends one line to each observation,

    [Notes] You are at: desk 1. Needed here: book 2. You hold: nothing. Not visited: shelf 1, drawer 1.

(for "put a book on a shelf": "needed here" is the task's object where the agent stands, then, for
a lamp task, the lamp; a place of the goal's kind is starred, "You are at: shelf 1*"), so that the
next action can be read off the current turn, also after a command the engine refused ("Nothing
happens."). Teacher and student see the same line. This is the memory and attention a larger model
brings by itself; it makes ALFWorld playable by models of a few hundred thousand parameters (the
quickstart), and it is off unless a recipe turns it on.

The explorer expert (envs.alfworld.experts.ExplorerExpert) plays from the same notebook.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

NOTES_PREFIX = "[Notes]"
NOT_VISITED_SHOWN = 3  # places listed; the next one to visit is the first

_ROOM_RE = re.compile(r"Looking quickly around you, you see (.*?)\.\s*(?:\n|$)")
_NAME_RE = re.compile(r"\b([a-z]+ \d+)\b")
_SEEN_RE = re.compile(r"you see (.*?)\.\s*(?:\n|$)")


@dataclass
class Notebook:
    """Where the agent is and what it saw there, what it holds and which receptacles it has not
    visited, kept from the commands it played and the engine's answers. The types the task needs
    (`wanted`: its object, then its light) and its `destination` type come from the task. The search starts over when the agent picks something up (it now looks
    for a destination or a light) and once every receptacle is visited."""

    receptacles: list[str] = field(default_factory=list)
    wanted: tuple[str, ...] = ()
    destination: str = ""
    location: str | None = None
    here: list[str] | None = None  # what the location shows; None: closed (or not looked at)
    holding: str | None = None
    visited: set[str] = field(default_factory=set)

    @classmethod
    def for_task(cls, params: dict, first_observation: str) -> Notebook:
        """The notebook of a task (`task_params`) at its first observation."""
        match = _ROOM_RE.search(first_observation)
        wanted = tuple(t.lower() for t in (params["object_target"], params["toggle_target"]) if t)
        return cls(receptacles=_NAME_RE.findall(match.group(1)) if match else [], wanted=wanted,
                   destination=params["parent_target"].lower())

    def update(self, action: str, observation: str) -> None:
        if observation.startswith("Nothing happens"):
            return
        if action.startswith("go to "):
            self.location, self.here = action.removeprefix("go to "), None
            self.visited.add(self.location)
            if not self.not_visited():
                self.visited = {self.location}
        elif action.startswith("take ") and observation.startswith("You pick up"):
            self.holding = action.removeprefix("take ").split(" from ")[0]
            self.here = [thing for thing in self.here or [] if thing != self.holding]
            self.visited = {self.location} if self.location else set()
        elif action.startswith("move ") and observation.startswith("You move"):
            self.here = [*(self.here or []), self.holding] if self.holding else self.here
            self.holding = None
        seen = _SEEN_RE.search(observation)
        if seen and action.split()[0] in ("go", "open"):
            self.here = _NAME_RE.findall(seen.group(1))

    def not_visited(self, admissible: list[str] | None = None) -> list[str]:
        """Receptacles not visited yet, in the room's order but, while holding something, places of
        the destination's kind first; with `admissible`, only those the agent can go to now."""
        places = [r for r in self.receptacles
                  if r not in self.visited and (admissible is None or f"go to {r}" in admissible)]
        if self.holding is not None and self.destination:
            places.sort(key=lambda r: r.split()[0] != self.destination)
        return places

    def needed_here(self) -> str | None:
        """The lowest-numbered thing here of the type the task needs next: its object while the
        hands are empty, then (look_at_obj_in_light) its light."""
        if self.holding is None:
            wanted = self.wanted[:1]
        else:
            wanted = self.wanted[1:]
        found = [t for t in self.here or [] if t.split()[0] in wanted]
        return min(found, key=lambda t: int(t.split()[1])) if found else None

    def line(self, admissible: list[str] | None = None) -> str:
        places = ", ".join(self.not_visited(admissible)[:NOT_VISITED_SHOWN]) or "none"
        if self.location is None:
            where = "the start"
        else:
            where = self.location + ("*" if self.location.split()[0] == self.destination else "")
            where += " (closed)" if self.here is None else ""
        return (f"{NOTES_PREFIX} You are at: {where}. Needed here: {self.needed_here() or 'nothing'}. "
                f"You hold: {self.holding or 'nothing'}. Not visited: {places}.")
