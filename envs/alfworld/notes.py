"""A notebook of what an ALFWorld agent has seen (the env option `notes`).

ALFWorld hides where things are: an agent must search the room's receptacles one by one and
remember where it has been. A model with a long context can keep that memory itself; a tiny one
cannot, and loops. With the env option `notes: true` the env appends one line to each observation,

    [Notes] You are at: desk 1, where you see: pen 1, book 2. You hold: nothing. Not visited: shelf 1,
    shelf 2, drawer 1.

so that the next action can be read off the current turn, also after a command the engine refused
("Nothing happens."). Teacher and student see the same line.

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
    visited, kept from the commands it played and the engine's answers. Once every receptacle is
    visited, the search starts over (an object may have been missed behind a closed door)."""

    receptacles: list[str] = field(default_factory=list)
    location: str | None = None
    here: list[str] | None = None  # what the location shows; None: closed (or not looked at)
    holding: str | None = None
    visited: set[str] = field(default_factory=set)

    @classmethod
    def from_first_observation(cls, observation: str) -> Notebook:
        match = _ROOM_RE.search(observation)
        return cls(receptacles=_NAME_RE.findall(match.group(1)) if match else [])

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
        elif action.startswith("move ") and observation.startswith("You move"):
            self.here = [*(self.here or []), self.holding] if self.holding else self.here
            self.holding = None
        seen = _SEEN_RE.search(observation)
        if seen and action.split()[0] in ("go", "open"):
            self.here = _NAME_RE.findall(seen.group(1))

    def not_visited(self, admissible: list[str] | None = None) -> list[str]:
        """Receptacles not visited yet; with `admissible`, only those the agent can go to now."""
        return [r for r in self.receptacles
                if r not in self.visited and (admissible is None or f"go to {r}" in admissible)]

    def line(self, admissible: list[str] | None = None) -> str:
        places = ", ".join(self.not_visited(admissible)[:NOT_VISITED_SHOWN]) or "none"
        if self.location is None:
            where = "the start"
        elif self.here is None:
            where = f"{self.location} (closed)"
        else:
            where = f"{self.location}, where you see: {', '.join(self.here) or 'nothing'}"
        return (f"{NOTES_PREFIX} You are at: {where}. You hold: {self.holding or 'nothing'}. "
                f"Not visited: {places}.")
