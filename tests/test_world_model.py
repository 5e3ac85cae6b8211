"""Hand-worked checks of the world-model corrections and fidelity measures in
turnopd.algorithm.world_model_corrections, and of the fidelity table built from them."""

import math
import random

import pytest

from envs import make_env_spec
from envs.autoresearch.env import job_report
from envs.transitions import Transition, episode_transitions, split_episodes
from turnopd.algorithm.world_model_corrections import (
    auroc,
    debiased_mean,
    expected_calibration_error,
    inverse_variance_weights,
    sample_disagreement,
    token_f1,
    trajectory_variance,
)
from turnopd.config import EnvConfig
from turnopd.core.types import EpisodeSummary
from turnopd.orchestration.run_log import world_model_fields
from turnopd.orchestration.world_model_training import fidelity_table, metric_table, replay_table
from turnopd.rollout.world_model_pool import WORLD_MODEL, Verdict, WorldModelTrace

# ------------------------------------------------------------------------- Online Debiasing


def test_debiased_mean_subtracts_the_bias_measured_on_real_episodes():
    # model episodes f = 1,0,1,1 (mean 3/4); real pairs (y, f) = (1, 1), (0, 1): residuals 0, 1,
    # bias 1/2, so mu = 3/4 - 1/2 = 1/4.
    # Var(f) = ((1/4)^2 * 3 + (3/4)^2) / 3 = 1/4; Var(residual) = (1/4 + 1/4) / 1 = 1/2
    # se = sqrt(1/4 / 4 + 1/2 / 2) = sqrt(5/16)
    result = debiased_mean([1, 0, 1, 1], real_outcomes=[1, 0], real_predictions=[1, 1])
    assert result.bias == 0.5
    assert result.estimate == 0.25
    assert result.stderr == pytest.approx(math.sqrt(5 / 16))


def test_debiased_mean_is_clipped_to_the_signal_range():
    # the model says 1 on both model episodes and under-predicted the real one by 1: 1 - (-1) = 2
    result = debiased_mean([1, 1], real_outcomes=[1], real_predictions=[0])
    assert result.bias == -1.0
    assert result.estimate == 1.0


def test_debiased_mean_with_only_real_episodes_is_their_mean():
    # y = 1, 0, 1: mean 2/3, se = sqrt(Var / n) = sqrt((1/3) / 3) = 1/3; the predictions only bias
    result = debiased_mean([], real_outcomes=[1, 0, 1], real_predictions=[0, 0, 0])
    assert result.estimate == pytest.approx(2 / 3)
    assert result.stderr == pytest.approx(1 / 3)
    assert result.bias == pytest.approx(-2 / 3)


def test_debiased_mean_removes_an_optimistic_models_bias_on_average():
    # true success 0.4; the model calls every success and half the failures a win (mean 0.7).
    # With 2 real episodes in 10, the debiased mean over many steps averages 0.4, the raw one 0.7.
    rng = random.Random(0)

    def episode():
        won = rng.random() < 0.4
        return float(won), float(won or rng.random() < 0.5)

    raw, debiased = [], []
    for _ in range(4000):
        model = [episode()[1] for _ in range(8)]
        real = [episode() for _ in range(2)]
        raw.append(sum(model) / 8)
        result = debiased_mean(model, [y for y, _ in real], [f for _, f in real],
                               low=-math.inf, high=math.inf)  # clipping would bias the mean
        debiased.append(result.estimate)
    assert sum(raw) / len(raw) == pytest.approx(0.7, abs=0.01)
    assert sum(debiased) / len(debiased) == pytest.approx(0.4, abs=0.015)


def _episode(success: bool, depth: int, *, world_model: bool = False, predicted: float | None = None,
             verdict_steps: int = 0, env_error: str = "") -> EpisodeSummary:
    trace = WorldModelTrace(played=world_model, predicted_success=predicted, verdict_steps=verdict_steps)
    return EpisodeSummary("t", "look", success, depth, False, 0, 0, env_error, addons={WORLD_MODEL: trace})


