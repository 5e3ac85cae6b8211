"""The two TurnOPD controllers (the paper's "budgeting"), as pure functions and small state machines (no I/O).

1. Progressive turn-normalized loss budgeting: `loss_alpha` moves the token-weight mix from
   trajectory-level (alpha = 0) to turn-balanced (alpha = 1) over training.
2. Adaptive rollout-depth budgeting: `DepthController` sets how many turns training rollouts
   play from full-depth probe rollouts. Baseline depth modes: full, fixed, curriculum.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from turnopd.core.registry import Registry
from turnopd.core.types import Trajectory

# --------------------------------------------------------------------------------------------
# Progressive loss alpha
# --------------------------------------------------------------------------------------------

# name -> alpha(x, start): x in [0, 1] is the position on the ramp (see loss_alpha); `start` is the
# recipe's loss.alpha_start, which the constant schedule takes as its alpha.
ALPHA_SCHEDULES: Registry[Callable[[float, float], float]] = Registry("alpha schedule")


@ALPHA_SCHEDULES.register("linear")
def _linear(x: float, start: float) -> float:
    """alpha = x"""
    return x


@ALPHA_SCHEDULES.register("cosine")
def _cosine(x: float, start: float) -> float:
    """alpha = (1 - cos(pi x)) / 2: same end points as linear, flat at both ends."""
    return 0.5 * (1.0 - math.cos(math.pi * x))


@ALPHA_SCHEDULES.register("step")
def _step(x: float, start: float) -> float:
    """alpha = 0 before the midpoint of [start, end], 1 from it on."""
    return 1.0 if x >= 0.5 else 0.0


@ALPHA_SCHEDULES.register("constant")
def _constant(x: float, start: float) -> float:
    """alpha = start at every step (the ramp is not used)."""
    return start


def loss_alpha(step: int, total_steps: int, start: float = 0.0, end: float = 1.0,
               schedule: str = "linear") -> float:
    """Progressive alpha at optimizer step `step` (0-based) of `total_steps`.

    With k = step + 1 (the design's "step k of K", 1-based, so that the last step has k/K = 1):
    x = clip((k / K - start) / (end - start), 0, 1); linear: alpha = x (the paper, start = 0,
    end = 1), cosine: (1 - cos(pi x)) / 2, step: 1[x >= 1/2]. `constant`: alpha = start at every
    step (end unused). The recipe check (turnopd.config) holds 0 <= start < end <= 1.
    """
    if total_steps <= 0:
        raise ValueError(f"total_steps must be > 0, got {total_steps}")
    fn = ALPHA_SCHEDULES.get(schedule)
    if schedule == "constant":  # no ramp
        return float(fn(0.0, start))
    x = min(max(((step + 1) / total_steps - start) / (end - start), 0.0), 1.0)
    return float(fn(x, start))


# --------------------------------------------------------------------------------------------
# Adaptive rollout depth
# --------------------------------------------------------------------------------------------


def effective_depth(turn_kl: Sequence[Sequence[float]], eps: float = 1e-8) -> float:
    """H_eff before rounding, in turns, from probes' per-turn KL (one list per probe, its length =
    depth). With turn t = 1..T (1-based, so that H_eff counts turns as H_cov does):

    K_t = mean KL at turn t over the probes alive at t; n_t = probes alive at t, n_1 = probes;
    m_t = max(K_t, 0) * n_t / n_1;  q_t = m_t / (sum_j m_j + eps);  H_eff = sum_t t * q_t.
    (docs/algorithm.md writes t from 0 and adds the 1 to the cap; counting from 1 here, the cap needs no +1,
    and H_eff and H_cov are in the same unit.)
    """
    probes = [list(kl) for kl in turn_kl if len(kl) > 0]
    if not probes:
        return 0.0
    n0 = len(probes)
    masses = []
    for t in range(max(len(kl) for kl in probes)):
        alive = [kl[t] for kl in probes if len(kl) > t]
        masses.append(max(sum(alive) / len(alive), 0.0) * len(alive) / n0)
    total = sum(masses) + eps
    return sum((t + 1) * m / total for t, m in enumerate(masses))


def coverage_depth(depths: Sequence[int], success: Sequence[bool], quantile: float = 0.8,
                   min_successes: int = 8) -> int | None:
    """H_cov, in turns: the `quantile` of the depths (turns played) of the SUCCESSFUL probes, or None
    when fewer than `min_successes` succeeded. Convention: numpy's default (linear interpolation
    between order statistics, `np.quantile(method="linear")`), then ceil, so the cap covers at
    least that share of successful episodes."""
    won = [d for d, ok in zip(depths, success, strict=True) if ok]
    if len(won) < min_successes:
        return None
    return int(math.ceil(float(np.quantile(np.asarray(won, dtype=float), quantile)) - 1e-9))


def probe_statistics(trajectories: Sequence[Trajectory], turn_kl: Sequence[Sequence[float]]
                     ) -> tuple[list[list[float]], list[bool]]:
    """The per-turn KL and success of the probes among a step's trajectories (turn_kl[i] is
    trajectory i's, from the train step: the exact KL where the estimator computes it). Episodes the
    env ended are left out (they say nothing of the agent); a truncated probe is refused: statistics
    from capped rollouts would make the cap collapse."""
    if len(turn_kl) != len(trajectories):
        raise ValueError(f"{len(turn_kl)} per-turn KL lists for {len(trajectories)} trajectories")
    kls, success = [], []
    for traj, kl in zip(trajectories, turn_kl, strict=True):
        if not traj.is_probe or traj.failed_by_env:
            continue
        if traj.truncated:
            raise ValueError(f"a truncated probe ({traj.task_id}) would feed the depth controller; probes play "
                             "at full depth")
        kls.append(list(kl))
        success.append(traj.success)
    return kls, success


class DepthSchedule(Protocol):
    """How many turns the next training rollouts may play (the cap, at most the horizon h_max =
    env.max_turns), and how many of a step's episodes are full-depth probes.

    cap_at(step)                 the cap of step `step`'s rollouts
    probes_at(step, episodes)    how many of its episodes are probes (0: none)
    update(turn_kl, success)     a controller step from probes' per-turn KL and success; the new cap
    diagnostics()                the latest update's H_eff, H_cov, H_cov_measured, H_ctrl, H_bar
                                 (empty before one, and for the schedules that take no probes)
    state_dict / load_state_dict what a checkpoint keeps
    """

    def cap_at(self, step: int) -> int: ...
    def probes_at(self, step: int, episodes: int) -> int: ...
    def update(self, turn_kl: Sequence[Sequence[float]], success: Sequence[bool]) -> int: ...
    def diagnostics(self) -> dict[str, float | bool]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class DepthController:
    """Adaptive rollout-depth budgeting (TurnOPD), updated only from full-depth probes.

    H_ctrl = max(H_eff, H_cov), both in turns (effective_depth, coverage_depth); when fewer than
    `min_successes` probes succeeded, H_cov is `coverage_fallback`'s: "previous" (the last H_cov
    measured, h_max before any), "h_max" (the paper's), or "h_eff" (H_ctrl = H_eff alone).
    H_bar_k = (1 - ema) H_bar_{k-1} + ema H_ctrl, the first update taking H_bar_1 = H_ctrl (the
    warm-up cap h_max is a default, not a measurement); cap = clip(round(H_bar_k), h_min, h_max).
    Before the first update cap = h_max. Rounding is Python's round (half to even).

    h_max is the horizon (the recipe's env.max_turns); the recipe check (turnopd.config) holds
    1 <= h_min <= h_max, 0 < ema <= 1 and the coverage_fallback names.

    Probes, two ways:
    - periodic (probe_fraction None): after `warmup_steps` optimizer steps, then every `probe_every`
      steps, a step's whole batch is probes (`num_probes` episodes instead, when set); each update
      uses that batch alone.
    - continuous (probe_fraction f): every step, round(f x episodes) of its episodes are probes; each
      update uses the probes of the last `probe_every` steps (f = 1 / probe_every probes as many
      episodes as the periodic batches do). The cap stays h_max for the first `warmup_steps` steps.
    """

    def __init__(self, h_min: int = 2, h_max: int = 50, quantile: float = 0.8, min_successes: int = 8,
                 ema: float = 0.3, warmup_steps: int = 3, probe_every: int = 8, num_probes: int | None = None,
                 probe_fraction: float | None = None, coverage_fallback: str = "previous"):
        self.h_min, self.h_max, self.quantile, self.min_successes = h_min, h_max, quantile, min_successes
        self.ema, self.warmup_steps, self.probe_every = ema, warmup_steps, probe_every
        self.num_probes, self.probe_fraction, self.coverage_fallback = num_probes, probe_fraction, coverage_fallback
        # continuous probing: the last probe_every steps' probes, one (turn_kl, success) list per step
        self.window: deque[list[tuple[list[float], bool]]] | None = (
            deque(maxlen=probe_every) if probe_fraction is not None else None)
        self.cap = h_max
        self.h_bar: float | None = None
        self.h_cov: float | None = None  # the last measured H_cov
        self.last: dict[str, float] = {}  # H_eff, H_cov, H_ctrl, H_bar of the latest update

    def cap_at(self, step: int) -> int:
        return self.h_max if self.probe_fraction is not None and step < self.warmup_steps else self.cap

    def probes_at(self, step: int, episodes: int) -> int:
        if self.probe_fraction is not None:
            return round(self.probe_fraction * episodes)
        if step >= self.warmup_steps and (step - self.warmup_steps) % self.probe_every == 0:
            return self.num_probes or episodes
        return 0

    def update(self, turn_kl: Sequence[Sequence[float]], success: Sequence[bool]) -> int:
        """One controller step from new probes' per-turn KL and success (with a window: those and
        the window's earlier ones); returns the new cap."""
        if len(turn_kl) != len(success):
            raise ValueError(f"{len(turn_kl)} turn_kl lists but {len(success)} success flags")
        if self.window is not None:
            self.window.append(list(zip(map(list, turn_kl), success, strict=True)))
            turn_kl = [kl for step in self.window for kl, _ in step]
            success = [ok for step in self.window for _, ok in step]
        if not turn_kl:
            raise ValueError("DepthController.update needs at least one probe")
        h_eff = round(effective_depth(turn_kl))
        measured = coverage_depth([len(kl) for kl in turn_kl], success, self.quantile, self.min_successes)
        if measured is not None:
            self.h_cov = float(measured)
        h_cov = {"previous": self.h_max if self.h_cov is None else self.h_cov, "h_max": self.h_max,
                 "h_eff": h_eff}[self.coverage_fallback] if measured is None else measured
        h_ctrl = max(h_eff, h_cov)
        self.h_bar = float(h_ctrl) if self.h_bar is None else (1 - self.ema) * self.h_bar + self.ema * h_ctrl
        self.cap = min(max(round(self.h_bar), self.h_min), self.h_max)
        self.last = {"h_eff": float(h_eff), "h_cov": float(h_cov), "h_cov_measured": measured is not None,
                     "h_ctrl": float(h_ctrl), "h_bar": self.h_bar}
        return self.cap

    def diagnostics(self) -> dict[str, float | bool]:
        return dict(self.last)

    def state_dict(self) -> dict[str, Any]:
        return {"cap": self.cap, "h_bar": self.h_bar, "h_cov": self.h_cov, "last": dict(self.last),
                "window": None if self.window is None else [list(step) for step in self.window]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cap, self.h_bar, self.h_cov, self.last = int(state["cap"]), state["h_bar"], state["h_cov"], dict(state["last"])
        if self.window is not None:
            self.window.extend([(list(kl), bool(ok)) for kl, ok in step] for step in state["window"])


class _StaticDepth:
    """Base of the baseline modes: no probes, nothing to learn."""

    def probes_at(self, step: int, episodes: int) -> int:
        return 0

    def update(self, turn_kl: Sequence[Sequence[float]], success: Sequence[bool]) -> int:
        raise RuntimeError(f"{type(self).__name__} takes no probes")

    def diagnostics(self) -> dict[str, float | bool]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class FullDepth(_StaticDepth):
    """Vanilla OPD: always h_max."""

    def __init__(self, h_max: int):
        self.h_max = h_max

    def cap_at(self, step: int) -> int:
        return self.h_max


class FixedDepth(_StaticDepth):
    """A constant cap (the recipe check holds 1 <= cap <= h_max)."""

    def __init__(self, cap: int):
        self.cap = cap

    def cap_at(self, step: int) -> int:
        return self.cap


class CurriculumDepth(_StaticDepth):
    """TCOD-F2B front-to-back curriculum: cap = min(1 + (step + first_step) // interval, h_max) at the
    0-based step `step`. first_step 1 numbers the steps as TCOD numbers its explorer steps (from 1:
    its workflow reads batch_id = explore_step_num + 1), so the cap first grows a step earlier."""

    def __init__(self, interval: int, h_max: int, first_step: int = 0):
        self.interval, self.h_max, self.first_step = interval, h_max, first_step

    def cap_at(self, step: int) -> int:
        return min(1 + (step + self.first_step) // self.interval, self.h_max)


# name -> the schedule of a recipe's `depth` block (turnopd.config.DepthConfig, or any object with its
# fields) over the horizon h_max (env.max_turns)
DEPTH_MODES: Registry[Callable[[Any, int], DepthSchedule]] = Registry("depth mode")


@DEPTH_MODES.register("adaptive")
def _adaptive(d: Any, h_max: int) -> DepthController:
    return DepthController(d.h_min, h_max, d.quantile, d.min_successes, d.ema, d.warmup_steps, d.probe_every,
                           d.num_probes, d.probe_fraction, d.coverage_fallback)


@DEPTH_MODES.register("full")
def _full(d: Any, h_max: int) -> FullDepth:
    return FullDepth(h_max)


@DEPTH_MODES.register("fixed")
def _fixed(d: Any, h_max: int) -> FixedDepth:
    return FixedDepth(d.fixed_cap)


@DEPTH_MODES.register("curriculum")
def _curriculum(d: Any, h_max: int) -> CurriculumDepth:
    return CurriculumDepth(d.curriculum_interval, h_max, d.curriculum_first_step)


def make_depth_schedule(depth: Any, horizon: int) -> DepthSchedule:
    """The depth schedule a recipe's `depth` block names (`depth.mode`, see DEPTH_MODES), capping
    rollouts within the env's horizon (env.max_turns, the one horizon setting)."""
    return DEPTH_MODES.get(depth.mode)(depth, horizon)


class EnvDepths:
    """A multi-env run's depth controllers, one per env (its own horizon), each fed only its own env's
    probes: horizons differ by an order of magnitude between envs, so one cap for a mixed batch would be
    wrong for all. `updated` names the envs the last update_from moved."""

    def __init__(self, schedules: dict[str, DepthSchedule]):
        self.schedules = schedules
        self.updated: list[str] = []

    def update_from(self, trajectories: Sequence[Trajectory], turn_kl: Sequence[Sequence[float]]) -> bool:
        """Each env's controller step from its own probes among a mixed batch (turn_kl[i]: trajectory
        i's); returns whether any env had probes to update from."""
        if len(turn_kl) != len(trajectories):
            raise ValueError(f"{len(turn_kl)} per-turn KL lists for {len(trajectories)} trajectories")
        self.updated = []
        for env, schedule in self.schedules.items():
            mine = [(t, kl) for t, kl in zip(trajectories, turn_kl, strict=True) if t.env_name == env]
            probe_kl, probe_won = probe_statistics([t for t, _ in mine], [kl for _, kl in mine])
            if probe_kl:
                schedule.update(probe_kl, probe_won)
                self.updated.append(env)
        return bool(self.updated)

    def diagnostics(self) -> dict[str, dict[str, float | bool]]:
        """The last update's diagnostics of each env it moved."""
        return {env: self.schedules[env].diagnostics() for env in self.updated}

    def state_dict(self) -> dict[str, Any]:
        return {env: schedule.state_dict() for env, schedule in self.schedules.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for env, schedule in self.schedules.items():
            schedule.load_state_dict(state[env])
