"""`turnopd distill`: the on-policy distillation loop, top to bottom in `train`.

Per optimizer step k of K:
    plan the batch (the turn budget: each episode's turn limit, probes at the full horizon; under
    trainer.budget in env steps or tokens generated, only the episodes the budget leaves room for)
    -> take its scored trajectories from the rollout source -> loss + optimizer step
    -> depth-controller update from the step's probes -> weight sync -> the step's record
    (+ evaluation every eval.every steps and at the end, + checkpoint every checkpoint.every steps)

On a probe step the probes are that step's training batch (they are full-depth, on-policy and
already scored: discarding them would waste their cost). The step's scored trajectories come from a
rollout source (turnopd.orchestration.pipeline, `pipeline.mode`): played here (sync), or by a
generator process that overlaps generation with training (one_step_off, pool). Opening the run
(checks, model builds, a resumed checkpoint) is turnopd.orchestration.startup's; the record it
writes turnopd.orchestration.run_log's; the evaluations turnopd.orchestration.evaluation's. A
multi-env run (recipe key `envs`) plans, plays and evaluates each env's share with that env's own
depth controller, env pool and teacher (turnopd.orchestration.pipeline.mixture): the loop is the same.
"""

from __future__ import annotations

import dataclasses
import sys
from functools import partial
from pathlib import Path
from typing import Any

from turnopd.algorithm.controllers import DepthSchedule, EnvDepths, loss_alpha, probe_statistics
from turnopd.config import RunConfig
from turnopd.core.checkpoint import list_checkpoints
from turnopd.core.distributed import gather_objects
from turnopd.core.interrupt import RunStopped, StopSignals
from turnopd.core.progress import StepProgress, print_summary
from turnopd.core.types import EpisodeSummary, Trajectory, build_token_batch, describe_env_errors, env_errors
from turnopd.orchestration.addons import Addons, open_addons
from turnopd.orchestration.evaluation import evaluate_at_start, evaluate_on_schedule
from turnopd.orchestration.pipeline import (
    BatchPlan,
    EnvPools,
    MixturePlan,
    Rollouts,
    open_pools,
    open_rollouts,
    plan_step,
    plan_work_bound,
    work_left,
)
from turnopd.orchestration.run_log import step_record
from turnopd.orchestration.startup import DistillRun, open_run, save_checkpoint


class EnvFailed(RuntimeError):
    """The env ended every episode of a step itself (crashes, hangs, a game it cannot load): the agent
    played nothing to learn from, and later steps would fare the same."""


def train(run: DistillRun, stop: StopSignals) -> dict[str, Any]:
    """The loop: evaluations at the start, then per step plan, take the scored trajectories, train,
    update the depth controller from probes, sync weights, log; evaluate and checkpoint on schedule;
    stop at a step boundary when a stop signal came (turnopd.core.interrupt)."""
    cfg, setup, ledger, log, trainer, depth = run.cfg, run.setup, run.ledger, run.log, run.trainer, run.depth
    summary: dict[str, Any] = {"run_dir": str(run.run_dir), "start_step": run.start_step, "teacher_eval": None}
    with (open_pools(cfg, setup) as pools, open_addons(run, pools.first) as addons,
          open_rollouts(cfg, setup, trainer=trainer, policy=run.policy, pool=pools.first, pools=pools,
                        teachers=run.teachers, depth=depth, ledger=ledger, start_step=run.start_step,
                        addons=addons) as rollouts):
        if run.start_step == 0:
            summary.update(stop.abortable(partial(evaluate_at_start, cfg, setup, pools, run.policy, log), {}))
            addons.between_steps()
            stop_if_asked(run, stop, run.start_step, checkpointed=True)
        progress = StepProgress(cfg.trainer.steps, run.start_step, enabled=log.is_main)
        for step in range(run.start_step, cfg.trainer.steps):
            if run.budget_reached:  # trainer.budget: the last step was the one before
                break
            # each env's share with its own cap (a multi-env run); only what trainer.budget leaves
            plan = plan_step(depth, step, cfg, work_left(cfg, run.spent))
            trajectories = rollouts.take(plan)  # the ledger's rollout (or probe) phase, or trainer_idle
            episodes = all_ranks_episodes(trajectories, step, run.run_dir)
            outcome_fields = run.outcomes.apply(trajectories, episodes)
            if step + 1 < cfg.trainer.steps:
                prepare_next(run, rollouts, plan)

            alpha = step_alpha(cfg, step)
            with ledger.phase("train"):
                result = trainer.step(build_token_batch(trajectories), alpha)  # raises TrainingDiverged
            # a dropped batch (an image of it lost) trained nothing: its probes measured no KL
            updated = not result.dropped and update_depth(depth, plan, trajectories, result.turn_kl)
            with ledger.phase("weight_sync"), trainer.gathered_parameters() as student_weights:
                run.policy.update_weights(student_weights)
                rollouts.publish(student_weights, version=step + 1)

            done = step + 1
            record = step_record(done, ledger, ledger.end_step(), depth, plan, updated, alpha, result, episodes,
                                 rollouts.stats(), rollouts.take_replica_stats())
            record = dataclasses.replace(record, **outcome_fields, **addons.record_fields(trajectories, result))
            log.train(record)
            progress.update(record)
            run.spent.add(record)
            summary.update(end_step(run, stop, pools, addons, done))  # evaluation and checkpoint, off the clock
        progress.close()

    summary.update(train_time_s=ledger.train_time(), wall_time_s=ledger.wall_time(), phases=dict(ledger.totals),
                   steps=log.step)
    log.finish()
    if log.is_main:
        print_summary(cfg, summary)
    return summary


