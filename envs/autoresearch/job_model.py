"""A world model of autoresearch that predicts the job, not the text: the env itself, with each
training job replaced by a learned prediction of its validation accuracy.

WMRL's world model grades a change before paying for its job: it predicts the metric. A language
model of the env's text (turnopd world-model train) has to learn the report's wording and how ten
knobs interact from a few hundred transitions, and at the sizes this machine trains it did not learn
the second (docs/world-models.md). This model learns only the second, from numbers:

- Labels: the memo of job results is an exact oracle, so any (problem, configuration, change) can be
  labelled for one job's cost, without an agent. `label_changes` walks from each train task's start
  making random single changes, kept when they beat the best (the env's keep-or-revert: the states a
  player reaches), and adds every single change of a visited state that the memo already knows (the
  coordinate-search expert scored whole knobs of its states: free labels).
- Model: an ensemble of `members` small MLPs, each fitted on its own bootstrap resample, predicting
  the change of accuracy a change makes, Delta = acc(candidate) - acc(current), from the problem
  (log features, classes, examples, steps), the two configurations (`config_features`) and the
  current accuracy. Its members' spread is the model's uncertainty (a deep ensemble).
- Answers (`JobModelWorld.answers`): the world prompt's goal, current observation and action are
  read back (the env wrote them), the env is put in that state and steps with the predicted accuracy,
  snapped to the validation set's 1/n grid as the real job's is. So every answer has the env's exact
  wording, keep-or-revert, reward and ending; only the accuracy is predicted. Temperature 0: the
  ensemble's mean; above 0: each answer is one member drawn at random (seeded), so K answers
  disagree where the members do.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from envs.autoresearch.data import DATASETS, load_dataset
from envs.autoresearch.env import AutoresearchEnv, Task, read_state
from envs.autoresearch.train import KNOB_NAMES, KNOB_VALUES, Config, JobResult, Oracle, Problem, with_value
from envs.base import WorldAnswerer

JOB_MODEL_FILE = "job_model.pt"
OPTIMIZERS = KNOB_VALUES["optimizer"]
ACTIVATIONS = KNOB_VALUES["activation"]


def config_features(config: Config) -> list[float]:
    """16 numbers for a configuration: the numeric knobs on the scale their values are spaced on (log
    for lr, batch size, width and weight decay), the two word-valued ones one-hot."""
    k = dict(zip(KNOB_NAMES, config, strict=True))
    return [math.log10(float(k["lr"])), math.log2(float(k["batch_size"])), math.log2(float(k["width"])),
            float(k["depth"]), math.log10(float(k["weight_decay"]) + 1e-5), float(k["dropout"]),
            float(k["warmup"]), float(k["label_smoothing"]),
            *(float(k["optimizer"] == o) for o in OPTIMIZERS), *(float(k["activation"] == a) for a in ACTIVATIONS)]


@cache
def problem_features(dataset: str, steps: int) -> tuple[float, ...]:
    data = load_dataset(dataset)
    return (math.log2(data.features), math.log2(data.classes), math.log2(len(data.y_train)), steps / 1000)


def change_features(problem: Problem, current: Config, accuracy: float, candidate: Config) -> list[float]:
    """The model's input for one change: problem, current and candidate configuration, current accuracy."""
    return [*problem_features(problem.dataset, problem.steps), *config_features(current),
            *config_features(candidate), accuracy]


@dataclass(frozen=True)
class LabelledChange:
    problem: Problem
    current: Config
    accuracy: float  # the current (best) configuration's real accuracy
    candidate: Config
    candidate_accuracy: float  # the candidate's real accuracy (the job's, from the memo)


def single_changes(config: Config) -> list[Config]:
    return [with_value(config, knob, value) for knob in KNOB_NAMES for value in KNOB_VALUES[knob]
            if value != config[KNOB_NAMES.index(knob)]]


