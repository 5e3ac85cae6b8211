"""Hand-worked checks of WMRL's corrections in turnopd.algorithm.world_model_corrections (the
isotonic map and its refit schedule, bias_stats, the anchor weight, the anchor scheduler) and of the
loop's use of them (turnopd.orchestration.outcomes)."""

import math

import pytest

from turnopd.algorithm.world_model_corrections import (
    Calibration,
    InverseVarianceWeighter,
    OnlineDebiaser,
    anchor_groups,
    apply_calibration,
    bias_stats,
    fit_calibration,
    group_disagreement,
)
from turnopd.config import RunConfig
from turnopd.core.types import EpisodeSummary, Trajectory
from turnopd.orchestration.outcomes import Outcomes
from turnopd.orchestration.pipeline.plan import anchored_episodes, grouped_tasks, sample_tasks
from turnopd.rollout.world_model_pool import WORLD_MODEL, WorldModelTrace

# ----------------------------------------------------------------- the isotonic map (debias=isotonic)

# (model score x, real score y), 10 bins of width 0.1:
#   bin 0: (0.05, 0), (0.05, 1)               x = 0.05, y = 1/2, 2 pairs
#   bin 2: (0.25, 0)                          x = 0.25, y = 0,   1 pair
#   bin 5: (0.55, 1), (0.55, 1), (0.55, 0)    x = 0.55, y = 2/3, 3 pairs
#   bin 9: (0.95, 1)                          x = 0.95, y = 1,   1 pair
# pool adjacent violators: 1/2 > 0, so bins 0 and 2 pool to (1/2 * 2 + 0 * 1) / 3 = 1/3;
# 1/3 <= 2/3 <= 1 holds. The map: (0.05, 1/3), (0.25, 1/3), (0.55, 2/3), (0.95, 1).
PAIRS = [(0.05, 0.0), (0.05, 1.0), (0.25, 0.0), (0.55, 1.0), (0.55, 1.0), (0.55, 0.0), (0.95, 1.0)]


def test_bucketed_isotonic_fit_pools_adjacent_violators_by_hand():
    fit = fit_calibration(PAIRS)
    assert fit.xs == pytest.approx((0.05, 0.25, 0.55, 0.95))
    assert fit.ys == pytest.approx((1 / 3, 1 / 3, 2 / 3, 1.0))
    # linear between breakpoints, flat beyond: 0.4 is halfway from 1/3 to 2/3, 0.75 halfway from 2/3 to 1
    assert apply_calibration(fit, [0.0, 0.15, 0.4, 0.75, 1.0]) == pytest.approx([1 / 3, 1 / 3, 1 / 2, 5 / 6, 1.0])
    # not affine: the slopes differ (0 on [0.05, 0.25], 10/9 on [0.25, 0.55], 5/6 on [0.55, 0.95])
    assert apply_calibration(None, [0.2, 0.7]) == [0.2, 0.7]  # no map: the identity


def test_bins_are_equal_width_with_one_included_in_the_last():
    assert fit_calibration([(0.1, 0.0), (0.19, 1.0)]) is None  # both in bin 1: one populated bin
    assert fit_calibration([(0.0999, 0.0), (0.1, 1.0)]).xs == pytest.approx((0.0999, 0.1))  # bins 0 and 1
    assert fit_calibration([(0.95, 0.0), (1.0, 1.0)]) is None  # 1.0 is in the last bin, with 0.95
    assert fit_calibration([(0.5, 1.0)]) is None  # fewer than 2 pairs


def test_bias_stats_is_the_centred_squared_residual_before_and_after():
    # x = 0, 1 and y = 1, 0: centred -1/2, 1/2 and 1/2, -1/2, residuals -1, 1: before 1. A flat map
    # f = 1/2 centres to 0, so after = mean((y - 1/2)^2) = 1/4, reduction 1 - 1/4 = 3/4
    stats = bias_stats([0.0, 1.0], [1.0, 0.0], Calibration(xs=(0.0, 1.0), ys=(0.5, 0.5)))
    assert (stats.before, stats.after, stats.reduction) == pytest.approx((1.0, 0.25, 0.75))
    # a constant offset is no bias: x = y + 0.3 gives 0 before
    assert bias_stats([0.3, 1.3], [0.0, 1.0], None).before == pytest.approx(0.0)
    assert bias_stats([0.0, 1.0], [1.0, 0.0], None).reduction == 0.0  # the identity changes nothing


