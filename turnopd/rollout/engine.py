"""The asynchronous agent loop: each episode is its own coroutine, and nobody waits for a batch.

An episode resets its env, then turn by turn asks the policy for an answer and steps its env with
the parsed action. The policy backend batches the requests that are pending at once (transformers:
a micro-batch by prompt length; vLLM: continuous batching), and env requests run in the pool's
workers, so one episode's env step overlaps others' generation, and a finished episode leaves the
rest at once. `play_episode` is one episode in a given env-pool slot; `rollout` plays a list of
tasks, each in its own slot, all at the same time (the pool pipeline also keeps a fixed number of
slots busy with `play_episode`, turnopd.orchestration.pipeline.generator).

Each turn an episode's prompt is its env's template (task, step, current observation, the last
`env.history_length` (observation, action) pairs, admissible actions) as ONE user message wrapped in
the policy tokenizer's chat template. The prompt is rendered afresh each turn (verl-agent style), so
a trajectory is scored by the teacher one turn window at a time (see turnopd.core.types.trajectory_sequences).
Each request is sampled from its own random stream (request_seed of the batch's seed, the episode
and the turn), so an episode plays the same whatever it is batched with.

Prompt length is not truncated: a prompt that does not fit the model's context raises an error
naming the lengths; lower `env.history_length` (or `policy.max_new_tokens`) to make it fit.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import nullcontext
from typing import Any

from envs.base import (
    IMAGE_PLACEHOLDER,
    EnvSpec,
    PromptContext,
    recent_pairs,
    screenshot_view,
    shows_screenshots,
)
from turnopd.algorithm.judge import Decision
from turnopd.config import EnvConfig
from turnopd.core.faults import failpoint
from turnopd.core.text import expand_placeholders
from turnopd.core.types import Trajectory, Turn
from turnopd.rollout.base import Policy, SamplingParams, request_seed
from turnopd.rollout.completion import check_prompt_lengths


def student_prompt(spec: EnvSpec, tokenizer: Any, image_tokens: int, ctx: PromptContext, page_keys: Sequence[str]
                   ) -> tuple[list[int], list[str], list[int] | None]:
    """The token ids of a turn's prompt as the policy sees it, the screenshots they show and, in an
    env that shows screenshots (envs.base.shows_screenshots), the text prompt a text teacher reads
    instead: a vision-language policy's prompt (`image_tokens` positions an image) has an image in
    place of each page the window shows (envs.base.screenshot_view); a policy that reads no images
    (image_tokens 0: the text teacher played as a policy, in its evaluation) reads the pages' text.
    `page_keys`: the screenshot keys of ctx.history's pages, then the current page's."""
    text = chat_prompt_ids(tokenizer, spec.render_prompt(ctx))
    if not shows_screenshots(spec) or not image_tokens:
        return text, [], None
    view, keys = screenshot_view(ctx, page_keys, spec.screenshot_window)
    placeholder = tokenizer.convert_tokens_to_ids(IMAGE_PLACEHOLDER)
    ids = chat_prompt_ids(tokenizer, spec.render_prompt(view))
    if ids.count(placeholder) != len(keys):
        raise ValueError(f"the policy's tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) does not keep "
                         f"{IMAGE_PLACEHOLDER} as one token: {ids.count(placeholder)} in a prompt of {len(keys)} images")
    return expand_placeholders(ids, placeholder, image_tokens), keys, text


def chat_prompt_ids(tokenizer: Any, user_message: str) -> list[int]:
    """The token ids of one user message in the tokenizer's chat template, ready for the answer."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the policy tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) has no chat template; "
                         "the rollout engine sends each prompt as a chat user message")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": user_message}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    return list(ids)


