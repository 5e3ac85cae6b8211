"""The rollout engine on real ALFWorld games (the real engine, through the real env pool) with a
tiny policy trained here, in seconds, to play one game's expert walkthrough: that game ends early
(won) and leaves the others playing; the cap truncates; probes run at full depth; invalid actions
are counted as a replay of the same actions on a fresh env says; and on greedy decoding the
asynchronous engine plays exactly what the lock-step engine it replaced played (written out here
as the reference)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from envs import make_env_spec
from envs.base import PromptContext, format_answer
from envs.pool import EnvPool
from tests.conftest import TINY_CORPUS
from tests.rollout.lockstep import lockstep_rollout
from turnopd.config import EnvConfig, PolicyConfig
from turnopd.models.tiny import build_tiny_model
from turnopd.rollout import POLICY_BACKENDS, SamplingParams
from turnopd.rollout.agent_loop import rollout
from turnopd.rollout.takeover import Takeover

pytestmark = pytest.mark.slow

# A 4-step game of valid_unseen (go to desk 2, take alarmclock, go to desk 1, use desklamp).
LOOK_GAME = "look_at_obj_in_light-AlarmClock-None-DeskLamp-308/trial_T20190908_222917_366542"
ENV_CONFIG = EnvConfig(name="alfworld", max_turns=6, history_length=1, answer_format="action",
                       invalid_action_penalty=0.25)
SAMPLING = SamplingParams(temperature=0.0, max_new_tokens=24, stop=("</action>",))


@pytest.fixture(scope="module")
def spec():
    return make_env_spec(ENV_CONFIG)


@pytest.fixture(scope="module")
def games(spec):
    """LOOK_GAME and three kitchen games of other task types (no desks there)."""
    tasks = spec.tasks("valid_unseen")
    others = [next(t for t in tasks if t.startswith(kind)) for kind in
              ("pick_clean_then_place_in_recep", "pick_heat_then_place_in_recep", "pick_cool_then_place_in_recep")]
    return [LOOK_GAME, *others]


def expert_demo(spec) -> list[tuple[str, str]]:
    """(user message, answer) per turn of LOOK_GAME played by its expert, rendered as the engine
    documents: the env's template, history = the last history_length (observation, action) pairs."""
    env, expert = spec.make(), spec.expert(LOOK_GAME)
    outcome = env.reset(LOOK_GAME)
    task, history, demo = outcome.info["task"], [], []
    while not outcome.done:
        action = expert.act(outcome)
        message = spec.render_prompt(PromptContext(
            task=task, step=len(demo), observation=outcome.observation, history=history[-ENV_CONFIG.history_length:],
            admissible=outcome.admissible, answer_format=ENV_CONFIG.answer_format))
        demo.append((message, format_answer(action, ENV_CONFIG.answer_format)))
        history.append((outcome.observation, action))
        outcome = env.step(action)
    env.close()
    assert outcome.won and len(demo) == 4
    return demo


@pytest.fixture(scope="module")
def demo(spec):
    return expert_demo(spec)