def test_a_steps_world_model_record_by_hand():
    episodes = [_episode(True, 5, world_model=True), _episode(True, 7, world_model=True),
                _episode(False, 9, world_model=True),
                _episode(True, 8, predicted=1.0, verdict_steps=6),   # the replay won, as the env did
                _episode(False, 10, predicted=1.0, verdict_steps=4),  # the replay won where the env did not
                _episode(False, 3, predicted=None, verdict_steps=2),  # the replay gave no usable answer
                _episode(False, 1, env_error="worker died")]          # the env failed: no outcome
    record = world_model_fields(episodes)
    # model mean 2/3; bias over the two real episodes with verdicts ((1-1) + (1-0)) / 2 = 1/2;
    # se^2 = Var(1,1,0)/3 + Var(0,1)/2 = (1/3)/3 + (1/2)/2 = 13/36
    assert record == {"world_model_episodes": 3, "world_model_steps": 21, "world_model_verdict_steps": 12,
                      "world_model_no_verdict": 1,
                      "success_rate_real": 0.5, "success_rate_debiased": pytest.approx(1 / 6),
                      "success_rate_debiased_stderr": pytest.approx(math.sqrt(13 / 36)),
                      "world_model_bias": 0.5}


def test_debiased_mean_refuses_unpaired_or_missing_real_episodes():
    with pytest.raises(ValueError, match="pair one to one"):
        debiased_mean([1], real_outcomes=[1, 0], real_predictions=[1])
    with pytest.raises(ValueError, match="real_fraction"):
        debiased_mean([1], real_outcomes=[], real_predictions=[])

# ----------------------------------------------------------------- Inverse-Variance Denoising


def test_sample_disagreement_is_one_minus_the_modal_share():
    assert sample_disagreement(["a", "a", "b", "c"]) == 0.5   # 1 - 2/4
    assert sample_disagreement(["a", "a", "a"]) == 0.0
    assert sample_disagreement(["a", "b", "c"]) == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        sample_disagreement([])


def test_trajectory_variance_is_the_chance_of_leaving_the_modal_path():
    assert trajectory_variance([0.5, 0.5]) == 0.75   # 1 - (1/2)(1/2)
    assert trajectory_variance([0.2]) == pytest.approx(0.2)
    assert trajectory_variance([]) == 0.0             # a real-env trajectory
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        trajectory_variance([1.5])


def test_inverse_variance_weights_hand_worked():
    # eps = 0.1: precisions 1/0.1, 1/0.2, 1/0.4 = 10, 5, 2.5; mean 17.5/3; w = p / mean
    weights = inverse_variance_weights([0.0, 0.1, 0.3], variance_floor=0.1)
    assert weights == pytest.approx([10 * 3 / 17.5, 5 * 3 / 17.5, 2.5 * 3 / 17.5])
    assert sum(weights) / 3 == pytest.approx(1.0)
    # a trajectory at sigma^2 = eps weighs half of a certain one
    certain, at_floor = inverse_variance_weights([0.0, 0.05], variance_floor=0.05)
    assert certain == pytest.approx(2 * at_floor)
    assert inverse_variance_weights([0.2, 0.2], variance_floor=0.1) == pytest.approx([1.0, 1.0])
    with pytest.raises(ValueError, match="variance_floor"):
        inverse_variance_weights([0.1], variance_floor=0.0)


# ------------------------------------------------------------------------- fidelity measures


def test_token_f1_counts_shared_words_with_their_multiplicity():
    # 4 of 5 words shared each way: p = r = 4/5
    assert token_f1("you see a mug 1", "You see a cup 1") == pytest.approx(0.8)
    # "a a b" vs "a b b c": shared a once, b once = 2; p = 2/3, r = 2/4, F1 = 2pr/(p+r) = 4/7
    assert token_f1("a a b", "a b b c") == pytest.approx(4 / 7)
    assert token_f1("", "") == 1.0
    assert token_f1("", "x") == 0.0 and token_f1("x", "") == 0.0
    assert token_f1("x y", "z") == 0.0


