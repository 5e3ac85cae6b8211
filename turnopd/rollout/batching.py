"""Batching the generation requests of concurrent episodes.

`MicroBatcher` serves a backend whose generation is one blocking call over a batch (transformers):
requests wait in a queue, and a batch of the pending requests runs grouped by sampling settings
(all but the seed) and by prompt length (`length_batches`, at most `max_rows` rows). It starts a
batch once every active episode (a `session`) has a request pending, or once the oldest pending
request has waited `wait_s`: a call costs a fixed overhead beside its rows (~27 ms on the headline
runs), so a batch waits a little for episodes whose env step is about to return, and never for long
for one that is slow (a reset loading a game, a straggler's env).

The batch runs on the event loop's thread: env requests already sent keep running in the pool's
worker processes meanwhile, and a generation thread would only contend with the loop for the GIL
(measured: 0.91x lock-step's episode-turns/s with a thread, 0.97x inline,
benchmarks/rollout_throughput.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from turnopd.loaders.hf_models import length_batches
from turnopd.rollout.base import Generation, SamplingParams

DEFAULT_WAIT_S = 0.05


@dataclass
class PendingGeneration:
    prompt: list[int]
    sampling: SamplingParams
    future: asyncio.Future = field(repr=False)
    since: float = 0.0  # loop time it was submitted
    image_keys: list[str] = field(default_factory=list)


class MicroBatcher:
    """`await submit(prompt, sampling, image_keys)`: the request's Generation, from a call
    `run_batch(prompts, samplings, image_keys)` (rows of equal settings but their seeds; each row's
    screenshot keys)."""

    def __init__(self, run_batch: Callable[[list[list[int]], list[SamplingParams], list[list[str]]], list[Generation]],
                 max_rows: int, wait_s: float = DEFAULT_WAIT_S):
        self.run_batch, self.max_rows, self.wait_s = run_batch, max_rows, wait_s
        self.before_batch: Callable[[], None] | None = None
        self.lock = threading.RLock()  # held while a batch runs: weight updates wait for it
        self.batch_sizes: list[int] = []  # every batch run, for tests and benchmarks
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: list[PendingGeneration] = []
        self._sessions = 0
        self._wake: asyncio.Event | None = None
        self._draining: asyncio.Task | None = None

    def _bind(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new event loop (each rollout may run its own): nothing carries over
            self._loop, self._pending, self._sessions, self._draining = loop, [], 0, None
            self._wake = asyncio.Event()
        return loop

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """An episode that will send requests: a batch waits (up to wait_s) for each active one."""
        self._bind()
        self._sessions += 1
        try:
            yield
        finally:
            self._sessions -= 1
            self._wake.set()  # a batch may have been waiting for this episode

    async def submit(self, prompt: list[int], sampling: SamplingParams, image_keys: Sequence[str] = ()) -> Generation:
        loop = self._bind()
        request = PendingGeneration(prompt, sampling, loop.create_future(), loop.time(), list(image_keys))
        self._pending.append(request)
        self._wake.set()
        if self._draining is None or self._draining.done():
            self._draining = loop.create_task(self._drain())
        return await request.future

    async def _drain(self) -> None:
        while self._pending:
            await self._gather()
            taken, self._pending = self._pending, []
            for group in _groups(taken, self.max_rows):
                try:
                    generations = self._run(group)
                except Exception as exc:
                    for request in group:
                        if not request.future.done():
                            request.future.set_exception(exc)
                    continue
                for request, generation in zip(group, generations, strict=True):
                    if not request.future.done():  # its episode may have been cancelled
                        request.future.set_result(generation)

    async def _gather(self) -> None:
        """Wait until every active episode has a request pending, or the oldest waited wait_s."""
        deadline = self._pending[0].since + self.wait_s
        while len(self._pending) < self._sessions and self._loop.time() < deadline:
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), deadline - self._loop.time())

    def _run(self, group: list[PendingGeneration]) -> list[Generation]:
        with self.lock:
            if self.before_batch is not None:
                self.before_batch()
            self.batch_sizes.append(len(group))
            return self.run_batch([r.prompt for r in group], [r.sampling for r in group], [r.image_keys for r in group])


def _groups(requests: list[PendingGeneration], max_rows: int) -> list[list[PendingGeneration]]:
    """Requests of the same settings (the seed aside), in batches of similar prompt length; inside a
    batch the requests keep the order they came in."""
    by_settings: dict[Any, list[PendingGeneration]] = {}
    for request in requests:
        by_settings.setdefault(replace(request.sampling, seed=None), []).append(request)
    out = []
    for same in by_settings.values():
        for batch in length_batches([len(r.prompt) for r in same], max_rows=max_rows):
            out.append([same[i] for i in sorted(batch)])
    return out
