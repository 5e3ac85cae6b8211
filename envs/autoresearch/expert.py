"""The autoresearch expert: coordinate search over the oracle (the memo of job results, which tells
exactly what any change would score, running the job when it is not known yet).

From the best configuration so far it takes the knobs in turn, from where it stopped: for a knob it
scores every other value of it and plays the best one if that beats the best accuracy (ties go to
the value listed first), else it moves on to the next knob. It submits when a whole round of the
knobs found nothing, or after `passes` rounds. Every move it plays is one the env keeps.

It reads the state from the outcome (info["config"], info["best"]), so it can label states another
player reached (envs.base.RelabellingExpert). Its jobs run in the process that asks for its actions
(the main process), through the same memo as the env's when the on-disk cache is on.
"""

from __future__ import annotations

from envs.autoresearch.train import KNOB_VALUES, KNOBS, Oracle, Problem, config_from, with_value
from envs.base import StepOutcome

PASSES = 3  # rounds over the knobs at most ("a few passes"): each costs ~40 jobs


class CoordinateSearchExpert:
    def __init__(self, problem: Problem, oracle: Oracle, passes: int = PASSES):
        self.problem = problem
        self.oracle = oracle
        self.passes = passes
        self.cursor = 0  # the next knob to try
        self.tried = 0  # knobs tried so far
        self.fruitless = 0  # knobs tried in a row that found nothing

    def act(self, outcome: StepOutcome) -> str:
        return self.label(outcome)

    def label(self, outcome: StepOutcome) -> str:
        if "config" not in outcome.info:
            raise ValueError("the autoresearch expert acts on the env's outcomes, whose info['config'] holds the "
                             "best configuration so far")
        config, best = config_from(outcome.info["config"]), outcome.info["best"]
        while self.fruitless < len(KNOBS) and self.tried < self.passes * len(KNOBS):
            index = self.cursor
            knob, current = KNOBS[index].name, config[index]
            self.cursor = (index + 1) % len(KNOBS)
            self.tried += 1
            scored = [(self.oracle.result(self.problem, with_value(config, knob, value)).accuracy, value)
                      for value in KNOB_VALUES[knob] if value != current]
            accuracy, value = max(scored, key=lambda pair: pair[0])  # max keeps the first of equals
            if accuracy > best:
                self.fruitless = 0
                return f"set {knob} {value}"
            self.fruitless += 1
        return "submit"

    def follow(self, command: str) -> None:
        """Nothing to track: the state is read from each outcome, whoever played the command."""