def test_expected_calibration_error_by_hand():
    # bins of width 0.1: {0.05: no} |0 - .05|, {0.15: no} .15, {0.85: yes} .15,
    # {0.95: no, 0.9: yes} |.5 - .925| = .425 twice -> (.05 + .15 + .15 + .85) / 5 = .24
    probs = [0.05, 0.15, 0.85, 0.95, 0.9]
    assert expected_calibration_error(probs, [False, False, True, False, True]) == pytest.approx(0.24)
    # two bins; p = 1 goes into the last: {1.0, .5: yes, yes} |1 - .75| * 2, {.2: no} .2 -> .7 / 3
    assert expected_calibration_error([1.0, 0.5, 0.2], [True, True, False], bins=2) == pytest.approx(0.7 / 3)
    assert expected_calibration_error([1.0, 0.0], [True, False]) == 0.0  # sure and right


@pytest.mark.parametrize("args, message", [
    (([0.5], [True, False]), "1 probabilities for 2 labels"),
    (([], []), "at least one"),
    (([1.5], [True]), r"in \[0, 1\]"),
    (([0.5], [True], 0), "bins must be >= 1"),
])
def test_expected_calibration_error_refuses_bad_input(args, message):
    with pytest.raises(ValueError, match=message):
        expected_calibration_error(*args)


def test_auroc_by_hand():
    # positives score .9 and .4, negatives .6 and .1: of the 4 pairs the positive is higher in
    # (.9, .6), (.9, .1), (.4, .1), lower in (.4, .6) -> 3/4
    assert auroc([0.9, 0.4, 0.6, 0.1], [True, True, False, False]) == 0.75
    assert auroc([0.5, 0.5], [True, False]) == 0.5  # a tie counts one half
    assert auroc([0.9, 0.1], [True, False]) == 1.0 and auroc([0.1, 0.9], [True, False]) == 0.0
    assert auroc([0.3, 0.7], [True, True]) is None and auroc([], []) is None  # one class: undefined
    with pytest.raises(ValueError, match="2 scores for 1 labels"):
        auroc([0.1, 0.2], [True])


def _transition(action, next_observation, won, source="expert"):
    return Transition(task_id="t", task="goal", first_observation="room", history=(), step=0, observation="o",
                      action=action, next_observation=next_observation, done=won, won=won, source=source)


def test_fidelity_table_by_hand():
    transitions = [_transition("go to desk 1", "you see a mug 1", won=False),
                   _transition("use desklamp 1", "You win.", won=True, source="student")]
    answers = ["continue\nyou see a cup 1", "continue\nYou  win."]  # extra space: still an exact match
    probs = [{"continue": 0.8, "won": 0.1, "lost": 0.1}, {"continue": 0.6, "won": 0.3, "lost": 0.1}]
    table = fidelity_table(transitions, answers, probs)
    assert list(table) == ["all", "source=expert", "source=student", "verb=go", "verb=use"]
    row = table["all"]
    assert (row.transitions, row.exact_match, row.status_accuracy) == (2, 0.5, 0.5)
    assert row.token_f1 == pytest.approx((0.8 + 1.0) / 2)
    # P(done) = .2 (label no) and .4 (label yes), different bins: (.2 + .6) / 2
    assert row.done_ece == pytest.approx(0.4)
    # P(won) = .1 (no) and .3 (yes): (.1 + .7) / 2
    assert row.won_ece == pytest.approx(0.4)
    assert table["verb=use"].exact_match == 1.0 and table["verb=use"].status_accuracy == 0.0
    assert table["verb=go"].token_f1 == pytest.approx(0.8) and table["verb=go"].done_ece is None
    # an answer without a status line: the status is wrong, the text is still compared
    unparsed = fidelity_table(transitions[:1], ["you see a mug 1"], probs[:1])["all"]
    assert unparsed.status_accuracy == 0.0 and unparsed.exact_match == 1.0


def _episode_of(turns: int, won: bool, source: str) -> list[Transition]:
    return episode_transitions("t", "goal", [(f"o{i}", f"a{i}") for i in range(turns)], "end", ended=won, won=won,
                               history_length=1, source=source)


def test_split_episodes_cuts_at_each_first_step():
    a, b, c = _episode_of(3, True, "expert"), _episode_of(1, False, "expert"), _episode_of(2, False, "student")
    assert split_episodes(a + b + c) == [a, b, c]
    assert split_episodes([]) == []


