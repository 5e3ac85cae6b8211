"""The turn budget: the batch plan decides every episode's turn limit (probes at the full horizon,
env.max_turns), episodes carry it, and the engine only reads it (tests/rollout/test_engine.py)."""

from __future__ import annotations

import pytest

from turnopd.algorithm.controllers import DepthController, make_depth_schedule
from turnopd.config import DepthConfig, EnvConfig, RunConfig, TrainerConfig
from turnopd.core.ledger import Ledger
from turnopd.core.metrics import StepRecord
from turnopd.core.types import Trajectory, Turn, build_token_batch
from turnopd.orchestration.pipeline.plan import BatchPlan, episode_turn_limits, plan_batch, step_episodes
from turnopd.orchestration.run_log import timed_evaluation


def test_episode_turn_limits_by_hand():
    # 5 episodes, 2 probes, cap 7, horizon 40: the probes play 40, the rest 7
    assert episode_turn_limits(5, 2, 7, 40) == (40, 40, 7, 7, 7)
    assert episode_turn_limits(3, 3, 7, 40) == (40, 40, 40)  # a probe step
    assert episode_turn_limits(2, 0, 50, 40) == (40, 40)  # a cap above the horizon is the horizon


def _cfg(episodes: int, horizon: int) -> RunConfig:
    return RunConfig(env=EnvConfig(max_turns=horizon), trainer=TrainerConfig(episodes_per_step=episodes))


def test_plan_batch_probe_steps_mixed_steps_and_rollout_steps():
    cfg = _cfg(episodes=4, horizon=30)
    depth = DepthController(h_min=2, h_max=30, min_successes=1, warmup_steps=1, probe_every=2)
    depth.cap = 9  # as if updated
    probe = plan_batch(depth, 1, cfg)  # warm-up 1, every 2 steps: steps 1, 3, ... probe the whole batch
    assert (probe.turn_limits, probe.probes, probe.is_probe_step, probe.cap) == ((30, 30, 30, 30), 4, True, 30)
    rollouts = plan_batch(depth, 2, cfg)
    assert (rollouts.turn_limits, rollouts.probes, rollouts.is_probe_step, rollouts.cap) == ((9, 9, 9, 9), 0, False, 9)
    more = plan_batch(DepthController(h_max=30, warmup_steps=0, num_probes=6), 0, cfg)  # a probe step of 6
    assert more.turn_limits == (30,) * 6 and more.is_probe_step
    mixed = plan_batch(DepthController(h_max=30, warmup_steps=0, num_probes=2), 0, cfg)  # 2 probes among 4
    assert (mixed.turn_limits, mixed.is_probe_step, mixed.cap) == ((30, 30, 30, 30), False, 30)  # no update yet: cap 30
    continuous = DepthController(h_max=30, warmup_steps=0, probe_fraction=0.25)
    continuous.cap = 5
    assert plan_batch(continuous, 3, cfg).turn_limits == (30, 5, 5, 5)  # round(0.25 x 4) = 1 probe
    # the horizon is env.max_turns: the schedule a recipe builds caps within it
    assert make_depth_schedule(DepthConfig(mode="full"), horizon=cfg.env.max_turns).cap_at(0) == 30


def test_episodes_carry_their_turn_limits_to_each_rank(monkeypatch):
    cfg = _cfg(episodes=4, horizon=30)
    plan = BatchPlan(3, turn_limits=(30, 30, 6, 6), probes=2)
    tasks = [f"t{i}" for i in range(10)]
    whole = step_episodes(cfg, tasks, plan)
    assert (whole.turn_limits, whole.probes) == ((30, 30, 6, 6), 2)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    share = step_episodes(cfg, tasks, plan)  # rank 1 of 2: episodes 1 and 3
    assert (share.tasks, share.turn_limits, share.probes) == (whole.tasks[1::2], (30, 6), 1)


def _trajectory(turn_tokens: list[int], weight: float | None) -> Trajectory:
    turns = [Turn(index=i, observation="", prompt_ids=[1, 2], action_ids=[3] * n, student_logprobs=[-1.0] * n)
             for i, n in enumerate(turn_tokens)]
    return Trajectory(task_id="t", env_name="e", turns=turns, loss_weight=weight)


def test_trajectory_loss_factors_are_their_own_field_of_the_token_batch():
    batch = build_token_batch([_trajectory([2, 1], 0.5), _trajectory([3], None), _trajectory([1], 2.0)])
    # one factor per trajectory, 1 where it carries none; not a turn signal
    assert batch.trajectory_weights.tolist() == [0.5, 1.0, 2.0]
    assert batch.turn_signals == {}
    # each action token's factor is its trajectory's (2 + 1 tokens, then 3, then 1)
    factors = batch.trajectory_weights[batch.traj_ids[batch.loss_mask]].tolist()
    assert factors == [0.5, 0.5, 0.5, 1.0, 1.0, 1.0, 2.0]
    assert build_token_batch([_trajectory([1], None)]).trajectory_weights is None


def test_step_record_round_trips_and_reads_older_records():
    record = StepRecord(step=3, train_time_s=12.5, rollout_depth_cap=7, probed=True, h_eff=4.0, tokens_trained=99)
    saved = record.to_json()
    assert saved["kind"] == "train" and list(saved)[0] == "kind"
    assert "world_model_bias" not in saved  # a run without world-model rollouts writes none of their fields
    assert StepRecord.from_json(saved) == record
    older = StepRecord.from_json({"kind": "train", "step": 1, "train_time_s": 2.0, "a_removed_field": 1})
    assert (older.step, older.turn_signal_profiles, older.h_cov) == (1, {}, None)


