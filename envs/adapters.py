"""What the adapter envs (envs/gymnasium, envs/openenv, envs/verifiers) share: tasks that are numbered
(reset seeds, or a taskset's positions), the env block's checks of one task type and template, and one prompt (the goal, the recent turns, the
observation and, where the env names them, its actions)."""

from __future__ import annotations

from typing import Any

from envs.base import (
    PromptContext,
    answer_instruction,
    check_known,
    check_split,
    observation_lines,
    select_tasks,
)


def seed_of(task_id: str) -> int:
    """'seed-12' (or 'task-12') -> 12."""
    return int(task_id.rsplit("-", 1)[1])


def render_default(ctx: PromptContext) -> str:
    lines = [f"Your task is to: {ctx.task}", *observation_lines(ctx.history, ctx.step, ctx.observation)]
    if ctx.admissible:
        lines.append(f"Your admissible actions are: [{', '.join(ctx.admissible)}].")
    return "\n".join([*lines, answer_instruction(ctx.answer_format)])


class SeedTasks:
    """An adapter spec's splits: "train" plays seeds 0..train_tasks-1, "test" the next test_tasks (task
    id "seed-N", or `id_prefix`-N), all of one task type, `task_kind`. `check_block` checks the env block's options,
    task types and template (there is one, "default")."""

    name: str
    config: Any
    task_kind: str
    seeds: dict[str, range]
    id_prefix = "seed"

    def check_block(self, config: Any, allowed_options: dict[str, Any]) -> dict[str, Any]:
        """The env block's options over their defaults."""
        check_known(f"{self.name} options", config.options, allowed_options, key="options")
        if config.template != "default":
            raise ValueError(f"unknown prompt template {config.template!r} for env {self.name!r}; allowed: default")
        self.config = config
        options = {**allowed_options, **config.options}
        train, test = options["train_tasks"], options["test_tasks"]
        self.seeds = {"train": range(train), "test": range(train, train + test)}
        return options

    def check_task_types(self) -> None:
        check_known(f"{self.name} task types", self.config.task_types, [self.task_kind], key="task_types")

    def splits(self) -> list[str]:
        return list(self.seeds)

    def tasks(self, split: str) -> list[str]:
        check_split(self.name, split, self.splits())
        return select_tasks([f"{self.id_prefix}-{n}" for n in self.seeds[split]], self.task_type, self.config)

    def task_type(self, task_id: str) -> str:
        return self.task_kind

    def render_prompt(self, ctx: PromptContext) -> str:
        return render_default(ctx)
