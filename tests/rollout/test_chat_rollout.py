"""Token in, token out on a transformers rollout of prompt.style=chat: a tiny random model with
SmolLM2-135M-Instruct's real tokenizer and template plays real ALFWorld games (the real engine, in
this process); every turn's prompt is the previous prompt + the ids the policy sampled + the
template's pieces, the trajectory is one sequence, and one forward pass over it gives, at the
sampled tokens, the log-probs the policy sampled them with (so trained and scored ids are the
sampled ones, in the context the policy saw). A context bound ends an episode as truncated."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from envs import make_env_spec
from envs.base import PromptContext
from tests.doubles import InProcessPool
from turnopd.config import EnvConfig, PolicyConfig, PromptConfig
from turnopd.core.types import build_token_batch, trajectory_sequences
from turnopd.rollout import POLICY_BACKENDS, SamplingParams
from turnopd.rollout.agent_loop import rollout
from turnopd.rollout.takeover import Takeover

LOOK_GAME = "look_at_obj_in_light-AlarmClock-None-DeskLamp-308/trial_T20190908_222917_366542"
ENV_CONFIG = EnvConfig(name="alfworld", max_turns=5, template="compact", answer_format="action", num_workers=1)
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=6, stop=("</action>",), seed=3)
IM_END = 2


@pytest.fixture(scope="module")
def model_dir(smollm2_tiny_model_dir):
    return smollm2_tiny_model_dir


@pytest.fixture(scope="module")
def played(model_dir):
    spec = make_env_spec(ENV_CONFIG)
    policy = POLICY_BACKENDS.get("transformers")(model_dir, PolicyConfig(), dtype="float32")
    return rollout(spec, InProcessPool(spec), policy, [LOOK_GAME, LOOK_GAME], env_config=ENV_CONFIG,
                   sampling=SAMPLING, prompt=PromptConfig(style="chat"))


def test_each_prompt_appends_the_sampled_ids(played):
    for trajectory in played:
        assert trajectory.depth == 5 and not trajectory.truncated  # played to the horizon
        for before, after in itertools.pairwise(trajectory.turns):
            n, m = len(before.prompt_ids), len(before.prompt_ids) + len(before.action_ids)
            assert after.prompt_ids[:m] == before.prompt_ids + before.action_ids
            # then the engine's <|im_end|>, unless the policy sampled it as its last token
            sampled_end = before.action_ids[-1] == IM_END
            assert after.prompt_ids[m - 1 if sampled_end else m] == IM_END and n < m


def test_one_forward_pass_scores_the_sampled_tokens_as_sampled(played, model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for trajectory in played:
        (sequence,) = trajectory_sequences(trajectory, "teacher")
        with torch.no_grad():
            logprobs = model(torch.tensor([sequence.ids])).logits[0].log_softmax(-1)
        for (start, end, index), turn in zip(sequence.spans, trajectory.turns, strict=True):
            assert (index, sequence.ids[start:end]) == (turn.index, turn.action_ids)
            scored = [logprobs[p - 1, sequence.ids[p]].item() for p in range(start, end)]
            assert scored == pytest.approx(turn.student_logprobs, abs=1e-4)
    batch = build_token_batch(played)
    assert batch.input_ids[batch.loss_mask].tolist() == [t for traj in played for turn in traj.turns
                                                         for t in turn.action_ids]
    assert batch.seq_lens.tolist() == [len(t.turns[-1].prompt_ids) + len(t.turns[-1].action_ids) for t in played]


def test_a_context_bound_ends_the_episode_as_truncated(played, model_dir):
    spec = make_env_spec(ENV_CONFIG)
    policy = POLICY_BACKENDS.get("transformers")(model_dir, PolicyConfig(), dtype="float32")
    third_prompt = len(played[0].turns[2].prompt_ids)
    bound = PromptConfig(style="chat", max_context=third_prompt - 1 + SAMPLING.max_new_tokens)
    (trajectory,) = rollout(spec, InProcessPool(spec), policy, [LOOK_GAME], env_config=ENV_CONFIG, sampling=SAMPLING,
                            prompt=bound)
    assert trajectory.depth == 2 and trajectory.truncated and not trajectory.ended
    assert [t.action_ids for t in trajectory.turns] == [t.action_ids for t in played[0].turns[:2]]


def test_a_chat_takeover_starts_from_the_conversation_of_its_replayed_steps(model_dir):
    """A takeover (the teacher audit's) in a chat: the policy's first prompt is the conversation in
    which the replayed actions were the assistant's answers, rendered by the template as a whole."""
    spec = make_env_spec(ENV_CONFIG)
    tok = AutoTokenizer.from_pretrained(model_dir)
    replay = ["go to desk 1", "look"]
    reset = asyncio.run(Takeover(InProcessPool(spec), [replay]).reset_slot(0, LOOK_GAME))
    prior = reset.info["prior_steps"]
    assert [step.action for step in prior] == replay
    states = [(step.observation, step.admissible) for step in prior[1:]] + [(reset.observation, reset.admissible)]
    first = spec.render_prompt(PromptContext(task=reset.info["task"], step=0, observation=prior[0].observation,
                                             history=[], admissible=prior[0].admissible, answer_format="action"))
    messages = [{"role": "user", "content": first}]
    for action, (observation, admissible) in zip(replay, states, strict=True):
        messages += [{"role": "assistant", "content": f"<action>{action}</action>"},
                     {"role": "user", "content": observation + "\nAdmissible actions: " + ", ".join(
                         f"'{a}'" for a in admissible if a != "help")}]
    expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)

    policy = POLICY_BACKENDS.get("transformers")(model_dir, PolicyConfig(), dtype="float32")
    (taken,) = rollout(spec, Takeover(InProcessPool(spec), [replay]), policy, [LOOK_GAME], env_config=ENV_CONFIG,
                       sampling=SAMPLING, prompt=PromptConfig(style="chat"))
    assert taken.turns[0].index == 2 and taken.turns[0].observation == reset.observation
    assert taken.turns[0].prompt_ids == list(expected)
    assert len(trajectory_sequences(taken)) == 1  # the replay is context, the policy's turns still one sequence