def _spread(i: int) -> float:
    return (i % 10) / 10 + 0.05  # one pair per bin in turn


def test_the_map_is_the_identity_until_200_pairs_then_refits_every_64():
    debiaser = OnlineDebiaser()
    for i in range(199):
        debiaser.push(_spread(i), 0.0)
    assert debiaser.calibration is None and debiaser.apply([0.3]) == [0.3]
    debiaser.push(_spread(199), 0.0)  # pair 200: the first fit
    assert debiaser.fits == 1 and debiaser.apply([0.3]) == [0.0]
    assert debiaser.stats.after == 0.0 and debiaser.stats.before > 0
    for i in range(200, 263):  # 63 more: no refit
        debiaser.push(_spread(i), 1.0)
    assert debiaser.fits == 1
    debiaser.push(_spread(263), 1.0)  # the 64th since the fit
    assert debiaser.fits == 2 and 0.0 < debiaser.apply([0.3])[0] < 1.0


def test_a_fit_without_two_populated_bins_keeps_the_identity_and_tries_again_at_the_next_pair():
    debiaser = OnlineDebiaser()
    for _ in range(250):
        debiaser.push(0.5, 1.0)
    assert debiaser.calibration is None and debiaser.since_fit == 250
    debiaser.push(0.05, 0.0)
    assert debiaser.fits == 1 and debiaser.since_fit == 0


def test_the_pairs_are_a_fifo_of_5000():
    debiaser = OnlineDebiaser()
    for i in range(5000):
        debiaser.push(_spread(i), 0.0)
    for i in range(5000):
        debiaser.push(_spread(i), 1.0)
    assert len(debiaser.pairs) == 5000 and set(y for _, y in debiaser.pairs) == {1.0}
    debiaser.refit()  # only the last 5000 pairs: every bin's real score is 1
    assert debiaser.apply([0.05, 0.5, 0.95]) == [1.0, 1.0, 1.0]


def test_the_debiasers_state_resumes_where_it_was():
    debiaser = OnlineDebiaser()
    for i in range(230):
        debiaser.push(_spread(i), float(i % 3 == 0))
    resumed = OnlineDebiaser()
    resumed.load_state_dict(debiaser.state_dict())
    for d in (debiaser, resumed):
        for i in range(230, 300):
            d.push(_spread(i), float(i % 2 == 0))
    assert resumed.calibration == debiaser.calibration and resumed.fits == debiaser.fits == 2

# ----------------------------------------------------------------- the anchor weight (denoise=anchor_weight)


def test_group_disagreement_by_hand():
    # d = 1, 0 and s = 0, 1: centred residuals -1, 1 (mean square 1), Var(s) = 1/4: s^2 = 4
    assert group_disagreement([1.0, 0.0], [0.0, 1.0]) == pytest.approx(4.0)
    # d centred 0.4, -0.4 against s centred 0.5, -0.5: residuals -0.1, 0.1, 0.01 / (1/4) = 0.04
    assert group_disagreement([0.9, 0.1], [1.0, 0.0]) == pytest.approx(0.04)
    assert group_disagreement([1.0, 0.0], [1.0, 1.0]) is None  # every real score the same


def test_anchor_weight_is_1_until_32_groups_then_2_then_tracks_the_disagreement_with_half_life_64():
    weighter = InverseVarianceWeighter()
    for _ in range(31):
        assert weighter.observe_group([1.0, 0.0], [0.0, 1.0]) == 1.0  # s^2 = 4 each, c not fixed yet
    assert weighter.observe_group([1.0, 0.0], [1.0, 1.0]) == 1.0  # degenerate: skipped, not counted
    assert weighter.groups == 31
    assert weighter.observe_group([1.0, 0.0], [0.0, 1.0]) == pytest.approx(2.0)  # group 32: c = (2 - 1) / 4
    assert weighter.c == pytest.approx(0.25)
    # one agreeing group (s^2 = 0): s^2 = 4 (1 - a), a = 1 - 0.5^(1/64); w = 1 + 0.25 * 4 * 0.5^(1/64)
    assert weighter.observe_group([1.0, 0.0], [1.0, 0.0]) == pytest.approx(1 + 0.5 ** (1 / 64))
    for _ in range(63):  # 64 agreeing groups in all: the disagreement has halved, w = 1 + 0.25 * 2
        weighter.observe_group([1.0, 0.0], [1.0, 0.0])
    assert weighter.weight() == pytest.approx(1.5)
    for _ in range(1000):  # s^2 = 0.0025-scaled residuals 0.45: s^2 = 0.2025 / 0.0025 = 81; 1 + 81/4 > 4
        weighter.observe_group([1.0, 0.0], [0.1, 0.0])
    assert weighter.weight() == 4.0  # clipped


