"""Single-turn prompts from JSONL files (a prompt dataset: math, chat, the first turns of an agent's
games): what a prompt-distillation trainer such as TRL's DistillationTrainer trains on. No engine: the
env answers at once, so recipes run it with env.pool=inline."""

from envs.base import ENVS
from envs.prompts.spec import PromptsSpec

ENVS.register("prompts")(PromptsSpec)

__all__ = ["PromptsSpec"]
