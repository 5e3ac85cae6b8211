"""`turnopd distill`: the on-policy distillation loop. One orchestrator, top to bottom.

Per optimizer step k of K:
    (probe: full-depth rollouts, teacher scoring, depth-controller update)  -- when the schedule says
    rollouts at the current depth cap -> teacher scoring -> loss + optimizer step -> weight sync
    -> metrics (+ evaluation every eval.every steps, + checkpoint every checkpoint.every steps)

On a probe step the probes are that step's training batch (they are full-depth, on-policy and
already scored: discarding them would waste their cost); the next steps use the updated cap.

The step's scored trajectories come from a rollout source (turnopd.orchestration.pipeline,
`pipeline.mode`): played here (sync), or by a generator process that overlaps generation with
training (one_step_off, pool). `open_run` builds what a run needs (or restores it from the last
checkpoint); `train` is the loop.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from envs.pool import EnvPool
from teachers import Teacher, TeacherSpec, check_tokenizers, make_teachers
from turnopd.algorithm.budget import DepthSchedule, loss_alpha, make_depth_schedule, probe_statistics
from turnopd.algorithm.objective import ESTIMATORS, turn_kl_profile
from turnopd.algorithm.world_model import debiased_mean
from turnopd.analysis.plot import plot_run
from turnopd.config import RunConfig, to_yaml
from turnopd.core import checkpoint as ckpt
from turnopd.core.distributed import barrier, gather_objects, rank_and_world
from turnopd.core.faults import naming_a_full_disk
from turnopd.core.ledger import Ledger
from turnopd.core.methods import method_of
from turnopd.core.metrics import MetricsWriter, truncate_after_step
from turnopd.core.progress import StepProgress, print_summary
from turnopd.core.tracking import TRACKERS, TrackedRun
from turnopd.core.types import EpisodeSummary, build_token_batch, describe_env_errors, env_errors
from turnopd.engines.hf_models import load_model, load_student
from turnopd.models import prepare_model, weights_fingerprint
from turnopd.orchestration.pipeline import BatchPlan, PipelineStats, open_rollouts, plan_batch
from turnopd.orchestration.preflight import Setup, check_setup, run_dir_for
from turnopd.orchestration.sft import build_missing_teacher
from turnopd.rollout import Policy, make_policy
from turnopd.rollout.eval import EvalResult, avg_at_k, evaluate
from turnopd.rollout.world_model import open_world_model
from turnopd.trainer import Trainer
from turnopd.trainer.engine import init_process_group


class EnvFailed(RuntimeError):
    """The env ended every episode of a step itself (crashes, hangs, a game it cannot load): the agent
    played nothing to learn from, and later steps would fare the same."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class RunLog:
    """What a run writes, on rank 0 only: metrics.jsonl (one record per step and evaluation, appended
    and flushed: the run's record), the same records to each tracker of `tracking`
    (turnopd.core.tracking), the eval lines a person reads and, at the end, frontier.png."""

    def __init__(self, cfg: RunConfig, run_dir: Path, ledger: Ledger, start_step: int, setup: Setup):
        rank, world = rank_and_world()
        self.ledger, self.is_main, self.run_dir, self.step = ledger, rank == 0, run_dir, start_step
        self.writer, self.trackers = None, []
        if not self.is_main:
            return
        with naming_a_full_disk(run_dir / "config.yaml", "the run's config.yaml was not written", run_dir):
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(to_yaml(cfg))
        self.writer = MetricsWriter(run_dir / "metrics.jsonl")
        self.writer.write({"kind": "start", "name": cfg.name, "method": method_of(dataclasses.asdict(cfg)),
                           "seed": cfg.seed, "total_steps": cfg.trainer.steps, "resumed_from_step": start_step,
                           "world_size": world, "models": model_builds(setup)})
        tracked = TrackedRun(run_dir, cfg.name, dataclasses.asdict(cfg), start_step)
        self.trackers = [TRACKERS.get(name)(tracked) for name in cfg.tracking]

    def train(self, record: dict[str, Any]) -> None:
        if self.writer is not None:
            self.writer.write(record)
        self.step = record["step"]
        for tracker in self.trackers:
            tracker.log_record(record, record["step"])

    def eval(self, result: EvalResult, step: int, kind: str = "eval") -> None:
        if not self.is_main:
            return
        who = "teacher" if kind == "teacher_eval" else f"student at step {step}"
        print(f"{who}: Avg@{result.k} {100 * result.avg_at_k:.1f}% on {result.num_tasks} {result.split} tasks "
              f"(mean {result.mean_turns:.1f} turns)", flush=True)
        if result.env_failures:
            print(f"WARNING: {who} eval: {result.describe_env_failures()}; they count as lost", flush=True)
        record = {"kind": kind, "step": step, "train_time_s": self.ledger.train_time(),
                  "eval_time_s": self.ledger.step_phases.get("eval", 0.0), **result.record()}
        self.writer.write(record)
        for tracker in self.trackers:
            tracker.log_eval(kind, record, step)

    def finish(self) -> None:
        """Once the run has trained: its accuracy-vs-training-time plot, frontier.png, to every tracker."""
        if self.is_main:
            plot = plot_run(self.run_dir)
            for tracker in self.trackers:
                tracker.log_image("frontier", plot, self.step)

    def close(self) -> None:
        for out in (self.writer, *self.trackers):
            if out is not None:
                out.close()


