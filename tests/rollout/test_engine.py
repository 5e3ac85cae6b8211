"""The rollout engine on a tiny deterministic env (in-process stand-ins for the env pool and, in
most tests, a scripted policy); tests/rollout/test_engine_alfworld.py plays real ALFWorld games
with a real model."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
from transformers import AutoTokenizer

from envs.base import ParsedAction, PromptContext, StepOutcome, extract_action
from tests.doubles import InProcessPool
from turnopd.config import EnvConfig, PolicyConfig
from turnopd.core.ledger import Ledger
from turnopd.orchestration.pipeline.plan import episode_turn_limits
from turnopd.rollout import POLICY_BACKENDS, Generation, Policy, SamplingParams
from turnopd.rollout.agent_loop import POLICY_SAMPLE, rollout
from turnopd.rollout.completion import PromptTooLongError
from turnopd.rollout.render import chat_prompt_ids
from turnopd.rollout.takeover import Takeover

# Task ids "need-K:PATTERN": the env is won after K actions "step"; the scripted policy answers turn
# t by PATTERN[t % len]: "s" -> step, "x" -> an action the env refuses, "?" -> no action tags.
# "crash-K:..." ends by an env error at step K (K = 0: at reset).
ANSWERS = {"s": "<action>step</action>", "x": "<action>dance</action>", "?": "I do not know"}


class CounterEnv:
    def reset(self, task_id: str) -> StepOutcome:
        self.kind, rest = task_id.split("-")
        self.goal = int(rest.split(":")[0])
        self.count = self.steps = 0
        if self.kind == "crash" and self.goal == 0:
            return StepOutcome("", done=True, info={"env_error": "boom at reset"})
        return StepOutcome("count 0", admissible=["step"], info={"task": f"reach {self.goal}"})

    def step(self, action: str) -> StepOutcome:
        self.steps += 1
        if self.kind == "crash" and self.steps == self.goal:
            return StepOutcome("", done=True, info={"env_error": "boom"})
        valid = action == "step"
        self.count += valid
        won = self.kind == "need" and self.count == self.goal
        return StepOutcome(f"count {self.count}", reward=1.0 if won else 0.0, done=won, won=won,
                           admissible=["step"], info={"invalid": not valid})

    def close(self) -> None:
        pass


class CounterSpec:
    name = "counter"
    default_max_turns = 10

    def task_type(self, task_id: str) -> str:
        return task_id.split("-")[0]

    def make(self) -> CounterEnv:
        return CounterEnv()

    def parse_action(self, text: str) -> ParsedAction:
        return extract_action(text)

    def render_prompt(self, ctx: PromptContext) -> str:
        return f"goal={ctx.task} step={ctx.step} obs={ctx.observation} history={ctx.history} admissible={ctx.admissible}"


class ScriptedPolicy(Policy):
    """Answers from the task's pattern, read back from the prompt text; counts the requests of each turn."""

    def __init__(self, tokenizer, max_model_len: int = 4096):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.weight_version = 7
        self.before_batch = None
        self.requests_per_turn: dict[int, int] = {}
        self.patterns: dict[str, str] = {}  # goal text -> pattern

    def session(self):
        return contextlib.nullcontext()

    async def generate(self, prompt, sampling, image_keys=()):
        text = self.tokenizer.decode(prompt)
        goal = re.search(r"goal=(.*?) step=", text).group(1)
        step = int(re.search(r" step=(\d+)", text).group(1))
        self.requests_per_turn[step] = self.requests_per_turn.get(step, 0) + 1
        pattern = self.patterns[goal]
        answer = ANSWERS[pattern[step % len(pattern)]]
        ids = self.tokenizer(answer, add_special_tokens=False)["input_ids"]
        return Generation(ids, [-0.25] * len(ids), answer)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def play(tokenizer, tasks, *, cap, max_turns=10, history_length=2, probes=0, penalty=0.0, ledger=None):
    spec = CounterSpec()
    pool = InProcessPool(spec)
    policy = ScriptedPolicy(tokenizer)
    for task in tasks:
        kind, rest = task.split("-")
        goal, pattern = rest.split(":")
        policy.patterns[f"reach {goal}"] = pattern
    env_config = EnvConfig(name="alfworld", max_turns=max_turns, history_length=history_length,
                           invalid_action_penalty=penalty)
    trajs = rollout(spec, pool, policy, tasks, env_config=env_config, sampling=SamplingParams(),
                    turn_limits=episode_turn_limits(len(tasks), probes, cap, max_turns), probes=probes, ledger=ledger)
    return trajs, policy, pool