async def play_episode(spec: EnvSpec, pool: Any, policy: Policy, task_id: str, *, slot: int, episode: int,
                       env_config: EnvConfig, sampling: SamplingParams, turn_limit: int, is_probe: bool = False,
                       ledger: Any = None, replay: Sequence[str] = (), judge: Any = None) -> Trajectory:
    """One episode of `task_id` in env-pool slot `slot`, for at most `turn_limit` turns (the batch
    plan's, at most the horizon env_config.max_turns); turn t is sampled with
    request_seed(sampling.seed, episode, t). Stopped by a limit below the horizon with the env not
    done: truncated. Waiting for generation is the ledger's "generation" busy time, for the env
    (reset and steps) its "env" busy time (a world-model pool's own resource name, `ledger_resource`,
    when the episode plays in one).

    `replay`: env actions played first, without the policy (a takeover from another episode's state):
    they enter the prompt history but are not turns of the trajectory, whose first turn has index
    len(replay), and the policy then plays up to `turn_limit` turns of its own.

    `judge` (a turnopd.rollout.judge.Judge): in a real episode each turn's action is the judge's pick
    among k sampled candidates (the first being the turn's own sample); its comparisons are the
    ledger's "judge" busy time."""
    busy = ledger.busy if ledger is not None else (lambda _: nullcontext())
    env = getattr(pool, "ledger_resource", "env")  # a world model's steps are its own busy time, not the env's
    trajectory = Trajectory(task_id=task_id, env_name=spec.name, is_probe=is_probe, task_type=spec.task_type(task_id),
                            weight_version=policy.weight_version)
    with policy.session():  # the backend may wait for this episode's requests when it batches
        with busy(env):
            outcome = await pool.reset_slot(slot, task_id)
        trajectory.world_model = bool(outcome.info.get("world_model"))
        goal = trajectory.goal = outcome.info.get("task", "")
        first_observation = outcome.observation
        judging = judge is not None and not trajectory.world_model  # a model step costs no real run to save
        history: list[tuple[str, str]] = []  # (observation, action), all turns
        page_keys: list[str] = []  # their pages' screenshot keys, in an env that shows screenshots
        for action_text in replay:
            if outcome.done:
                break
            with busy(env):
                next_outcome = await pool.step_slot(slot, action_text)
            history.append((outcome.observation, action_text))
            page_keys.append(outcome.info.get("screenshot", ""))
            outcome = next_outcome
        for turn_index in range(len(history), len(history) + turn_limit):
            if outcome.done:
                break
            ctx = PromptContext(task=goal, step=turn_index, observation=outcome.observation,
                                history=recent_pairs(history, env_config.history_length),
                                admissible=outcome.admissible, answer_format=env_config.answer_format)
            prompt, image_keys, teacher_prompt = student_prompt(
                spec, policy.tokenizer, getattr(policy, "image_tokens", 0), ctx,
                [*recent_pairs(page_keys, env_config.history_length), outcome.info.get("screenshot", "")])
            check_prompt_lengths([prompt], sampling.max_new_tokens, policy.max_model_len,
                                 hint=f"Lower env.history_length (now {env_config.history_length}) or "
                                      f"policy.max_new_tokens (now {sampling.max_new_tokens}).")
            with busy("generation"):
                generation = await policy.generate(prompt, dataclasses.replace(
                    sampling, seed=request_seed(sampling.seed, episode, turn_index)), image_keys)
            if judging:
                generation = await judge.select(policy, prompt, sampling, generation, busy, Decision(
                    task_id, episode, goal, first_observation, list(history), outcome.observation,
                    (judge.step, turn_index)))
            action = spec.parse_action(generation.text)
            with busy(env):
                next_outcome = await pool.step_slot(slot, action.action)
            invalid = not action.valid or bool(next_outcome.info.get("invalid"))
            if "world_model_disagreement" in next_outcome.info:
                trajectory.world_model_disagreements.append(next_outcome.info["world_model_disagreement"])
            trajectory.turns.append(Turn(
                index=turn_index, observation=outcome.observation, prompt_ids=prompt, action_ids=generation.token_ids,
                student_logprobs=generation.logprobs, action_text=generation.text,
                reward=next_outcome.reward - (env_config.invalid_action_penalty if invalid else 0.0), invalid=invalid,
                image_keys=image_keys, teacher_prompt_ids=teacher_prompt,
            ))
            history.append((outcome.observation, action.action))
            page_keys.append(outcome.info.get("screenshot", ""))
            outcome = next_outcome
    trajectory.final_observation = outcome.observation
    if outcome.done:
        trajectory.ended = True
        trajectory.success = bool(outcome.won)
        trajectory.env_error = outcome.info.get("env_error", "")
    else:
        # Still playing after the last allowed turn: stopped by its turn limit when that was below max_turns;
        # at max_turns the env's own turn limit ended it (not a truncation).
        trajectory.truncated = turn_limit < env_config.max_turns
        pool.end([slot])
    failpoint("rollout.episode_done")
    return trajectory


class SlotPool:
    """Env-pool slots shared by concurrent episodes (the pool pipeline, a stream of episodes): an
    episode waits for a free slot, plays in it, and frees it when it ends, so the next waiting
    episode starts at once; waiting episodes get slots in the order they asked."""

    def __init__(self, slots: int):
        self._free: asyncio.Queue[int] = asyncio.Queue()
        for slot in range(slots):
            self._free.put_nowait(slot)

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[int]:
        slot = await self._free.get()
        try:
            yield slot
        finally:
            self._free.put_nowait(slot)


