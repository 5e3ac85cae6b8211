"""Autoresearch: tune a real training job one change at a time. Each step trains an MLP (a real job,
envs.autoresearch.train) and answers with its validation accuracy.

Actions: `set KNOB VALUE` changes one knob of the best configuration so far and runs the job; the
change is kept if the accuracy beats the best, else reverted (keep-or-revert). `submit` ends the
episode. Anything else (an unknown knob or value, a value the knob already has, a step after the
end) is invalid: the env says why, lists the knobs and their values, and nothing changes. Every step
counts as a turn; the env ends the episode itself at its turn limit.

Reward: each step's rise of the best accuracy (a fraction: 0.05 is 5 points), so an episode's rewards
add up to its final improvement over the starting configuration; won: that improvement reached the
task's threshold.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from envs.autoresearch.data import load_dataset
from envs.autoresearch.train import (
    KNOB_NAMES,
    KNOB_VALUES,
    KNOBS,
    Config,
    Oracle,
    Problem,
    config_from,
    describe_config,
    with_value,
)
from envs.base import MetricReading, StepOutcome

MAX_ACTION_CHARS = 200


@dataclass(frozen=True)
class Task:
    """One task: a problem, the configuration it starts from and the improvement that wins."""

    task_id: str
    problem: Problem
    start: Config
    threshold: float  # accuracy points (a fraction) the best must rise by to win


def parse_command(action: str) -> tuple[str, str] | str:
    """`set KNOB VALUE` -> (knob, value as KNOBS spell it), `submit` -> ('submit', ''); anything else
    -> a sentence saying what is wrong. Command and knob are case-insensitive; a number may be written
    any way that equals an allowed value (1e-2 for 0.01)."""
    words = action.split()
    if len(action) > MAX_ACTION_CHARS or not words:
        return "an action is `set KNOB VALUE` or `submit`"
    if [w.lower() for w in words] == ["submit"]:
        return ("submit", "")
    if words[0].lower() != "set" or len(words) != 3:
        return "an action is `set KNOB VALUE` or `submit`"
    knob, value = words[1].lower(), words[2].lower()
    if knob not in KNOB_VALUES:
        return f"there is no knob {words[1]!r}"
    allowed = KNOB_VALUES[knob]
    if value in allowed:
        return (knob, value)
    try:
        number = float(value)
    except ValueError:
        number = None
    for spelled in allowed:
        try:
            if number is not None and float(spelled) == number:
                return (knob, spelled)
        except ValueError:  # a word-valued knob (optimizer, activation)
            break
    return f"{knob} cannot be {words[2]!r}"


def knob_table() -> str:
    return "; ".join(f"{k.name} ({k.meaning}): {', '.join(k.values)}" for k in KNOBS)


def percent(accuracy: float) -> str:
    return f"{100 * accuracy:.2f}%"


def points(change: float) -> str:
    return f"{100 * change:+.2f} points"


DIVERGED = " (training diverged: the loss became NaN)"


def job_report(knob: str, value: str, was: str, accuracy: float, diverged: bool, change: float, kept: bool) -> str:
    """The sentence a step that ran a job opens with; `read_job_report` reads it back."""
    return (f"Ran {knob}={value} (was {was}): validation accuracy {percent(accuracy)}{DIVERGED if diverged else ''}, "
            f"{points(change)} vs the best: {'kept' if kept else 'reverted'}.")


_JOB_REPORT = re.compile(r"Ran \S+=\S+ \(was \S+\): validation accuracy (?P<accuracy>\d+(?:\.\d+)?)%"
                         rf"(?:{re.escape(DIVERGED)})?, (?P<change>[+-]\d+(?:\.\d+)?) points vs the best: (?P<verdict>kept|reverted)\.")


def read_job_report(observation: str) -> MetricReading | None:
    """The accuracy and its change against the best (in percent and points, as written) and whether the
    change was kept, from an observation that opens with `job_report`'s sentence (the env's, or a world
    model's imitation of it); None for any other (an invalid action, a submit, text that does not
    follow the format)."""
    match = _JOB_REPORT.match(observation)
    return None if match is None else MetricReading(float(match["accuracy"]), match["verdict"] == "kept",
                                                    float(match["change"]))


@dataclass(frozen=True)
class State:
    """What an observation says of the episode's state (`AutoresearchEnv._state`'s sentence)."""

    best: float  # the best accuracy so far, a fraction (as written: to 0.01 points)
    over_start: float  # its rise over the start's
    config: Config  # the best configuration
    turns_left: int  # 0 once the episode is over


_STATE = re.compile(r"Best accuracy (?P<best>\d+(?:\.\d+)?)% \((?P<over>[+-]\d+(?:\.\d+)?) points over the start\) "
                    r"with (?P<config>.+?)\. (?:(?P<left>\d+) turn\(s\) left\.|The episode is over\.)")


def read_state(observation: str) -> State:
    """The state an env observation ends with (ValueError for text without one)."""
    match = _STATE.search(observation)
    if match is None:
        raise ValueError(f"no autoresearch state in {observation[:120]!r}")
    values = dict(pair.split("=", 1) for pair in match["config"].split(", "))
    return State(float(match["best"]) / 100, float(match["over"]) / 100, config_from(values),
                 int(match["left"] or 0))


class AutoresearchEnv:
    """The Env of one pool slot. `tasks`: the tasks it may be reset to, by id; `max_turns`: the turn
    limit at which it ends an episode itself; `oracle`: the memo of job results it runs jobs through.

    Outcomes carry in info: "config" (the best configuration, {knob: value}), "best" and "start"
    (accuracies), "turns_left", "threshold"; after a step also "invalid", and for a job "accuracy",
    "kept", "job_seconds"; at the end "improvement"."""

    def __init__(self, tasks: dict[str, Task], max_turns: int, oracle: Oracle):
        self.tasks = tasks
        self.max_turns = max_turns
        self.oracle = oracle
        self.task: Task | None = None
        self.config: Config = ()
        self.start_accuracy = self.best = 0.0
        self.turns = 0
        self.done = False

    def reset(self, task_id: str) -> StepOutcome:
        if task_id not in self.tasks:
            raise KeyError(f"unknown autoresearch task id {task_id!r} (ids are DATASET-mlp-sN, see spec.tasks())")
        self.task = self.tasks[task_id]
        self.config = self.task.start
        self.start_accuracy = self.best = self.oracle.result(self.task.problem, self.config).accuracy
        self.turns = 0
        self.done = False
        observation = (f"The starting configuration reaches a validation accuracy of {percent(self.best)}. "
                       f"{self._state()}")
        return self._outcome(observation, 0.0, info={"task": self._goal()})

    def resume(self, task_id: str, config: Config, best: float, start_accuracy: float, turns: int) -> None:
        """Put the env in a state without running a job (a world model's step from a state it read)."""
        self.task, self.config, self.best, self.start_accuracy = self.tasks[task_id], config, best, start_accuracy
        self.turns, self.done = turns, turns >= self.max_turns

    def step(self, action: str) -> StepOutcome:
        if self.task is None:
            raise RuntimeError("AutoresearchEnv.step called before reset")
        if self.done:
            return self._outcome("The episode is over.", 0.0, info={"invalid": True})
        self.turns += 1
        command = parse_command(action)
        if isinstance(command, tuple) and command[0] in KNOB_VALUES and command[1] == self._value(command[0]):
            command = f"{command[0]} is already {command[1]}"  # a no-op would cost a job for nothing
        if isinstance(command, str):
            self.done = self.turns >= self.max_turns
            observation = (f"Invalid action: {command}. Write `set KNOB VALUE` to change one knob or `submit` to "
                           f"finish. The knobs and their values: {knob_table()}. {self._state()}")
            return self._outcome(observation, 0.0, info={"invalid": True})
        knob, value = command
        if knob == "submit":
            self.done = True
            return self._outcome(f"Submitted. {self._state()}", 0.0, info={"invalid": False})
        was = self._value(knob)
        candidate = with_value(self.config, knob, value)
        result = self.oracle.result(self.task.problem, candidate)
        kept = result.accuracy > self.best
        change = result.accuracy - self.best
        rise = max(change, 0.0)
        if kept:
            self.config, self.best = candidate, result.accuracy
        self.done = self.turns >= self.max_turns
        observation = f"{job_report(knob, value, was, result.accuracy, result.diverged, change, kept)} {self._state()}"
        return self._outcome(observation, rise, info={"invalid": False, "accuracy": result.accuracy, "kept": kept,
                                                      "job_seconds": result.seconds})

    def _value(self, knob: str) -> str:
        return self.config[KNOB_NAMES.index(knob)]

    def _goal(self) -> str:
        assert self.task is not None
        problem = self.task.problem
        return (f"Raise by at least {100 * self.task.threshold:.0f} points over its starting configuration the "
                f"validation accuracy of an MLP trained for {problem.steps} steps on "
                f"{load_dataset(problem.dataset).describe()}.")

    def _state(self) -> str:
        left = self.max_turns - self.turns
        ending = "The episode is over." if self.done else f"{left} turn(s) left."
        return (f"Best accuracy {percent(self.best)} ({points(self.best - self.start_accuracy)} over the start) with "
                f"{describe_config(self.config)}. {ending}")

    def _outcome(self, observation: str, reward: float, info: dict) -> StepOutcome:
        assert self.task is not None
        improvement = self.best - self.start_accuracy
        # the tolerance: accuracies are fractions k/n, whose differences miss a round threshold by
        # a rounding error (0.8125 - 0.7125 < 0.1)
        won = self.done and improvement >= self.task.threshold - 1e-9
        info |= {"config": dict(zip(KNOB_NAMES, self.config, strict=True)), "best": self.best,
                 "start": self.start_accuracy, "turns_left": self.max_turns - self.turns,
                 "threshold": self.task.threshold}
        if self.done:
            info["improvement"] = improvement
            observation += f" Final improvement {points(improvement)}: {'won' if won else 'not won'}."
        return StepOutcome(observation=observation, reward=reward, done=self.done, won=won,
                           admissible=None if self.done else self._admissible(), info=info)

    def _admissible(self) -> list[str]:
        """Every single change of the best configuration, then submit."""
        return [f"set {name} {value}" for name, current in zip(KNOB_NAMES, self.config, strict=True)
                for value in KNOB_VALUES[name] if value != current] + ["submit"]

    def close(self) -> None:
        self.task = None