def test_cap_truncates_and_finished_episodes_are_dropped(tokenizer):
    ledger = Ledger()
    trajs, policy, pool = play(tokenizer, ["need-1:s", "need-2:s", "need-5:s", "need-5:s"], cap=3, ledger=ledger)
    assert [t.depth for t in trajs] == [1, 2, 3, 3]
    assert [t.success for t in trajs] == [True, True, False, False]
    assert [t.truncated for t in trajs] == [False, False, True, True]
    assert policy.requests_per_turn == {0: 4, 1: 3, 2: 2}
    assert {step: sorted(slots) for step, slots in pool.stepped.items()} == {0: [0, 1, 2, 3], 1: [1, 2, 3], 2: [2, 3]}
    assert sorted(pool.ended) == [2, 3]  # the two the cap stopped: their games are closed
    assert all(not t.is_probe and t.weight_version == 7 and t.env_name == "counter" for t in trajs)
    assert [t.task_type for t in trajs] == ["need"] * 4
    assert set(ledger.busy_totals) == {"generation", "env"} and not ledger.totals
    assert [turn.index for turn in trajs[2].turns] == [0, 1, 2]
    assert trajs[0].turns[0].reward == 1.0 and trajs[2].turns[0].reward == 0.0


def test_probe_runs_full_depth_and_is_not_truncated(tokenizer):
    trajs, policy, _ = play(tokenizer, ["need-3:s", "need-20:s"], cap=6, max_turns=6, probes=2)
    assert [t.depth for t in trajs] == [3, 6]
    assert [t.truncated for t in trajs] == [False, False]  # the env's max_turns ended it, not a cap
    assert [t.success for t in trajs] == [True, False]
    assert all(t.is_probe for t in trajs)
    assert policy.requests_per_turn == {0: 2, 1: 2, 2: 2, 3: 1, 4: 1, 5: 1}


def test_probes_among_capped_rollouts_play_full_depth(tokenizer):
    # the first `probes` episodes are probes: uncensored (max_turns 6) while the others stop at cap 2
    trajs, _, pool = play(tokenizer, ["need-20:s", "need-20:s", "need-20:s"], cap=2, max_turns=6, probes=1)
    assert [(t.is_probe, t.depth, t.truncated) for t in trajs] == [(True, 6, False), (False, 2, True), (False, 2, True)]
    assert sorted(pool.ended) == [0, 1, 2]  # all three unfinished: their games closed


def test_invalid_actions_counted_and_penalized(tokenizer):
    (traj,), _, _ = play(tokenizer, ["need-2:x?sxs"], cap=10, penalty=0.5)
    assert [turn.invalid for turn in traj.turns] == [True, True, False, True, False]
    assert [turn.reward for turn in traj.turns] == [-0.5, -0.5, 0.0, -0.5, 1.0]
    assert traj.invalid_actions == 3 and traj.success
    assert [turn.action_text for turn in traj.turns] == [ANSWERS[c] for c in "x?sxs"]