def test_replay_table_by_hand():
    episodes = [_episode_of(4, True, "expert"), _episode_of(6, False, "expert"),
                _episode_of(10, False, "student"), _episode_of(8, True, "student"), _episode_of(5, False, "student")]
    verdicts = [Verdict(1.0, 4),   # won in both
                Verdict(1.0, 3),   # the model won what the env did not, sooner
                Verdict(0.0, 10),  # neither won
                Verdict(0.0, 2),   # the model lost what the env won
                Verdict(None, 1)]  # no usable answer: left out
    table = replay_table(episodes, verdicts)
    assert list(table) == ["all", "source=expert", "source=student"]
    row = table["all"]  # judged: 4 episodes; env won 2, model won 2, same ending 2 (the 1st and 3rd)
    assert (row.episodes, row.no_verdict) == (4, 1)
    assert (row.won_real, row.won_replayed, row.same_ending) == (0.5, 0.5, 0.5)
    assert (row.turns_real, row.turns_replayed) == ((4 + 6 + 10 + 8) / 4, (4 + 3 + 10 + 2) / 4)
    expert = table["source=expert"]
    assert (expert.won_real, expert.won_replayed, expert.same_ending, expert.turns_replayed) == (0.5, 1.0, 0.5, 3.5)
    student = table["source=student"]
    assert (student.episodes, student.no_verdict, student.won_real, student.won_replayed) == (2, 1, 0.5, 0.0)
    nothing = replay_table(episodes[4:], verdicts[4:])["all"]
    assert (nothing.episodes, nothing.no_verdict) == (0, 1) and math.isnan(nothing.won_real)
    with pytest.raises(ValueError, match="2 episodes for 1 verdicts"):
        replay_table(episodes[:2], verdicts[:1])


def _ran(accuracy: float, kept: bool) -> str:
    """An autoresearch observation of a job scoring `accuracy` (a fraction), written by the env's own code."""
    return job_report("lr", "0.01", "0.001", accuracy, False, 0.0, kept) + " Best accuracy 55.00% with lr=0.01."


def test_metric_table_by_hand():
    reader = make_env_spec(EnvConfig(name="autoresearch"))
    cases = [  # (source, the env's observation, the greedy answer, 2 sampled answers)
        ("expert", _ran(0.50, True), "continue\n" + _ran(0.475, True), [_ran(0.5, True), _ran(0.4, False)]),
        ("student", _ran(0.40, False), "continue\n" + _ran(0.41, False), [_ran(0.5, True), _ran(0.4, False)]),
        ("student", _ran(0.30, False), "continue\nno metric", ["garbage", "continue\n" + _ran(0.2, False)]),
        ("student", "Invalid action: there is no knob 'x'.", "continue\n" + _ran(0.3, True), ["", ""]),  # no metric
        ("expert", _ran(0.60, True), _ran(0.60, True), [_ran(0.6, False), "continue\n" + _ran(0.6, True)]),
    ]
    table = metric_table(reader, [_transition("set lr 0.01", obs, won=False, source=source) for source, obs, _, _ in cases],
                         [answer for _, _, answer, _ in cases], [samples for _, _, _, samples in cases])
    assert list(table) == ["all", "source=expert", "source=student"]
    row = table["all"]  # the 4 scored changes; P(helps) = .5, .5, 0, .5; helped: yes, no, no, yes
    assert (row.changes, row.helped, row.parsed) == (4, 2, 3)
    assert row.metric_mae == pytest.approx((2.5 + 1.0 + 0.0) / 3)  # in points; the third wrote no metric
    # positives .5, .5 against negatives .5, 0: each positive ties .5 (1/2) and beats 0 (1) -> 3/4
    assert row.helps_auroc == 0.75
    # 10 bins: {.5, .5, .5} helped 2/3: |2/3 - .5| * 3/4; {0} helped 0: 0 -> .125
    assert row.helps_ece == pytest.approx(0.125)
    expert, student = table["source=expert"], table["source=student"]
    assert (expert.changes, expert.helped, expert.metric_mae, expert.helps_auroc) == (2, 2, 1.25, None)
    assert expert.helps_ece == pytest.approx(0.5)  # both P = .5, both helped
    assert (student.parsed, student.metric_mae, student.helps_ece) == (1, pytest.approx(1.0), pytest.approx(0.25))
    assert metric_table(reader, [_transition("submit", "Submitted.", won=False)], ["x"], [["x"]]) == {}