@dataclass
class Run:
    """An opened run: its recipe and setup, the models built and loaded, and where it starts."""

    cfg: RunConfig
    setup: Setup
    run_dir: Path
    start_step: int
    ledger: Ledger
    log: RunLog
    trainer: Trainer
    tokenizer: Any
    policy: Policy
    teachers: dict[str, Teacher]
    depth: DepthSchedule


def build_missing_models(cfg: RunConfig, setup: Setup) -> None:
    """On rank 0, before any rank loads them: teachers trained by their sft_recipe and the student
    built by its preparation, where their folders do not exist yet."""
    if rank_and_world()[0] == 0:
        for spec in setup.teacher_specs.values():
            build_missing_teacher(spec)
        if cfg.student.prepare is not None and not setup.student_path.exists():
            prepare_model(cfg.student.prepare, setup.student_path, **cfg.student.prepare_options)
    barrier()


def restore_checkpoint(run_dir: Path, trainer: Trainer) -> dict[str, Any] | None:
    """Load the newest checkpoint that reads back into the trainer and return its loop state (a torn
    or corrupted one, say by a full disk or a copy cut short, is passed over with a warning: the one
    before it is complete)."""
    for checkpoint in reversed(ckpt.list_checkpoints(run_dir)):
        try:
            state = ckpt.load_loop_state(checkpoint)
            trainer.load(checkpoint)
            ckpt.load_rng(checkpoint)
            return state
        except Exception as exc:  # noqa: BLE001 - whatever the damage, the previous checkpoint may do
            print(f"warning: checkpoint {checkpoint} cannot be read ({type(exc).__name__}: {str(exc)[:300]}); "
                  "trying the one before it", file=sys.stderr, flush=True)
    return None


def open_run(cfg: RunConfig, resume: str | None = None) -> Run:
    """Check the recipe's setup (before any heavy work), build and load the models, and restore the
    last checkpoint of a resumed run (a run killed before its first checkpoint starts over)."""
    setup, _ = check_setup(cfg)  # fails fast, naming the problem: data, splits, models, teacher specs
    run_dir = run_dir_for(cfg, resume)
    if rank_and_world()[1] > 1:
        init_process_group()  # for the barrier below (one process joins it later, in the Trainer)
    build_missing_models(cfg, setup)
    seed_everything(cfg.seed)  # after the builds, which draw random numbers of their own
    student, tokenizer = load_student(setup.student_path, cfg.student.dtype, cfg.student.lora)
    if cfg.student.lora is not None and rank_and_world()[0] == 0:
        trainable, total = student.get_nb_trainable_parameters()
        print(f"training a LoRA adapter (rank {cfg.student.lora.rank}): {trainable / 1e6:.2f}M of "
              f"{total / 1e6:.1f}M parameters", flush=True)
    teachers = make_teachers(setup.teacher_specs)
    for env, teacher in teachers.items():
        check_tokenizers(tokenizer, teacher.tokenizer, str(setup.student_path), setup.teacher_specs[env].name)
    in_process = ESTIMATORS.get(cfg.objective.estimator).needs_teacher_model
    trainer = Trainer(student, cfg.trainer, cfg.objective, cfg.loss, cfg.trainer.steps,
                      teacher_model=teachers[cfg.env.name].model if in_process else None,
                      familiarity_cfg=cfg.familiarity,
                      world_model_weights=cfg.world_model.path is not None and cfg.world_model.samples >= 2)
    policy = make_policy(cfg.policy, trainer.module, tokenizer=tokenizer, seed=cfg.seed)
    depth = make_depth_schedule(cfg.depth)

    start_step, ledger = 0, Ledger()
    state = restore_checkpoint(run_dir, trainer) if resume else None
    if state is not None:
        with trainer.gathered_parameters() as student_weights:
            policy.update_weights(student_weights)
        depth.load_state_dict(state["depth"])
        start_step = state["step"]
        ledger = Ledger(train_time_offset=state["train_time_s"], wall_time_offset=state["wall_time_s"])
    if resume and rank_and_world()[0] == 0:
        dropped = truncate_after_step(run_dir / "metrics.jsonl", start_step)
        if start_step:
            print(f"resuming {run_dir} from step {start_step} ({dropped} records past it dropped)")
    log = RunLog(cfg, run_dir, ledger, start_step, setup)
    return Run(cfg, setup, run_dir, start_step, ledger, log, trainer, tokenizer, policy, teachers, depth)