def test_the_weighters_state_resumes_where_it_was():
    weighter = InverseVarianceWeighter(warmup=2)
    for _ in range(3):
        weighter.observe_group([1.0, 0.0], [0.0, 1.0])
    resumed = InverseVarianceWeighter(warmup=2)
    resumed.load_state_dict(weighter.state_dict())
    assert [w.observe_group([0.9, 0.1], [1.0, 0.0]) for w in (weighter, resumed)] == [weighter.weight()] * 2

# ----------------------------------------------------------------- the anchor scheduler


def test_anchor_groups_take_the_fraction_at_least_one_and_the_cap():
    assert len(anchor_groups(20, [0, 1])) == 2  # round(0.1 * 20)
    assert len(anchor_groups(4, [0, 1])) == 1  # round(0.4) = 0, at least 1
    assert len(anchor_groups(25, [0, 1])) == 2  # round(2.5) = 2: Python rounds half to even, as WMRL
    assert len(anchor_groups(3, [0, 1], min_per_step=5)) == 3  # never more than the groups
    assert len(anchor_groups(30, [0, 1], fraction=0.5, max_concurrent=4)) == 4
    assert anchor_groups(30, [0, 1], max_concurrent=2, in_flight=2) == []
    assert anchor_groups(0, [0, 1]) == []
    with pytest.raises(ValueError, match="fraction"):
        anchor_groups(10, [0, 1], fraction=1.5)


def test_anchor_groups_are_seeded_sorted_and_spread():
    picks = anchor_groups(40, [7, 3], fraction=0.25)
    assert picks == anchor_groups(40, [7, 3], fraction=0.25) == sorted(set(picks)) and len(picks) == 10
    chosen = [g for step in range(200) for g in anchor_groups(10, [7, step])]
    assert set(chosen) == set(range(10)) and len(chosen) == 200  # one a step, every group in turn
    assert max(chosen.count(g) for g in range(10)) < 40  # uniform: 20 each expected


def test_groups_of_one_task_and_which_play_the_world_model():
    tasks = [f"t{i}" for i in range(20)]
    assert grouped_tasks(tasks, 6, 1, 0, 3, 0) == sample_tasks(tasks, 6, 0, 3, 0)  # group_size 1: as it was
    grouped = grouped_tasks(tasks, 6, 2, 0, 3, 0)
    assert grouped[0::2] == grouped[1::2] == sample_tasks(tasks, 3, 0, 3, 0)
    # 10 groups of 2, the first 3 episodes probes (groups 0 and 1 hold one): those play the real env,
    # and round(0.1 * 10) = 1 anchor group of the others
    simulated = anchored_episodes(20, 3, 2, 0.1, 1, None, seed=0, step=5)
    assert simulated[:4] == [False] * 4
    real_groups = [g for g in range(2, 10) if not simulated[2 * g]]
    assert all(simulated[2 * g] == simulated[2 * g + 1] for g in range(10))
    assert real_groups == [g for g in anchor_groups(10, [0, 5, 0, 2]) if g >= 2] == [8]

# ----------------------------------------------------------------- the loop's outcomes (orchestration)


def _cfg(**world_model) -> RunConfig:
    cfg = RunConfig(name="t")
    cfg.world_model.path = "/wm"
    for key, value in world_model.items():
        setattr(cfg.world_model, key, value)
    return cfg


def _summary(task: str, success: bool, world_model: bool, predicted: float | None = None,
             env_error: str = "") -> EpisodeSummary:
    trace = WorldModelTrace(played=world_model, predicted_success=predicted)
    return EpisodeSummary(task, "look", success, 3, False, 0, 5, env_error, addons={WORLD_MODEL: trace})