def test_prompts_show_the_history_window(tokenizer):
    for history_length in (0, 2):
        (traj,), _, _ = play(tokenizer, ["need-9:sx?"], cap=5, history_length=history_length)
        spec = CounterSpec()
        for t, turn in enumerate(traj.turns):
            pairs = [(prev.observation, spec.parse_action(prev.action_text).action) for prev in traj.turns[:t]]
            window = pairs[-history_length:] if history_length else []
            expected = spec.render_prompt(PromptContext(task="reach 9", step=t, observation=turn.observation,
                                                        history=window, admissible=["step"]))
            assert turn.prompt_ids == chat_prompt_ids(tokenizer, expected)
            assert turn.observation == f"count {sum(c == 's' for c in ('sx?' * 3)[:t])}"


def test_env_errors_mark_failed_by_env(tokenizer):
    trajs, _, _ = play(tokenizer, ["crash-2:s", "crash-0:s", "need-4:s"], cap=10)
    assert [t.failed_by_env for t in trajs] == [True, True, False]
    assert [t.env_error for t in trajs] == ["boom", "boom at reset", ""]
    assert [t.depth for t in trajs] == [2, 0, 4]
    assert [t.success for t in trajs] == [False, False, True]
    assert not any(t.truncated for t in trajs)


def test_the_engine_plays_each_episode_to_the_limit_it_is_given(tokenizer):
    # the turn limits are the plan's: the engine applies no rule of its own, so a probe given 2 turns
    # plays 2 (truncated: below the horizon 6), and the default is the horizon for every episode
    spec, pool, policy = CounterSpec(), InProcessPool(CounterSpec()), ScriptedPolicy(tokenizer)
    policy.patterns["reach 20"] = "s"
    env_config = EnvConfig(name="alfworld", max_turns=6)
    given = rollout(spec, pool, policy, ["need-20:s"] * 3, env_config=env_config, sampling=SamplingParams(),
                    turn_limits=[2, 6, 4], probes=1)
    assert [(t.depth, t.truncated, t.is_probe) for t in given] == [(2, True, True), (6, False, False), (4, True, False)]
    default = rollout(spec, pool, policy, ["need-20:s"] * 2, env_config=env_config, sampling=SamplingParams())
    assert [(t.depth, t.truncated) for t in default] == [(6, False), (6, False)]


class StepAfterWatching:
    """An action source that sees every turn's state and answers "step" from turn 1 on (the policy's
    own sample at turn 0): the hook the judge plugs into."""

    def __init__(self):
        self.states = []

    async def act(self, policy, prompt, sampling, state, busy):
        self.states.append(state)
        if state.turn == 0:
            return await POLICY_SAMPLE.act(policy, prompt, sampling, state, busy)
        ids = policy.tokenizer(ANSWERS["s"], add_special_tokens=False)["input_ids"]
        return Generation(ids, [-1.0] * len(ids), ANSWERS["s"])


def test_an_action_source_chooses_each_turns_action_from_the_episodes_state(tokenizer):
    spec, pool, policy = CounterSpec(), InProcessPool(CounterSpec()), ScriptedPolicy(tokenizer)
    policy.patterns["reach 3"] = "x"  # the policy alone would never step
    source = StepAfterWatching()
    (traj,) = rollout(spec, pool, policy, ["need-3:x"], env_config=EnvConfig(name="alfworld", max_turns=6),
                      sampling=SamplingParams(), actions=source)
    assert [turn.invalid for turn in traj.turns] == [True, False, False, False] and traj.success
    assert policy.requests_per_turn == {0: 1}  # only turn 0 asked the policy
    assert [(s.turn, s.goal, s.observation, len(s.history)) for s in source.states] == [
        (0, "reach 3", "count 0", 0), (1, "reach 3", "count 0", 1), (2, "reach 3", "count 1", 2),
        (3, "reach 3", "count 2", 3)]
    assert source.states[2].history == [("count 0", "dance"), ("count 0", "step")]
    assert all(s.first_observation == "count 0" and s.reset_info["task"] == "reach 3" for s in source.states)


