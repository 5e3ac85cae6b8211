"""The autoresearch EnvSpec: tasks and splits, the prompt, action parsing, the expert and the memo.

A task is a dataset (envs.autoresearch.data), an MLP trained on it for a fixed number of steps and a
starting configuration of the ten knobs (envs.autoresearch.train.KNOBS), drawn at random from the
allowed values with the task id as seed. Task ids are DATASET-mlp-sN; the task type is the dataset.
The test split holds other starts of the training datasets and a dataset of its own (letters).
"""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path
from typing import Any

from envs.autoresearch.data import DATASETS
from envs.autoresearch.env import (
    MAX_ACTION_CHARS,
    AutoresearchEnv,
    Task,
    knob_table,
    parse_command,
    read_job_report,
)
from envs.autoresearch.expert import CoordinateSearchExpert
from envs.autoresearch.job_model import JobModel, JobModelWorld
from envs.autoresearch.train import KNOBS, Config, Oracle, Problem
from envs.base import (
    Expert,
    MetricReading,
    ParsedAction,
    PromptContext,
    answer_instruction,
    check_known,
    check_split,
    extract_action,
    observation_lines,
    select_tasks,
    select_template,
)
from envs.cache import cache_root

SPLITS = ("train", "test")
# The starts of each split, by dataset (letters is never trained on). test held 6 tasks (starts 10-11,
# letters 0-1) until 2026-12-06, too few to resolve any but 30-60-point effects; it holds 30 now, and
# split_ids' start-major order keeps those 6 first (eval.max_tasks=6 plays them again).
SPLIT_STARTS = {
    "train": {"digits": range(0, 10), "spirals": range(0, 10)},
    "test": {"digits": range(10, 20), "spirals": range(10, 20), "letters": range(0, 10)},
}
STEPS = {"digits": 300, "letters": 400, "spirals": 500}  # each task's training steps, by dataset
# The improvement that wins, by dataset (accuracy points as a fraction)
THRESHOLDS = {"digits": 0.10, "letters": 0.10, "spirals": 0.10}
OPTIONS: dict[str, Any] = {"disk_cache": False}  # option -> default


def start_config(task_id: str) -> Config:
    """The task's starting configuration: each knob drawn uniformly from its values, seeded by the id
    (random.Random seeds a string through SHA-512: the same draw on every machine and version)."""
    rng = random.Random(f"autoresearch/{task_id}")
    return tuple(rng.choice(knob.values) for knob in KNOBS)


def parse_task_id(task_id: str) -> tuple[str, int]:
    """'digits-mlp-s3' -> ('digits', 3)."""
    dataset, _, rest = task_id.partition("-mlp-s")
    if dataset not in DATASETS or not rest.isdigit():
        raise ValueError(f"autoresearch task id {task_id!r}: expected DATASET-mlp-sN with DATASET one of "
                         f"{', '.join(DATASETS)}, e.g. digits-mlp-s3")
    return dataset, int(rest)


def split_ids(split: str) -> list[str]:
    """A split's task ids, start-major (the first N tasks cover every dataset)."""
    starts = SPLIT_STARTS[split]
    return [f"{dataset}-mlp-s{n}" for i in range(max(map(len, starts.values())))
            for dataset, ns in starts.items() for n in ns[i:i + 1]]


def make_task(task_id: str) -> Task:
    dataset, _ = parse_task_id(task_id)
    return Task(task_id, Problem(dataset, STEPS[dataset]), start_config(task_id), THRESHOLDS[dataset])


@cache
def oracle(cache_dir: Path | None) -> Oracle:
    """This process's memo of job results for a cache folder (None: in memory only), shared by the
    envs of a worker, or by the experts of the main process."""
    return Oracle(cache_dir)


def render_default(ctx: PromptContext) -> str:
    """verl-agent's layout (as the other envs): the role and goal, the recent history and the current
    observation (which holds the best configuration), the actions with every knob's values, the
    answer format."""
    lines = [
        "You are an expert machine-learning researcher tuning a training run. Each turn you may change one "
        "knob; the run is trained again and the change is kept only if the validation accuracy improves.",
        f"Your task: {ctx.task}",
        *observation_lines(ctx.history, ctx.step, ctx.observation),
        "Your available actions: set KNOB VALUE (for example, set lr 0.01), or submit to end with the best "
        f"configuration. The knobs and their values: {knob_table()}.",
        "",
        "Now it's your turn to take an action.",
        answer_instruction(ctx.answer_format),
    ]
    return "\n".join(lines)


TEMPLATES = {"default": render_default}


class AutoresearchSpec:
    """Tune an MLP's training on small datasets, one knob per turn, every turn a real training job
    (~0.1-1 s on one thread). Option `disk_cache` (default false): keep every job's result in
    cache_root()/autoresearch (one JSON-lines file per dataset and step budget), shared by the env
    workers, the expert and later runs, so no configuration is ever trained twice."""

    name = "autoresearch"
    default_max_turns = 12
    observation_version = "1"

    def __init__(self, config: Any, data_dir: str | None = None):
        # data_dir is not used: the datasets are made from installed packages (envs.autoresearch.data)
        self.config = config
        self.render_template = select_template(TEMPLATES, config.template, self.name)
        check_known("autoresearch task types", config.task_types, DATASETS, key="task_types")
        check_known("autoresearch options", config.options, OPTIONS, key="options")
        disk_cache = config.options.get("disk_cache", OPTIONS["disk_cache"])
        if not isinstance(disk_cache, bool):
            raise ValueError(f"autoresearch option disk_cache must be true or false; got {disk_cache!r}")
        self.cache_dir = cache_root() / "autoresearch" if disk_cache else None

    def splits(self) -> list[str]:
        return list(SPLITS)

    def tasks(self, split: str) -> list[str]:
        check_split("autoresearch", split, SPLITS)
        return select_tasks(split_ids(split), self.task_type, self.config)

    def task_type(self, task_id: str) -> str:
        return parse_task_id(task_id)[0]

    def make(self) -> AutoresearchEnv:
        """An env for one pool slot; called inside a worker process. It knows every split's tasks."""
        tasks = {task_id: make_task(task_id) for split in SPLITS for task_id in split_ids(split)}
        return AutoresearchEnv(tasks, self.config.max_turns, oracle(self.cache_dir))

    def expert(self, task_id: str) -> Expert:
        return CoordinateSearchExpert(make_task(task_id).problem, oracle(self.cache_dir))

    def parse_action(self, text: str) -> ParsedAction:
        """The action in the answer; valid when it is `set KNOB VALUE` with a known knob and value, or
        `submit` (whether the value is new is the env's call)."""
        parsed = extract_action(text, max_chars=MAX_ACTION_CHARS)
        return ParsedAction(parsed.action, parsed.valid and isinstance(parse_command(parsed.action), tuple))

    def render_prompt(self, ctx: PromptContext) -> str:
        return self.render_template(ctx)

    def world_answerer(self, folder: Path) -> JobModelWorld:
        """The job model in `folder` (turnopd world-model train, kind job_model) as a world model: the
        env answers, each job's accuracy predicted (envs.autoresearch.job_model)."""
        return JobModelWorld(JobModel.load(folder), self.config.max_turns)

    def read_metric(self, observation: str) -> MetricReading | None:
        """A step's validation accuracy (percent) and whether its change was kept (envs.base.MetricReader)."""
        return read_job_report(observation)
