"""The training job behind every step of the autoresearch env: an MLP trained on one dataset for a
fixed number of steps under a configuration of ten knobs, scored by its validation accuracy.

A job is deterministic (fixed seeds, one thread, CPU): the same problem and configuration give the
same accuracy bit for bit, so results are memoised by configuration (`Oracle`): in the process, and
optionally in an append-only JSON-lines file per problem that other processes (the other env
workers, the expert in the main process, later runs) read too.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from envs.autoresearch.data import load_dataset

# Bump when a job's result for the same problem and configuration can change (the model, the
# schedule, the data): on-disk results of another version are not read.
JOB_VERSION = "1"


@dataclass(frozen=True)
class Knob:
    name: str
    values: tuple[str, ...]  # the allowed values, as the action spells them
    meaning: str


# The knobs, in the order the prompt lists them and the expert tries them. Values are strings: a
# configuration is compared, memoised and spelled exactly as the agent writes it.
KNOBS = (
    Knob("lr", ("0.0003", "0.001", "0.003", "0.01", "0.03", "0.1", "0.3"), "peak learning rate"),
    Knob("batch_size", ("8", "16", "32", "64", "128"), "examples per step"),
    Knob("width", ("8", "16", "32", "64", "128"), "units per hidden layer"),
    Knob("depth", ("1", "2", "3", "4"), "hidden layers"),
    Knob("weight_decay", ("0", "0.0001", "0.001", "0.01", "0.1"), "L2 penalty (decoupled for adamw)"),
    Knob("dropout", ("0", "0.1", "0.2", "0.4"), "dropout after each hidden layer"),
    Knob("optimizer", ("sgd", "momentum", "adam", "adamw"), "momentum is SGD with Nesterov momentum 0.9"),
    Knob("warmup", ("0", "0.05", "0.2", "0.5"), "fraction of the steps with a linear warmup, then cosine decay"),
    Knob("activation", ("relu", "tanh", "gelu", "sigmoid"), "hidden activation"),
    Knob("label_smoothing", ("0", "0.05", "0.1", "0.2"), "label smoothing of the cross-entropy"),
)
KNOB_NAMES = tuple(k.name for k in KNOBS)
KNOB_VALUES = {k.name: k.values for k in KNOBS}

Config = tuple[str, ...]  # one value per knob, in KNOBS order


@dataclass(frozen=True)
class Problem:
    """What a job trains, apart from the configuration: the dataset, the step budget and the seed."""

    dataset: str
    steps: int
    seed: int = 0

    @property
    def key(self) -> str:
        return f"{self.dataset}-mlp-{self.steps}steps-seed{self.seed}-v{JOB_VERSION}"


@dataclass(frozen=True)
class JobResult:
    accuracy: float  # validation accuracy, a fraction
    seconds: float  # wall-clock of the job that computed it (a memo hit returns the first job's time)
    diverged: bool  # the training loss became NaN or infinite; the accuracy is then of what was left


def config_from(values: Mapping[str, str]) -> Config:
    """A configuration from {knob: value}; every knob must be given, with an allowed value."""
    unknown = sorted(set(values) - set(KNOB_NAMES))
    missing = [name for name in KNOB_NAMES if name not in values]
    if unknown or missing:
        raise ValueError(f"autoresearch configuration: unknown knobs {unknown}, missing knobs {missing}; "
                         f"the knobs are {', '.join(KNOB_NAMES)}")
    for name in KNOB_NAMES:
        if values[name] not in KNOB_VALUES[name]:
            raise ValueError(f"autoresearch configuration: {name}={values[name]!r} is not allowed; "
                             f"allowed: {', '.join(KNOB_VALUES[name])}")
    return tuple(values[name] for name in KNOB_NAMES)


def with_value(config: Config, knob: str, value: str) -> Config:
    i = KNOB_NAMES.index(knob)
    return config[:i] + (value,) + config[i + 1:]


def describe_config(config: Config) -> str:
    return ", ".join(f"{name}={value}" for name, value in zip(KNOB_NAMES, config, strict=True))


def _lr_factor(step: int, steps: int, warmup: float) -> float:
    """Linear warmup over the first `warmup` fraction of the steps, then cosine decay to 0."""
    ramp = int(round(warmup * steps))
    if step < ramp:
        return (step + 1) / ramp
    return 0.5 * (1 + math.cos(math.pi * (step - ramp) / max(steps - ramp, 1)))


def train_job(problem: Problem, config: Config) -> JobResult:
    """Train and score one configuration: the real job. One thread (restored afterwards) so that the
    result and its cost do not depend on the machine's cores or on other work in the process."""
    import torch
    from torch import nn

    knobs = dict(zip(KNOB_NAMES, config, strict=True))
    data = load_dataset(problem.dataset)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    start = time.perf_counter()
    try:
        torch.manual_seed(problem.seed)  # initial weights and dropout masks
        batches = torch.Generator().manual_seed(problem.seed + 1)  # the order of the examples
        activation = {"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU, "sigmoid": nn.Sigmoid}[knobs["activation"]]
        width, layers, size = int(knobs["width"]), [], data.features
        for _ in range(int(knobs["depth"])):
            layers += [nn.Linear(size, width), activation(), nn.Dropout(float(knobs["dropout"]))]
            size = width
        model = nn.Sequential(*layers, nn.Linear(size, data.classes))
        lr, decay = float(knobs["lr"]), float(knobs["weight_decay"])
        optimizer = {
            "sgd": lambda: torch.optim.SGD(model.parameters(), lr=lr, weight_decay=decay),
            "momentum": lambda: torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True,
                                                weight_decay=decay),
            "adam": lambda: torch.optim.Adam(model.parameters(), lr=lr, weight_decay=decay),
            "adamw": lambda: torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=decay),
        }[knobs["optimizer"]]()
        loss_fn = nn.CrossEntropyLoss(label_smoothing=float(knobs["label_smoothing"]))
        x, y = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
        batch, order, cursor, diverged = int(knobs["batch_size"]), torch.randperm(len(y), generator=batches), 0, False
        model.train()
        for step in range(problem.steps):
            if cursor + batch > len(y):  # a new epoch: reshuffle
                order, cursor = torch.randperm(len(y), generator=batches), 0
            index = order[cursor:cursor + batch]
            cursor += batch
            for group in optimizer.param_groups:
                group["lr"] = lr * _lr_factor(step, problem.steps, float(knobs["warmup"]))
            loss = loss_fn(model(x[index]), y[index])
            if not torch.isfinite(loss):
                diverged = True
                break
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            logits = model(torch.from_numpy(data.x_val))
        # a row with a NaN or infinite logit predicts nothing: it counts as wrong
        right = (logits.argmax(dim=1) == torch.from_numpy(data.y_val)) & torch.isfinite(logits).all(dim=1)
        accuracy = right.sum().item() / len(data.y_val)
    finally:
        torch.set_num_threads(threads)
    return JobResult(accuracy, time.perf_counter() - start, diverged)


