"""The Policy protocol, its sampling parameters and completions, and the registry of policy backends."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from turnopd.core.registry import Registry


@dataclass(frozen=True)
class SamplingParams:
    """How one completion is sampled. `seed` makes it reproducible whatever the request is batched
    with (every backend samples each request from its own random stream)."""

    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ("</action>",)
    seed: int | None = None


def request_seed(seed: int | None, *keys: int) -> int | None:
    """The seed of one request: a hash of a batch's seed and the request's place in it (episode,
    turn), so that every request samples from a stream of its own."""
    if seed is None:
        return None
    return int(np.random.SeedSequence([seed, *keys]).generate_state(1)[0])


@dataclass
class Generation:
    """One sampled completion: its token ids (ending with EOS or the tokens of a stop string, both
    kept) and each token's log-prob under the model's raw distribution (see Policy)."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str = "stop"  # "stop" (EOS or a stop string) or "length"
    extra: dict[str, Any] = field(default_factory=dict)


class Policy(Protocol):
    """A rollout backend. `generate` is one request (one prompt, one completion); the requests of
    concurrent coroutines are batched by the backend (transformers: a micro-batch of what is
    pending, by prompt length; vLLM: continuous batching, a request joins at the next engine step).

    Backends are constructed by `make_policy`: `model` is a Hugging Face directory or a loaded
    nn.Module with its tokenizer (transformers generates with that very module; vllm saves it once to
    load it). Stored log-probs are under the model's raw distribution (temperature 1, no top-p) in
    every backend: the sampling log-prob when temperature == top_p == 1. `before_batch`, when set,
    runs before each generation batch (or engine step), in the thread that runs it: the pool
    pipeline loads newer weights there, between batches, so no batch sees half an update. An
    episode holds `session()` while it plays, so the backend knows how many requests may still
    come (the transformers micro-batcher waits a little for them; vLLM needs no wait). Backends
    subclass this protocol, so that an attribute they do not set reads as its default here.
    """

    tokenizer: Any
    weight_version: int  # incremented by each update_weights
    max_model_len: int  # prompt + generated tokens must fit
    before_batch: Callable[[], None] | None
    # the positions a screenshot takes in a prompt (a vision-language student); 0: a text policy
    image_tokens: int = 0
    # a text student's screen reader (turnopd.loaders.screens.attach_screens): it sees each page of an
    # env that shows screenshots as the text read off it; None: it reads the env's text (a teacher)
    screen_reader: Any = None

    # image_keys: the pixel-store keys of the screenshots in the prompt's image positions (a VLM student)
    async def generate(self, prompt: list[int], sampling: SamplingParams, image_keys: Sequence[str] = ()) -> Generation: ...
    def session(self) -> AbstractContextManager[None]: ...
    def update_weights(self, model: Any) -> None: ...  # new student weights (a module or state dict)
    def close(self) -> None: ...


POLICY_BACKENDS: Registry[Callable[..., Policy]] = Registry("policy backend")


def make_policy(config: Any, model: Any, *, tokenizer: Any = None, dtype: str = "auto", seed: int = 0) -> Policy:
    """The policy backend a recipe's `policy` block (turnopd.config.PolicyConfig) names, generating with
    `model` (a Hugging Face folder, or a loaded module with its tokenizer)."""
    return POLICY_BACKENDS.get(config.backend)(model, config, tokenizer=tokenizer, dtype=dtype, seed=seed)


def generate_all(policy: Policy, prompts: list[list[int]], sampling: SamplingParams) -> list[Generation]:
    """One completion per prompt, requested together (so the backend batches them), prompt i sampled
    with request_seed(sampling.seed, i). For callers outside an event loop (tests, benchmarks)."""
    async def run() -> list[Generation]:
        return await asyncio.gather(*(policy.generate(prompt, dataclasses.replace(
            sampling, seed=request_seed(sampling.seed, i))) for i, prompt in enumerate(prompts)))

    return asyncio.run(run())
