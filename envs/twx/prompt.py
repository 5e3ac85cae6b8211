"""The TextWorldExpress prompt templates: the user message of one turn, by name (env.template)."""

from __future__ import annotations

from collections.abc import Callable

from envs.base import PromptContext, answer_instruction, observation_lines


def render_default(ctx: PromptContext) -> str:
    """verl-agent's layout (as envs/alfworld's prompt): the game's own task description (a full
    sentence, e.g. "Your task is to search the environment and find the coin. ..."), the recent history
    and the current observation, the admissible actions, the answer format."""
    actions = ", ".join(f"'{a}'" for a in ctx.admissible or [])
    lines = [
        f"You are an expert agent playing a text adventure game. The game says: {ctx.task}",
        *observation_lines(ctx.history, ctx.step, ctx.observation),
        f"Your admissible actions of the current situation are: [{actions}].",
        "",
        "Now it's your turn to take an action.",
        answer_instruction(ctx.answer_format),
    ]
    return "\n".join(lines)


TEMPLATES: dict[str, Callable[[PromptContext], str]] = {"default": render_default}