class Oracle:
    """Job results memoised by configuration: in this process, and in `cache_dir/<problem key>.jsonl`
    when a cache folder is given. Each result is one appended line, written with a single write and
    flushed, so concurrent writers (the pool's workers) never interleave; a line cut short by a crash
    is skipped when read. `jobs` counts the jobs this oracle ran itself."""

    def __init__(self, cache_dir: Path | None = None):
        self.cache_dir = cache_dir
        self.memo: dict[tuple[str, Config], JobResult] = {}
        self.jobs = 0

    def result(self, problem: Problem, config: Config) -> JobResult:
        key = (problem.key, config)
        if key not in self.memo and self.cache_dir is not None:
            self._load(problem)
        if key not in self.memo:
            self.memo[key] = train_job(problem, config)
            self.jobs += 1
            if self.cache_dir is not None:
                self._append(problem, config, self.memo[key])
        return self.memo[key]

    def _path(self, problem: Problem) -> Path:
        assert self.cache_dir is not None
        return self.cache_dir / f"{problem.key}.jsonl"

    def _load(self, problem: Problem) -> None:
        """Read the problem's file (again: other processes append to it)."""
        path = self._path(problem)
        if not path.exists():
            return
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
                config = config_from(row["config"])
                result = JobResult(float(row["accuracy"]), float(row["seconds"]), bool(row["diverged"]))
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a crash, or of knobs that changed
            self.memo.setdefault((problem.key, config), result)

    def _append(self, problem: Problem, config: Config, result: JobResult) -> None:
        path = self._path(problem)
        path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"config": dict(zip(KNOB_NAMES, config, strict=True)), "accuracy": result.accuracy,
                           "seconds": round(result.seconds, 4), "diverged": result.diverged}) + "\n"
        # O_APPEND: each write lands whole at the end, whoever else appends
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