def model_builds(setup: Setup) -> dict[str, dict[str, Any]]:
    """Which weights the run distills (the start record's `models`): each model's folder and its
    weights' fingerprint, so that `turnopd frontier` tells runs of two builds of one folder apart."""
    models = {"student": setup.student_path, **{f"teacher:{env}": spec.model for env, spec in setup.teacher_specs.items()},
              **{f"teacher:{env}:adapter": spec.adapter for env, spec in setup.teacher_specs.items() if spec.adapter}}
    return {role: {"path": str(path), "weights": weights_fingerprint(path)} for role, path in models.items()}


def run_eval(cfg: RunConfig, setup: Setup, pool: EnvPool, policy: Policy, step: int, k: int | None = None
             ) -> EvalResult:
    """Avg@k (k: eval.k by default) on this rank's share of the eval tasks, combined over ranks."""
    rank, world = rank_and_world()
    k = k or cfg.eval.k
    shard = setup.eval_tasks[rank::world]  # empty on the last ranks when there are fewer tasks than ranks
    local = evaluate(setup.spec, pool, policy, shard, split=setup.eval_split, env_config=cfg.env,
                     policy_config=cfg.policy, k=k, temperature=cfg.eval.temperature,
                     seed=cfg.seed + step).trajectories if shard else []
    episodes = [e for part in gather_objects([EpisodeSummary.of(t) for t in local]) for e in part]
    overall, per_type, per_task = avg_at_k(episodes, k)
    return EvalResult(setup.eval_split, k, overall, per_type, len(setup.eval_tasks),
                      sum(e.depth for e in episodes) / len(episodes), env_errors(episodes), per_task)


def step_record(step: int, ledger: Ledger, phases: dict[str, float], depth: DepthSchedule, plan: BatchPlan,
                updated: bool, alpha: float, train: dict[str, Any], episodes: list[EpisodeSummary],
                pipeline: PipelineStats, teacher_replicas: dict[str, Any]) -> dict[str, Any]:
    """One train record of metrics.jsonl (turnopd.core.metrics lists the fields). The work measures
    beside the clock: tokens generated, scored by the teacher and trained, env steps."""
    last = getattr(depth, "last", {}) if updated else {}
    turns = sum(e.depth for e in episodes)
    return {
        "kind": "train", "step": step, "train_time_s": ledger.train_time(), "wall_time_s": ledger.wall_time(),
        "phases": phases, "busy": ledger.last_busy, "step_time_s": ledger.last_step_time_s,
        "generator_phases": ledger.last_generator_phases,
        "pipeline": dataclasses.asdict(pipeline), "rollout_depth_cap": plan.cap, "probed": plan.probe,
        "probes": plan.probes, "h_eff": last.get("h_eff"), "h_cov": last.get("h_cov"),
        "h_cov_measured": last.get("h_cov_measured"), "alpha": alpha,
        "loss": train["loss"], "grad_norm": train.get("grad_norm"), "lr": train.get("lr"),
        "mean_kl": train["mean_kl"], "turn_kl_profile": turn_kl_profile(train["turn_kl"]),
        "deep_turn_share": train["deep_turn_share"], "skipped": train["skipped"],
        "turn_signal_profiles": {name: turn_kl_profile(turns) for name, turns in train["turn_signals"].items()},
        "familiarity_kept_share": train["familiarity_kept_share"],
        "tokens_generated": sum(e.action_tokens for e in episodes), "tokens_scored": sum(e.scored_tokens for e in episodes),
        "tokens_trained": train["tokens_trained"],
        "env_steps": sum(e.depth for e in episodes if not e.world_model),  # a world model's are not the env's
        "episodes": len(episodes), "mean_turns": turns / len(episodes),
        "success_rate": sum(e.success for e in episodes) / len(episodes),
        "truncated_rate": sum(e.truncated for e in episodes) / len(episodes),
        "invalid_action_rate": sum(e.invalid_actions for e in episodes) / max(turns, 1),
        "env_failures": sum(e.failed_by_env for e in episodes), "env_errors": env_errors(episodes),
        "teacher_replicas": teacher_replicas,
        **(world_model_record(episodes) if any(e.world_model or e.predicted_success is not None for e in episodes)
           else {}),
    }