def test_mean_turns_of_won_and_lost_episodes():
    from turnopd.core.types import EpisodeSummary
    from turnopd.orchestration.run_log import mean_turns_of

    def episode(depth: int, won: bool, env_error: str = "") -> EpisodeSummary:
        return EpisodeSummary("t", "", won, depth, False, 0, 0, env_error)

    episodes = [episode(4, True), episode(10, True), episode(40, False), episode(25, False), episode(3, False, "hung")]
    assert mean_turns_of(episodes, won=True) == 7.0  # (4 + 10) / 2
    assert mean_turns_of(episodes, won=False) == 32.5  # (40 + 25) / 2: the env's error is neither
    assert mean_turns_of(episodes[2:], won=True) is None


def test_an_evaluation_is_off_the_training_clock_and_carries_its_own_time():
    now = [100.0]
    ledger = Ledger(clock=lambda: now[0])
    now[0] = 130.0  # 30 s of training

    def evaluation():
        now[0] += 12.0  # the evaluation takes 12 s
        return "result"

    result, train_time_s, eval_time_s = timed_evaluation(ledger, evaluation)
    assert (result, train_time_s, eval_time_s) == ("result", 30.0, 12.0)
    assert ledger.train_time() == pytest.approx(30.0)  # the 12 s are not training


def test_work_spent_adds_the_work_of_each_step_and_keeps_the_clock():
    from turnopd.core.metrics import WorkSpent

    spent = WorkSpent()
    spent.add(StepRecord(step=1, train_time_s=10.0, env_steps=30, tokens_generated=200, tokens_trained=900))
    spent.add(StepRecord(step=2, train_time_s=25.5, env_steps=12, tokens_generated=80, tokens_trained=400))
    assert spent == WorkSpent(train_time_s=25.5, env_steps=42, tokens_generated=280, tokens_trained=1300)


def _budgeted(unit: str, amount: float, mode: str = "sync") -> RunConfig:
    from turnopd.config import BudgetConfig, PipelineConfig, PolicyConfig

    return RunConfig(env=EnvConfig(max_turns=30), policy=PolicyConfig(max_new_tokens=16),
                     pipeline=PipelineConfig(mode=mode),
                     trainer=TrainerConfig(episodes_per_step=4, budget=BudgetConfig(unit=unit, amount=amount)))


def test_the_last_step_plays_only_what_the_budget_leaves():
    from turnopd.core.metrics import WorkSpent
    from turnopd.orchestration.pipeline import plan_work_bound, work_left

    depth = DepthController(h_min=2, h_max=30, min_successes=1, warmup_steps=0, probe_every=3, num_probes=1)
    depth.cap = 9  # step 0 probes (1 probe at 30 turns among 3 at the cap 9), steps 1 and 2 do not
    cfg = _budgeted("env_steps", 100)
    spent = WorkSpent(env_steps=80)  # 20 left: episodes of at most 9, 9, 9, 9 env steps reach it with 3 (27)
    assert work_left(cfg, spent) == 20
    assert plan_batch(depth, 1, cfg, work_left(cfg, spent)).turn_limits == (9, 9, 9)
    # 80 + 27 = 107 at most at the end: within one episode's 9 env steps of the budget, 100
    assert plan_batch(depth, 1, cfg, 100 - 95).turn_limits == (9,)  # 5 left: one episode
    assert plan_batch(depth, 1, cfg, 36).turn_limits == (9, 9, 9, 9)  # 4 x 9 = 36 just reaches it
    assert plan_batch(depth, 1, cfg, 1000).turn_limits == (9, 9, 9, 9)  # the whole batch
    # a probe step: the probe first (30), which alone reaches 25 left: the step is that probe
    probe_step = plan_batch(depth, 0, cfg, 25)
    assert (probe_step.turn_limits, probe_step.probes, probe_step.is_probe_step) == ((30,), 1, True)
    assert plan_batch(depth, 0, cfg, 35).turn_limits == (30, 9)  # 30 < 35 <= 39
    # tokens generated: at most 16 a turn, 9 x 16 = 144 an episode: 300 left take 3 (432 >= 300 > 288)
    assert plan_batch(depth, 1, _budgeted("tokens_generated", 1000), 300).turn_limits == (9, 9, 9)
    # pool: the rollouts come from waves requested at earlier caps, so each counts env.max_turns (30)
    assert plan_batch(depth, 1, _budgeted("env_steps", 100, "pool"), 35).turn_limits == (9, 9)
    # one_step_off plans the next batch before this one is trained: it counts on 20 - (9 + 9 + 9) <= 0
    this_step = plan_batch(depth, 1, cfg, work_left(cfg, spent))
    assert work_left(cfg, spent, ahead=plan_work_bound(cfg, this_step)) == 20 - 27
    # no plan bounds the clock or tokens_trained (prompts are trained too): the step is whole
    for unit in ("train_time_s", "tokens_trained"):
        assert work_left(_budgeted(unit, 100), spent) is None
    assert work_left(RunConfig(), spent) is None  # no budget