@pytest.fixture(scope="module")
def policy(demo, tmp_path_factory):
    """A tiny model that has memorized LOOK_GAME's expert answers (greedy reproduces them)."""
    path = build_tiny_model(tmp_path_factory.mktemp("alf") / "m", [*TINY_CORPUS, *(m + a for m, a in demo)],
                            hidden_size=64, num_heads=2, max_position_embeddings=2048, seed=0)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rows = []
    for message, answer in demo:
        prompt = tok.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)
        target = tok(answer, add_special_tokens=False)["input_ids"]
        rows.append((torch.tensor([prompt + target]), len(prompt)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(300):
        memorized = True
        for ids, n in rows:
            logits = model(ids).logits[0, n - 1 : -1]
            loss = torch.nn.functional.cross_entropy(logits, ids[0, n:])
            loss.backward()
            memorized &= bool((logits.argmax(-1) == ids[0, n:]).all())
        if memorized:
            break
        optimizer.step()
        optimizer.zero_grad()
    assert memorized, "the tiny model did not memorize the walkthrough"
    return POLICY_BACKENDS.get("transformers")(model.eval(), PolicyConfig(), tokenizer=tok)


def replay(spec, traj) -> list[tuple[bool, float, str]]:
    """(invalid, reward, observation before the action) per turn, from the trajectory's own actions
    played again on a fresh env."""
    env = spec.make()
    outcome = env.reset(traj.task_id)
    out = []
    for turn in traj.turns:
        parsed = spec.parse_action(turn.action_text)
        invalid = not parsed.valid or parsed.action not in outcome.admissible
        before = outcome.observation
        outcome = env.step(parsed.action)
        out.append((invalid, outcome.reward - ENV_CONFIG.invalid_action_penalty * invalid, before))
    env.close()
    return out


def test_probe_full_depth_finished_dropped_invalid_counted(spec, games, policy, demo):
    batches_before = len(policy._batcher.batch_sizes)
    with EnvPool(spec, num_workers=2, step_timeout_s=120) as pool:  # refuses to step an ended episode
        trajs = rollout(spec, pool, policy, games, env_config=ENV_CONFIG, sampling=SAMPLING, probes=len(games))
    assert [t.task_id for t in trajs] == games
    assert [t.depth for t in trajs] == [4, 6, 6, 6]
    assert [t.success for t in trajs] == [True, False, False, False]
    assert not any(t.truncated for t in trajs) and all(t.is_probe for t in trajs)
    # one request per turn (22), batched as they were pending: at most the 4 episodes at once
    batches = policy._batcher.batch_sizes[batches_before:]
    assert sum(batches) == 22 and max(batches) <= 4
    assert [turn.action_text for turn in trajs[0].turns] == [answer for _, answer in demo]
    assert trajs[0].invalid_actions == 0
    assert sum(t.invalid_actions for t in trajs[1:]) > 0
    for traj in trajs:
        expected = replay(spec, traj)
        assert [turn.invalid for turn in traj.turns] == [e[0] for e in expected]
        assert [turn.reward for turn in traj.turns] == pytest.approx([e[1] for e in expected])
        assert [turn.observation for turn in traj.turns] == [e[2] for e in expected]
        assert traj.task_type == traj.task_id.split("-")[0] and not traj.failed_by_env


def test_cap_truncates_real_episodes(spec, games, policy):
    with EnvPool(spec, num_workers=2, step_timeout_s=120) as pool:
        trajs = rollout(spec, pool, policy, games[:2], env_config=ENV_CONFIG, sampling=SAMPLING, turn_limits=[2, 2])
    assert [t.depth for t in trajs] == [2, 2]
    assert all(t.truncated and not t.success and not t.is_probe for t in trajs)
    # the memorized game played its first two expert moves
    assert [spec.parse_action(turn.action_text).action for turn in trajs[0].turns] == [
        "go to desk 2", "take alarmclock 1 from desk 2"]


@pytest.mark.parametrize("cap, is_probe", [(6, True), (3, False)])
def test_greedy_trajectories_are_the_lockstep_engines(spec, games, policy, cap, is_probe):
    probes = len(games) if is_probe else 0
    """Token ids, masks (turn boundaries), observations, rewards and outcomes exactly; log-probs to
    float rounding (a token's log-prob comes from a batch padded another way)."""
    with EnvPool(spec, num_workers=2, step_timeout_s=120) as pool:
        reference = lockstep_rollout(spec, pool, policy, games, env_config=ENV_CONFIG, sampling=SAMPLING, cap=cap,
                                     is_probe=is_probe)
        trajs = rollout(spec, pool, policy, games, env_config=ENV_CONFIG, sampling=SAMPLING,
                        turn_limits=[cap] * len(games), probes=probes)
    for got, want in zip(trajs, reference, strict=True):
        assert (got.task_id, got.success, got.truncated, got.is_probe, got.env_error, got.depth) == (
            want.task_id, want.success, want.truncated, want.is_probe, want.env_error, want.depth)
        for a, b in zip(got.turns, want.turns, strict=True):
            assert (a.index, a.observation, a.prompt_ids, a.action_ids, a.action_text, a.reward, a.invalid) == (
                b.index, b.observation, b.prompt_ids, b.action_ids, b.action_text, b.reward, b.invalid)
            assert a.student_logprobs == pytest.approx(b.student_logprobs, abs=1e-5)


def test_a_replayed_prefix_puts_the_policy_in_the_same_state(spec, games, policy):
    """A takeover: the first two expert actions replayed, then the policy plays from turn 2 the very
    prompts (history included) of the episode it played from the start, and wins the same way."""
    with EnvPool(spec, num_workers=2, step_timeout_s=120) as pool:
        (whole,) = rollout(spec, pool, policy, [LOOK_GAME], env_config=ENV_CONFIG, sampling=SAMPLING)
        prefix = [spec.parse_action(turn.action_text).action for turn in whole.turns[:2]]
        taken, wrong = rollout(spec, Takeover(pool, [prefix, ["go to desk 1", "look"]]), policy, [LOOK_GAME, LOOK_GAME],
                               env_config=ENV_CONFIG, sampling=SAMPLING)
    assert [turn.index for turn in taken.turns] == [2, 3] and taken.success
    assert [turn.prompt_ids for turn in taken.turns] == [turn.prompt_ids for turn in whole.turns[2:]]
    assert taken.turns[0].observation == whole.turns[2].observation
    assert wrong.turns[0].observation != whole.turns[2].observation  # another prefix, another state
    assert wrong.turns[0].index == 2 and wrong.depth == 6  # max_turns turns of its own after the replay
