"""The episodes of each optimizer step: the plan (probes at full depth or rollouts at the depth cap),
its tasks and sampling seeds as pure functions of (seed, step), and playing and scoring them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from envs.base import EnvSpec
from envs.pool import EnvPool
from teachers import Teacher, score_trajectories
from turnopd.algorithm.controllers import DepthSchedule
from turnopd.algorithm.objective import ESTIMATORS
from turnopd.algorithm.world_model_corrections import (
    anchor_groups,
    inverse_variance_weights,
    trajectory_variance,
)
from turnopd.config import RunConfig
from turnopd.core.distributed import rank_and_world
from turnopd.core.ledger import Ledger
from turnopd.core.metrics import WorkSpent
from turnopd.core.progress import EpisodeProgress
from turnopd.core.types import Trajectory
from turnopd.orchestration.preflight import scoring_topk
from turnopd.rollout import Policy, SamplingParams
from turnopd.rollout.agent_loop import POLICY_SAMPLE, rollout
from turnopd.rollout.judge import Judge
from turnopd.rollout.world_model_pool import WorldModelPool, trace_of

# Task draws: salt 0 for a step's rollouts, 1 for its probes, POOL_SALT + start_step for pool waves
# (so that a resumed run does not replay the waves of the run it continues).
POOL_SALT = 2
WORLD_MODEL_DRAW = 1  # the 4th key of the draw of which episodes play the world model (task draws have 3)
ANCHOR_DRAW = 2  # the 4th key of the draw of a step's anchor groups (world_model.debias / denoise of WMRL)
T = TypeVar("T")


def sample_tasks(tasks: list[str], n: int, seed: int, step: int, salt: int) -> list[str]:
    """n training tasks for a step, a pure function of (seed, step, salt) so a resumed run draws
    the same tasks as an uninterrupted one (with replacement only when n exceeds the split)."""
    rng = np.random.default_rng([seed, step, salt])
    return [tasks[i] for i in rng.choice(len(tasks), size=n, replace=n > len(tasks))]


def grouped_tasks(tasks: list[str], n: int, group_size: int, seed: int, step: int, salt: int) -> list[str]:
    """n episodes' tasks in groups of `group_size` consecutive episodes of one task (trainer.group_size):
    ceil(n / group_size) tasks drawn by sample_tasks, each repeated; group_size 1 is sample_tasks."""
    drawn = sample_tasks(tasks, -(-n // group_size), seed, step, salt)
    return [task for task in drawn for _ in range(group_size)][:n]


def step_sampling(cfg: RunConfig, step: int) -> SamplingParams:
    p = cfg.policy
    return SamplingParams(temperature=p.temperature, top_p=p.top_p, max_new_tokens=p.max_new_tokens,
                          stop=tuple(p.stop), seed=cfg.seed * 1_000_003 + step)


def episode_turn_limits(episodes: int, probes: int, cap: int, horizon: int) -> tuple[int, ...]:
    """The turn budget of a batch, decided here and nowhere else: each episode's most turns. The first
    `probes` are the depth controller's probes and play the full horizon (env.max_turns: uncensored,
    or their statistics would shrink the cap that censored them); the others play at most `cap`."""
    return (horizon,) * probes + (min(cap, horizon),) * (episodes - probes)


@dataclass(frozen=True)
class BatchPlan:
    """What optimizer step `step` trains on: one episode per entry of `turn_limits` (its most turns,
    episode_turn_limits), the first `probes` of them full-depth probes for the depth controller."""

    step: int
    turn_limits: tuple[int, ...]
    probes: int = 0

    @property
    def episodes(self) -> int:
        return len(self.turn_limits)

    @property
    def is_probe_step(self) -> bool:
        """A probe step: every episode is a probe."""
        return self.probes > 0 and self.probes == self.episodes

    @property
    def cap(self) -> int:
        """The step's rollout-depth cap: its non-probe episodes' limit (the horizon on a probe step)."""
        return self.turn_limits[-1]


def plan_batch(depth: DepthSchedule, step: int, cfg: RunConfig, work_left: float | None = None) -> BatchPlan:
    """A step's batch is trainer.episodes_per_step episodes, its probes among them (depth.num_probes,
    when set, makes a probe step that many instead), each with its turn limit; with `work_left`
    (what trainer.budget leaves, see work_left) only the first episodes that can reach it
    (within_budget)."""
    episodes = cfg.trainer.episodes_per_step
    probes = depth.probes_at(step, episodes)
    episodes = max(episodes, probes)
    limits = episode_turn_limits(episodes, probes, depth.cap_at(step), cfg.env.max_turns)
    if work_left is not None:
        limits = within_budget(limits, work_left, episode_work_bounds(cfg, limits, probes),
                               at_least=rank_and_world()[1])
    return BatchPlan(step, limits, min(probes, len(limits)))


def turn_work(cfg: RunConfig) -> int | None:
    """The most of trainer.budget's unit one turn spends: one env step (env_steps), policy.max_new_tokens
    (tokens_generated). None without a budget or in a unit no plan bounds: the clock (train_time_s)
    and tokens_trained (which counts prompts, and no setting limits those)."""
    budget = cfg.trainer.budget
    if budget is None:
        return None
    return {"env_steps": 1, "tokens_generated": cfg.policy.max_new_tokens}.get(budget.unit)


def episode_work_bounds(cfg: RunConfig, limits: tuple[int, ...], probes: int) -> tuple[int, ...]:
    """The most of trainer.budget's unit each episode of a batch spends: its turn limit x turn_work. In
    pool mode a step's rollouts come from waves requested at earlier (larger) caps: env.max_turns."""
    per_turn = turn_work(cfg) or 0
    if cfg.pipeline.mode == "pool":
        limits = limits[:probes] + (cfg.env.max_turns,) * (len(limits) - probes)
    return tuple(limit * per_turn for limit in limits)


