"""Autoresearch's job model (envs.autoresearch.job_model): the env answering a world prompt, each job's
accuracy predicted. Real short jobs (spirals, 150 steps, ~0.07 s) label the changes; a predictor that
returns the real job's accuracy must make the answers the real env's, word for word."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import numpy as np
import pytest

from envs.autoresearch.env import AutoresearchEnv, Task, read_state
from envs.autoresearch.job_model import (
    JobModel,
    JobModelWorld,
    config_features,
    label_changes,
    read_goal,
    single_changes,
    snap,
)
from envs.autoresearch.train import KNOB_NAMES, Oracle, Problem, config_from
from envs.base import WorldAnswerer
from envs.transitions import parse_world_answer, world_prompt
from turnopd.config import RecipeError
from turnopd.orchestration.world_model_training import load_world_model_recipe
from turnopd.rollout.base import request_seed
from turnopd.rollout.world_model_pool import WorldModelPool

SHORT = Problem("spirals", steps=150)
START = config_from({"lr": "0.003", "batch_size": "32", "width": "16", "depth": "1", "weight_decay": "0",
                     "dropout": "0", "optimizer": "adam", "warmup": "0", "activation": "relu", "label_smoothing": "0"})
TASK = Task("short", SHORT, START, 0.10)


class OracleModel(JobModel):
    """Every member predicts the real job's accuracy (the stand-in beside the fitted model's tests)."""

    def __init__(self, oracle: Oracle, offsets: tuple[float, ...] = (0.0,)):
        super().__init__(members=len(offsets), hidden=2)
        self.oracle, self.offsets = oracle, offsets

    def predict(self, changes):
        real = [self.oracle.result(problem, candidate).accuracy for problem, _, _, candidate in changes]
        return np.array([[a + d for a in real] for d in self.offsets])


def test_config_features_hand_worked() -> None:
    config = config_from({"lr": "0.01", "batch_size": "32", "width": "64", "depth": "2", "weight_decay": "0",
                          "dropout": "0.1", "optimizer": "adam", "warmup": "0.05", "activation": "gelu",
                          "label_smoothing": "0.1"})
    assert config_features(config) == pytest.approx([-2, 5, 6, 2, -5, 0.1, 0.05, 0.1, 0, 0, 1, 0, 0, 0, 1, 0])


def test_snap_to_the_validation_grid() -> None:
    # digits: 400 validation examples; 0.70126 * 400 = 280.504 -> 281 / 400
    assert snap(0.70126, "digits") == 281 / 400
    assert snap(-0.2, "spirals") == 0.0 and snap(1.3, "spirals") == 1.0
    assert snap(0.5, "letters") == 312 / 624


def test_state_and_goal_read_back_from_the_envs_own_text() -> None:
    oracle = Oracle()
    env = AutoresearchEnv({"short": TASK}, 3, oracle)
    outcomes = [env.reset("short")] + [env.step(a) for a in ("set lr 0.03", "set colour red", "submit")]
    for outcome in outcomes:
        state = read_state(outcome.observation)
        assert state.config == config_from(outcome.info["config"])
        assert state.best == pytest.approx(outcome.info["best"], abs=5e-5)  # written to 0.01 points
        assert state.over_start == pytest.approx(outcome.info["best"] - outcome.info["start"], abs=5e-5)
        assert state.turns_left == (0 if outcome.done else outcome.info["turns_left"])
    assert read_goal(env._goal()) == (SHORT, 0.10)
    with pytest.raises(ValueError, match="no autoresearch state"):
        read_state("Nothing here.")
    with pytest.raises(ValueError, match="not an autoresearch goal"):
        read_goal("Put a clean mug on the desk.")


def play_real(actions: list[str], max_turns: int) -> tuple[str, list[tuple[str, str, str, bool, bool]]]:
    """The real env's episode: its goal and (observation, action, next observation, done, won) per step."""
    env = AutoresearchEnv({"short": TASK}, max_turns, Oracle())
    observation, steps = env.reset("short").observation, []
    for action in actions:
        outcome = env.step(action)
        steps.append((observation, action, outcome.observation, outcome.done, outcome.won))
        observation = outcome.observation
    return env._goal(), steps


def test_with_the_real_jobs_accuracy_the_answers_are_the_real_envs() -> None:
    actions = ["set lr 0.03", "set width 128", "set lr 0.0003", "set banana 1", "set depth 2"]
    goal, steps = play_real(actions, max_turns=5)
    world = JobModelWorld(OracleModel(Oracle()), max_turns=5)
    first = steps[0][0]
    for step, (observation, action, real_next, done, won) in enumerate(steps):
        prompt = world_prompt(goal, first, [], step, observation, action)
        (answer,) = world.answers(prompt, [0], temperature=0.0)
        status = "won" if won else "lost" if done else "continue"
        assert parse_world_answer(answer) == (status, real_next)


def test_temperature_zero_is_the_members_mean_and_above_it_a_seeded_member() -> None:
    oracle = Oracle()
    offsets = (-0.1, 0.0, 0.2)
    world = JobModelWorld(OracleModel(oracle, offsets), max_turns=5)
    goal, steps = play_real(["set lr 0.03"], max_turns=5)
    prompt = world_prompt(goal, steps[0][0], [], 0, steps[0][0], "set lr 0.03")
    real = oracle.result(SHORT, config_from({**dict(zip(KNOB_NAMES, START, strict=True)), "lr": "0.03"})).accuracy
    n = 300  # spirals' validation examples

    def written(answer: str) -> float:
        return float(answer.split("validation accuracy ")[1].split("%")[0]) / 100

    (mean,) = world.answers(prompt, [7], temperature=0.0)
    assert written(mean) == pytest.approx(round((real + sum(offsets) / 3) * n) / n, abs=5e-5)
    seeds = [3, 11, 12345]
    sampled = world.answers(prompt, seeds, temperature=1.0)
    for seed, answer in zip(seeds, sampled, strict=True):
        offset = offsets[random.Random(seed).randrange(3)]
        assert written(answer) == pytest.approx(min(max(round((real + offset) * n), 0), n) / n, abs=5e-5)