def world_model_record(episodes: list[EpisodeSummary]) -> dict[str, Any]:
    """A world-model run's success signals: the step's success rate (success_rate, above) mixes the
    model's verdicts on its own episodes with real outcomes; success_rate_real is the real episodes'
    alone, success_rate_debiased the model episodes' corrected by the bias measured on the real
    ones (Online Debiasing: the model's verdict on each real episode against its outcome);
    world_model_verdict_steps the model steps those verdicts took (a replay's are an episode's),
    world_model_no_verdict the real episodes left out of the bias (the model gave no usable answer)."""
    played = [e for e in episodes if not e.env_error]
    model = [float(e.success) for e in played if e.world_model]
    real = [e for e in played if not e.world_model and e.predicted_success is not None]
    record: dict[str, Any] = {"world_model_episodes": sum(e.world_model for e in episodes),
                              "world_model_steps": sum(e.depth for e in episodes if e.world_model),
                              "world_model_verdict_steps": sum(e.verdict_steps for e in episodes),
                              "world_model_no_verdict": sum(not e.world_model and e.predicted_success is None
                                                            for e in played),
                              "success_rate_real": sum(e.success for e in real) / len(real) if real else None,
                              "success_rate_debiased": None, "success_rate_debiased_stderr": None,
                              "world_model_bias": None}
    if real:
        debiased = debiased_mean(model, [float(e.success) for e in real], [e.predicted_success for e in real])
        record.update(success_rate_debiased=debiased.estimate, success_rate_debiased_stderr=debiased.stderr,
                      world_model_bias=debiased.bias)
    return record


def train(run: Run) -> dict[str, Any]:
    """The loop: evaluations at the start, then per step plan, take the scored trajectories, update the
    depth controller from probes, train, sync weights, log; evaluate and checkpoint on schedule."""
    cfg, setup, ledger, log, trainer, policy, depth = (run.cfg, run.setup, run.ledger, run.log, run.trainer,
                                                       run.policy, run.depth)
    summary: dict[str, Any] = {"run_dir": str(run.run_dir), "start_step": run.start_step, "teacher_eval": None}
    with (EnvPool.for_config(setup.spec, cfg.env) as pool, open_world_model(cfg, setup.spec, pool) as world,
          open_rollouts(cfg, setup, trainer=trainer, policy=policy, pool=pool, teachers=run.teachers, depth=depth,
                        ledger=ledger, start_step=run.start_step, world=world) as rollouts):
        if run.start_step == 0 and cfg.eval.teacher:
            with ledger.phase("eval"):
                summary["teacher_eval"] = evaluate_teacher(cfg, setup, setup.teacher_specs[cfg.env.name], pool)
            log.eval(summary["teacher_eval"], 0, kind="teacher_eval")
            ledger.end_step()
        if run.start_step == 0 and cfg.eval.at_start:
            with ledger.phase("eval"):
                summary["eval_before"] = run_eval(cfg, setup, pool, policy, 0)
            log.eval(summary["eval_before"], 0)
            ledger.end_step()

        progress = StepProgress(cfg.trainer.steps, run.start_step, enabled=log.is_main)
        for step in range(run.start_step, cfg.trainer.steps):
            # Rollouts at the depth cap and full-depth probes among them (or a whole probe batch), scored.
            plan = plan_batch(depth, step, cfg)
            trajectories = rollouts.take(plan)
            episodes = [e for part in gather_objects([EpisodeSummary.of(t) for t in trajectories]) for e in part]
            if all(e.failed_by_env for e in episodes):  # nothing the agent did: the env cannot run
                raise EnvFailed(f"step {step + 1}: {describe_env_errors(env_errors(episodes), len(episodes))}. "
                                f"Fix the env, then continue the run with --resume {run.run_dir}")
            if step + 1 < cfg.trainer.steps:  # the asynchronous modes generate it while this step trains
                rollouts.prepare(plan_batch(depth, step + 1, cfg))

            alpha = loss_alpha(step, cfg.trainer.steps, cfg.loss.alpha_start, cfg.loss.alpha_end,
                               cfg.loss.alpha_schedule) if cfg.loss.mode == "progressive" else 0.0
            with ledger.phase("train"):
                result = trainer.step(build_token_batch(trajectories), alpha)  # raises TrainingDiverged
            # The probes update the controller with the train step's per-turn KL (the exact one where
            # the estimator computes it); the next steps' caps follow.
            probe_kl, probe_won = probe_statistics([t for part in gather_objects(trajectories) for t in part],
                                                   result["turn_kl"]) if plan.probes else ([], [])
            if probe_kl:
                depth.update(probe_kl, probe_won)
            with ledger.phase("weight_sync"), trainer.gathered_parameters() as student_weights:
                policy.update_weights(student_weights)
                rollouts.publish(student_weights, version=step + 1)

            done = step + 1
            record = step_record(done, ledger, ledger.end_step(), depth, plan, bool(probe_kl), alpha, result,
                                 episodes, rollouts.stats(), rollouts.take_replica_stats())
            log.train(record)
            progress.update(record)

            if cfg.eval.every and done % cfg.eval.every == 0 and done < cfg.trainer.steps:
                with ledger.phase("eval"):
                    log.eval(run_eval(cfg, setup, pool, policy, done), done)
            if done == cfg.trainer.steps:
                with ledger.phase("eval"):
                    summary["eval_after"] = run_eval(cfg, setup, pool, policy, done)
                log.eval(summary["eval_after"], done)
                if cfg.eval.final_k:  # a sampled Avg@k of the final student, beside the greedy curve
                    with ledger.phase("eval"):
                        log.eval(run_eval(cfg, setup, pool, policy, done, k=cfg.eval.final_k), done, kind="final_eval")
            if (cfg.checkpoint.every and done % cfg.checkpoint.every == 0) or done == cfg.trainer.steps:
                with ledger.phase("checkpoint"):
                    ckpt.save_checkpoint(run.run_dir, done, trainer, run.tokenizer, {
                        "train_time_s": ledger.train_time(), "wall_time_s": ledger.wall_time(),
                        "depth": depth.state_dict()}, cfg.checkpoint.keep_last)
            ledger.end_step()  # eval and checkpoint time are in the record's clocks, not its phases
        progress.close()

    summary.update(train_time_s=ledger.train_time(), wall_time_s=ledger.wall_time(), phases=dict(ledger.totals),
                   steps=cfg.trainer.steps)
    log.finish()
    if log.is_main:
        print_summary(cfg, summary)
    return summary


