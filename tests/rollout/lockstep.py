"""The rollout engine before the asynchronous one, kept as the reference it is tested and measured
against (tests/rollout/test_engine_alfworld.py, benchmarks/rollout_throughput.py); not used by the
library. Every live episode moves in lock-step by turn index: one generation batch for all of them,
then one env step for all of them. Requests carry the seeds the asynchronous engine gives them
(request_seed of the batch's seed, the episode and the turn), so both play the same episodes."""

from __future__ import annotations

import asyncio
import dataclasses

from envs.base import PromptContext
from turnopd.core.types import Trajectory, Turn
from turnopd.rollout.base import request_seed
from turnopd.rollout.render import chat_prompt_ids


async def _generate(policy, prompts, sampling, episodes, turn_index):
    return await asyncio.gather(*(policy.generate(prompt, dataclasses.replace(
        sampling, seed=request_seed(sampling.seed, episode, turn_index))) for prompt, episode in zip(
        prompts, episodes, strict=True)))


def lockstep_rollout(spec, pool, policy, tasks, *, env_config, sampling, cap, is_probe=False) -> list[Trajectory]:
    """`turnopd.rollout.agent_loop.rollout`'s episodes, played in lock-step through the pool's batch calls."""
    depth = min(env_config.max_turns, cap)
    outcomes = pool.reset(list(tasks))
    trajs = [Trajectory(task_id=t, env_name=spec.name, is_probe=is_probe, task_type=spec.task_type(t),
                        weight_version=policy.weight_version) for t in tasks]
    goals = [o.info.get("task", "") for o in outcomes]
    histories: list[list[tuple[str, str]]] = [[] for _ in tasks]
    for turn_index in range(depth):
        live = [i for i, o in enumerate(outcomes) if not o.done]
        if not live:
            break
        prompts = [chat_prompt_ids(policy.tokenizer, spec.render_prompt(PromptContext(
            task=goals[i], step=turn_index, observation=outcomes[i].observation,
            history=histories[i][-env_config.history_length:] if env_config.history_length else [],
            admissible=outcomes[i].admissible, answer_format=env_config.answer_format))) for i in live]
        generations = asyncio.run(_generate(policy, prompts, sampling, live, turn_index))
        parsed = [spec.parse_action(g.text) for g in generations]
        stepped = pool.step({i: p.action for i, p in zip(live, parsed, strict=True)})
        for i, prompt, gen, action in zip(live, prompts, generations, parsed, strict=True):
            invalid = not action.valid or bool(stepped[i].info.get("invalid"))
            trajs[i].turns.append(Turn(index=turn_index, observation=outcomes[i].observation, prompt_ids=prompt,
                                       action_ids=gen.token_ids, student_logprobs=gen.logprobs, action_text=gen.text,
                                       reward=stepped[i].reward - (env_config.invalid_action_penalty if invalid else 0.0),
                                       invalid=invalid))
            histories[i].append((outcomes[i].observation, action.action))
            outcomes[i] = stepped[i]
    for traj, outcome in zip(trajs, outcomes, strict=True):
        traj.success, traj.env_error = bool(outcome.won), outcome.info.get("env_error", "")
        traj.truncated = not outcome.done and depth < env_config.max_turns
    return trajs
