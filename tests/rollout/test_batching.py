"""The micro-batcher of the transformers backend, with a recording stand-in for model.generate
(the real one: tests/rollout/test_transformers_policy.py)."""

from __future__ import annotations

import asyncio

from turnopd.rollout.base import Generation, SamplingParams
from turnopd.rollout.batching import MicroBatcher


def recording_batcher(wait_s: float, max_rows: int = 8) -> tuple[MicroBatcher, list[list[int]]]:
    """A batcher whose batches answer each prompt with its own first token; `calls` lists each batch's
    first tokens."""
    calls: list[list[int]] = []

    def run_batch(prompts, samplings, image_keys):
        calls.append([p[0] for p in prompts])
        return [Generation([p[0]], [0.0], str(p[0])) for p in prompts]

    return MicroBatcher(run_batch, max_rows=max_rows, wait_s=wait_s), calls


async def episode(batcher: MicroBatcher, token: int, delays: list[float]) -> list[str]:
    """An episode that sends one request per delay, each after that long (its env step)."""
    out = []
    with batcher.session():
        for delay in delays:
            await asyncio.sleep(delay)
            out.append((await batcher.submit([token, 0, 0], SamplingParams())).text)
    return out


def test_a_batch_waits_for_every_active_episode():
    batcher, calls = recording_batcher(wait_s=5.0)

    async def run():
        return await asyncio.gather(episode(batcher, 1, [0, 0]), episode(batcher, 2, [0, 0.05]),
                                    episode(batcher, 3, [0.1, 0.01]))

    assert asyncio.run(run()) == [["1", "1"], ["2", "2"], ["3", "3"]]
    # each turn's batch waited for the episode still in its env (never the 5 s limit)
    assert [sorted(c) for c in calls] == [[1, 2, 3], [1, 2, 3]]


def test_a_slow_episode_is_not_waited_for_past_wait_s():
    batcher, calls = recording_batcher(wait_s=0.02)

    async def run():
        return await asyncio.gather(episode(batcher, 1, [0, 0]), episode(batcher, 2, [0.5]))

    asyncio.run(run())
    assert calls == [[1], [1], [2]]  # episode 1 went on without the one whose reset took 0.5 s


def test_an_ended_episode_releases_a_waiting_batch():
    batcher, calls = recording_batcher(wait_s=5.0)

    async def run():
        await asyncio.gather(episode(batcher, 1, [0, 0]), episode(batcher, 2, [0]))

    asyncio.run(asyncio.wait_for(run(), timeout=2.0))  # episode 1's second turn did not wait 5 s for 2
    assert calls == [[1, 2], [1]]


def test_rows_are_grouped_by_settings_and_length():
    batcher, calls = recording_batcher(wait_s=0.0, max_rows=2)

    async def run():
        greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3)
        await asyncio.gather(*(batcher.submit([t] * length, sampling) for t, length, sampling in (
            (1, 3, greedy), (2, 9, greedy), (3, 8, greedy), (4, 3, sampled), (5, 2, sampled))))

    asyncio.run(run())
    # per settings, longest first, at most 2 rows; inside a batch the order they came in
    assert calls == [[2, 3], [1], [4, 5]]
