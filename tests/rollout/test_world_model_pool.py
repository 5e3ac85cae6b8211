"""WorldModelPool: real resets (cached per task), world-model steps from the envs.transitions prompt,
the disagreement of K samples, endings from the status line, the verdicts on a real episode
(its last transition, its actions replayed in the model, a twin episode of its task). The world
model is scripted here (its answers are what the test is about); tests/test_world_model_rollouts.py
runs a trained one in real distillation."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from envs import make_env_spec
from envs.pool import EnvPool
from turnopd.config import EnvConfig
from turnopd.core.types import Trajectory, Turn
from turnopd.rollout import Generation, Policy, SamplingParams
from turnopd.rollout.agent_loop import rollout
from turnopd.rollout.world_model_pool import NO_STATUS, WorldModelPool, listed, trace_of


class ScriptedWorldModel(Policy):
    """Answers each request with the next of `answers`; records the prompts (as text) and seeds."""

    weight_version = 0
    max_model_len = 100_000

    def __init__(self, tokenizer, answers: list[str]):
        self.tokenizer, self.answers = tokenizer, list(answers)
        self.prompts: list[str] = []
        self.seeds: list[int | None] = []

    def session(self):
        return contextlib.nullcontext()

    async def generate(self, prompt: list[int], sampling: SamplingParams, image_keys=()) -> Generation:
        self.prompts.append(self.tokenizer.decode(prompt))
        self.seeds.append(sampling.seed)
        text = self.answers.pop(0)
        return Generation([1], [0.0], text)


@pytest.fixture(scope="module")
def alfworld():
    spec = make_env_spec(EnvConfig(name="alfworld", task_types=["look_at_obj_in_light"]))
    with EnvPool(spec, num_workers=1) as pool:
        yield spec, pool


def test_a_model_episode_resets_in_the_real_env_once_per_task_then_plays_the_models_answers(alfworld, tiny_model_dir):
    from transformers import AutoTokenizer

    spec, real = alfworld
    task = spec.tasks("train")[0]
    model = ScriptedWorldModel(AutoTokenizer.from_pretrained(tiny_model_dir), [
        "continue\nYou arrive at desk 1.", "continue\nYou arrive at desk 1.", "continue\nYou arrive at desk  1.",
        "won\nYou turn on the desklamp 1.", "won\nYou turn on the desklamp 1.", "lost\nNothing.",
        "no status at all", "continue\nx", "continue\nx"])
    world = WorldModelPool(spec, real, model, history_length=1, max_observation_tokens=32, samples=3, seed=5)

    async def play():
        world.start_batch(7)
        first = await world.reset_slot(0, task)
        arrive = await world.step_slot(0, "go to desk 1")
        lamp = await world.step_slot(0, "use desklamp 1")
        trace = world.take_trace(0)
        again = await world.reset_slot(0, task)
        broken = await world.step_slot(0, "go to bed 1")
        return first, arrive, lamp, trace, again, broken

    first, arrive, lamp, trace, again, broken = asyncio.run(play())
    assert world.real_resets == 1 and first.info["world_model"] and first.observation == again.observation
    assert first.observation.startswith("-= Welcome to TextWorld, ALFRED! =-")
    # three samples, two the same once whitespace is normalised: all agree -> d = 0
    assert (arrive.observation, arrive.done, trace.disagreements[0]) == ("You arrive at desk 1.", False, 0.0)
    # won, won, lost: the first is played; d = 1 - 2/3
    assert (lamp.done, lamp.won, lamp.reward) == (True, True, 1.0)
    assert trace.played and trace.disagreements[1:] == [pytest.approx(1 / 3)]
    # the second step's prompt: the goal, the start, the last (observation, action), now, the action
    goal = first.info["task"]
    assert model.prompts[3].count(f"Goal: {goal}\nStart: {first.observation}\nRecent: [Observation 1: '"
                                  f"{first.observation}', Action 1: 'go to desk 1']\nNow: You arrive at desk 1.\n"
                                  "Action: use desklamp 1") == 1
    # each sample of each step has its own stream; the same batch and episode give the same seeds
    assert len(set(model.seeds[:6])) == 6
    # an answer without a status line ends the episode, as the env failing would
    assert broken.done and broken.info["env_error"] == NO_STATUS
    assert world.model_steps == 3


def _real_episode(turns: int) -> Trajectory:
    return Trajectory(task_id="t", env_name="alfworld", goal="g", turns=[
        Turn(index=i, observation=f"o{i}", prompt_ids=[1], action_ids=[2], student_logprobs=[0.0],
             action_text=f"<action>a{i}</action>") for i in range(turns)])


def test_the_last_turn_verdict_is_the_share_of_won_answers_to_the_real_last_transition(alfworld, tiny_model_dir):
    from transformers import AutoTokenizer

    spec, real = alfworld
    model = ScriptedWorldModel(AutoTokenizer.from_pretrained(tiny_model_dir),
                               ["won\nok", "continue\nno", "won\nok", "junk"])
    world = WorldModelPool(spec, real, model, history_length=1, max_observation_tokens=32, samples=4)
    assert asyncio.run(world.predict_success(_real_episode(3), slot=0)) == (0.5, 1)  # 2 of 4 say won
    assert model.prompts[0].count("Goal: g\nStart: o0\nRecent: [Observation 2: 'o1', Action 2: 'a1']\nNow: o2\n"
                                  "Action: a2") == 1
    assert asyncio.run(world.predict_success(Trajectory(task_id="t", env_name="alfworld"), slot=0)) == (0.0, 0)


@pytest.mark.parametrize(("answers", "verdict"), [
    (["continue\nm1", "continue\nm2", "won\nm3"], (1.0, 3)),   # the model's first ending is won
    (["continue\nm1", "lost\nm2"], (0.0, 2)),                  # ... is lost: the replay stops there
    (["won\nm1"], (1.0, 1)),                                     # won sooner than the real episode ended
    (["continue\nm1", "continue\nm2", "continue\nm3"], (0.0, 3)),  # the actions run out: not won
    (["continue\nm1", "junk"], (None, 2)),                      # no status line: no verdict
])
def test_a_replay_is_the_models_ending_of_the_real_actions(alfworld, tiny_model_dir, answers, verdict):
    from transformers import AutoTokenizer

    spec, real = alfworld
    model = ScriptedWorldModel(AutoTokenizer.from_pretrained(tiny_model_dir), answers)
    world = WorldModelPool(spec, real, model, history_length=1, max_observation_tokens=32, samples=4, seed=5)
    assert asyncio.run(world.replay("g", "o0", listed(["a0", "a1", "a2"]), slot=2)) == verdict
    assert model.answers == []  # one answer a step, whatever `samples` is
    # each step follows the model's own answers (m1), not the real observation (o1)
    if len(model.prompts) > 1:
        assert model.prompts[1].count("Goal: g\nStart: o0\nRecent: [Observation 1: 'o0', Action 1: 'a0']\nNow: m1\n"
                                      "Action: a1") == 1


def test_a_shadow_replays_a_real_episode_while_it_plays_as_a_replay_after_it_would(alfworld, tiny_model_dir):
    from transformers import AutoTokenizer

    spec, real = alfworld
    task, actions = spec.tasks("train")[0], ["go to desk 1", "look", "go to bed 1"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    answers = ["continue\nmodel one", "continue\nmodel two", "continue\nmodel three"] * 2
    model = ScriptedWorldModel(tokenizer, answers[:3])
    world = WorldModelPool(spec, real, model, history_length=1, max_observation_tokens=32, samples=2, seed=5,
                           verdict="replay")
    busy: list[str] = []

    @contextlib.contextmanager
    def record(resource):
        busy.append(resource)
        yield

    async def play():
        world.start_batch(4)
        shadow = world.shadow(real, slot=0, busy=record)
        first = await shadow.reset_slot(0, task)
        outcomes = [await shadow.step_slot(0, a) for a in actions]
        shadow.end([0])
        return first, outcomes, await shadow.verdict()

    first, outcomes, verdict = asyncio.run(play())
    # the episode plays the real env (its reset and answers are the env's, not the model's) ...
    assert "world_model" not in first.info and first.observation.startswith("-= Welcome to TextWorld, ALFRED! =-")
    assert not any("model" in o.observation for o in outcomes) and outcomes[0].observation
    # ... and the model replayed its actions alongside, one step each, inside its busy time: no ending
    assert verdict == (0.0, 3) and busy == ["world_model"] * 3
    assert model.prompts[0].count(f"Goal: {first.info['task']}\nNow: {first.observation}\nAction: go to desk 1") == 1
    # the same answers and sampling streams as a replay of the finished episode's actions
    after = ScriptedWorldModel(tokenizer, answers[3:])
    world = WorldModelPool(spec, real, after, history_length=1, max_observation_tokens=32, samples=2, seed=5)
    world.start_batch(4)
    assert asyncio.run(world.replay(first.info["task"], first.observation, listed(actions), slot=0)) == verdict
    assert (after.prompts, after.seeds) == (model.prompts, model.seeds)


def test_a_replay_samples_apart_from_the_model_episode_in_its_slot(alfworld, tiny_model_dir):
    from transformers import AutoTokenizer

    spec, real = alfworld
    model = ScriptedWorldModel(AutoTokenizer.from_pretrained(tiny_model_dir), ["continue\nm"] * 4)
    world = WorldModelPool(spec, real, model, history_length=1, max_observation_tokens=32, seed=5)

    async def play():
        world.start_batch(3)
        await world.reset_slot(0, spec.tasks("train")[0])
        await world.step_slot(0, "go to desk 1")
        await world.step_slot(0, "go to bed 1")
        return await world.replay("g", "o0", listed(["a0", "a1"]), slot=0)

    assert asyncio.run(play()) == (0.0, 2)
    assert len(set(model.seeds)) == 4  # two model-episode steps, two replay steps: four streams


class ScriptedStudent(ScriptedWorldModel):
    """The student: the same action every turn; records each request's prompt and sampling seed."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer, [])

    async def generate(self, prompt: list[int], sampling: SamplingParams, image_keys=()) -> Generation:
        self.answers.append("<action>look</action>")
        return await super().generate(prompt, sampling)


