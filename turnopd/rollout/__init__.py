"""Student generation: the Policy protocol, its backends (registered by name) and the rollout engine."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from turnopd.registry import Registry


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ("</action>",)
    n: int = 1  # samples per prompt
    seed: int | None = None


@dataclass
class Generation:
    """One sampled completion: its token ids and the log-prob each was sampled with (under the
    policy's temperature-scaled, top-p-truncated sampling distribution... see the backend docs)."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str = "stop"  # "stop" (EOS or a stop string) or "length"
    extra: dict[str, Any] = field(default_factory=dict)


class Policy(Protocol):
    """A rollout backend. `generate` returns, per prompt, `sampling.n` generations."""

    tokenizer: Any
    weight_version: int

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[list[Generation]]: ...
    def update_weights(self, model: Any) -> None: ...  # new student weights (a module or state dict)
    def close(self) -> None: ...


POLICY_BACKENDS: Registry[Callable[..., Policy]] = Registry("policy backend")