def label_changes(tasks: Sequence[Task], oracle: Oracle, walks: int, turns: int, seed: int) -> list[LabelledChange]:
    """Each task: `walks` keep-or-revert walks of `turns` random single changes from its start (each
    change's job run, or read from the memo), then every single change of every visited state that
    the memo knows by then (the walks' and, with the on-disk memo, every earlier job's). The walks are
    seeded; the memo's extra rows depend on what earlier runs trained."""
    rows: dict[tuple[str, Config, Config], LabelledChange] = {}
    for task in tasks:
        rng = random.Random(f"{seed}/{task.task_id}")
        states = {task.start: oracle.result(task.problem, task.start).accuracy}
        for _ in range(walks):
            config = task.start
            best = states[config]
            for _ in range(turns):
                candidate = rng.choice(single_changes(config))
                accuracy = oracle.result(task.problem, candidate).accuracy
                rows[(task.problem.key, config, candidate)] = LabelledChange(task.problem, config, best, candidate, accuracy)
                if accuracy > best:
                    config, best = candidate, accuracy
                    states[config] = best
        for state, best in states.items():
            for candidate in single_changes(state):
                result = oracle.memo.get((task.problem.key, candidate))
                if result is not None:
                    rows.setdefault((task.problem.key, state, candidate),
                                    LabelledChange(task.problem, state, best, candidate, result.accuracy))
    return list(rows.values())


class JobModel:
    """A deep ensemble of MLPs predicting Delta accuracy of a change (see the module docstring)."""

    def __init__(self, members: int = 8, hidden: int = 64, seed: int = 0):
        import torch
        from torch import nn

        self.members, self.hidden, self.seed = members, hidden, seed
        width = len(change_features(Problem("digits", 1), _any_config(), 0.0, _any_config()))
        with torch.random.fork_rng():  # seeded weights without moving the process's generator (a run's sampling)
            torch.manual_seed(seed)
            self.nets = nn.ModuleList(nn.Sequential(nn.Linear(width, hidden), nn.SiLU(), nn.Linear(hidden, hidden),
                                                    nn.SiLU(), nn.Linear(hidden, 1)) for _ in range(members))
        self.mean = torch.zeros(width)
        self.std = torch.ones(width)

    def fit(self, rows: Sequence[LabelledChange], steps: int, lr: float, weight_decay: float = 1e-4) -> tuple[float, float]:
        """Each member on its own bootstrap resample of `rows` (full batch, Adam, mean squared error
        of Delta); returns the members' mean first and final training losses."""
        import torch

        x = torch.tensor([change_features(r.problem, r.current, r.accuracy, r.candidate) for r in rows])
        y = torch.tensor([r.candidate_accuracy - r.accuracy for r in rows])
        self.mean, self.std = x.mean(0), x.std(0).clamp_min(1e-6)
        x = (x - self.mean) / self.std
        generator = torch.Generator().manual_seed(self.seed)
        losses = []  # (first, final) a member
        for net in self.nets:
            sample = torch.randint(len(rows), (len(rows),), generator=generator)
            optimizer = torch.optim.Adam(net.parameters(), lr=lr, weight_decay=weight_decay)
            for step in range(steps):
                loss = torch.mean((net(x[sample]).squeeze(-1) - y[sample]) ** 2)
                if step == 0:
                    first = loss.item()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            losses.append((first, loss.item()))
        return float(np.mean([f for f, _ in losses])), float(np.mean([f for _, f in losses]))

    def predict(self, changes: Sequence[tuple[Problem, Config, float, Config]]) -> np.ndarray:
        """[members, changes] predicted accuracies of the candidates (current accuracy + Delta)."""
        import torch

        x = torch.tensor([change_features(*c) for c in changes])
        x = (x - self.mean) / self.std
        with torch.no_grad():
            delta = torch.stack([net(x).squeeze(-1) for net in self.nets])
        return (delta + torch.tensor([c[2] for c in changes])).numpy()

    def save(self, folder: Path) -> None:
        import torch

        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"{JOB_MODEL_FILE}.tmp"
        torch.save({"members": self.members, "hidden": self.hidden, "seed": self.seed, "mean": self.mean,
                    "std": self.std, "nets": self.nets.state_dict()}, tmp)
        tmp.replace(folder / JOB_MODEL_FILE)

    @classmethod
    def load(cls, folder: Path) -> JobModel:
        import torch

        state = torch.load(Path(folder) / JOB_MODEL_FILE, weights_only=True)
        model = cls(state["members"], state["hidden"], state["seed"])
        model.nets.load_state_dict(state["nets"])
        model.mean, model.std = state["mean"], state["std"]
        return model


