"""Avg@k on hand-worked examples, and the eval record that keeps what the env cut short."""

import pytest

from turnopd.core.types import EpisodeSummary, Trajectory, Turn
from turnopd.rollout.eval import EvalResult, avg_at_k, invalid_action_rate


def _episode(task: str, success: bool, env_error: str = "") -> Trajectory:
    return Trajectory(task, "e", success=success, task_type=task.split("-")[0], env_error=env_error)


def test_avg_at_k_is_the_mean_over_tasks_of_each_tasks_success_share():
    # k = 2. look-1: 2/2, look-2: 0/2, pick-1: 1/2 -> overall (1 + 0 + 0.5) / 3 = 0.5;
    # per type: look (1 + 0) / 2 = 0.5, pick 0.5
    episodes = [_episode("look-1", True), _episode("look-1", True), _episode("look-2", False),
                _episode("look-2", False), _episode("pick-1", True), _episode("pick-1", False)]
    overall, per_type, per_task = avg_at_k(episodes, 2)
    assert overall == pytest.approx(0.5)
    assert per_type == {"look": pytest.approx(0.5), "pick": pytest.approx(0.5)}
    assert per_task == {"look-1": 1.0, "look-2": 0.0, "pick-1": 0.5}
    # k = 1 over three tasks, one won: 1/3
    assert avg_at_k([_episode("a-1", True), _episode("a-2", False), _episode("b-1", False)], 1)[0] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match=r"Avg@2 needs 2 episodes per task; got \{'pick-9': 1\}"):
        avg_at_k(episodes + [_episode("pick-9", True)], 2)


def test_the_record_counts_env_failures_and_reads_back():
    result = EvalResult("valid_unseen", 1, 0.25, {"look": 0.25}, 4, 12.5, {"disk full": 2, "worker died": 1})
    record = result.record()
    assert record["env_failures"] == 3 and record["env_errors"] == {"disk full": 2, "worker died": 1}
    assert result.describe_env_failures() == (  # of num_tasks x k = 4 x 1 episodes
        "3 of 4 episodes were ended by the env, not the agent: disk full (x2); worker died (x1)")
    again = EvalResult.from_record(record)
    assert again == result and again.env_failures == 3
    # records written before env errors were kept read back with none
    older = {k: v for k, v in record.items() if k not in ("env_failures", "env_errors")}
    assert EvalResult.from_record(older).env_failures == 0


def test_the_invalid_action_rate_pools_the_turns_of_all_episodes():
    def played(*invalid: bool) -> Trajectory:
        return Trajectory("t", "e", turns=[Turn(i, "", [], [], [], invalid=bad) for i, bad in enumerate(invalid)])

    # 1 of 4 turns and 2 of 2: 3 of 6 turns pooled = 0.5 (the mean of the episodes' rates would be 0.625)
    episodes = [played(False, True, False, False), played(True, True)]
    assert invalid_action_rate(episodes) == pytest.approx(0.5)
    assert invalid_action_rate([EpisodeSummary.of(e) for e in episodes]) == pytest.approx(0.5)  # as ranks gather them
    assert invalid_action_rate([]) == 0.0
    # a mixed evaluation weighs each env's rate by its turns: 0.5 over 2 x 10 turns, 0.0 over 1 x 4 -> 10 / 24
    alfworld = EvalResult("valid_unseen", 1, 0.5, {}, 2, 10.0, invalid_action_rate=0.5)
    search = EvalResult("test", 1, 0.0, {}, 1, 4.0, invalid_action_rate=0.0)
    mixed = EvalResult.mixed({"alfworld": alfworld, "search": search})
    assert mixed.invalid_action_rate == pytest.approx(10 / 24)
    assert EvalResult.from_record(mixed.record()).invalid_action_rate == pytest.approx(10 / 24)
    # a record from before the rate was kept reads back without one, and so does a mixture holding it
    older = {k: v for k, v in search.record().items() if k != "invalid_action_rate"}
    assert EvalResult.from_record(older).invalid_action_rate is None
    assert EvalResult.mixed({"alfworld": alfworld, "search": EvalResult.from_record(older)}).invalid_action_rate is None