async def play_all(spec: EnvSpec, pool: Any, policy: Policy, tasks: list[str], *, env_config: EnvConfig,
                   sampling: SamplingParams, turn_limits: Sequence[int] | None = None, probes: int = 0,
                   ledger: Any = None, replays: Sequence[Sequence[str]] | None = None, world: Any = None,
                   simulated: Sequence[bool] = (), judge: Any = None,
                   on_episode: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:
    """`rollout` inside a running event loop."""
    if not tasks:
        raise ValueError("rollout needs at least one task")
    turn_limits = list(turn_limits) if turn_limits is not None else [env_config.max_turns] * len(tasks)
    if len(turn_limits) != len(tasks) or not all(1 <= n <= env_config.max_turns for n in turn_limits):
        raise ValueError(f"rollout needs one turn limit per task, each in [1, env.max_turns={env_config.max_turns}]; "
                         f"got {turn_limits} for {len(tasks)} tasks")
    simulated = list(simulated) or [False] * len(tasks)
    if len(simulated) != len(tasks) or (any(simulated) and world is None) or any(simulated[:probes]):
        raise ValueError("`simulated` names one flag per task, needs a world model, and no probe plays in it "
                         f"(got {len(simulated)} flags for {len(tasks)} tasks, {probes} probes, world {world})")

    busy = ledger.busy if ledger is not None else (lambda _: nullcontext())

    async def play(i: int, task: str) -> Trajectory:
        episode = functools.partial(play_episode, spec, policy=policy, task_id=task, slot=i, episode=i,
                                    env_config=env_config, sampling=sampling, is_probe=i < probes, ledger=ledger,
                                    turn_limit=turn_limits[i], judge=judge)
        judged = world is not None and not simulated[i]  # a real episode the world model gives its verdict on
        # "twin": the same task in the model, played beside it with its sampling streams (a closed loop)
        shadow = world.shadow(pool, slot=i, busy=busy, twin=functools.partial(episode, world)) \
            if judged and world.verdict != "last_turn" else None
        try:
            trajectory = await episode(world if simulated[i] else shadow or pool, replay=replays[i] if replays else ())
            if judged and not trajectory.env_error:
                if shadow is None:
                    with busy("world_model"):
                        verdict = await world.predict_success(trajectory, slot=i)
                else:  # its model steps are in the world model's busy time already
                    verdict = await shadow.verdict()
                trajectory.predicted_success, trajectory.verdict_steps = verdict
        finally:
            if shadow is not None:
                shadow.cancel()  # a no-op once its verdict is in
        if on_episode is not None:
            on_episode(trajectory)
        return trajectory

    return list(await asyncio.gather(*(play(i, task) for i, task in enumerate(tasks))))


def rollout(spec: EnvSpec, pool: Any, policy: Policy, tasks: list[str], *, env_config: EnvConfig,
            sampling: SamplingParams, turn_limits: Sequence[int] | None = None, probes: int = 0,
            ledger: Any = None, replays: Sequence[Sequence[str]] | None = None, world: Any = None,
            simulated: Sequence[bool] = (), judge: Any = None,
            on_episode: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:
    """Play one episode per task id (repeat a task id for several samples of it), all at once in
    slots 0..len(tasks)-1, episode i for at most turn_limits[i] turns (default: the horizon,
    env_config.max_turns, for every one; the batch plan decides them, probes at the horizon:
    turnopd.orchestration.pipeline.plan.episode_turn_limits); the first `probes` are marked as
    probes (Trajectory.is_probe); with `replays`, episode
    i first replays replays[i] (see play_episode). With `world` (a turnopd.rollout.world_model_pool
    WorldModelPool), episode i plays in it when simulated[i] (never a probe); each other episode gets
    the world model's verdict on it (Trajectory.predicted_success: by world.verdict, the model's answer
    to its last transition, its replay in the model alongside it, or the ending of a twin episode of
    its task played in the model beside it, not trained on). With `judge` (turnopd.rollout.judge.Judge)
    each real episode plays the judge's pick among k candidates a turn (see play_episode).
    `on_episode` is called with each trajectory as it ends (a progress bar). Returns the trajectories
    in the order of `tasks`."""
    return asyncio.run(play_all(spec, pool, policy, tasks, env_config=env_config, sampling=sampling,
                                turn_limits=turn_limits, probes=probes, ledger=ledger, replays=replays, world=world, simulated=simulated,
                                judge=judge, on_episode=on_episode))