def end_step(run: DistillRun, stop: StopSignals, pools: EnvPools, addons: Addons, done: int) -> dict[str, Any]:
    """After step `done`'s record: evaluate and checkpoint on schedule and after the last step (all
    steps, or trainer.budget reached: said in the record), then stop if a signal asked."""
    cfg, budget = run.cfg, run.cfg.trainer.budget
    last = done == cfg.trainer.steps or run.budget_reached
    if run.budget_reached and done < cfg.trainer.steps:
        run.log.budget_reached(done, budget.unit, budget.amount, getattr(run.spent, budget.unit))
    results = stop.abortable(partial(evaluate_on_schedule, cfg, run.setup, pools, run.policy, run.log, done, last), {})
    checkpointed = bool(cfg.checkpoint.every and done % cfg.checkpoint.every == 0) or last
    if checkpointed:
        with run.ledger.phase("checkpoint"):
            save_checkpoint(run, done)
    run.ledger.end_step()  # eval and checkpoint time are in the record's clocks, not its phases
    addons.between_steps()
    stop_if_asked(run, stop, done, checkpointed)
    return results


def prepare_next(run: DistillRun, rollouts: Rollouts, plan: BatchPlan | MixturePlan) -> None:
    """The next step's plan, which the asynchronous modes generate while this step trains. It may only
    count on the budget this step cannot spend (work_left with `ahead`); when that is nothing it is not
    made: if this step leaves the budget unreached, the next one is planned and generated when it starts."""
    left = work_left(run.cfg, run.spent, ahead=plan_work_bound(run.cfg, plan))
    if left is None or left > 0:
        rollouts.prepare(plan_step(run.depth, plan.step + 1, run.cfg, left))


def all_ranks_episodes(trajectories: list[Trajectory], step: int, run_dir: Path) -> list[EpisodeSummary]:
    """The step's episodes on every rank, summarized; a step the env ended entirely stops the run."""
    episodes = [e for part in gather_objects([EpisodeSummary.of(t) for t in trajectories]) for e in part]
    if all(e.failed_by_env for e in episodes):  # nothing the agent did: the env cannot run
        raise EnvFailed(f"step {step + 1}: {describe_env_errors(env_errors(episodes), len(episodes))}. "
                        f"Fix the env, then continue the run with --resume {run_dir}")
    return episodes


def step_alpha(cfg: RunConfig, step: int) -> float:
    """The progressive loss's alpha at `step` (0 for the other loss modes, which do not read it)."""
    if cfg.loss.mode != "progressive":
        return 0.0
    return loss_alpha(step, cfg.trainer.steps, cfg.loss.alpha_start, cfg.loss.alpha_end, cfg.loss.alpha_schedule)


def update_depth(depth: DepthSchedule | EnvDepths, plan: BatchPlan | MixturePlan, trajectories: list[Trajectory],
                 turn_kl: list[list[float]]) -> bool:
    """The depth controller's update from the step's probes (all ranks'), with the train step's
    per-turn KL (the exact one where the estimator computes it); the next plans' caps follow (a
    multi-env run's controllers each from its own env's probes). Returns whether it updated (a probe
    batch the env ended entirely gives it nothing)."""
    if not plan.probes:
        return False
    everyone = [t for part in gather_objects(trajectories) for t in part]
    if isinstance(depth, EnvDepths):
        return depth.update_from(everyone, turn_kl)
    probe_kl, probe_won = probe_statistics(everyone, turn_kl)
    if probe_kl:
        depth.update(probe_kl, probe_won)
    return bool(probe_kl)


def stop_if_asked(run: DistillRun, stop: StopSignals, done: int, checkpointed: bool) -> None:
    """At a step boundary, on every rank: when a stop signal came, checkpoint the steps done
    (checkpoint.on_stop, unless just written or nothing was trained) and end the run (RunStopped)."""
    signum = stop.agreed()
    if signum is None:
        return
    if run.cfg.checkpoint.on_stop and not checkpointed and done > run.start_step:
        with run.ledger.phase("checkpoint"):
            save_checkpoint(run, done)
    checkpoints = list_checkpoints(run.run_dir)
    raise RunStopped(signum, done, run.cfg.trainer.steps, run.run_dir, checkpoints[-1] if checkpoints else None)


def run_distillation(cfg: RunConfig, resume: str | None = None) -> dict[str, Any]:
    """Open the run (or resume it) and train it; returns the run's summary. A stop signal ends it
    with RunStopped (at once in set-up, else at the next step boundary)."""
    with StopSignals() as stop:
        run = stop.abortable(lambda: open_run(cfg, resume), None)
        if run is None:
            raise RunStopped(stop.received, 0, cfg.trainer.steps, None, None)
        try:
            return train(run, stop)
        finally:
            run.log.close()


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `turnopd distill RECIPE`")