def _any_config() -> Config:
    return tuple(values[0] for values in KNOB_VALUES.values())


_GOAL = re.compile(r"Raise by at least (?P<threshold>\d+) points over its starting configuration the validation "
                   r"accuracy of an MLP trained for (?P<steps>\d+) steps on (?P<described>.+)\.$")


@cache
def _datasets_by_description() -> dict[str, str]:
    return {load_dataset(name).describe(): name for name in DATASETS}


def read_goal(goal: str) -> tuple[Problem, float]:
    """(problem, threshold) from the goal the env writes (AutoresearchEnv._goal); ValueError otherwise."""
    match = _GOAL.match(goal)
    dataset = None if match is None else _datasets_by_description().get(match["described"])
    if match is None or dataset is None:
        raise ValueError(f"not an autoresearch goal: {goal[:120]!r}")
    return Problem(dataset, int(match["steps"])), int(match["threshold"]) / 100


def snap(accuracy: float, dataset: str) -> float:
    """An accuracy on the validation set's grid k/n, within [0, 1] (what a real job can score)."""
    n = len(load_dataset(dataset).y_val)
    return min(max(round(accuracy * n), 0), n) / n


_WORLD_LINE = re.compile(r"^(Goal|Now|Action): (.*)$", re.MULTILINE)


class JobModelWorld(WorldAnswerer):
    """Autoresearch's WorldAnswerer: world prompts in, the env's answers out, each job's accuracy
    predicted by a JobModel."""

    def __init__(self, model: JobModel, max_turns: int):
        self.model, self.max_turns = model, max_turns

    def answers(self, prompt: str, seeds: Sequence[int], temperature: float) -> list[str]:
        """One answer per seed to a world prompt (envs.transitions.world_prompt): "status\\nobservation"."""
        from envs.transitions import status_of

        lines = dict(_WORLD_LINE.findall(prompt))
        problem, threshold = read_goal(lines["Goal"])
        state = read_state(lines["Now"])
        best = snap(state.best, problem.dataset)
        start = snap(state.best - state.over_start, problem.dataset)
        oracle = PredictedOracle()
        env = AutoresearchEnv({"world": Task("world", problem, state.config, threshold)}, self.max_turns, oracle)
        out = []
        for seed in seeds:
            oracle.predict = lambda candidate, seed=seed: self._predict(problem, state.config, best, candidate,
                                                                         seed, temperature)
            env.resume("world", state.config, best, start, self.max_turns - state.turns_left)
            outcome = env.step(lines["Action"])
            out.append(f"{status_of(outcome.done, outcome.won)}\n{outcome.observation}")
        return out

    def _predict(self, problem: Problem, current: Config, accuracy: float, candidate: Config, seed: int,
                 temperature: float) -> float:
        members = self.model.predict([(problem, current, accuracy, candidate)])[:, 0]
        value = float(members.mean()) if temperature == 0 else float(members[random.Random(seed).randrange(len(members))])
        return snap(value, problem.dataset)


class PredictedOracle(Oracle):
    """An Oracle whose every job is `predict(candidate)` (no job runs; nothing is memoised)."""

    def __init__(self) -> None:
        super().__init__(None)
        self.predict = lambda candidate: 0.0

    def result(self, problem: Problem, config: Config) -> JobResult:
        return JobResult(self.predict(config), 0.0, False)