@pytest.mark.parametrize(("answers", "verdict"), [
    (["continue\nYou see a desk.", "won\nYou turn on the desklamp 1."], (1.0, 2)),  # the twin won at its 2nd step
    (["continue\nYou see a desk."] * 3, (0.0, 3)),                                 # it played the 3 turns: not won
    (["continue\nYou see a desk.", "junk"], (None, 2)),                           # an unusable answer: no verdict
])
def test_a_twin_verdict_is_the_ending_of_the_same_task_played_in_the_model_beside_the_real_episode(
        alfworld, tiny_model_dir, answers, verdict):
    from transformers import AutoTokenizer

    spec, real = alfworld
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    task, student, model = spec.tasks("train")[0], ScriptedStudent(tokenizer), ScriptedWorldModel(tokenizer, answers)
    world = WorldModelPool(spec, real, model, history_length=1, max_observation_tokens=32, seed=5, verdict="twin")
    world.start_batch(2)
    [trajectory] = rollout(spec, real, student, [task], env_config=EnvConfig(name="alfworld", max_turns=3),
                           sampling=SamplingParams(seed=9), run_episode=world.runner(real, [False]))
    # the real episode played the env (3 looks, not won), and only it is returned: the twin is not trained on
    trace = trace_of(trajectory)
    assert (trajectory.depth, trajectory.success, trace.played) == (3, False, False)
    assert (trace.predicted_success, trace.verdict_steps) == verdict
    # the twin started from the real episode's reset (the env was not reset for it) ...
    assert world.real_resets == 0 and model.answers == []
    assert model.prompts[0].count(f"Now: {trajectory.turns[0].observation}\nAction: look") == 1
    # ... and played the student's sampling streams: turn t of both from the same seed, the prompts
    # the same until the model's observation differs from the env's
    seeds = {}
    for prompt, seed in zip(student.prompts, student.seeds, strict=True):
        seeds.setdefault(seed, []).append(prompt)
    assert len(student.prompts) == 3 + verdict[1] and len(seeds) == 3
    first_prompts = next(prompts for prompts in seeds.values() if trajectory.turns[0].observation in prompts[0])
    assert len(first_prompts) == 2 and first_prompts[0] == first_prompts[1]


def test_a_verdict_mode_must_be_known(alfworld, tiny_model_dir):
    spec, real = alfworld
    with pytest.raises(ValueError, match="verdict must be one of last_turn, replay, twin, got 'final'"):
        WorldModelPool(spec, real, None, history_length=1, max_observation_tokens=32, verdict="final")
