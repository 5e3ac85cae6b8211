"""Hand-worked checks of the two budget controllers in turnopd.algorithm.controllers."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnopd.algorithm.controllers import (
    CurriculumDepth,
    DepthController,
    FixedDepth,
    FullDepth,
    coverage_depth,
    effective_depth,
    loss_alpha,
    make_depth_schedule,
    probe_statistics,
)
from turnopd.config import DepthConfig
from turnopd.core.types import Trajectory, Turn

# ------------------------------------------------------------------------------- loss alpha


def test_linear_alpha_paper_defaults_reaches_one_on_the_last_step():
    # a = clip((k/K - 0)/(1 - 0), 0, 1) = k/K with k = step + 1 (1-based): 1/100 at step 0, 1 at 99
    assert loss_alpha(0, 100) == 0.01
    assert loss_alpha(24, 100) == 0.25
    assert loss_alpha(99, 100) == 1.0
    assert loss_alpha(47, 48) == 1.0  # the quickstart's last step (it ended at 47/48 = 0.979 before)


def test_linear_alpha_with_start_and_end():
    # s = 0.2, e = 0.6: at k/K = 0.1 -> (0.1-0.2)/0.4 < 0 -> 0; at 0.4 -> 0.2/0.4 = 0.5; at 0.8 -> 1
    assert loss_alpha(9, 100, 0.2, 0.6) == 0.0
    assert loss_alpha(39, 100, 0.2, 0.6) == pytest.approx(0.5)
    assert loss_alpha(79, 100, 0.2, 0.6) == 1.0


def test_cosine_step_constant_alpha():
    # cosine at x = 0.25: (1 - cos(pi/4))/2 = (1 - 0.707107)/2 = 0.146447
    assert loss_alpha(24, 100, schedule="cosine") == pytest.approx((1 - math.cos(math.pi / 4)) / 2)
    assert loss_alpha(49, 100, schedule="cosine") == pytest.approx(0.5)
    # step: 0 before the midpoint (k/K < 0.5), 1 from it on
    assert loss_alpha(48, 100, schedule="step") == 0.0
    assert loss_alpha(49, 100, schedule="step") == 1.0
    # constant: alpha = start everywhere
    assert loss_alpha(3, 100, start=0.3, schedule="constant") == 0.3
    assert loss_alpha(99, 100, start=0.3, schedule="constant") == 0.3


def test_alpha_bad_inputs():
    with pytest.raises(ValueError, match="total_steps"):
        loss_alpha(1, 0)
    with pytest.raises(KeyError, match="unknown alpha schedule 'exp'; registered: constant, cosine, linear, step"):
        loss_alpha(1, 10, schedule="exp")


# ---------------------------------------------------------------------- depth statistics


def test_effective_depth_hand_worked():
    # 4 probes: depths 3, 3, 2, 1 with per-turn KL; turns t = 1, 2, 3
    turn_kl = [[0.4, 0.2, 0.3], [0.6, 0.4, 0.1], [0.2, 0.6], [0.8]]
    # K_1 = (0.4+0.6+0.2+0.8)/4 = 0.5, n_1 = 4 -> m_1 = 0.5 * 4/4 = 0.5
    # K_2 = (0.2+0.4+0.6)/3 = 0.4,     n_2 = 3 -> m_2 = 0.4 * 3/4 = 0.3
    # K_3 = (0.3+0.1)/2   = 0.2,       n_3 = 2 -> m_3 = 0.2 * 2/4 = 0.1
    # q = [0.5, 0.3, 0.1] / 0.9; H_eff = (1*0.5 + 2*0.3 + 3*0.1) / 0.9 = 1.4/0.9 = 1.5556 turns
    assert effective_depth(turn_kl) == pytest.approx(1.4 / 0.9, rel=1e-6)


def test_effective_depth_clips_negative_kl():
    # K_1 = 1, K_2 = -2 -> max(., 0) = 0: all mass on turn 1 -> H_eff = 1
    assert effective_depth([[1.0, -2.0]]) == pytest.approx(1.0, rel=1e-6)
    # K_1 = -1 (clipped), K_2 = 1 -> all mass on turn 2 -> H_eff = 2
    assert effective_depth([[-1.0, 1.0]]) == pytest.approx(2.0, rel=1e-6)


def test_coverage_depth_numpy_linear_then_ceil():
    depths = [2, 4, 4, 5, 7, 8, 9, 12, 30]
    success = [True] * 8 + [False]  # the failed depth-30 probe is ignored
    # successful depths sorted: 2 4 4 5 7 8 9 12 (n = 8); p = 0.8 -> position 0.8 * 7 = 5.6
    # value = 8 + 0.6 * (9 - 8) = 8.6 -> ceil -> 9
    assert coverage_depth(depths, success, 0.8, 8) == 9
    # fewer than min_successes successful probes -> None (the controller's coverage_fallback decides)
    assert coverage_depth(depths, success, 0.8, 9) is None


def test_controller_updates_and_each_coverage_fallback_hand_worked():
    def first_update(fallback):
        dc = DepthController(h_min=2, h_max=50, quantile=0.8, min_successes=2, ema=0.3, coverage_fallback=fallback)
        assert dc.cap == 50  # h_max before the first update
        # two successful probes of depths 4 and 6, KL mass all on turn 1 -> H_eff = 1 turn
        # H_cov: successful depths [4, 6], p=.8 -> 4 + .8*2 = 5.6 -> 6; H_ctrl = max(1, 6) = 6
        # H_bar_1 = H_ctrl = 6 (first measurement); cap = clip(round(6), 2, 50) = 6: the depth the
        # statistics say, not one more
        assert dc.update([[1.0, 0, 0, 0], [1.0, 0, 0, 0, 0, 0]], [True, True]) == 6
        assert dc.last == {"h_eff": 1.0, "h_cov": 6.0, "h_cov_measured": True, "h_ctrl": 6.0, "h_bar": 6.0}
        return dc

    # update 2: one success only (< min_successes=2); H_eff = 1 (KL on turn 1)
    updates = {}
    for fallback in ("previous", "h_max", "h_eff"):
        dc = first_update(fallback)
        updates[fallback] = (dc.update([[1.0], [1.0, 0.0]], [True, False]), dc.h_bar)
        assert not dc.last["h_cov_measured"]
    # previous: H_cov = 6 (the last measured) -> H_ctrl 6 -> H_bar = .7*6 + .3*6 = 6 -> cap 6
    # h_max:    H_cov = 50 -> H_ctrl 50 -> H_bar = 4.2 + 15 = 19.2 -> cap 19
    # h_eff:    H_ctrl = H_eff = 1 -> H_bar = 4.2 + 0.3 = 4.5 -> round half to even: 4
    assert updates == {"previous": (6, pytest.approx(6.0)), "h_max": (19, pytest.approx(19.2)),
                       "h_eff": (4, pytest.approx(4.5))}


def test_controller_effective_depth_term():
    dc = DepthController(h_min=2, h_max=50, min_successes=1)
    # one successful probe of depth 2 (H_cov = 2); KL [0, 0, 0, 0, 5, 5] on a failed probe of
    # depth 6 and [0, 0] on the success: K at turns 5, 6 is 5 with n_t/n_1 = 1/2 -> m_5 = m_6 = 2.5,
    # q_5 = q_6 = .5 (each 2.5/(5 + eps)) -> H_eff = 5.5 - O(eps) -> round -> 5; cap = max(5, 2) = 5
    assert dc.update([[0, 0, 0, 0, 5, 5], [0, 0]], [False, True]) == 5


def test_cap_clipped_to_h_min():
    dc = DepthController(h_min=3, h_max=10, min_successes=1)
    # depth-1 success, KL on turn 1 -> H_ctrl = max(1, 1) = 1 -> clip to h_min = 3
    assert dc.update([[1.0]], [True]) == 3


def test_probe_schedules():
    periodic = DepthController(warmup_steps=3, probe_every=8)
    assert {s: periodic.probes_at(s, 8) for s in range(30) if periodic.probes_at(s, 8)} == {3: 8, 11: 8, 19: 8, 27: 8}
    assert DepthController(warmup_steps=3, probe_every=8, num_probes=16).probes_at(11, 8) == 16  # an override
    continuous = DepthController(h_max=40, warmup_steps=2, probe_fraction=0.25)
    assert [continuous.probes_at(s, 8) for s in range(4)] == [2, 2, 2, 2]  # round(0.25 * 8) every step
    continuous.cap = 12
    assert [continuous.cap_at(s) for s in range(4)] == [40, 40, 12, 12]  # h_max through the warm-up


def test_continuous_probes_update_from_a_window_of_the_last_probe_every_steps():
    dc = DepthController(h_min=1, h_max=50, min_successes=1, ema=0.3, probe_every=2, probe_fraction=0.25)
    # step A: one won probe of depth 3, KL on turn 1 -> H_eff 1, H_cov 3 -> cap 3
    assert dc.update([[1.0, 0, 0]], [True]) == 3
    # step B: a lost probe of depth 5 with KL on turn 5; window A + B:
    #   turn 1: K = (1 + 0)/2, n 2 -> m = 0.5; turn 5: K = 1, n 1 -> m = 1 * 1/2 = 0.5
    #   H_eff = (1 * .5 + 5 * .5) / 1 = 3; H_cov = quantile of the won depths [3] = 3 -> H_ctrl 3
    #   H_bar = .7 * 3 + .3 * 3 = 3 -> cap 3
    assert dc.update([[0, 0, 0, 0, 1.0]], [False]) == 3
    # step C: a won probe of depth 7 with KL on turn 7; the window drops A and keeps B + C:
    #   turn 5: K = (1 + 0)/2, n 2 -> m = 0.5; turn 7: K = 1, n 1 -> m = 0.5 -> H_eff = (5 + 7)/2 = 6
    #   H_cov = [7] -> 7; H_ctrl = 7; H_bar = .7 * 3 + .3 * 7 = 4.2 -> cap 4
    assert dc.update([[0, 0, 0, 0, 0, 0, 1.0]], [True]) == 4
    assert dc.last["h_eff"] == 6.0 and dc.last["h_cov"] == 7.0
    other = DepthController(h_min=1, h_max=50, min_successes=1, ema=0.3, probe_every=2, probe_fraction=0.25)
    other.load_state_dict(dc.state_dict())  # the window survives a resume
    assert other.update([[1.0]], [True]) == dc.update([[1.0]], [True])


def scored(turns: int, success=True, truncated=False, is_probe=True, env_error=""):
    return Trajectory("task", "env", [Turn(t, "obs", [1], [2], [0.0]) for t in range(turns)], success=success,
                      truncated=truncated, is_probe=is_probe, env_error=env_error)


def test_probe_statistics_take_probes_only_and_refuse_truncated_ones():
    trajs = [scored(2), scored(3, is_probe=False, truncated=True), scored(1, success=False), scored(0, env_error="x")]
    kls = [[0.1, 0.2], [0.3, 0.3, 0.3], [0.5], []]
    assert probe_statistics(trajs, kls) == ([[0.1, 0.2], [0.5]], [True, False])
    with pytest.raises(ValueError, match="a truncated probe"):
        probe_statistics([scored(2, truncated=True)], [[0.1, 0.2]])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=6))
def test_censored_rollouts_never_reach_the_controller(flags):
    trajs = [scored(2, is_probe=probe, truncated=trunc) for probe, trunc in flags]
    kls = [[0.5, 0.2]] * len(trajs)
    if any(probe and trunc for probe, trunc in flags):
        with pytest.raises(ValueError, match="a truncated probe"):
            probe_statistics(trajs, kls)
    else:
        selected, _ = probe_statistics(trajs, kls)
        assert len(selected) == sum(probe for probe, _ in flags)  # capped rollouts never enter


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 10), st.integers(0, 40),
       st.lists(st.tuples(st.lists(st.floats(-5, 5), min_size=1, max_size=40), st.booleans()),
                min_size=1, max_size=12, ))
def test_cap_stays_within_bounds(h_min, extra, probes):
    h_max = h_min + extra
    dc = DepthController(h_min=h_min, h_max=h_max, min_successes=2)
    for _ in range(3):
        cap = dc.update([kl for kl, _ in probes], [ok for _, ok in probes])
        assert h_min <= cap <= h_max


def test_baseline_depth_modes():
    assert [FullDepth(50).cap_at(s) for s in (0, 10)] == [50, 50]
    assert FixedDepth(7).cap_at(123) == 7
    # TCOD-F2B: cap = min(1 + step // interval, h_max) with interval 5, h_max 4
    assert [CurriculumDepth(5, 4).cap_at(s) for s in (0, 4, 5, 10, 14, 15, 100)] == [1, 1, 2, 3, 3, 4, 4]
    assert FullDepth(50).probes_at(3, 8) == 0
    with pytest.raises(RuntimeError, match="takes no probes"):
        FullDepth(50).update([], [])
    assert make_depth_schedule(DepthConfig(mode="fixed", fixed_cap=7), horizon=50).cap_at(3) == 7
    assert make_depth_schedule(DepthConfig(mode="full"), horizon=40).cap_at(3) == 40  # the env's horizon
    with pytest.raises(KeyError, match="unknown depth mode 'random'; registered: adaptive, curriculum, fixed, full"):
        make_depth_schedule(DepthConfig(mode="random"), horizon=50)


def test_controller_state_round_trip():
    dc = DepthController(min_successes=1)
    dc.update([[1.0, 2.0]], [True])
    other = DepthController(min_successes=1)
    other.load_state_dict(dc.state_dict())
    assert (other.cap, other.h_bar, other.last) == (dc.cap, dc.h_bar, dc.last)
