"""The asynchronous agent loop: each episode is its own coroutine, and nobody waits for a batch.

An episode resets its env, then turn by turn renders what the policy is shown, takes an action and
steps its env with it. The policy backend batches the requests that are pending at once
(transformers: a micro-batch by prompt length; vLLM: continuous batching), and env requests run in
the pool's workers, so one episode's env step overlaps others' generation, and a finished episode
leaves the rest at once. `play_episode` is one episode in a given env-pool slot; `rollout` plays a
list of tasks, each in its own slot, all at the same time (the pool pipeline also keeps a fixed
number of slots busy with `play_episode`, turnopd.orchestration.pipeline.generator).

The loop knows turns, and three hooks decide the rest:
- what the policy is shown: a Renderer (turnopd.rollout.render: the env's text, screenshots, or a chat);
- where an action comes from: an ActionSource (the policy's sample by default; a judge choosing among
  k candidates, turnopd.rollout.judge);
- where the next observation comes from: the env pool's interface (`reset_slot`, `step_slot`, `end`),
  behind which a real env, a world model (turnopd.rollout.world_model_pool) or a takeover that
  replays given actions first (turnopd.rollout.takeover) answers. A reset whose info holds
  "prior_steps" starts the episode after them: they enter the prompt history, not the trajectory.
`rollout`'s `run_episode` wraps each episode (the world model's runner: which pool it plays in, and
its verdict on it). The renderer also reads the answer back into an env action, and may decline a
turn whose prompt would not fit its context (prompt.style=chat): the episode then ends, truncated.

Each request is sampled from its own random stream (request_seed of the batch's seed, the episode
and the turn), so an episode plays the same whatever it is batched with. Prompt length is not
truncated: a prompt that does not fit the model's context raises an error naming the lengths; lower
`env.history_length` (or `policy.max_new_tokens`) to make it fit.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

from envs.base import EnvSpec, PromptContext, recent_pairs
from turnopd.config import EnvConfig, PromptConfig
from turnopd.core.faults import failpoint
from turnopd.core.types import Trajectory, Turn
from turnopd.rollout.base import Generation, Policy, SamplingParams, request_seed
from turnopd.rollout.completion import check_prompt_lengths
from turnopd.rollout.render import RenderedPrompt, Renderer, renderer_for

Busy = Callable[[str], AbstractContextManager[Any]]


@dataclass(frozen=True)
class TurnState:
    """What an action source may read of the episode at a turn."""

    task_id: str
    episode: int
    turn: int  # the turn's index (after any prior steps)
    goal: str
    first_observation: str
    history: list[tuple[str, str]]  # (observation, action) of every earlier turn, prior steps included
    observation: str
    reset_info: Mapping[str, Any]  # the info of the episode's reset (e.g. whether a world model plays it)


class ActionSource(Protocol):
    async def act(self, policy: Policy, prompt: RenderedPrompt, sampling: SamplingParams, state: TurnState,
                  busy: Busy) -> Generation:
        """The turn's generation; `sampling` is the batch's (its seed not yet the turn's)."""
        ...


class PolicySample:
    """The default action source: the policy's own sample, from the stream request_seed(seed,
    episode, turn), in the ledger's "generation" busy time."""

    async def act(self, policy: Policy, prompt: RenderedPrompt, sampling: SamplingParams, state: TurnState,
                  busy: Busy) -> Generation:
        with busy("generation"):
            return await policy.generate(prompt.ids, dataclasses.replace(
                sampling, seed=request_seed(sampling.seed, state.episode, state.turn)), prompt.image_keys)


POLICY_SAMPLE = PolicySample()


def policy_renderer(spec: EnvSpec, policy: Policy, prompt: PromptConfig | None, sampling: SamplingParams,
                    teacher_tokenizer: Any = None) -> Renderer:
    """What `policy` is shown of `spec`'s turns under the recipe's `prompt` section; a chat prompt holds
    at most prompt.max_context (else the policy's context) less the answer's max_new_tokens. With a
    `teacher_tokenizer` (objective.tokenizers=cross) each turn also carries the teacher's own reading
    of it (turnopd.rollout.render.TeacherTokens)."""
    context = min(policy.max_model_len, prompt.max_context or policy.max_model_len) if prompt else policy.max_model_len
    return renderer_for(spec, policy.tokenizer, image_tokens=policy.image_tokens, screen_reader=policy.screen_reader,
                        prompt=prompt,
                        max_prompt=context - sampling.max_new_tokens, teacher_tokenizer=teacher_tokenizer)


async def play_episode(spec: EnvSpec, pool: Any, policy: Policy, task_id: str, *, slot: int, episode: int,
                       env_config: EnvConfig, sampling: SamplingParams, turn_limit: int, is_probe: bool = False,
                       ledger: Any = None, actions: ActionSource = POLICY_SAMPLE,
                       renderer: Renderer | None = None, prompt: PromptConfig | None = None,
                       teacher_tokenizer: Any = None) -> Trajectory:
    """One episode of `task_id` in env-pool slot `slot`, for at most `turn_limit` turns (the batch
    plan's, at most the horizon env_config.max_turns). Stopped by a limit below the horizon with the
    env not done: truncated. Waiting for the env (reset and steps) is the ledger's "env" busy time
    (the pool's `ledger_resource`: a world model's steps are its own busy time, not the env's)."""
    busy = ledger.busy if ledger is not None else (lambda _: nullcontext())
    env = pool.ledger_resource
    renderer = renderer or policy_renderer(spec, policy, prompt, sampling, teacher_tokenizer)
    context_full = False
    trajectory = Trajectory(task_id=task_id, env_name=spec.name, is_probe=is_probe, task_type=spec.task_type(task_id),
                            weight_version=policy.weight_version)
    with policy.session():  # the backend may wait for this episode's requests when it batches
        with busy(env):
            outcome = await pool.reset_slot(slot, task_id)
        reset_info = outcome.info
        trajectory.goal = goal = reset_info.get("task", "")
        prior = reset_info.get("prior_steps", ())  # PriorSteps played before the policy
        first_observation = prior[0].observation if prior else outcome.observation
        history = [(step.observation, step.action) for step in prior]
        infos = [step.info for step in prior]  # the info of each history observation
        for turn_index in range(len(history), len(history) + turn_limit):
            if outcome.done:
                break
            ctx = PromptContext(task=goal, step=turn_index, observation=outcome.observation,
                                history=recent_pairs(history, env_config.history_length),
                                admissible=outcome.admissible, answer_format=env_config.answer_format)
            shown = renderer.render(ctx, [*recent_pairs(infos, env_config.history_length), outcome.info],
                                     trajectory.turns, prior)
            if shown is None:  # the conversation would overflow the renderer's context
                context_full = True
                break
            check_prompt_lengths([shown.ids], sampling.max_new_tokens, policy.max_model_len,
                                 hint=f"Lower env.history_length (now {env_config.history_length}) or "
                                      f"policy.max_new_tokens (now {sampling.max_new_tokens}).")
            generation = await actions.act(policy, shown, sampling, TurnState(
                task_id, episode, turn_index, goal, first_observation, list(history), outcome.observation, reset_info),
                busy)
            action = renderer.parse_action(generation.text)
            with busy(env):
                next_outcome = await pool.step_slot(slot, action.action)
            invalid = not action.valid or bool(next_outcome.info.get("invalid"))
            trajectory.turns.append(renderer.finish_turn(Turn(
                index=turn_index, observation=outcome.observation, prompt_ids=shown.ids,
                action_ids=generation.token_ids, student_logprobs=generation.logprobs, action_text=generation.text,
                reward=next_outcome.reward - (env_config.invalid_action_penalty if invalid else 0.0), invalid=invalid,
                image_keys=shown.image_keys, teacher_prompt_ids=shown.teacher_ids,
            )))
            history.append((outcome.observation, action.action))
            infos.append(outcome.info)
            outcome = next_outcome
    end_episode(trajectory, outcome, pool, slot, truncated=turn_limit < env_config.max_turns or context_full)
    return trajectory


def end_episode(trajectory: Trajectory, outcome: Any, pool: Any, slot: int, *, truncated: bool) -> None:
    """Record how the episode ended; one the env has not ended is ended in the pool. `truncated`: it
    still played when its turn limit below max_turns, or its renderer's context, stopped it (at
    max_turns the env's own turn limit ended it, not a truncation)."""
    trajectory.final_observation = outcome.observation
    if outcome.done:
        trajectory.ended = True
        trajectory.success = bool(outcome.won)
        trajectory.env_error = outcome.info.get("env_error", "")
    else:
        trajectory.truncated = truncated
        pool.end([slot])
    failpoint("rollout.episode_done")


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


# Wraps episode i: given i and the episode as a function of the pool it plays in, plays it.
EpisodeRunner = Callable[[int, Callable[[Any], Awaitable[Trajectory]]], Awaitable[Trajectory]]


async def play_all(spec: EnvSpec, pool: Any, policy: Policy, tasks: list[str], *, env_config: EnvConfig,
                   sampling: SamplingParams, turn_limits: Sequence[int] | None = None, probes: int = 0,
                   ledger: Any = None, actions: ActionSource = POLICY_SAMPLE,
                   run_episode: EpisodeRunner | None = None,
                   on_episode: Callable[[Trajectory], None] | None = None,
                   prompt: PromptConfig | None = None, teacher_tokenizer: Any = None) -> list[Trajectory]:
    """`rollout` inside a running event loop."""
    if not tasks:
        raise ValueError("rollout needs at least one task")
    turn_limits = list(turn_limits) if turn_limits is not None else [env_config.max_turns] * len(tasks)
    if len(turn_limits) != len(tasks) or not all(1 <= n <= env_config.max_turns for n in turn_limits):
        raise ValueError(f"rollout needs one turn limit per task, each in [1, env.max_turns={env_config.max_turns}]; "
                         f"got {turn_limits} for {len(tasks)} tasks")
    renderer = policy_renderer(spec, policy, prompt, sampling, teacher_tokenizer)

    async def play(i: int, task: str) -> Trajectory:
        episode = functools.partial(play_episode, spec, policy=policy, task_id=task, slot=i, episode=i,
                                    env_config=env_config, sampling=sampling, is_probe=i < probes, ledger=ledger,
                                    turn_limit=turn_limits[i], actions=actions, renderer=renderer)
        trajectory = await (run_episode(i, episode) if run_episode is not None else episode(pool))
        if on_episode is not None:
            on_episode(trajectory)
        return trajectory

    return list(await asyncio.gather(*(play(i, task) for i, task in enumerate(tasks))))


def rollout(spec: EnvSpec, pool: Any, policy: Policy, tasks: list[str], *, env_config: EnvConfig,
            sampling: SamplingParams, turn_limits: Sequence[int] | None = None, probes: int = 0,
            ledger: Any = None, actions: ActionSource = POLICY_SAMPLE,
            run_episode: EpisodeRunner | None = None,
            on_episode: Callable[[Trajectory], None] | None = None,
            prompt: PromptConfig | None = None, teacher_tokenizer: Any = None) -> list[Trajectory]:
    """Play one episode per task id (repeat a task id for several samples of it), all at once in
    slots 0..len(tasks)-1, episode i for at most turn_limits[i] turns (default: the horizon,
    env_config.max_turns, for every one; the batch plan decides them, probes at the horizon:
    turnopd.orchestration.pipeline.plan.episode_turn_limits); the first `probes` are marked as
    probes (Trajectory.is_probe). `actions` chooses each turn's action (the policy's sample by
    default); `run_episode` wraps each episode (see the module docstring); `on_episode` is called with
    each trajectory as it ends (a progress bar); `prompt` is the recipe's prompt section (None: the
    history_block style); `teacher_tokenizer`: a teacher of another tokenizer's, whose reading of each
    turn the turns carry (objective.tokenizers=cross; None: the teacher reads the student's tokens).
    Returns the trajectories in the order of `tasks`."""
    return asyncio.run(play_all(spec, pool, policy, tasks, env_config=env_config, sampling=sampling,
                                turn_limits=turn_limits, probes=probes, ledger=ledger, actions=actions,
                                run_episode=run_episode, on_episode=on_episode, prompt=prompt,
                                teacher_tokenizer=teacher_tokenizer))