def test_label_changes_walks_keep_or_revert_and_add_the_memos_neighbours() -> None:
    oracle = Oracle()
    rows = label_changes([TASK], oracle, walks=1, turns=3, seed=0)
    walk = rows[:3]
    # hand-replayed: the walk's changes are single changes of the state it is in, which moves on a keep
    state, best = START, oracle.result(SHORT, START).accuracy
    visited = {START: best}
    for row in walk:
        assert (row.current, row.accuracy) == (state, best)
        assert row.candidate in single_changes(state)
        assert row.candidate_accuracy == oracle.result(SHORT, row.candidate).accuracy
        if row.candidate_accuracy > best:
            state, best = row.candidate, row.candidate_accuracy
            visited[state] = best
    # then every single change of a visited state that the memo holds (the walk's jobs: a kept
    # change's state has the state before it as a neighbour), each pair once
    known = {config for (_, config) in oracle.memo}
    extra = {(s, c) for s in visited for c in single_changes(s) if c in known} - {(r.current, r.candidate) for r in walk}
    assert {(r.current, r.candidate) for r in rows[3:]} == extra and len(rows) == 3 + len(extra)
    assert all(r.accuracy == visited[r.current] and r.candidate_accuracy == oracle.memo[(SHORT.key, r.candidate)].accuracy
               for r in rows[3:])
    assert oracle.jobs == 1 + 3  # the start and the walk's changes: the neighbours cost no job
    extra_job = next(c for c in single_changes(START) if c not in known)
    oracle.result(SHORT, extra_job)
    again = label_changes([TASK], oracle, walks=1, turns=3, seed=0)
    assert again[:3] == walk and (START, extra_job) in {(r.current, r.candidate) for r in again[3:]}
    assert len(again) == len(rows) + 1


def test_a_fitted_ensemble_beats_predicting_no_change_and_survives_a_save(tmp_path) -> None:
    oracle = Oracle()
    rows = label_changes([TASK], oracle, walks=3, turns=6, seed=1)
    model = JobModel(members=3, hidden=16, seed=0)
    first, final = model.fit(rows, steps=300, lr=1e-2)
    assert final < first
    changes = [(r.problem, r.current, r.accuracy, r.candidate) for r in rows]
    predicted = model.predict(changes)
    assert predicted.shape == (3, len(rows))
    real = np.array([r.candidate_accuracy for r in rows])
    no_change = np.mean(np.abs(np.array([r.accuracy for r in rows]) - real))
    assert np.mean(np.abs(predicted.mean(0) - real)) < no_change
    model.save(tmp_path)
    assert np.array_equal(JobModel.load(tmp_path).predict(changes), predicted)


def test_the_pool_plays_the_answerer_and_counts_its_disagreement() -> None:
    oracle = Oracle()
    offsets = (0.0, 0.0, 0.3)
    world = JobModelWorld(OracleModel(oracle, offsets), max_turns=4)
    assert isinstance(world, WorldAnswerer)

    class Real:  # the real env's reset (the pool asks the real env for it, then caches it)
        def __init__(self):
            self.env = AutoresearchEnv({"short": TASK}, 4, oracle)

        async def reset_slot(self, slot, task_id):
            return self.env.reset(task_id)

        def end(self, slots):
            pass

    pool = WorldModelPool(None, Real(), world, history_length=1, max_observation_tokens=1, samples=3,
                          temperature=1.0, seed=5)

    class Spec:
        def render_prompt(self, ctx):
            return ctx.observation

    pool.spec = Spec()

    async def play():
        await pool.reset_slot(0, "short")
        return await pool.step_slot(0, "set lr 0.03")

    outcome = asyncio.run(play())
    (disagreement,) = pool.take_trace(0).disagreements
    # the K = 3 answers are the members drawn by the pool's streams (seed, batch, slot, episode, step, k)
    members = [random.Random(request_seed(5, 0, 0, 1, 0, k)).randrange(3) for k in range(3)]
    drawn = [offsets[m] for m in members]
    assert disagreement == pytest.approx(1 - max(Counter(drawn).values()) / 3)
    real = oracle.result(SHORT, config_from({**dict(zip(KNOB_NAMES, START, strict=True)), "lr": "0.03"})).accuracy
    played = snap(real + drawn[0], "spirals")
    assert outcome.observation.startswith(f"Ran lr=0.03 (was 0.003): validation accuracy {100 * played:.2f}%")
    assert not outcome.done and 0 in pool._episodes  # 3 turns left


def test_a_job_model_recipe_is_refused_for_another_env() -> None:
    with pytest.raises(RecipeError, match="models env autoresearch only"):
        load_world_model_recipe("recipes/autoresearch/world_model_job.yaml", ["env.name=alfworld"])
    with pytest.raises(RecipeError, match="kind language_model trains a model"):
        load_world_model_recipe("recipes/autoresearch/world_model_job.yaml", ["kind=language_model"])