def run_distillation(cfg: RunConfig, resume: str | None = None) -> dict[str, Any]:
    """Open the run (or resume it) and train it; returns the run's summary."""
    run = open_run(cfg, resume)
    try:
        return train(run)
    finally:
        run.log.close()


def teacher_policy(cfg: RunConfig, spec: TeacherSpec) -> Policy:
    """The teacher as a policy of the recipe's backend, to play episodes itself (a LoRA teacher plays
    with its adapter; vLLM serves it as a LoRA adapter)."""
    if spec.adapter:
        model, tokenizer = load_model(spec.model, spec.dtype, adapter=spec.adapter)
        return make_policy(cfg.policy, model, tokenizer=tokenizer, dtype=spec.dtype, seed=cfg.seed)
    return make_policy(cfg.policy, spec.model, dtype=spec.dtype, seed=cfg.seed)


EVAL_CACHE = Path.home() / ".cache" / "turnopd" / "evals"


def evaluate_teacher(cfg: RunConfig, setup: Setup, spec: TeacherSpec, pool: EnvPool) -> EvalResult:
    """The teacher's Avg@k on the same held-out tasks: the ceiling the student distills toward.
    Cached per (teacher weights, tasks, env and generation settings), so later runs skip it."""
    def weights(folder: str) -> list:
        return sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in Path(folder).glob("*.safetensors"))

    adapter = [spec.adapter, weights(spec.adapter)] if spec.adapter else []
    key = json.dumps([spec.model, weights(spec.model), setup.eval_tasks, dataclasses.asdict(cfg.env),
                      dataclasses.asdict(cfg.policy), cfg.eval.k, cfg.eval.temperature, cfg.seed, *adapter],
                     sort_keys=True)
    cache = EVAL_CACHE / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
    if cache.is_file():
        return EvalResult.from_record(json.loads(cache.read_text()))
    policy = teacher_policy(cfg, spec)
    try:
        result = evaluate(setup.spec, pool, policy, setup.eval_tasks, split=setup.eval_split, env_config=cfg.env,
                          policy_config=cfg.policy, k=cfg.eval.k, temperature=cfg.eval.temperature, seed=cfg.seed)
    finally:
        policy.close()
    if not result.env_failures:  # a score the env cut short is not the teacher's: measure it again next run
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(result.record()))
    return result


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `turnopd distill RECIPE`")
