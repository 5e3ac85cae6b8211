"""Logged env transitions and the text a world model reads and writes.

A transition is one real env step: what the player had seen (the goal, the episode's first
observation, the last `history_length` (observation, action) pairs, the current observation), the
action it played, and what the env answered (the next observation; whether the episode ended, and
whether it was won). They come from expert demonstrations (`demo_transitions`) and from the
student's own episodes (`trajectory_transitions`). A world model (turnopd.orchestration.world_model_training)
learns to write the env's answer from the context, both as plain text:

    prompt  Goal: <goal>
            Start: <first observation>            (from the second step on)
            Recent: [Observation k: '...', Action k: '...']   (when history_length > 0 and there is one)
            Now: <observation>
            Action: <action>
    answer  <status>
            <next observation>

where status is "continue", "won" or "lost" (ended, not won). The status comes first: one forward
pass over the prompt gives its probabilities (what the done/won calibration measures), and a
sampled answer says whether the episode ended before the text it shows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from envs.base import ParsedAction, format_history, recent_pairs
from envs.demonstrations import Demonstration
from turnopd.core.types import Trajectory

STATUSES = ("continue", "won", "lost")


@dataclass(frozen=True)
class Transition:
    task_id: str
    task: str  # the goal text
    first_observation: str  # the reset observation (in ALFWorld the room and its receptacles)
    history: tuple[tuple[str, str], ...]  # the last history_length (observation, action) pairs before this step
    step: int  # steps taken before this one
    observation: str
    action: str
    next_observation: str
    done: bool
    won: bool
    source: str  # "expert" or "student"

    @property
    def status(self) -> str:
        return status_of(self.done, self.won)


def status_of(done: bool, won: bool) -> str:
    if won and not done:
        raise ValueError("a won episode has ended: won=True needs done=True")
    return "won" if won else "lost" if done else "continue"


def world_prompt(task: str, first_observation: str, history: Sequence[tuple[str, str]], step: int,
                 observation: str, action: str) -> str:
    """The world model's prompt for playing `action` after `observation` (see the module docstring)."""
    lines = [f"Goal: {task}"]
    if step:
        lines.append(f"Start: {first_observation}")
    if history:
        lines.append(f"Recent: {format_history(list(history), step)}")
    return "\n".join([*lines, f"Now: {observation}", f"Action: {action}"])


def transition_prompt(t: Transition) -> str:
    return world_prompt(t.task, t.first_observation, t.history, t.step, t.observation, t.action)


def parse_world_answer(text: str) -> tuple[str, str] | None:
    """(status, observation) of a world model's answer; None when it does not start with a status line."""
    status, _, observation = text.partition("\n")
    status = status.strip()
    return (status, observation.strip()) if status in STATUSES else None


def episode_transitions(task_id: str, task: str, steps: Sequence[tuple[str, str]], final_observation: str,
                        ended: bool, won: bool, history_length: int, source: str) -> list[Transition]:
    """The transitions of one episode: `steps` its (observation seen, action played) pairs in order,
    `final_observation` what the env answered to the last action, `ended` whether the env ended the
    episode there (False: it stopped at a turn limit, still playing)."""
    out = []
    for i, (observation, action) in enumerate(steps):
        last = i == len(steps) - 1
        history = recent_pairs(steps[:i], history_length)
        out.append(Transition(
            task_id=task_id, task=task, first_observation=steps[0][0], history=tuple(history), step=i,
            observation=observation, action=action,
            next_observation=final_observation if last else steps[i + 1][0],
            done=ended and last, won=won and last, source=source))
    return out


def demo_transitions(demo: Demonstration, history_length: int) -> list[Transition]:
    """An expert demonstration's transitions (envs.demonstrations.Demonstration: its steps, final
    observation and ending), exploring mistakes included: they are real env answers too."""
    if not demo.steps:
        return []
    return episode_transitions(demo.task_id, demo.task, [(s.observation, s.action) for s in demo.steps],
                               demo.final_observation, demo.ended, demo.won, history_length, "expert")


def trajectory_transitions(trajectory: Trajectory, parse_action: Callable[[str], ParsedAction], history_length: int) -> list[Transition]:
    """A rollout's transitions (turnopd.core.types.Trajectory with its goal and final observation);
    each turn's action is what the env received (`parse_action` of the generated text). An episode
    an env error ended has none: its last answer is not the env's."""
    if trajectory.env_error or not trajectory.turns:
        return []
    steps = [(turn.observation, parse_action(turn.action_text).action) for turn in trajectory.turns]
    return episode_transitions(trajectory.task_id, trajectory.goal, steps, trajectory.final_observation,
                               trajectory.ended, trajectory.success, history_length, "student")


def split_episodes(transitions: Sequence[Transition]) -> list[list[Transition]]:
    """Transitions in the order `episode_transitions` wrote them, cut into their episodes (a new one at
    each step 0)."""
    episodes: list[list[Transition]] = []
    for t in transitions:
        if t.step == 0 or not episodes:
            episodes.append([])
        episodes[-1].append(t)
    return episodes
