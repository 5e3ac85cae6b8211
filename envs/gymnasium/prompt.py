"""The gymnasium adapter's prompt: the goal, the recent turns, the observation and the action names."""

from __future__ import annotations

from collections.abc import Callable

from envs.base import PromptContext, answer_instruction, observation_lines, select_template


def render_default(ctx: PromptContext) -> str:
    lines = [f"Your task is to: {ctx.task}", *observation_lines(ctx.history, ctx.step, ctx.observation)]
    if ctx.admissible:
        lines.append(f"Your admissible actions are: [{', '.join(ctx.admissible)}].")
    return "\n".join([*lines, answer_instruction(ctx.answer_format)])


TEMPLATES = {"default": render_default}


def template(name: str) -> Callable[[PromptContext], str]:
    """The prompt template a recipe's env.template names."""
    return select_template(TEMPLATES, name, "gymnasium")
