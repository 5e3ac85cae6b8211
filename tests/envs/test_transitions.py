"""Transitions for world models: built by hand from episodes, the world model's text, and (real
ALFWorld) logged demonstrations whose transitions the env answers again when replayed."""

from __future__ import annotations

import pytest

from envs import make_env_spec
from envs.base import extract_action
from envs.demonstrations import play_experts
from envs.pool import EnvPool
from envs.transitions import (
    demo_transitions,
    episode_transitions,
    parse_world_answer,
    status_of,
    trajectory_transitions,
    transition_prompt,
)
from turnopd.config import EnvConfig
from turnopd.core.types import Trajectory, Turn

STEPS = [("o0", "a0"), ("o1", "a1"), ("o2", "a2")]


def test_each_step_answers_with_the_next_observation_and_the_last_with_the_ending():
    t0, t1, t2 = episode_transitions("task", "goal", STEPS, "o3", ended=True, won=True, history_length=1,
                                     source="expert")
    assert [(t.observation, t.action, t.next_observation) for t in (t0, t1, t2)] == [
        ("o0", "a0", "o1"), ("o1", "a1", "o2"), ("o2", "a2", "o3")]
    assert [t.status for t in (t0, t1, t2)] == ["continue", "continue", "won"]
    assert [t.history for t in (t0, t1, t2)] == [(), (("o0", "a0"),), (("o1", "a1"),)]
    assert {t.first_observation for t in (t0, t1, t2)} == {"o0"} and [t.step for t in (t0, t1, t2)] == [0, 1, 2]
    # stopped at a turn limit while playing: the last step did not end the episode
    *_, last = episode_transitions("task", "goal", STEPS, "o3", ended=False, won=False, history_length=0,
                                   source="student")
    assert (last.status, last.history, last.source) == ("continue", (), "student")
    *_, lost = episode_transitions("task", "goal", STEPS, "o3", ended=True, won=False, history_length=5, source="x")
    assert lost.status == "lost" and lost.history == (("o0", "a0"), ("o1", "a1"))


def test_the_world_models_text():
    _, t1, _ = episode_transitions("task", "goal", STEPS, "o3", ended=True, won=True, history_length=1, source="expert")
    assert transition_prompt(t1) == ("Goal: goal\nStart: o0\nRecent: [Observation 1: 'o0', Action 1: 'a0']\n"
                                     "Now: o1\nAction: a1")
    t0 = episode_transitions("task", "goal", STEPS, "o3", ended=True, won=True, history_length=1, source="expert")[0]
    assert transition_prompt(t0) == "Goal: goal\nNow: o0\nAction: a0"  # the start is the current observation
    assert parse_world_answer("won\nYou win.\n") == ("won", "You win.")
    assert parse_world_answer(" continue \nYou arrive at desk 1.") == ("continue", "You arrive at desk 1.")
    assert parse_world_answer("maybe\nYou win.") is None
    with pytest.raises(ValueError, match="won=True needs done=True"):
        status_of(done=False, won=True)


def _turn(index: int, observation: str, action: str) -> Turn:
    return Turn(index=index, observation=observation, prompt_ids=[1], action_ids=[2], student_logprobs=[0.0],
                action_text=f"<action>{action}</action>")


def test_a_rollouts_transitions_are_the_actions_the_env_received():
    trajectory = Trajectory(task_id="task", env_name="alfworld", goal="goal", ended=True, success=False,
                            final_observation="o2", turns=[_turn(0, "o0", "go to  desk 1"), _turn(1, "o1", "look")])
    t0, t1 = trajectory_transitions(trajectory, extract_action, history_length=1)
    assert (t0.action, t0.next_observation, t1.next_observation, t1.status) == ("go to desk 1", "o1", "o2", "lost")
    assert t1.source == "student" and t1.task == "goal"
    trajectory.env_error = "env worker 0 died"  # its last answer is not the env's
    assert trajectory_transitions(trajectory, extract_action, history_length=1) == []


def test_logged_alfworld_transitions_are_what_the_env_answers_when_replayed():
    """The explorer expert (with its mistakes) plays real games; replaying each transition's actions in
    a fresh game gives every logged next observation and the logged ending."""
    env_config = EnvConfig(name="alfworld", task_types=["look_at_obj_in_light"], max_turns=40, num_workers=1,
                           options={"expert": "explorer", "expert_noise": 0.3, "notes": True})
    spec = make_env_spec(env_config)
    tasks = spec.tasks("train")[:2]
    with EnvPool(spec, num_workers=1) as pool:
        demos = list(play_experts(spec, pool, tasks, env_config.max_turns))
        assert all(d.ended == d.won for d in demos)  # ALFWorld ends an episode only when it is won
        for demo in demos:
            transitions = demo_transitions(demo, history_length=1)
            (outcome,) = pool.reset([demo.task_id])
            assert outcome.observation == transitions[0].observation == transitions[0].first_observation
            for t in transitions:
                outcome = pool.step({0: t.action})[0]
                assert (outcome.observation, outcome.done, outcome.won) == (t.next_observation, t.done, t.won)
    assert any(d.won for d in demos) and any(s.observation != "Nothing happens." for d in demos for s in d.steps)