def within_budget(limits: tuple[T, ...], work_left: float, bounds: tuple[int, ...],
                  at_least: int = 1) -> tuple[T, ...]:
    """The batch's first n turn limits (or other entries, one per episode), n the fewest whose work
    bounds add up to `work_left` (all when they do not), at least `at_least` (one an episode per rank). The first n - 1 spend less than what is
    left, so the step ends at most one episode's bound past the budget: the last step plays only what
    is left."""
    most = 0
    for n, bound in enumerate(bounds, 1):
        most += bound
        if most >= work_left:
            return limits[:max(n, at_least)]
    return limits


def work_left(cfg: RunConfig, spent: WorkSpent, ahead: int = 0) -> float | None:
    """What trainer.budget leaves after `spent`, in a unit a plan bounds (turn_work; else None), less
    `ahead`, the most that a batch planned and generating can spend before its step trains
    (pipeline.mixture.plan_work_bound: the next batch of one_step_off and pool is planned while this
    step trains, so it may only count on what this step cannot spend)."""
    if turn_work(cfg) is None:
        return None
    return cfg.trainer.budget.amount - getattr(spent, cfg.trainer.budget.unit) - ahead


@dataclass(frozen=True)
class Episodes:
    """Episodes to play: this rank's task ids (one episode each), each one's turn limit, their
    sampling, and how many of them (the first ones) are probes."""

    tasks: list[str]
    turn_limits: tuple[int, ...]
    sampling: SamplingParams
    probes: int = 0
    simulated: tuple[bool, ...] = ()  # per task: it plays the world model (empty: every one plays the real env)

    @property
    def is_probe_step(self) -> bool:
        return self.probes > 0 and self.probes == len(self.tasks)


def step_episodes(cfg: RunConfig, train_tasks: list[str], plan: BatchPlan) -> Episodes:
    """This rank's share of step `plan.step`'s episodes: the same tasks, seeds and turn limits in every
    mode. A probe step draws its tasks apart (salt 1) from a rollout step's (salt 0)."""
    rank, world = rank_and_world()
    tasks = grouped_tasks(train_tasks, plan.episodes, cfg.trainer.group_size, cfg.seed, plan.step,
                          salt=int(plan.is_probe_step))[rank::world]
    wm = cfg.world_model
    if wm.path is None:
        simulated = []
    elif wm.anchors:
        simulated = anchored_episodes(plan.episodes, plan.probes, cfg.trainer.group_size, wm.anchor_fraction,
                                      wm.anchor_min_groups, wm.anchor_max_concurrent, cfg.seed, plan.step)
    else:
        simulated = simulated_episodes(plan.episodes, plan.probes, wm.real_fraction, cfg.seed, plan.step)
    return Episodes(tasks, plan.turn_limits[rank::world], step_sampling(cfg, plan.step),
                    probes=len(range(rank, plan.probes, world)), simulated=tuple(simulated[rank::world]))


def simulated_episodes(n: int, probes: int, real_fraction: float, seed: int, step: int) -> list[bool]:
    """Which of a step's n episodes (global indices) play the world model: never one of the first
    `probes`; each other one unless its uniform draw u_i (seeded by (seed, step)) is below
    real_fraction, so real_fraction 1 plays every episode in the real env."""
    draws = np.random.default_rng([seed, step, 0, WORLD_MODEL_DRAW]).random(n)
    return [i >= probes and bool(draws[i] >= real_fraction) for i in range(n)]


