"""The gymnasium adapter on gymnasium's own FrozenLake and Blackjack envs (the `gymnasium` extra; the
tests skip without it)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from envs import make_env_spec
from envs.base import ParsedAction, PromptContext, answer_instruction
from envs.pool import EnvPool
from tests.conftest import LOOP_RECIPE, child_env, hide_package, loop_models
from turnopd.config import EnvConfig
from turnopd.core.metrics import read_metrics

gymnasium = pytest.importorskip("gymnasium")

LAKE = {"id": "FrozenLake-v1", "make_kwargs": {"is_slippery": False}}
# FrozenLake's 4x4 map: S start, F frozen, H hole, G goal
MAP = ["SFFF", "FHFH", "FFFH", "HFFG"]
TO_GOAL = ["right", "right", "down", "down", "down", "right"]  # (0,0) -> (0,2) -> (3,2) -> (3,3), no hole


def lake(**options) -> EnvConfig:
    return EnvConfig(name="gymnasium", options={**LAKE, **options})


def grid(row: int, col: int) -> str:
    """The ANSI rendering's grid as the adapter writes it: the agent's cell in [brackets]."""
    return "\n".join("".join(f"[{c}]" if (r, k) == (row, col) else c for k, c in enumerate(line))
                     for r, line in enumerate(MAP))


def test_frozen_lake_plays_through_the_pool() -> None:
    spec = make_env_spec(lake(train_tasks=3, test_tasks=1))
    assert spec.tasks("train") == ["seed-0", "seed-1", "seed-2"] and spec.tasks("test") == ["seed-3"]
    with EnvPool(spec, num_workers=1, step_timeout_s=60) as pool:
        start = pool.reset(["seed-0", "seed-1"])
        assert start[0].observation == grid(0, 0) and start[0].admissible == ["left", "down", "right", "up"]
        assert start[0].info["task"] == "reach the goal of FrozenLake-v1"
        bad = pool.step({0: "jump"})[0]  # not an action: not played
        assert (bad.observation, bad.info["invalid"], bad.done) == (grid(0, 0), True, False)
        outcome = pool.step({0: "right", 1: "down"})
        assert outcome[0].observation == "  (Right)\n" + grid(0, 1)
        into_hole = pool.step({1: "right"})[1]  # (1,0) -> (1,1), a hole: the episode ends, lost
        assert (into_hole.done, into_hole.won, into_hole.reward) == (True, False, 0.0)
        for action in TO_GOAL[1:]:
            outcome = pool.step({0: action})
        assert outcome[0].observation == "  (Right)\n" + grid(3, 3)
        assert (outcome[0].done, outcome[0].won, outcome[0].reward) == (True, True, 1.0)


def test_a_discrete_observation_without_a_text_rendering_is_its_repr() -> None:
    spec = make_env_spec(EnvConfig(name="gymnasium", options={"id": "Blackjack-v1"}))
    env = spec.make()
    reference = gymnasium.make("Blackjack-v1")
    try:
        observation, _ = reference.reset(seed=7)
        assert env.reset("seed-7").observation == f"observation: {observation!r}"
        _, reward, terminated, _, _ = reference.step(0)  # stick: the hand is scored
        outcome = env.step("stick")
        assert (outcome.reward, outcome.done, outcome.won) == (reward, terminated, reward > 0)
    finally:
        env.close()


def test_actions_parse_to_the_env_s_names() -> None:
    spec = make_env_spec(lake())
    assert spec.parse_action("<think>go</think><action>down</action>") == ParsedAction("down", True)
    assert spec.parse_action("<action>jump</action>") == ParsedAction("jump", False)
    ctx = PromptContext(task="cross the lake", step=0, observation=grid(0, 0), history=[],
                        admissible=["left", "down", "right", "up"], answer_format="action")
    assert spec.render_prompt(ctx) == (f"Your task is to: cross the lake\nYour current observation is: {grid(0, 0)}\n"
                                       "Your admissible actions are: [left, down, right, up].\n"
                                       f"{answer_instruction('action')}")


@pytest.mark.parametrize(
    "options, message",
    [
        ({"id": None}, "env gymnasium needs option `id`, a gymnasium env id, e.g. env.options.id=FrozenLake-v1"),
        ({"id": "FrozenLake-v9"}, "unknown gymnasium env id 'FrozenLake-v9'; did you mean FrozenLake-v1, FrozenLake8x8-v1?"),
        ({"id": "CliffWalkingSlippery-v1"}, "gymnasium env CliffWalkingSlippery-v1 has 4 actions: set env.options.actions "
                                            "to 4 distinct names, in the order of the action indices (got none)"),
        ({"actions": ["a", "a", "b", "c"]}, "gymnasium env FrozenLake-v1 has 4 actions: set env.options.actions to 4 "
                                            "distinct names, in the order of the action indices (got ['a', 'a', 'b', 'c'])"),
        ({"colour": "red"}, "unknown gymnasium options ['colour']; allowed: id, make_kwargs, actions, task, "
                            "train_tasks, test_tasks"),
    ],
)
def test_bad_options_are_refused(options, message) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        make_env_spec(lake(**options))


def test_without_gymnasium_the_error_gives_the_install_line(monkeypatch) -> None:
    hide_package(monkeypatch, "gymnasium")
    with pytest.raises(ValueError, match=r"^env gymnasium needs the gymnasium package, which is not installed: "
                                         r"pip install -e \"\.\[gymnasium\]\"$"):
        make_env_spec(lake())


@pytest.mark.slow
def test_two_distillation_steps_on_frozen_lake(tmp_path, tiny_model_dir) -> None:
    root = loop_models(tmp_path, tiny_model_dir, "")
    recipe = LOOP_RECIPE.replace("alfworld", "gymnasium").replace("valid_seen", "test") + """
name: lake
trainer: {{steps: 2, episodes_per_step: 2, lr: 1.0e-3}}
eval: {{max_tasks: 1, at_start: false}}
"""
    (root / "lake.yaml").write_text(recipe.format(root=root))
    run = subprocess.run([sys.executable, "-m", "turnopd.cli", "distill", str(root / "lake.yaml"),
                          "env.options.id=FrozenLake-v1", "env.options.make_kwargs.is_slippery=false"], env=child_env(),
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    train = [r for r in read_metrics(root / "runs" / "lake" / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2] and all(r["tokens_trained"] > 0 for r in train)