def test_outcomes_put_the_anchor_weight_on_the_real_groups_and_advantages_on_all():
    cfg = _cfg(denoise="anchor_weight")
    cfg.objective.reward_weight = 0.5
    outcomes = Outcomes(cfg)
    outcomes.weighter.warmup = 1  # c fixed at the first group: w = 2
    episodes = [_summary("a", True, False, 0.0), _summary("a", False, False, 1.0),  # anchor: s^2 = 4
                _summary("b", True, True), _summary("b", False, True), _summary("b", True, True, env_error="x")]
    trajectories = [Trajectory(e.task_id, "alfworld") for e in episodes]
    fields = outcomes.apply(trajectories, episodes)
    assert fields == {"world_model_anchor_weight": pytest.approx(2.0), "world_model_anchor_groups": 1}
    assert [t.loss_weight for t in trajectories] == [2.0, 2.0, 1.0, 1.0, 1.0]
    # group a: 1, 0 -> +-1/(1/2 + 1e-4) * 1/2; group b: 1, 0 (the env error is not graded: 0)
    a = 0.5 / (0.5 + 1e-4)
    assert [t.advantage for t in trajectories] == pytest.approx([a, -a, a, -a, 0.0])


def test_outcomes_calibrate_model_scores_with_isotonic():
    outcomes = Outcomes(_cfg(debias="isotonic"))
    outcomes.debiaser.min_pairs = outcomes.debiaser.refit_every = 2
    # real pairs (verdict, outcome): (0.05, 0), (0.95, 0): the map is 0 everywhere; model scores 1, 0 -> 0, 0
    episodes = [_summary("a", False, False, 0.05), _summary("b", False, False, 0.95),
                _summary("c", True, True), _summary("d", False, True)]
    fields = outcomes.apply([Trajectory(e.task_id, "alfworld") for e in episodes], episodes)
    assert fields["world_model_calibrated"] and fields["success_rate_debiased"] == 0.0
    assert fields["success_rate_debiased_stderr"] is None
    assert fields["world_model_bias_after"] == 0.0 and math.isclose(fields["world_model_bias_before"], 0.2025)


def test_outcomes_do_nothing_in_a_plain_run():
    cfg = RunConfig(name="t")
    trajectories = [Trajectory("a", "alfworld")]
    assert Outcomes(cfg).apply(trajectories, [_summary("a", True, False)]) == {}
    assert trajectories[0].loss_weight is None and trajectories[0].advantage is None


def test_the_recipes_schedule_keys_reach_the_corrections_and_null_keeps_wmrls_constants():
    published = Outcomes(_cfg(debias="isotonic", denoise="anchor_weight"))
    assert (published.debiaser.min_pairs, published.debiaser.refit_every) == (200, 64)
    assert (published.weighter.warmup, published.weighter.half_life) == (32, 64.0)
    scaled = Outcomes(_cfg(debias="isotonic", denoise="anchor_weight", calibration_min_pairs=2,
                           calibration_refit_every=3, anchor_warmup_groups=1, anchor_half_life=8.0))
    assert (scaled.debiaser.min_pairs, scaled.debiaser.refit_every) == (2, 3)
    assert (scaled.weighter.warmup, scaled.weighter.half_life) == (1, 8.0)
    # 2 pairs reach min_pairs but not refit_every 3: still the identity
    episodes = [_summary("a", False, False, 0.05), _summary("b", False, False, 0.95)]
    assert not scaled.apply([Trajectory(e.task_id, "alfworld") for e in episodes], episodes)["world_model_calibrated"]
    # the third, (0.5, 1): the first fit. Centred x: -0.45, 0.45, 0; centred y: -1/3, -1/3, 2/3;
    # before = ((-0.45 + 1/3)^2 + (0.45 + 1/3)^2 + (2/3)^2) / 3 = 0.357222...
    third = [_summary("c", True, False, 0.5)]
    fields = scaled.apply([Trajectory("c", "alfworld")], third)
    assert fields["world_model_calibrated"]
    assert math.isclose(fields["world_model_bias_before"], ((-0.45 + 1 / 3) ** 2 + (0.45 + 1 / 3) ** 2 + (2 / 3) ** 2) / 3)