def test_a_takeover_replays_its_actions_into_the_history_not_the_trajectory(tokenizer):
    spec, policy = CounterSpec(), ScriptedPolicy(tokenizer)
    policy.patterns["reach 3"] = "s"
    pool = Takeover(InProcessPool(spec), [["step", "dance"], ["step", "step", "step", "step"]])
    taken, finished = rollout(spec, pool, policy, ["need-3:s", "need-3:s"],
                              env_config=EnvConfig(name="alfworld", max_turns=5, history_length=2),
                              sampling=SamplingParams())
    # two replayed actions (count 1), then the policy's from turn 2: two steps reach 3
    assert [turn.index for turn in taken.turns] == [2, 3] and taken.success
    assert taken.turns[0].observation == "count 1"
    expected = spec.render_prompt(PromptContext(task="reach 3", step=2, observation="count 1",
                                                history=[("count 0", "step"), ("count 1", "dance")],
                                                admissible=["step"]))
    assert taken.turns[0].prompt_ids == chat_prompt_ids(tokenizer, expected)
    # the replay won the game at its third action: it stops there, and the policy plays no turn
    assert finished.depth == 0 and finished.success and finished.ended


def test_bad_arguments_fail_before_any_env_work(tokenizer):
    spec, env_config = CounterSpec(), EnvConfig(name="alfworld", max_turns=5)
    policy = ScriptedPolicy(tokenizer)
    for kwargs, message in (({"turn_limits": [0]}, r"each in \[1, env.max_turns=5\]"),
                            ({"turn_limits": [6]}, r"each in \[1, env.max_turns=5\]"),
                            ({"turn_limits": [2, 2]}, "one turn limit per task")):
        pool = InProcessPool(spec)
        args = {"env_config": env_config, "sampling": SamplingParams(), **kwargs}
        with pytest.raises(ValueError, match=message):
            rollout(spec, pool, policy, ["need-1:s"], **args)
        assert not pool.envs
    with pytest.raises(ValueError, match="at least one task"):
        rollout(spec, InProcessPool(spec), policy, [], env_config=env_config, sampling=SamplingParams())


def test_prompt_too_long_names_history_length(tokenizer):
    spec = CounterSpec()
    policy = ScriptedPolicy(tokenizer, max_model_len=60)
    policy.patterns["reach 9"] = "s"
    with pytest.raises(PromptTooLongError, match=r"env.history_length \(now 2\)"):
        rollout(spec, InProcessPool(spec), policy, ["need-9:s"], env_config=EnvConfig(name="alfworld"),
                sampling=SamplingParams(max_new_tokens=8), turn_limits=[5])


def test_real_policy_turns_hold_exact_student_logprobs(tiny_model_dir):
    """With the real transformers policy: every turn's action tokens and log-probs are what the model
    gives for exactly the recorded prompt."""
    policy = POLICY_BACKENDS.get("transformers")(tiny_model_dir, PolicyConfig(), dtype="float32")
    spec = CounterSpec()
    env_config = EnvConfig(name="alfworld", max_turns=3, history_length=1)
    trajs = rollout(spec, InProcessPool(spec), policy, ["need-2:s", "need-1:s"], env_config=env_config,
                    sampling=SamplingParams(temperature=1.0, max_new_tokens=8, seed=5), turn_limits=[2, 2])
    assert [t.depth for t in trajs] == [2, 2]  # a random model never says "step": truncated by the cap
    assert all(t.truncated and t.weight_version == 0 for t in trajs)
    for traj in trajs:
        for turn in traj.turns:
            assert 1 <= len(turn.action_ids) <= 8
            with torch.no_grad():
                logits = policy.model(torch.tensor([turn.prompt_ids + turn.action_ids])).logits[0]
            lp = logits.log_softmax(-1)
            n = len(turn.prompt_ids)
            expected = [lp[n - 1 + j, t].item() for j, t in enumerate(turn.action_ids)]
            assert turn.student_logprobs == pytest.approx(expected, abs=1e-4)
            assert turn.invalid  # random text has no action tags