def anchored_episodes(n: int, probes: int, group_size: int, fraction: float, min_groups: int,
                      max_concurrent: int | None, seed: int, step: int) -> list[bool]:
    """Which of a step's n episodes (global indices, in groups of group_size) play the world model,
    with WMRL's anchor groups: all but the episodes of the anchor groups (anchor_groups, seeded by
    (seed, step)) and of a group holding a probe (probes play the real env, and a group is graded by
    one source)."""
    anchors = set(anchor_groups(-(-n // group_size), [seed, step, 0, ANCHOR_DRAW], fraction, min_groups,
                                max_concurrent))
    return [(i // group_size) * group_size >= probes and i // group_size not in anchors for i in range(n)]


def wave_episodes(cfg: RunConfig, train_tasks: list[str], start_step: int, wave: int, cap: int) -> Episodes:
    """This rank's share of pool wave `wave` of a run (re)started at `start_step`, capped at `cap`
    turns (no probes: those are step batches): tasks and sampling seed are pure functions of (seed,
    start_step, wave)."""
    rank, world = rank_and_world()
    salt = POOL_SALT + start_step
    n = cfg.pipeline.wave_episodes or cfg.trainer.episodes_per_step
    tasks = grouped_tasks(train_tasks, n, cfg.trainer.group_size, cfg.seed, wave, salt)[rank::world]
    seed = int(np.random.default_rng([cfg.seed, wave, salt]).integers(2**31))
    return Episodes(tasks, episode_turn_limits(len(tasks), 0, cap, cfg.env.max_turns),
                    dataclasses.replace(step_sampling(cfg, wave), seed=seed))


def teacher_tokenizer(cfg: RunConfig, teachers: dict[str, Teacher], env: str) -> Any:
    """The tokenizer of `env`'s teacher when it reads turns in its own tokens (objective.tokenizers=cross),
    else None (it reads the student's)."""
    return teachers[env].tokenizer if cfg.objective.tokenizers == "cross" else None


def score(cfg: RunConfig, teachers: dict[str, Teacher], trajectories: list[Trajectory]) -> None:
    """The teachers' scores the estimator needs in the batch (none for one whose teacher runs in
    the training step: it is not run twice)."""
    if ESTIMATORS.get(cfg.objective.estimator).needs_scoring:
        score_trajectories(teachers, trajectories, topk=scoring_topk(cfg))


def play_and_score(cfg: RunConfig, spec: EnvSpec, pool: EnvPool, policy: Policy, teachers: dict[str, Teacher],
                   episodes: Episodes, ledger: Ledger, world: WorldModelPool | None = None, judge: Judge | None = None,
                   step: int = 0) -> list[Trajectory]:
    """Play the episodes (all at once, each within its turn limit; the simulated ones in `world`) and
    score them (see score). With world_model.samples >= 2 each
    trajectory's loss weight is its inverse-variance factor. The whole is the ledger's "probe" (a
    probe step) or "rollout" phase; inside it, generation, env, world_model and teacher are busy
    times (the first three overlap), and so is a `judge`'s (turnopd.rollout.judge). Rank 0 shows the
    episodes' progress (turnopd.core.progress.EpisodeProgress) of step `step`."""
    phase = "probe" if episodes.is_probe_step else "rollout"
    with ledger.phase(phase), EpisodeProgress(f"step {step} {phase}", len(episodes.tasks),
                                              enabled=rank_and_world()[0] == 0) as progress:
        trajectories = rollout(spec, pool, policy, episodes.tasks, env_config=cfg.env, sampling=episodes.sampling,
                               turn_limits=episodes.turn_limits, probes=episodes.probes, ledger=ledger,
                               actions=judge or POLICY_SAMPLE,
                               run_episode=world.runner(pool, episodes.simulated, ledger.busy) if world else None,
                               on_episode=progress.episode_done, prompt=cfg.prompt,
                               teacher_tokenizer=teacher_tokenizer(cfg, teachers, spec.name))
        if world is not None and cfg.world_model.denoise == "trajectory_variance" and cfg.world_model.samples >= 2:
            weights = inverse_variance_weights([trajectory_variance(trace_of(t).disagreements) for t in trajectories],
                                               cfg.world_model.variance_floor)
            for trajectory, weight in zip(trajectories, weights, strict=True):
                trajectory.loss_weight = weight
        with ledger.busy("teacher"):
            score(cfg, teachers, trajectories)
    return trajectories
