"""Where each optimizer step's scored trajectories come from: recipe key `pipeline.mode`.

sync          the step's episodes are played and teacher-scored in the training process, with the
              step's own weights (the synchronous loop; the default).
one_step_off  a generator process plays and scores the batch of step k+1 while step k trains: the
              same tasks and seeds as sync, generated with weights one update old.
pool          an everlasting rollout pool: the generator process plays waves of episodes back to
              back (`pipeline.wave_episodes` each) and queues each scored wave; a step takes
              `trainer.episodes_per_step` trajectories, oldest first. One more than
              `pipeline.max_staleness` weight versions older than the trainer is dropped (and
              counted), never trained on; waves are requested only while their trajectories can be
              trained within that bound, so drops are rare. Newer weights are loaded between
              generation calls, also in the middle of a wave: the pool never stops for a sync.

A weight version is the number of optimizer steps behind the weights; a trajectory records the
version it started with (its oldest tokens). Stale tokens are corrected by the k1 importance ratio
exp(s_new - s_old), s_old being the log-prob stored when the token was sampled
(turnopd.algorithm.objective.k1_loss, clipped by `objective.clip_eps`); the token-weight modes are the same
in every mode. Every episode carries its turn limit from the batch plan (plan.episode_turn_limits:
probes at the full horizon, env.max_turns; the others at the depth cap), in every mode. Probes are
generated with the newest weights: a probe request waits for the weights of its own step. A new
cap applies to the plans made after the controller's update: in sync the next step's, in
one_step_off the step after it (the next batch is planned and generated while this step trains),
in pool the waves requested after it. Under trainer.budget (env steps, tokens generated) a plan
made ahead counts only on what the step training meanwhile cannot spend (plan.work_left), and a
pool step takes only its plan's episodes (docs/recipes.md, Training budgets).

A multi-env run (recipe key `envs`) works in every mode, each env's share planned by its own depth
controller, played in its own env pool with its recipe view and scored by its own teacher: sync plays
the envs at once (pipeline.mixture.play_mixture); one_step_off and pool send the generator a request
per env, and pool queues and requests each env's waves apart (pipeline.generator.EnvStream).
"""

from turnopd.orchestration.pipeline import generator, in_process  # noqa: F401  (register the modes)
from turnopd.orchestration.pipeline.base import PIPELINE_MODES, PipelineMode, PipelineStats, Rollouts
from turnopd.orchestration.pipeline.generator import GeneratorError
from turnopd.orchestration.pipeline.mixture import (
    EnvPools,
    MixturePlan,
    env_parts,
    make_depth,
    open_pools,
    per_env_fields,
    plan_step,
    plan_work_bound,
)
from turnopd.orchestration.pipeline.plan import BatchPlan, plan_batch, sample_tasks, scoring_topk, work_left


def open_rollouts(cfg, setup, **backends):
    """The rollout source of `cfg.pipeline.mode`, as a context manager. backends: trainer, policy, pool,
    pools (every env's, by name), teachers, depth, ledger, start_step (each mode takes what it uses)."""
    return PIPELINE_MODES.get(cfg.pipeline.mode).open(cfg, setup, **backends)


__all__ = ["PIPELINE_MODES", "BatchPlan", "EnvPools", "GeneratorError", "MixturePlan", "PipelineMode",
           "PipelineStats", "Rollouts", "env_parts", "make_depth", "open_pools", "open_rollouts", "per_env_fields",
           "plan_batch", "plan_step", "plan_work_bound", "sample_tasks", "scoring_topk", "work_left"]
