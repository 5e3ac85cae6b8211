"""The verifiers adapter's EnvSpec: a taskset of the verifiers library (verifiers.v1, 0.4) and its Env,
played as a chat env (prompt.style=chat; docs/chat.md).

Tasks are the taskset's tasks in its load() order: split "train" plays tasks 0..train_tasks-1, "test"
the next test_tasks (task id "task-N"); the task type is the taskset id. Options:
  taskset        the taskset id: an installed module that exports one verifiers Taskset subclass
                 (verifiers' own plugin rule), e.g. a package of yours or verifiers' `textarena`
  taskset_args   its TasksetConfig fields, e.g. {game: Wordle-v0}
  env_id         a verifiers Env id; default: the Env the taskset's module exports, else verifiers'
                 SingleAgentEnv (one answer to the prompt)
  success_reward a finished episode whose reward reaches it is won (default 1.0)
  train_tasks, test_tasks   the number of tasks in each split
The recipe check loads the taskset and reads the splits' tasks: they must exist and share one system
prompt, the chat's (prompt.system overrides it). The Env must have one agent seat (the policy's).
envs/verifiers/env.py states how the conversation, env answers and rewards map to an episode.
There is no expert.
"""

from __future__ import annotations

import importlib.util
from itertools import islice
from typing import Any, NoReturn

from envs.adapters import SeedTasks
from envs.base import ParsedAction, PromptContext, observation_lines
from envs.verifiers.env import VerifiersEnv

INSTALL = 'pip install -e ".[verifiers]"'
OPTIONS: dict[str, Any] = {"taskset": None, "taskset_args": {}, "env_id": "", "success_reward": 1.0,
                           "train_tasks": 200, "test_tasks": 50}


def one_line(exc: Exception) -> str:
    """A verifiers error as one line: a pydantic validation error's fields and messages, else its text."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors())
    return " ".join(str(exc).split())


def checked_config(options: dict[str, Any]) -> tuple[Any, dict[str, Any], str]:
    """The verifiers env config the options name, as checked and as given, and its one agent seat."""
    if importlib.util.find_spec("verifiers") is None or importlib.util.find_spec("verifiers.v1") is None:
        raise ValueError(f"env verifiers needs the verifiers package (0.4, verifiers.v1), which is not installed: "
                         f"{INSTALL}")
    if not options["taskset"]:
        raise ValueError("env verifiers needs option `taskset`, a verifiers taskset id (an installed module that "
                         "exports a Taskset), e.g. env.options.taskset=my_tasks")
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.utils.loaders import resolve_env_config

    raw = {"id": options["env_id"], "taskset": {**options["taskset_args"], "id": options["taskset"]}}
    try:
        config = resolve_env_config(raw)
    except Exception as exc:  # the library's own message (unknown module, bad field), on one line
        raise ValueError(f"verifiers taskset {options['taskset']!r}: {one_line(exc)}") from None
    seats = list(agent_config_fields(config))
    if len(seats) != 1:
        raise ValueError(f"verifiers env {type(config).__name__} has agent seats {seats}; the adapter plays envs "
                         "with one seat (the policy's)")
    return config, raw, seats[0]


def read_tasks(config: Any, count: int) -> list[Any]:
    """The taskset's first `count` tasks (all the splits play)."""
    from verifiers.v1.utils.loaders import load_taskset

    try:
        tasks = list(islice(iter(load_taskset(config.taskset)), count))
    except Exception as exc:  # a taskset that cannot load here (missing data, a download offline)
        raise ValueError(f"verifiers taskset {config.taskset.id!r} failed to load: {type(exc).__name__}: "
                         f"{one_line(exc)}") from None
    if len(tasks) < count:
        raise ValueError(f"verifiers taskset {config.taskset.id!r} has {len(tasks)} tasks; train_tasks + test_tasks "
                         f"is {count}")
    return tasks


class VerifiersSpec(SeedTasks):
    name = "verifiers"
    default_max_turns = 10
    observation_version = "1"
    id_prefix = "task"

    def __init__(self, config: Any, data_dir: str | None = None):
        # data_dir is not used: the taskset loads its own tasks
        self.options = self.check_block(config, OPTIONS)
        vf_config, raw, self.seat = checked_config(self.options)
        self.task_kind = self.options["taskset"]
        self.check_task_types()
        tasks = read_tasks(vf_config, self.options["train_tasks"] + self.options["test_tasks"])
        prompts = {task.data.system_prompt or "" for task in tasks}
        if len(prompts) > 1:
            raise ValueError(f"verifiers taskset {self.task_kind!r}: its tasks have {len(prompts)} different system "
                             "prompts; a chat recipe has one (set prompt.system to override them all)")
        self.system_prompt = prompts.pop()
        # the policy's seat runs no harness: pinning the tool-less one keeps the Env from loading another
        self.raw_config = {**raw, self.seat: {"harness": {"id": "null"}}}

    def make(self) -> VerifiersEnv:
        return VerifiersEnv(self.raw_config, self.seat, self.options["success_reward"])

    def expert(self, task_id: str) -> NoReturn:
        raise ValueError("env verifiers has no expert (a verifiers taskset has none to give)")

    def parse_action(self, text: str) -> ParsedAction:
        # the whole answer is the action: the verifiers env reads the assistant message itself
        return ParsedAction(text.strip(), True)

    def render_prompt(self, ctx: PromptContext) -> str:
        """The task's prompt as it is (the chat's first message); a history_block turn after it shows
        the recent exchange and the env's message."""
        if ctx.step == 0:
            return ctx.observation
        return "\n".join(observation_lines(ctx.history, ctx.step, ctx.observation))
